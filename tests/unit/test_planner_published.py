"""The step-time model's published constants (megarl/planner/published.py) are pinned to the
values their sources state, so that a change is a deliberate edit that names a new source; the
quantities derived from them and the model's rules (decode steps, continuous async decode, the
overlap of off-policy steps, the host optimizer) are checked by hand.

The values below are copied from the sources, not from the code: each line names where."""
import math

import pytest

from megarl.planner import published as P
from megarl.planner.hardware import get_gpu
from megarl.planner.roofline import (StepEstimate, Phase, allreduce_s, decode_steps, harmonic, layer_overhead_s,
                                     network_allreduce_s)

# name -> (value, a fragment of the source the value must be quoted from)
PINNED = {
    "decode_batch1_hopper": (137.18, "QwenLM/Qwen3 docs/source/getting_started/speed_benchmark.md"),
    "decode_batch1_blackwell": (10.23, "sgl-project/sgl-cookbook"),
    "allreduce_nvlink": (10.0, "vllm-project/vllm PR #24111"),
    "decode_cross_node": (23.1, "tenstorrent/tt-inference-server issue #356"),
    "hbm_efficiency": (3000 / 3350, "FlashMLA"),
    "dropless_vs_forced": (237 / 295, "Megatron-MoE-ModelZoo"),
    "tflops_per_doubling": ((357 / 237) ** (1 / 3), "Megatron-MoE-ModelZoo"),
    "rl_mfu_qwen3_30b_h20": (0.31, "volcengine/verl docs/perf/dpsk.md"),
    "rl_mfu_deepseek_v3_h20": (0.19, "volcengine/verl docs/perf/dpsk.md"),
    "refit_nvlink": (6.22, "MoonshotAI/checkpoint-engine"),
    "refit_network": (11.33, "MoonshotAI/checkpoint-engine"),
    "host_memory_bandwidth": (307.2, "Intel ark"),
    "nic_bandwidth": (47.0, "nccl-tests issue #290"),
    "host_to_device": (35.19, "NVIDIA/nvbandwidth issue #24"),
    "device_to_host": (52.77, "NVIDIA/nvbandwidth issue #24"),
}
TRAINING = {   # (family, gpu, dispatcher class) -> (TFLOPS, forced balance, source fragment)
    ("deepseek_v3", "h100", "flex"): (250.0, True, "NVIDIA-NeMo/Automodel"),
    ("deepseek_v3", "gb200", "flex"): (782.0, True, "Megatron-Bridge"),
    ("qwen3_moe_235b", "h100", "flex"): (276.0, True, "Megatron-MoE-ModelZoo"),
    ("qwen3_moe_235b", "gb200", "flex"): (728.0, True, "Megatron-Bridge"),
    ("qwen3_moe_30b", "h100", "flex"): (277.0, True, "NVIDIA-NeMo/Automodel"),
    # megatron-core's all-to-all dispatcher
    ("qwen3_moe_235b", "h100", "alltoall"): (200.0, True, "'235B | A2A | H100 | BF16 | 256 | 4096"),
    ("qwen3_moe_30b", "h100", "alltoall"): (120.0, True, "Megatron-MoE-ModelZoo issue #21"),
    ("qwen3_moe_30b", "gb200", "alltoall"): (150.0, True, "Megatron-MoE-ModelZoo issue #7"),
}


def test_every_constant_is_pinned_to_its_source():
    got = {m.name: m for m in P.ALL}
    assert set(got) == set(PINNED), "a constant was added or removed: pin it here with its source"
    for name, (value, source) in PINNED.items():
        assert got[name].value == pytest.approx(value, rel=1e-12), name
        assert source in got[name].source, name
        assert got[name].setting and got[name].unit
    rows = {(t.family, t.gpu, t.dispatcher): t for t in P.TRAINING}
    assert set(rows) == set(TRAINING) and len(rows) == len(P.TRAINING)
    for key, (tflops, forced, source) in TRAINING.items():
        assert rows[key].tflops == tflops and rows[key].forced_balance == forced and source in rows[key].source, key


def test_no_constant_comes_from_the_rows_it_is_compared_with():
    # the NeMo-RL performance summary is what perf/plan_vs_published.py compares with
    for text in [m.source for m in P.ALL] + [t.source for t in P.TRAINING]:
        assert "NVIDIA-NeMo/RL" not in text and "performance-summary.md (NeMo-RL" not in text


def test_derived_quantities_by_hand():
    eff = 3000 / 3350
    # Hopper: 1/137.18 s minus 3.3e9 x 2 B at 4.0 TB/s x eff, over 48 layers
    hopper = (1 / 137.18 - 3.3e9 * 2 / (4.0e12 * eff)) / 48
    assert layer_overhead_s("h100")[0] == pytest.approx(hopper)
    assert 110e-6 < hopper < 118e-6
    # Blackwell: 10.23 ms minus 22e9 x 2 / 8 at 8 TB/s x eff minus 188 all-reduces of 10 us, over 94
    blackwell = (10.23e-3 - 22e9 * 2 / 8 / (8e12 * eff) - 188 * 10e-6) / 94
    assert layer_overhead_s("gb200")[0] == pytest.approx(blackwell)
    # across nodes: 23.1 ms minus 37e9 FP8 bytes / 16 at 3.35 TB/s x eff minus 61 Hopper layers, over 122
    network = (23.1e-3 - 37e9 / 16 / (3.35e12 * eff) - 61 * hopper) / 122
    assert network_allreduce_s()[0] == pytest.approx(network)
    assert allreduce_s(1e6, nvlink=True, group=8, link_bytes_per_s=50e9) == pytest.approx(20e-6)
    assert allreduce_s(1e6, nvlink=False, group=32, link_bytes_per_s=50e9) == pytest.approx(
        network + 2 * 31 / 32 * 1e6 / 50e9)
    assert allreduce_s(1e6, nvlink=False, group=1, link_bytes_per_s=50e9) == 0.0
    assert P.host_link_bytes_per_s(get_gpu("h100")) == (52.77e9, 35.19e9)
    assert P.host_link_bytes_per_s(get_gpu("gb200")) == (225e9, 225e9)
    assert P.refit_bytes_per_s(over_network=False) == pytest.approx(470e9 / 8 / 6.22)
    assert P.refit_bytes_per_s(over_network=True) == pytest.approx(671e9 / 16 / 11.33)
    # training throughput on a GPU without a row
    assert P.training_throughput("qwen3_moe_30b", "gb200")[0] == pytest.approx(277 * 728 / 276)
    assert P.training_throughput("deepseek_v3", "h200")[0] == pytest.approx(250.0)
    with pytest.raises(KeyError, match="add one"):
        P.training_throughput("llama", "h100")


def test_training_throughput_follows_the_dispatcher():
    # a published row of the dispatcher class: deepep and hybridep are both megatron-core's flex dispatcher
    assert P.training_throughput("qwen3_moe_235b", "h100", "alltoall")[:2] == (200.0, True)
    assert P.training_throughput("qwen3_moe_235b", "gb200", "hybridep")[0] == 728.0
    assert P.training_throughput("qwen3_moe_30b", "gb200", "alltoall")[0] == 150.0
    # DeepSeek-V3 has no all-to-all row: its DeepEP figure x Qwen3-235B's A2A / DeepEP ratio on H100
    assert P.training_throughput("deepseek_v3", "h100", "alltoall")[0] == pytest.approx(250 * 200 / 276)
    # ... and on GB200 that x the GB200 / H100 ratio of the all-to-all family that has both (Qwen3-30B)
    assert P.training_throughput("deepseek_v3", "gb200", "alltoall")[0] == pytest.approx(250 * 200 / 276 * 150 / 120)
    # another Hopper GPU: flex at the peak ratio; all-to-all adds H100's extra time per FLOP (same NVLink)
    peak = 148 / 989
    assert P.training_throughput("qwen3_moe_30b", "h20", "deepep")[0] == pytest.approx(277 * peak)
    a2a = P.training_throughput("qwen3_moe_30b", "h20", "alltoall")[0]
    assert a2a == pytest.approx(1 / (1 / (277 * peak) + 1 / 120 - 1 / 277))
    assert a2a < 277 * peak
    assert P.training_throughput("qwen3_moe_30b", "h200", "alltoall")[0] == 120.0   # H200: H100's bf16 peak
    # verl's measured RL update (Qwen3-30B-A3B on H20, DeepEP) stays a cross-check, printed beside the model
    assert {m.name for m in P.RL_TRAINING_MFU} <= {m.name for m in P.ALL}


def test_the_recipes_name_the_dispatcher_of_the_recipes_they_reproduce():
    # NeMo-RL's GB200 on-policy DeepSeek-V3 and Qwen3-235B recipes switch to the flex dispatcher with HybridEP;
    # every other NeMo-RL recipe inherits grpo_math_1B.yaml's alltoall; verl's DeepSeek-V3 script runs DeepEP
    from pathlib import Path

    from megarl.config import load_config

    repo = Path(__file__).resolve().parents[2]
    flex = {"grpo_deepseek_v3_gb200x128.yaml": "hybridep", "grpo_qwen3_235b_gb200x64.yaml": "hybridep",
            "grpo_deepseek_v3_h20x96.yaml": "deepep"}
    for path in sorted((repo / "configs").glob("grpo_*_*x*.yaml")):
        want = flex.get(path.name, "alltoall")
        assert load_config(str(path)).model.moe_dispatcher == want, path.name


def test_decode_steps_rule():
    assert harmonic(1) == 1.0 and harmonic(4) == pytest.approx(1 + 1 / 2 + 1 / 3 + 1 / 4)
    assert harmonic(5000) == pytest.approx(sum(1 / i for i in range(1, 5001)), rel=1e-6)
    # 512 responses of mean 700: the longest expected at 700 x H(512) ~ 4,770 > the cap
    assert decode_steps(512, 700, 1280) == 1280
    # 4 responses of mean 100: 100 x H(4) = 208 < the cap
    assert decode_steps(4, 100, 1280) == pytest.approx(100 * (1 + 1 / 2 + 1 / 3 + 1 / 4))


def test_off_policy_step_overlaps_generation_with_training():
    est = StepEstimate(phases=[Phase("generation", 40, ""), Phase("logprobs", 5, ""), Phase("train", 20, ""),
                               Phase("sync", 3, ""), Phase("offload", 0, "")])
    assert est.seconds == 68
    est.overlapped = True
    assert est.seconds == 43
    est.phases[2].seconds = 50
    assert est.seconds == 58


@pytest.fixture(autouse=True)
def _attention_env_restored(monkeypatch):
    """Building megatron models in this process writes NVTE_* attention variables; a later
    subprocess (tests/e2e/test_plan_cli.py) would inherit them and refuse DeepSeek's backend."""
    import os

    for key in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        if key in os.environ:
            monkeypatch.setenv(key, os.environ[key])
        else:   # recorded as absent (setenv first), so the teardown removes what a build wrote
            monkeypatch.setenv(key, "")
            monkeypatch.delenv(key)
    yield


def _plan(recipe, *overrides):
    from pathlib import Path

    from megarl.config import load_config
    from megarl.planner.plan import make_plan

    repo = Path(__file__).resolve().parents[2]
    return make_plan(load_config(repo / "configs" / recipe, list(overrides)), recipe)


def test_optimizer_offload_moves_the_optimizer_to_the_host_and_costs_its_transfer():
    """The 96-GPU DeepSeek-V3 layout (TP8 x PP12 x EP8 on 96 GB H20, verl's scale) fits only with
    the optimizer on the host; the plan counts it in host memory and prices the host update."""
    on = _plan("grpo_deepseek_v3_h20x96.yaml")
    off = _plan("grpo_deepseek_v3_h20x96.yaml", "trainer.optimizer_offload=false")
    kept = _plan("grpo_deepseek_v3_h20x96.yaml", "trainer.offload_train_state=false")
    neither = _plan("grpo_deepseek_v3_h20x96.yaml", "trainer.offload_train_state=false",
                    "trainer.optimizer_offload=false")
    assert not on.problems
    assert any(p.startswith("training on rank") and "optimizer state" in p for p in off.problems)
    for a, b in zip(on.kinds, off.kinds):
        assert b.train_phase - a.train_phase == a.state.optimizer       # off the device
    # onto the host: with the rest of the state kept on the devices, the host holds the optimizer
    # (the peak node is the last: 8 last-stage ranks, the largest optimizer shards)
    assert kept.host_peak - neither.host_peak == 8 * kept.kinds[-1].state.optimizer
    assert on.host_peak == off.host_peak      # offload_train_state moves all of it either way
    train_on, train_off = on.estimate.phase("train"), off.estimate.phase("train")
    assert "host optimizer" in train_on.detail and train_on.seconds > train_off.seconds
    worst = max(on.kinds, key=lambda k: k.state.total).count
    shard = worst.dense + worst.expert                                   # dp = expert-dp = 1 here
    host = 4 * shard / 52.77e9 + 2 * shard / 35.19e9 + 28 * shard / (2 * 307.2e9 / 8)
    optimizer_steps = 3
    assert train_on.seconds - train_off.seconds == pytest.approx(optimizer_steps * host, rel=1e-6)
    assert math.isfinite(on.estimate.seconds)


def test_async_decode_keeps_every_slot_busy():
    one_off = _plan("grpo_qwen3_30b_h100x192_8off.yaml", "trainer.mode=one_step_off")
    async_ = _plan("grpo_qwen3_30b_h100x192_8off.yaml")
    assert async_.estimate.overlapped and one_off.estimate.overlapped
    gen_async, gen_one = async_.estimate.phase("generation"), one_off.estimate.phase("generation")
    assert "continuous" in gen_async.detail and "longest of 2048" in gen_one.detail
    assert gen_async.seconds < gen_one.seconds
    # the planned GPUs are the training ones plus the engines' own
    assert async_.world == 128 + 32 * 2
