"""perf/gpu_check.py: skipped cleanly without CUDA; --cpu-smoke runs every part (each in its own
process, as on the GPU) at tiny sizes and reports real, finite numbers; its helpers' arithmetic.

The smoke run is the only place CI executes the GPU check's code paths: the engine on the three
model families with bf16 log-probs and Adam steps, the log-softmax against torch, the bridge
handing buffers to a second process (shared memory on CPU; CUDA IPC on the GPU), and the probe of
the engine as a training worker starts it."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

PERF = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "perf")
sys.path.insert(0, PERF)

import gpu_check  # noqa: E402

SCRIPT = os.path.join(PERF, "gpu_check.py")


def _run(*args, timeout):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check would run")
def test_without_cuda_it_skips_and_writes_nothing(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = _run("--out", str(out), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "gpu_check: skipped: no CUDA device" in proc.stdout
    assert not out.exists() and not (tmp_path / "gpu_check.md").exists()


def _numbers(obj, path=""):
    """Every (path, number) in a JSON tree."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _numbers(v, f"{path}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _numbers(v, f"{path}[{i}]")
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield path, obj


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke") / "smoke.json"
    proc = _run("--cpu-smoke", "--out", str(out), timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text()), out.with_suffix(".md").read_text(), proc.stdout


def test_smoke_runs_every_part_with_finite_numbers(smoke):
    report, md, stdout = smoke
    assert report["mode"] == "cpu-smoke"
    assert list(report["parts"]) == [p.name for p in gpu_check.PARTS]
    assert {name: r["status"] for name, r in report["parts"].items()} == {p.name: "ok" for p in gpu_check.PARTS}
    bad = [(p, v) for p, v in _numbers(report) if not math.isfinite(v)]
    assert bad == []
    for part in gpu_check.PARTS:
        assert f"gpu_check: {part.name}: ok in " in stdout
    assert md.count("| ok |") == 3 * 2 + 2 + 1 + 1 + 1   # engines x phases, log-softmax x 2, env, ipc, worker


@pytest.mark.parametrize("model", list(gpu_check.MODELS))
def test_smoke_engine_parts_measure_real_work(smoke, model):
    r = smoke[0]["parts"][model]
    config = gpu_check.MODELS[model][1]
    lengths = gpu_check.grpo_lengths(gpu_check.SMOKE_WORKLOAD, seed=1)
    assert r["tokens"] == sum(n for n, _ in lengths) and r["sequences"] == len(lengths)
    assert r["config"] == config and r["params"] > 0
    for phase in ("logprobs", "train"):
        p = r[phase]
        assert p["tokens_per_s"] > 0 and p["seconds"] > 0 and p["peak_gib"] > 0
        assert p["mfu"] is None            # no peak FLOP/s for a CPU
        assert p["model_tflops_per_s"] == pytest.approx(
            gpu_check.sequence_flops(_dims(config), lengths, phase == "train") / p["seconds"] / 1e12, rel=1e-9)
    assert r["logprobs"]["max_logprob"] <= 0 < -r["logprobs"]["mean_logprob"]
    # random weights, vocabulary 256: log-probs near log(1/256) = -5.5
    assert -8 < r["logprobs"]["mean_logprob"] < -3
    assert r["train"]["update_successful"] is True and r["train"]["grad_norm"] > 0


def test_smoke_logsoftmax_matches_torch(smoke):
    r = smoke[0]["parts"]["logsoftmax"]
    assert (r["tokens"], r["vocab"]) == (256, 1024)
    assert r["max_abs_diff_logprob"] < 1e-4 and r["max_abs_diff_entropy"] < 1e-4
    for impl in ("megarl", "torch"):
        assert r[impl]["forward_tokens_per_s"] > 0 and r[impl]["fwd_bwd_tokens_per_s"] > 0


def test_smoke_bridge_hands_every_byte_to_the_other_process(smoke):
    from megarl.bridge.mapping import get_mapping

    r = smoke[0]["parts"]["cuda_ipc"]
    shapes = get_mapping(gpu_check.MODELS["dense"][1]).vllm_shapes(1)
    assert r["transport"] == "shm"        # CUDA IPC needs a GPU; the same bridge path otherwise
    assert r["tensors"] == r["tensors_received"] == len(shapes)
    assert r["mismatched"] == []
    assert r["bytes"] == sum(math.prod(s) for s in shapes.values()) * 2   # bf16
    assert r["buckets"] > 1 and r["copy_gbps"] > 0


def test_smoke_worker_probe_runs_on_cpu(smoke):
    r = smoke[0]["parts"]["engine_as_worker"]
    assert (r["backend"], r["build_as_is"], r["forward_logprobs"], r["train_step"]) == ("gloo", "ok", "ok", "ok")


def test_smoke_within_budget(smoke):
    assert smoke[0]["wall_s"] < smoke[0]["budget_s"]


def _dims(config):
    from megarl.models.dims import ModelDims

    return ModelDims.from_hf(config)


def test_gpu_names_map_to_specs():
    assert [gpu_check.gpu_key(n) for n in ("NVIDIA H200", "NVIDIA H20", "NVIDIA H100 80GB HBM3", "NVIDIA GB200",
                                            "Tesla V100-SXM2-16GB")] == ["h200", "h20", "h100", "gb200", None]


def test_sequence_flops_sums_each_sequence_at_its_own_length():
    from megarl.planner.flops import flops_per_token

    dims = _dims(gpu_check.MODELS["dense"][0])
    lengths = [(100, 10), (700, 60)]
    want = 100 * flops_per_token(dims, 100, True) + 700 * flops_per_token(dims, 700, True)
    assert gpu_check.sequence_flops(dims, lengths, training=True) == want


def test_gpu_workload_matches_the_published_batch_shape():
    w = gpu_check.GPU_WORKLOAD
    lengths = gpu_check.grpo_lengths(w, seed=1)
    assert len(lengths) == w.sequences
    assert all(w.prompt[0] <= p <= w.prompt[1] and p < n <= w.max_len for n, p in lengths)
    mean_response = sum(n - p for n, p in lengths) / len(lengths)
    assert 400 < mean_response < 1000      # the published rows: mean generated length ~700
    mbs = gpu_check.micro_batches(lengths, 1000, w, seed=2, device="cpu")
    assert sum(len(b.input_ids) for b in mbs) == w.sequences
    assert all(b.num_tokens <= w.tokens_per_micro_batch or len(b.input_ids) == 1 for b in mbs)
    assert [ids.numel() for b in mbs for ids in b.input_ids] == [n for n, _ in lengths]
