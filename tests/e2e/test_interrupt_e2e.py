"""SIGINT and SIGTERM stop a real run at a safe point, with a checkpoint to resume from.

Two ``megarl train`` launches of the e2e recipe (6 steps, a scheduled checkpoint every 4):

1. When step 1's metrics are on disk, SIGINT goes to the run's whole process group, as a
   terminal's Ctrl-C does (Ray's daemons, the reward worker and the resource tracker get it too).
   Step 2 is in flight: it is abandoned before its update or, if its update already ran,
   finished. Asserted: exit code 130 within a bound, no traceback on the terminal, metrics of
   completed steps only, a complete checkpoint of the last completed step (not a scheduled one:
   checkpoint.save_on_interrupt), the final line names that folder and the command with
   ``--resume``, and no process of the run is left.
2. That command resumes from the interrupt's checkpoint; the resumed step's vLLM samples match
   Megatron's log-probs (the loaded weights reached both). When its metrics are on disk, SIGTERM
   goes to the driver only, as ``kill`` or a scheduler sends it: exit code 143, a checkpoint of
   the last completed step, no process left.

The recipe is GSPO (sequence-level importance ratios) with the RLOO baseline, so that these two
launches also carry that algorithm through the whole loop (each completed step: the weights
change, vLLM samples from the synced policy).
"""
import os
import signal
import time

import pytest
from e2e_common import ProcessWatch, metrics, recipe, start

from megarl.trainer.checkpoint import CheckpointManager

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
RECIPE = recipe("  name: gspo\n  advantage: rloo\n  kl_coef: 0.01", steps=6, save_every=4)
STOP_BOUND_S = 60   # signal -> exit (phase in flight, checkpoint, engines and Ray stopping): 14-17 s measured


def wait_for_step(proc, run_dir, step: int, log) -> None:
    deadline = time.time() + 900
    while not any(r["step"] == step for r in metrics(run_dir)):
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-5000:]
        time.sleep(0.3)


def stop_run(proc, signum: int, whole_group: bool, log) -> tuple[int, float]:
    """Send ``signum`` (to the process group, or to the driver only); exit code and seconds to exit."""
    t0 = time.time()
    (os.killpg if whole_group else os.kill)(proc.pid, signum)
    try:
        code = proc.wait(timeout=STOP_BOUND_S + 120)
    except Exception:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(log.read_text()[-5000:])
    return code, time.time() - t0


def check_stopped(run_dir, terminal: str, code: int, expected_code: int, seconds: float) -> int:
    """The shared assertions of a stopped run; returns its last completed step."""
    print(f"exit code {code}, {seconds:.1f} s after the signal")   # shown with -s / on failure
    assert code == expected_code, terminal[-5000:]
    assert seconds < STOP_BOUND_S, (seconds, terminal[-3000:])
    assert "Traceback" not in terminal and "KeyboardInterrupt" not in terminal, terminal[-5000:]
    assert "(interrupt)" in terminal   # megarl: stopping after step N (interrupt)
    steps = [r["step"] for r in metrics(run_dir)]
    assert steps == list(range(1, steps[-1] + 1)), steps          # completed steps only, once each
    ckpt = CheckpointManager(run_dir / "checkpoints")
    last, folder = ckpt.latest()
    assert last == steps[-1] and ckpt.verify(folder) == [], (last, steps)
    return last


def test_sigint_to_the_group_then_sigterm_to_the_driver_stop_cleanly_and_resume(tmp_path):
    run_dir, log = tmp_path / "stop", tmp_path / "stop.log"
    # 1. Ctrl-C: SIGINT to the process group, step 2 in flight
    proc = start(tmp_path, "stop", RECIPE)
    with ProcessWatch(proc.pid) as watch:
        wait_for_step(proc, run_dir, 1, log)
        code, seconds = stop_run(proc, signal.SIGINT, whole_group=True, log=log)
    terminal = log.read_text()
    last = check_stopped(run_dir, terminal, code, 130, seconds)
    assert last in (1, 2) and last % 4 != 0   # written by the interrupt, not by the schedule
    folder = CheckpointManager(run_dir / "checkpoints").latest()[1]
    final = terminal.strip().splitlines()[-1]
    assert final == (f"megarl: stopped by SIGINT after step {last}; resume from {folder} (step {last}): "
                     f"megarl train {tmp_path / 'stop.yaml'} --resume"), final
    left = watch.wait_gone()
    assert not left, "\n".join(left)

    # 2. the printed command resumes; SIGTERM to the driver only once a resumed step completed
    offset = len(terminal)
    proc = start(tmp_path, "stop", RECIPE, "--resume")
    with ProcessWatch(proc.pid) as watch:
        wait_for_step(proc, run_dir, last + 1, log)
        code, seconds = stop_run(proc, signal.SIGTERM, whole_group=False, log=log)
    terminal = log.read_text()[offset:]
    assert f"resumed from {folder} (step {last})" in terminal, terminal[-5000:]
    resumed = {r["step"]: r for r in metrics(run_dir)}[last + 1]
    assert resumed["rollout/logprob_diff_max"] < 1e-4, resumed   # vLLM and Megatron both have the loaded weights
    last2 = check_stopped(run_dir, terminal, code, 143, seconds)
    assert last2 > last and f"stopped by SIGTERM after step {last2}; resume from " in terminal.strip().splitlines()[-1]
    rows = metrics(run_dir)   # GSPO + RLOO trained every completed step
    sums = [r["actor/weight_checksum"] for r in rows]
    assert all(abs(a - b) > 1e-6 for a, b in zip(sums, sums[1:])) and all(r["actor/grad_norm"] > 0 for r in rows), rows
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in rows), [r["rollout/logprob_diff_max"] for r in rows]
    left = watch.wait_gone()
    assert not left, "\n".join(left)
