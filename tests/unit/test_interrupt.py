"""SIGINT/SIGTERM of a run (megarl/driver/interrupt.py), without Ray: the handlers' flag logic,
and the real loop (``megarl.driver.loop.train``) over an in-process fake worker group whose
phases send the signals, so that each case lands in a known phase of step 2. The real engines,
Ray and a terminal's Ctrl-C to the process group are in tests/e2e/test_faults_e2e.py."""
import os
import signal
from pathlib import Path

import pytest
import torch
from helpers import read_jsonl

from megarl.config import load_config
from megarl.data.batch import Rollout
from megarl.driver.checkpoint import CheckpointManager
from megarl.driver.interrupt import RunInterrupted, StepAbandoned, StopRequest


def send(signum: int) -> None:
    """Signal this process (the handler runs before the next statement); refuse when the run's
    handler is not installed: a default SIGTERM would end the test process."""
    assert signal.getsignal(signum) not in (signal.SIG_DFL, signal.default_int_handler), "handler not installed"
    os.kill(os.getpid(), signum)


def test_first_signal_sets_the_flag_second_raises_later_ones_are_ignored():
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with StopRequest() as stop:
        stop.arm()
        send(signal.SIGTERM)
        assert stop.requested and stop.signum == signal.SIGTERM and not stop.hard
        with pytest.raises(KeyboardInterrupt):
            send(signal.SIGINT)
        assert stop.hard
        send(signal.SIGINT)   # the fast release must not be interrupted in turn
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_a_second_signals_keyboard_interrupt_leaves_the_run_as_run_interrupted():
    with pytest.raises(RunInterrupted) as info:
        with StopRequest() as stop:
            stop.arm()
            stop.last_step = 4
            send(signal.SIGINT)
            send(signal.SIGINT)
    assert info.value.hard and info.value.exit_code == 130 and info.value.last_step == 4
    assert str(info.value) == "stopped at once by a second SIGINT after step 4"
    # a KeyboardInterrupt that is not the run's second signal passes through unchanged
    with pytest.raises(KeyboardInterrupt):
        with StopRequest():
            raise KeyboardInterrupt


def test_a_safe_point_drops_the_step_metrics_only_when_a_stop_was_requested():
    stop, metrics = StopRequest(), {"reward/mean": 0.5}
    stop.abandon_if_requested(metrics)
    assert metrics == {"reward/mean": 0.5}
    stop.signum, stop.step, stop.phase = signal.SIGTERM, 3, "logprobs"
    with pytest.raises(StepAbandoned, match="step 3 abandoned after its logprobs phase, before any update"):
        stop.abandon_if_requested(metrics)
    assert metrics == {}
    assert RunInterrupted(signal.SIGTERM, 2, hard=False).exit_code == 143
    assert str(RunInterrupted(signal.SIGTERM, 0, hard=False)) == "stopped by SIGTERM before a step completed"


# ------------------------------------------------------------------ the loop over a fake group
class FakePlacement:
    def __init__(self):
        self.closed = []

    def close(self, timeout_s: float = 120.0) -> None:
        self.closed.append(timeout_s)


class FakeGroup:
    """The WorkerGroup surface ``train`` uses; ``SIGNALS[(phase, step)]`` are sent in that phase."""
    SIGNALS: dict = {}
    instances: list = []

    def __init__(self, cfg, log_dir=None, verbose=False):
        # the run's handlers come after Ray (started in here) has installed its own
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        self.cfg, self.has_reference, self.has_critic = cfg, cfg.algorithm.kl_coef > 0, False
        self.placement, self.shut_down, self.step = FakePlacement(), False, 0
        self.passes, self.trained = [], []   # log-prob passes run; per update: (own_old_logprobs, per_sample keys)
        FakeGroup.instances.append(self)

    def precision(self) -> dict:
        return {"params": ["float32"], "main_params": ["float32"], "optimizer_state": None, "grads": ["float32"]}

    def _phase(self, name: str) -> None:
        for signum in self.SIGNALS.get((name, self.step), ()):
            send(signum)

    def generate(self, prompt_ids, seeds, greedy=False):
        self.step = seeds[0]
        self._phase("generate")

    def end_rollout(self) -> dict:
        return {}

    def train_step(self, rollout, hooks, m) -> None:
        """The real step's order (megarl.actors.step.RankStep) over this group's passes."""
        from megarl.actors.step import RankStep

        RankStep(self.cfg, self).run(rollout, hooks, m)

    def plan(self, rollout):
        return None

    routing_out: dict = {}          # a dense model: no routing compared or recorded
    moe_tokens_per_expert = None

    def logprobs(self, rollout, plan, reference: bool, per_sample=None, version=None, with_kl=False, **routing):
        """What the ranks return of a pass (megarl.actors.worker.HybridWorker.logprobs), computed
        here from constant log-probs: KL 0.2 per token, so the adaptive KL coefficient moves every step."""
        from megarl.data.readout import controller_readouts, k1_sum

        self.passes.append("reference" if reference else "old")
        self._phase("ref_logprobs" if reference else "logprobs")
        n = len(rollout)
        if reference:
            ref = [torch.full((2,), -1.2) for _ in range(n)]
            return {"ref_logprobs_T": ref,
                    **({"kl": [k1_sum(old, r) for old, r in zip(per_sample["old_logprobs_T"], ref)]} if with_kl else {})}
        old = [torch.full((2,), -1.0) for _ in range(n)]
        return {"old_logprobs_T": old,
                "readouts": controller_readouts(rollout, old, [torch.ones(2) for _ in range(n)], None, version)}

    FORWARD_LP = -1.0   # the training forward's log-probs (returned with own_old_logprobs)

    def train(self, rollout, plan, per_sample, kl_coef, routing=None, own_old_logprobs=False, version=None):
        from megarl.data.readout import controller_readouts

        self.trained.append((own_old_logprobs, sorted(per_sample)))
        self._phase("train")
        readouts = controller_readouts(rollout, [torch.full((2,), self.FORWARD_LP) for _ in range(len(rollout))],
                                       [torch.full((2,), 0.5) for _ in range(len(rollout))],
                                       per_sample.get("ref_logprobs_T"), version) if own_old_logprobs else None
        return {"actor/loss": 0.0}, readouts

    def sync_weights(self) -> dict:
        return {}

    def save_checkpoint(self, ckpt, step: int, metadata: dict, extra=None):
        self.step = step
        self._phase("save")
        ckpt.save(step, lambda folder: (Path(folder) / "weights.txt").write_text(str(step)), metadata)

    def shutdown(self) -> None:
        self.shut_down = True
        self.placement.close()


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=False):   # generations.jsonl's decoded samples
        return " ".join(map(str, ids))


class FakeRollouts:
    def __init__(self, cfg, sample_fn):
        self.sample_fn = sample_fn
        self.tokenizer = FakeTokenizer()
        self.drafts = None   # rollout.speculative off

    def collect(self, step: int, rewards):
        self.sample_fn([[1, 2]], [step], False)
        rollout = Rollout([[1, 2], [1, 2]], [[3, 4], [5, 6]], [[-1.0, -1.0], [-1.0, -1.0]], [0, 0], ["", ""],
                          [False, False], rewards=[1.0, 0.0])
        return rollout, {"reward/mean": 0.5}


class FakeRewardPool:
    def __init__(self, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


@pytest.fixture
def fake_run(tmp_path, monkeypatch):
    """``run(signals, *overrides)``: train a 4-step run (checkpoint every 3) over the fakes, with
    ``signals`` sent in (phase, step); returns (the RunInterrupted or None, metrics rows, the
    checkpoints as {step: metadata}, the fake group)."""
    import megarl.rewards
    import megarl.driver.rollouts
    import megarl.actors.group
    from megarl.driver.loop import train

    monkeypatch.setattr(megarl.actors.group, "WorkerGroup", FakeGroup)
    monkeypatch.setattr(megarl.driver.rollouts, "Rollouts", FakeRollouts)
    monkeypatch.setattr(megarl.rewards, "RewardPool", FakeRewardPool)
    FakeGroup.instances = []
    # Python's own SIGINT handler, also under nohup or a background shell job (which inherit SIGINT ignored)
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)

    def run(signals: dict, *overrides: str):
        monkeypatch.setattr(FakeGroup, "SIGNALS", signals)
        cfg = load_config(None, [f"trainer.run_dir={tmp_path / 'run'}", "trainer.steps=4", "checkpoint.save_every=3",
                                 "algorithm.kl_coef=0.1", "algorithm.kl_target=0.01", "logging.trackers=[jsonl]",
                                 "logging.stdout=false", "logging.progress=false", *overrides])
        before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
        stopped = None
        try:
            train(cfg, verbose=True)
        except RunInterrupted as err:
            stopped = err
        assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
        rows = read_jsonl(tmp_path / "run" / "metrics.jsonl", missing_ok=True)
        ckpt = CheckpointManager(tmp_path / "run" / "checkpoints")
        return stopped, rows, {step: ckpt.metadata(folder) for step, folder in ckpt.complete()}, FakeGroup.instances[-1]

    yield run
    signal.signal(signal.SIGINT, inherited)


def test_a_stop_before_the_update_abandons_the_step_and_saves_the_last_completed_one(fake_run):
    stopped, rows, checkpoints, group = fake_run({("generate", 2): [signal.SIGINT]})
    assert stopped is not None and not stopped.hard and stopped.exit_code == 130 and stopped.last_step == 1
    assert [r["step"] for r in rows] == [1]   # step 2's metrics are not written
    assert list(checkpoints) == [1]           # not scheduled (every 3): written by the interrupt
    # the KL coefficient of the last completed step, not the one step 2's log-probs moved it to
    assert checkpoints[1]["kl_coef"] == pytest.approx(rows[0]["actor/kl_coef"])
    assert group.shut_down and group.placement.closed == [120.0]


def test_a_stop_after_the_log_probs_still_abandons_the_step(fake_run):
    stopped, rows, checkpoints, _ = fake_run({("ref_logprobs", 3): [signal.SIGTERM]})
    assert stopped.exit_code == 143 and stopped.last_step == 2
    assert [r["step"] for r in rows] == [1, 2] and list(checkpoints) == [2]
    assert checkpoints[2]["kl_coef"] == pytest.approx(rows[1]["actor/kl_coef"])


def test_a_stop_during_the_update_finishes_the_step(fake_run):
    stopped, rows, checkpoints, _ = fake_run({("train", 2): [signal.SIGTERM]})
    assert stopped.exit_code == 143 and stopped.last_step == 2
    assert [r["step"] for r in rows] == [1, 2] and list(checkpoints) == [2]
    assert checkpoints[2]["kl_coef"] == pytest.approx(rows[1]["actor/kl_coef"])


def test_a_scheduled_checkpoint_is_not_written_twice_and_a_stop_in_the_last_step_finishes_the_run(fake_run):
    stopped, rows, checkpoints, _ = fake_run({("train", 3): [signal.SIGINT]})
    assert stopped.last_step == 3 and list(checkpoints) == [3]
    stopped, rows, checkpoints, _ = fake_run({("train", 4): [signal.SIGINT]})
    assert stopped is None and [r["step"] for r in rows] == [1, 2, 3, 4]   # the run was complete
    assert list(checkpoints) == [3, 4]


def test_save_on_interrupt_false_writes_no_checkpoint(fake_run):
    stopped, rows, checkpoints, _ = fake_run({("generate", 2): [signal.SIGINT]}, "checkpoint.save_on_interrupt=false")
    assert stopped.last_step == 1 and checkpoints == {}


def test_a_second_signal_stops_at_once_without_waiting_for_busy_actors(fake_run):
    from megarl.driver.loop import HARD_STOP_WAIT_S

    stopped, rows, checkpoints, group = fake_run({("train", 2): [signal.SIGINT, signal.SIGINT]})
    assert stopped.hard and stopped.exit_code == 130 and stopped.last_step == 1
    assert checkpoints == {} and not group.shut_down and group.placement.closed == [HARD_STOP_WAIT_S]
    assert [r["step"] for r in rows] == [1, 2] and "actor/loss" not in rows[1]   # step 2 as far as it got
    # a second signal during the checkpoint the first one asked for: that checkpoint is not written
    stopped, _, checkpoints, group = fake_run({("generate", 2): [signal.SIGTERM], ("save", 1): [signal.SIGTERM]})
    assert stopped.hard and stopped.exit_code == 143 and checkpoints == {}


def test_one_update_per_step_takes_the_old_log_probs_from_the_update_and_alarms_after_it(fake_run, monkeypatch,
                                                                                          tmp_path):
    """The fixture's adaptive KL keeps the old log-prob pass; a fixed coefficient does not need it
    (megarl.config.passes.needs_old_logprob_pass): the update then gets no old_logprobs_T, and
    the entropy and the rollout-vs-train alarm read its own forward's, so the alarm stops a step
    after its update (its metrics are written) and before its checkpoint."""
    from megarl.driver.loop import WeightSyncAlarm

    stopped, rows, _, group = fake_run({})
    assert group.passes == ["old", "reference"] * 4 and all(own is False for own, _ in group.trained)
    assert "old_logprobs_T" in group.trained[0][1] and [r["actor/old_logprob_pass"] for r in rows] == [1] * 4
    assert rows[0]["actor/entropy"] == 1.0                             # the pass's entropy

    stopped, rows, checkpoints, group = fake_run({}, "algorithm.kl_target=null")
    assert stopped is None and group.passes == ["reference"] * 4
    # vLLM's log-probs go to the ranks, where the update's forward is read (megarl.data.readout)
    assert group.trained == [(True, ["advantages_T", "ref_logprobs_T", "rollout_logprobs_T"])] * 4
    assert [r["actor/old_logprob_pass"] for r in rows] == [0] * 4 and "time/logprobs_s" in rows[0]   # the reference pass
    assert rows[0]["actor/entropy"] == 0.5 and rows[0]["rollout/logprob_diff_mean"] == 0.0   # the update's forward
    assert rows[0]["actor/kl"] == pytest.approx(0.2)                   # k1: forward -1.0 vs reference -1.2
    # no KL either: no forward before the update at all; the log-prob phase is still reported (the plan only)
    stopped, rows, _, group = fake_run({}, "algorithm.kl_target=null", "algorithm.kl_coef=0")
    assert stopped is None and group.passes == [] and "actor/kl" not in rows[0]
    assert all(0 <= r["time/logprobs_s"] < 0.1 for r in rows)

    # the update's forward disagrees with vLLM's log-probs (-1.0) by 0.5: the first step raises after its update
    monkeypatch.setattr(FakeGroup, "FORWARD_LP", -1.5)
    with pytest.raises(WeightSyncAlarm, match="trainer.logprob_diff_threshold=0.1"):
        fake_run({}, "algorithm.kl_target=null", "trainer.logprob_diff_threshold=0.1")
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1] and rows[0]["rollout/logprob_diff_mean"] == 0.5
    assert rows[0]["actor/loss"] == 0.0 and FakeGroup.instances[-1].trained != []   # updated, then stopped


# ------------------------------------------------------------------ the CLI's last line
@pytest.mark.parametrize("raised, code, line", [
    (RunInterrupted(signal.SIGINT, 3, hard=False), 130, "megarl: stopped by SIGINT after step 3; resume from "),
    (RuntimeError("the reward pool broke\nsecond line"), 1, "megarl: error: RuntimeError: the reward pool broke "
                                                           "(traceback in "),
])
def test_train_command_ends_with_one_line_saying_where_to_resume(tmp_path, monkeypatch, capsys, raised, code, line):
    import megarl.driver.loop
    from megarl.cli import main

    run_dir = tmp_path / "run"

    def stopped_train(cfg, resume=False, verbose=False):
        ckpt = CheckpointManager(run_dir / "checkpoints")
        ckpt.save(3, lambda folder: (Path(folder) / "weights.txt").write_text("3"), {})
        (run_dir / "logs").mkdir(parents=True)
        (run_dir / "logs" / "driver.log").write_text("Traceback ...\n")
        raise raised

    monkeypatch.setattr(megarl.driver.loop, "train", stopped_train)
    assert main(["train", f"trainer.run_dir={run_dir}", "data.prompts_per_step=2", "--no-preflight"]) == code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(line), err
    assert err.endswith(f"resume from {run_dir}/checkpoints/step_00000003 (step 3): megarl train "
                        f"trainer.run_dir={run_dir} data.prompts_per_step=2 --resume")
