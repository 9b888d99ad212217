"""perf/bench_grpo.py's row from a run's config.yaml and metrics.jsonl (a synthetic run with hand-
computed answers): step 1 is left out of every average, tokens/s/GPU counts prompt + response
tokens, MFU divides the model FLOPs of the step by the GPUs' bf16 peak; the JSONL and markdown
files it writes."""
import os
import sys

import pytest
from helpers import read_jsonl, write_jsonl

PERF = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "perf")
sys.path.insert(0, PERF)

import bench_grpo  # noqa: E402

ROOT = os.path.dirname(PERF)


def _step(step, generate, train, tokens, samples=32, response=60.0):
    phases = {"time/generate_s": generate, "time/score_s": 0.5, "time/logprobs_s": 1.0, "time/train_s": train,
              "time/sync_s": 0.5}
    total = sum(phases.values())
    return {"step": step, **phases, "throughput/tokens_per_s": tokens / total, "rollout/num_samples": samples,
            "response_length/mean": response, "reward/mean": 0.5}


@pytest.fixture
def run_dir(tmp_path):
    from megarl.config import load_config, save_resolved

    cfg = load_config(os.path.join(ROOT, "configs", "quickstart.yaml"),
                      ["model.path=fixture:tiny-qwen2", "topology.world_size=2"], check_model=False)
    save_resolved(cfg, tmp_path)
    rows = [_step(1, 40.0, 30.0, 9999), _step(2, 2.0, 3.0, 3200, response=70.0),
            _step(3, 3.0, 2.0, 3000, response=50.0)]
    write_jsonl(tmp_path / "metrics.jsonl", rows)
    return tmp_path


def test_row_skips_step_one_and_counts_all_tokens(run_dir):
    row = bench_grpo.summarise(run_dir, gpu=None, recipe="configs/quickstart.yaml")
    assert row["steady_steps"] == "2-3" and row["steps"] == 3
    assert (row["device"], row["gpus"], row["mode"]) == ("cpu", 2, "on_policy")   # CPU: the training ranks
    assert row["step_s"] == pytest.approx(7.0)
    assert row["tokens_per_step"] == pytest.approx(3100)
    assert row["tokens_per_s_per_gpu"] == pytest.approx(6200 / 14 / 2)
    assert (row["generation_s"], row["logprob_s"], row["train_s"], row["sync_s"]) == pytest.approx((2.5, 1.0, 2.5, 0.5))
    assert row["mean_response_length"] == pytest.approx(60.0)
    assert row["mfu"] is None and row["mfu_train"] is None


def test_mfu_on_a_gpu_type(run_dir):
    from megarl.models.dims import ModelDims
    from megarl.models.fixtures import tiny_config
    from megarl.planner.flops import flops_per_token

    row = bench_grpo.summarise(run_dir, gpu="h100")
    dims = ModelDims.from_hf(tiny_config("qwen2").to_dict())
    length = round(3100 / 32)                      # mean prompt + response tokens per sample
    fwd = 32 * length * flops_per_token(dims, length, training=False)
    train = 32 * length * flops_per_token(dims, length, training=True)
    # generation + the reference pass + training: one update per step, so no old-log-prob pass
    # (megarl.config.passes.needs_old_logprob_pass)
    total = fwd * (1 + 1) + train
    assert row["gpus"] == 2                        # colocated: the training devices hold the engines
    assert row["mfu"] == pytest.approx(total / (7.0 * 2 * 989e12))
    assert row["mfu_train"] == pytest.approx(train / (2.5 * 2 * 989e12))


def test_one_step_is_refused(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()[:1]
    (run_dir / "metrics.jsonl").write_text(lines[0] + "\n")
    with pytest.raises(ValueError, match="needs at least 2"):
        bench_grpo.summarise(run_dir, gpu=None)


def test_results_are_appended_and_tabulated(run_dir, tmp_path):
    results = tmp_path / "out" / "bench.jsonl"
    for label in ("first", "second"):
        bench_grpo.write_results(bench_grpo.summarise(run_dir, gpu=None, label=label), results)
    rows = read_jsonl(results)
    assert [r["label"] for r in rows] == ["first", "second"]
    table = results.with_suffix(".md").read_text().splitlines()
    header = next(i for i, line in enumerate(table) if line.startswith("| date"))
    assert table[header].split(" | ")[4:8] == ["GPUs", "mode", "steps averaged", "step s"]
    body = table[header + 2:]
    assert len(body) == 2 and all("| 2 | on_policy | 2-3 | 7.0 |" in line and "| n/a | n/a |" in line for line in body)
