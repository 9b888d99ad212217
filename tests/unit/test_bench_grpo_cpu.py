"""perf/bench_grpo_cpu.py's own parts: the prompts both sides get, the PSS sampler, the report.
(The benchmark itself runs megarl and TRL for ~30 min: perf/, never a test.)"""
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import read_jsonl

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))
import bench_grpo_cpu as bench   # noqa: E402


def test_trl_gets_the_batches_megarl_draws_in_order(tmp_path):
    from megarl.config.schema import DataConfig
    from megarl.driver.rollouts import PromptSource

    bench.write_prompts(tmp_path / "p.jsonl", steps=3, prompts=4, level=2, seed=5)
    rows = read_jsonl(tmp_path / "p.jsonl")
    source = PromptSource(DataConfig(task="arithmetic", difficulty=2, prompts_per_step=4, seed=5))
    expected = [r for step in (1, 2, 3) for r in source.batch(step, 4)]
    assert [(r["prompt"], r["answer"]) for r in rows] == [(r.prompt, r.answer) for r in expected]
    assert len({r["prompt"] for r in rows}) > 4   # steps differ


def test_pss_sampler_sums_the_whole_process_tree():
    """A child that touches 200 MiB and starts a grandchild that touches 100 MiB: the peak sum
    counts both (PSS of private pages = their size), each under its own label."""
    code = ("import subprocess, sys, time; b = b'x' * (200 << 20); "
            "p = subprocess.Popen([sys.executable, '-c', 'b = bytes([1]) * (100 << 20); import time; time.sleep(3)']); "
            "time.sleep(3); p.wait()")
    proc = subprocess.Popen([sys.executable, "-c", code])
    sampler = bench.PssSampler(proc.pid, period_s=0.1)
    proc.wait()
    time.sleep(0.2)
    sampler.stop()
    assert sampler.peak_kib / 1024 > 300, sampler.peak_kib
    table = sampler.table()
    assert sum(g["count"] for g in table) == 2 and all(g["process"].startswith("python") for g in table)
    assert sum(g["pss_mib"] for g in table) == pytest.approx(sampler.peak_kib / 1024)


def test_report_prints_the_ratios_against_every_trl_row():
    class A:
        model_label, level, prompts, n, max_new, lr, steps = "fixture:smollm2", 1, 8, 4, 96, 1e-6, 6
        dtype_reason = "model.dtype auto -> float32 (CPU without native bf16 (no avx512_bf16 or amx_bf16))"

    def side(name, dtype, step_s, pss):
        return {"side": name, "dtype": dtype, "step_s_median": step_s, "phases_median": {"generate": 1.0},
                "mean_response_length": 60.0, "response_tokens_per_s": 1.0, "peak_pss_gib": pss, "run_wall_s": 9,
                "pss_table": [{"process": "p", "count": 1, "pss_mib": 1.0}], "pss_samples": 3,
                "step_s_all": [step_s], "reward_per_step": [0.1]}

    text = bench.report(A(), [side("megarl", "float32", 50.0, 6.0), side("TRL GRPOTrainer", "float32", 150.0, 8.0)])
    assert "vs TRL float32: speed-up 3.00x (target >= 2), memory 0.75x (target <= 1)" in text
    assert text.count("Per-process PSS at the peak") == 2
    assert f"megarl's dtype: {A.dtype_reason}." in text and " flags: " in text   # the CPU's flags beside the numbers
