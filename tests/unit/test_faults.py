"""Fault handling without Ray or engines: the test-only fault hook (megarl/faults.py), the limit on
skipped updates (trainer.max_skipped_updates), a dead vLLM engine process named by the caller's
error (megarl/rollout/vllm_engine.py) and Ray's death reason in one line. The faults themselves
run on the real stack in tests/e2e/test_faults_e2e.py and tests/distributed/test_engine_train.py."""
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from megarl import faults
from megarl.config import load_config


def test_fault_plan_parses_and_names_the_known_faults(monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    assert faults.planned() == {}
    monkeypatch.setenv(faults.ENV, "nan_loss@2, nan_loss@5")
    assert faults.planned() == {"nan_loss": {2, 5}}
    for bad in ("nan_los@2", "nan_loss", "nan_loss@x"):
        monkeypatch.setenv(faults.ENV, bad)
        with pytest.raises(ValueError, match=r"MEGARL_FAULTS=.*is not FAULT@N .*'nan_loss'"):
            faults.planned()


def test_nan_loss_poisons_the_loss_not_the_metrics():
    loss, metrics = faults.nan_loss(lambda lp, batch: (lp.sum(), {"kl": 0.5}))(torch.ones(3), None)
    assert math.isnan(loss.item()) and metrics == {"kl": 0.5}


def test_train_loss_hook_poisons_the_planned_calls_of_the_last_rank_only(monkeypatch):
    """The hook a training worker applies to each train call's loss function: the identity
    without a plan; with ``nan_loss@2`` the 2nd call's loss is NaN on the last rank, and every
    other call (and every call of another rank) is left as it is."""
    def loss_fn(lp, batch):
        return lp.sum(), {}

    monkeypatch.delenv(faults.ENV, raising=False)
    assert faults.train_loss_hook(1, 2)(loss_fn) is loss_fn
    monkeypatch.setenv(faults.ENV, "nan_loss@2")
    last, first = faults.train_loss_hook(1, 2), faults.train_loss_hook(0, 2)
    got = [last(loss_fn)(torch.ones(3), None)[0].item() for _ in range(3)]
    assert got[0] == got[2] == 3.0 and math.isnan(got[1])
    assert all(first(loss_fn) is loss_fn for _ in range(3))
    monkeypatch.setenv(faults.ENV, "nan_los@2")
    with pytest.raises(ValueError, match="MEGARL_FAULTS"):
        faults.train_loss_hook(0, 2)


def test_max_skipped_updates_stops_after_that_many_in_a_row():
    from megarl.actors.updates import NonFiniteLossError, RankUpdates

    ranks = SimpleNamespace(cfg=load_config(None, ["trainer.max_skipped_updates=1"]))
    updates = RankUpdates(ranks)
    skipped, applied = {"update_successful": False, "loss": math.nan}, {"update_successful": True, "loss": 0.1}
    updates.count_skips("actor", skipped)
    updates.count_skips("actor", applied)             # an applied update resets the count
    updates.count_skips("actor", skipped)
    with pytest.raises(NonFiniteLossError, match=r"2 actor updates in a row .* trainer\.max_skipped_updates=1"):
        updates.count_skips("actor", skipped)
    updates.reset_skips()                             # a new run on the same ranks starts from zero
    updates.count_skips("actor", skipped)
    ranks.cfg = load_config(None, ["trainer.max_skipped_updates=0"])
    with pytest.raises(NonFiniteLossError):
        updates.count_skips("critic", skipped)
    with pytest.raises(Exception, match="max_skipped_updates"):
        load_config(None, ["trainer.max_skipped_updates=-1"])


def test_an_error_of_a_dead_engine_process_names_it():
    from megarl.rollout import vllm_engine

    class FakeLLM:
        pass

    llm, proc = FakeLLM(), subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        import psutil

        vllm_engine._PROCESSES[llm] = [(psutil.Process(proc.pid), "VLLM::Worker")]
        with pytest.raises(KeyError):           # every process alive: the engine's own error
            with vllm_engine.engine_errors(llm, "training rank 0", "generate"):
                raise KeyError("x")
        proc.kill()
        proc.wait()
        with pytest.raises(vllm_engine.EngineDied, match=rf"the vLLM engine of training rank 0 died during generate: "
                           rf"its process pid {proc.pid} \(VLLM::Worker\) exited \(RuntimeError: cancelled\)"):
            with vllm_engine.engine_errors(llm, "training rank 0", "generate"):
                raise RuntimeError("cancelled")
        with pytest.raises(RuntimeError, match="cancelled"):   # a rank without an engine
            with vllm_engine.engine_errors(None, "training rank 1", "the weight sync"):
                raise RuntimeError("cancelled")
    finally:
        proc.kill()
        proc.wait()


def test_ray_death_reason_in_one_line():
    from megarl.calls import death_reason

    message = ("The actor died unexpectedly before finishing this task.\n\tclass_name: HybridWorker\n\tpid: 12\n"
               "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit "
               "detail: Worker unexpectedly exits with a connection error code 2. End of file. Some common causes "
               "include: (1) the process was killed by the OOM killer")
    assert death_reason(RuntimeError(message)) == (
        "RuntimeError: The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR "
        "Worker exit detail: Worker unexpectedly exits with a connection error code 2. End of file.")
