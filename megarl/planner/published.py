"""Published measurements the step-time model (:mod:`megarl.planner.roofline`) is built from.

Every number here is a measurement another system published, quoted with its source, and never
one of the GRPO step times the estimates are compared with (NeMo-RL's performance summary).
``tests/unit/test_planner_published.py`` pins each value to the cited one: changing a constant is
a deliberate edit that names a new source. What the model derives
from them (a per-layer decode overhead, a bandwidth per GPU) is computed in the functions below,
in the open, from these values and the arithmetic their sources state.

Conventions: ``value`` in the unit named; ``source`` says where (repository + path + commit, or
URL) and quotes the figure; ``setting`` is what was measured (model, hardware, batch), which the
derivation needs.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Measurement:
    name: str
    value: float
    unit: str
    setting: str
    source: str

    def line(self) -> str:
        return f"{self.name} = {self.value:g} {self.unit} ({self.setting}): {self.source}"


# --- decode -----------------------------------------------------------------------------------
DECODE_BATCH1_HOPPER = Measurement(
    "decode_batch1_hopper", 137.18, "tokens/s",
    "Qwen3-30B-A3B BF16 on one NVIDIA H20 (4.0 TB/s), batch 1, input length 1, 2,048 generated tokens, "
    "SGLang 0.4.6.post1; 48 layers, 3.3B activated parameters (Qwen3 model card)",
    "QwenLM/Qwen3 docs/source/getting_started/speed_benchmark.md (commit c7f51a1a): Qwen3-30B-A3B "
    "'BF16 | 1 | 137.18'")
DECODE_BATCH1_BLACKWELL = Measurement(
    "decode_batch1_blackwell", 10.23, "ms per token",
    "Qwen3-235B-A22B-Instruct-2507 BF16 on 8x B200 (8 TB/s), tensor parallel 8, max-concurrency 1, "
    "1000 input / 8000 output tokens, SGLang 0.5.6; 94 layers, 22B activated parameters",
    "sgl-project/sgl-cookbook docs/autoregressive/Qwen/Qwen3.md (commit 7b5bd9c0): 'Mean TPOT (ms): 10.23'")
ALLREDUCE_NVLINK = Measurement(
    "allreduce_nvlink", 10.0, "us",
    "vLLM custom all-reduce (one-stage), H100 SXM, 4 GPUs, bf16 (32, 8192) = 0.5 MB per call",
    "vllm-project/vllm PR #24111, 'Isolated primitives benchmark results: H100', TP=4 row "
    "'(32, 8192) 0.50 MB 0.010'")
DECODE_CROSS_NODE = Measurement(
    "decode_cross_node", 23.1, "ms per token",
    "DeepSeek-R1-0528 (FP8 weights, 61 layers, 37B activated) on 16 H100 in 2 nodes over InfiniBand, tensor "
    "parallel 16, SGLang, concurrency 1, 128 input / 128 output tokens: the time of an engine whose "
    "all-reduces cross nodes",
    "tenstorrent/tt-inference-server issue #356, 'Performance Benchmark Sweeps for DeepSeek-R1-0528 on 16 H100 "
    "(SGLANG + INFINIBAND)': '128 | 128 | 1 | 8 | 179.7 | 23.1'")
HBM_EFFICIENCY = Measurement(
    "hbm_efficiency", 3000 / 3350, "of peak",
    "FlashMLA decode, memory-bound configuration, H800 SXM5 (HBM3 peak 3.35 TB/s)",
    "deepseek-ai/FlashMLA README: 'up to 3000 GB/s in memory-bound configuration'")

# --- training ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrainingThroughput:
    """Published MoE training throughput of a model family on one GPU type (bf16, 4096-token
    sequences, the source's routing) with one class of expert-parallel token dispatcher:
    ``flex`` (DeepEP / HybridEP, the tuned benchmarks) or ``alltoall`` (megatron-core's NCCL
    all-to-all, what ``model.moe_dispatcher: alltoall`` runs and NeMo-RL's H100 GRPO recipes run:
    their examples/configs/grpo_math_1B.yaml sets ``moe_token_dispatcher_type: alltoall``,
    ``moe_enable_deepep: false``; only the GB200 DeepSeek-V3 and Qwen3-235B recipes switch to
    ``flex`` / ``hybridep``)."""

    family: str
    gpu: str
    tflops: float
    forced_balance: bool
    setting: str
    source: str
    dispatcher: str = "flex"

    def line(self) -> str:
        routing = "forced/fake-balanced routing" if self.forced_balance else "dropless routing"
        return (f"training {self.family} on {self.gpu}, {self.dispatcher} dispatcher: {self.tflops:g} TFLOPS/GPU at "
                f"4096 tokens, bf16, {routing} ({self.setting}): {self.source}")


TRAINING = [
    TrainingThroughput("deepseek_v3", "h100", 250.0, True, "DeepSeek V3 671B, 256 H100, TP1 PP4 EP64 VP8, TE + DeepEP",
                       "NVIDIA-NeMo/Automodel docs/performance-summary.md (commit 01926a5c, 2025-10-02): "
                       "'DeepSeek V3 671B | 256 | 512 | ... | 8.18 | 250 | 1,002'; 'Fake balanced gate is enabled'"),
    TrainingThroughput("deepseek_v3", "gb200", 782.0, True, "DeepSeekV3 (w/o MTP), 256 GB200, TP1 PP4 VP4 EP64",
                       "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md, 25.11 GB200 table: "
                       "'DeepSeekV3 (w/o MTP) | 256 | BF16 | ... | 3139 | 782'; 'we force-balance the token "
                       "distribution among experts'"),
    TrainingThroughput("qwen3_moe_235b", "h100", 276.0, True, "Qwen3-235B-A22B, 256 H100, TP2 PP8 VPP4 EP32, DeepEP",
                       "yanring/Megatron-MoE-ModelZoo best_practice/qwen3/readme.md (commit 798dfb50): "
                       "'235B | DeepEP | H100 | BF16 | 256 | 4096 | ... | 17.6 | 276'; run script "
                       "--moe-router-force-load-balancing"),
    TrainingThroughput("qwen3_moe_235b", "gb200", 728.0, True, "Qwen3_235B_a22B, 256 GB200, TP1 PP8 VP3 EP32",
                       "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md, 25.11 GB200 table: "
                       "'Qwen3_235B_a22B | 256 | BF16 | ... | 4916 | 728'"),
    TrainingThroughput("qwen3_moe_30b", "h100", 277.0, True, "Qwen3 MoE 30B, 8 H100, EP8, TE + DeepEP",
                       "NVIDIA-NeMo/Automodel docs/performance-summary.md (commit 01926a5c): "
                       "'Qwen3 MoE 30B | 8 | 512 | ... | 21.773 | 277 | 12,040'; 'Fake balanced gate is enabled'"),
    TrainingThroughput("qwen3_moe_235b", "h100", 200.0, True,
                       "Qwen3-235B-A22B, 256 H100, megatron-core A2A dispatcher, TP2 EP8 PP32 VPP3, MBS 1, GBS 2048, "
                       "recompute norm + act",
                       "yanring/Megatron-MoE-ModelZoo best_practice/qwen3/readme.md (commit e8650517), 'Intra-node EP "
                       "strategy': '235B | A2A | H100 | BF16 | 256 | 4096 | 2 | 1 | 8 | 32 | ... | 24.2 | 200'; the "
                       "readme's runs add --moe-router-force-load-balancing", dispatcher="alltoall"),
    TrainingThroughput("qwen3_moe_30b", "h100", 120.0, True,
                       "Qwen3-30B-A3B, 32 H100 (4 nodes), megatron-core with the ModelZoo's run_30b.sh layout (TP1 PP1 "
                       "EP8, MBS 1, 4096 tokens, --moe-router-force-load-balancing); the report does not name its "
                       "dispatcher: counted as the untuned megatron-core stack, not the tuned DeepEP benchmark it asks "
                       "about",
                       "yanring/Megatron-MoE-ModelZoo issue #21 (2025-12-24): 'using the config provided in run_30b.sh "
                       "... On a setup with 4x8 H100 GPUs, I am only achieving around 120 TFLOPS'; the same report as "
                       "NVIDIA/Megatron-LM issue #2762 ('Low TFLOPS on Qwen3-30B-A3B (120 vs 277)')",
                       dispatcher="alltoall"),
    TrainingThroughput("qwen3_moe_30b", "gb200", 150.0, True,
                       "Qwen3-30B-A3B on 8 B200 (one node; priced as the GB200 GPU), megatron-core All2All dispatcher, "
                       "EP8 TP1 PP1, MBS 1, no recompute, --moe-router-force-load-balancing, grouped GEMM",
                       "yanring/Megatron-MoE-ModelZoo issue #7 ('Qwen3-30B-A3B Low Throughput', 2025-08-18): "
                       "'All2All as the dispatcher type' ... 'I'm getting throughput ~150 TFLOPs / GPU'",
                       dispatcher="alltoall"),
]
"""A family, GPU and dispatcher without a row is derived in :func:`training_throughput`, in the
open: Qwen3-30B-A3B on GB200 with the flex dispatcher has no bf16 row anywhere (Megatron-Bridge
publishes MXFP8 only), DeepSeek-V3 has no all-to-all row on any GPU."""

DROPLESS_SERIES = Measurement(
    "dropless_vs_forced", 237 / 295, "ratio",
    "Qwen3-235B-A22B, 256 H100, bf16, DeepEP, 16,384-token sequences: dropless 237 vs forced balance 295 TFLOPS "
    "(RL trains on the model's own routing, dropless)",
    "yanring/Megatron-MoE-ModelZoo best_practice/qwen3/readme.md, 'Long Context' table: "
    "'16384 | 32 | 4 | 1 | 256 | 295 (forced balance) / 237 (dropless)'")
SEQUENCE_TREND = Measurement(
    "tflops_per_doubling", (357 / 237) ** (1 / 3), "x per doubling of the sequence",
    "Qwen3-235B-A22B, 256 H100, bf16, dropless: 237, 277, 320, 357 TFLOPS at 16K, 32K, 64K, 128K tokens "
    "(the geometric mean step, applied to micro-batches shorter or longer than 4,096 tokens)",
    "yanring/Megatron-MoE-ModelZoo best_practice/qwen3/readme.md, 'Long Context' table")
RL_TRAINING_MFU = [
    Measurement("rl_mfu_qwen3_30b_h20", 0.31, "MFU",
                "verl, Megatron backend, GRPO policy update of Qwen3-30B-A3B on 32 H20, TP1 PP1 EP8, optimizer "
                "offload (MFU of the update only, 6 x active params + attention, against 148 TFLOPS)",
                "volcengine/verl docs/perf/dpsk.md (commit b178a3cd)"),
    Measurement("rl_mfu_deepseek_v3_h20", 0.19, "MFU",
                "verl, Megatron backend, GRPO of DeepSeek-V3 671B on 96 H20, mean response 1,960 tokens",
                "volcengine/verl docs/perf/dpsk.md (commit b178a3cd)"),
]
"""Cross-checks, not inputs: the RL updates another system measured (on H20, whose peak is a
sixth of H100's), printed beside the training estimate."""

# --- weight sync (refit) and host transfers ---------------------------------------------------
REFIT_NVLINK = Measurement(
    "refit_nvlink", 6.22, "s",
    "checkpoint-engine broadcast update of Qwen3-235B-A22B-Instruct-2507 BF16 into vLLM, 8x H800, TP8 "
    "(one NVLink node): 470 GB of bf16 weights, 58.7 GB per GPU",
    "MoonshotAI/checkpoint-engine README.md (commit 415c3205): 'Qwen3-235B-A22B-Instruct-2507 (BF16) | "
    "8xH800 TP8 | 0.33s | 6.22s (2.67GiB)'")
REFIT_NETWORK = Measurement(
    "refit_network", 11.33, "s",
    "checkpoint-engine broadcast update of DeepSeek-V3.1 (FP8, 671 GB) into vLLM, 256x H20 in 16 TP16 "
    "instances (each spanning 2 nodes): 41.9 GB per GPU",
    "MoonshotAI/checkpoint-engine README.md (commit 415c3205): 'DeepSeek-V3.1 (FP8) | 256xH20 TP16 | 0.80s | "
    "11.33s (8.00GiB)'")
REFIT_BYTES_PER_GPU = {"refit_nvlink": 470e9 / 8, "refit_network": 671e9 / 16}

HOST_MEMORY_BANDWIDTH = Measurement(
    "host_memory_bandwidth", 307.2, "GB/s per CPU socket",
    "Intel Xeon Platinum 8480C (DGX H100: 2 sockets per 8 GPUs): 8 channels of DDR5-4800",
    "Intel ark, Xeon Platinum 8480+ specifications: 'Max # of Memory Channels 8', 'DDR5-4800'; "
    "8 x 4800 MT/s x 8 B = 307.2 GB/s")

HOST_TO_DEVICE = Measurement(
    "host_to_device", 35.19, "GB/s",
    "nvbandwidth host_to_device_memcpy_sm, one H100 of an 8-GPU H100 server (PCIe Gen5): what onload achieves",
    "NVIDIA/nvbandwidth issue #24: 'memcpy SM CPU(row) -> GPU(column) bandwidth (GB/s)' row '35.19 35.25 35.30 ...'")
DEVICE_TO_HOST = Measurement(
    "device_to_host", 52.77, "GB/s",
    "nvbandwidth device_to_host_memcpy_sm on the same H100 server: what offload achieves",
    "NVIDIA/nvbandwidth issue #24: 'memcpy SM CPU(row) <- GPU(column) bandwidth (GB/s)' row '52.77 52.77 52.77 ...'")

NIC_BANDWIDTH = Measurement(
    "nic_bandwidth", 47.0, "GB/s per NIC",
    "NCCL bus bandwidth of one 400 Gb/s NDR InfiniBand NIC (one NIC per GPU on DGX H100): the rate of a "
    "collective whose group spans nodes (data-parallel gradient reduction, pipeline sends across nodes)",
    "NVIDIA/nccl-tests issue #290 (maintainer): 'For NDR @ 400Gbps you should see 46-48GB/s per NIC'")

ALL = [DECODE_BATCH1_HOPPER, DECODE_BATCH1_BLACKWELL, ALLREDUCE_NVLINK, DECODE_CROSS_NODE, HBM_EFFICIENCY,
       DROPLESS_SERIES, SEQUENCE_TREND, *RL_TRAINING_MFU, REFIT_NVLINK, REFIT_NETWORK, HOST_MEMORY_BANDWIDTH, NIC_BANDWIDTH,
       HOST_TO_DEVICE, DEVICE_TO_HOST]


def host_link_bytes_per_s(gpu) -> tuple[float, float]:
    """(device -> host, host -> device) bytes per second of one GPU: the published achieved rates
    on a PCIe Gen5 Hopper server; GB200's NVLink-C2C at its datasheet figure (no published achieved
    rate was found)."""
    if gpu.key in ("h100", "h200", "h20"):
        return DEVICE_TO_HOST.value * 1e9, HOST_TO_DEVICE.value * 1e9
    return gpu.host_gbps * 1e9, gpu.host_gbps * 1e9


def refit_bytes_per_s(over_network: bool) -> float:
    """Bytes per second one vLLM GPU receives in a published refit (checkpoint-engine's broadcast):
    over NVLink within a node, or into engines that span nodes."""
    m = REFIT_NETWORK if over_network else REFIT_NVLINK
    return REFIT_BYTES_PER_GPU[m.name] / m.value


DISPATCHERS = {"alltoall": "alltoall", "deepep": "flex", "hybridep": "flex", "flex": "flex"}
"""``model.moe_dispatcher`` -> the dispatcher class of the published rows."""


def training_throughput(family: str, gpu: str, dispatcher: str = "flex") -> tuple[float, bool, str]:
    """(TFLOPS per GPU, whether the source forced balanced routing, how it was obtained) for a
    model family on a GPU type with a dispatcher (``model.moe_dispatcher``: alltoall, deepep,
    hybridep), in this order:

    1. the published row of that family, GPU and dispatcher class;
    2. another Hopper GPU (H200, H20): the family's H100 figure (by these rules) times the ratio of the
       datasheet bf16 peaks;
    3. a Blackwell GPU: the family's H100 figure times the GB200/H100 ratio of a family that has
       both with that dispatcher;
    4. the other dispatcher class: the family's row on that GPU times the all-to-all / flex ratio
       of a family that has both on that GPU.
    The text says which."""
    from megarl.planner.hardware import GPUS

    kind = DISPATCHERS[dispatcher]
    rows = {(t.family, t.gpu, t.dispatcher): t for t in TRAINING}
    fams = {t.family for t in TRAINING}
    if family not in fams:
        raise KeyError(f"no published MoE training throughput for model family {family!r} "
                       f"(known: {', '.join(sorted(fams))}); add one to megarl/planner/published.py")
    if (family, gpu, kind) in rows:
        row = rows[family, gpu, kind]
        return row.tflops, row.forced_balance, row.line()
    if gpu in ("h200", "h20"):
        ratio = GPUS[gpu].bf16_tflops / GPUS["h100"].bf16_tflops
        flex, forced, how = training_throughput(family, "h100", "flex")
        if kind == "flex":
            return flex * ratio, forced, (f"training {family} on {gpu}, flex dispatcher: no published row; its H100 "
                                          f"figure {flex:.0f} x {ratio:.2f} (datasheet bf16 peak "
                                          f"{GPUS[gpu].bf16_tflops:g} / 989), from: {how}")
        a2a = training_throughput(family, "h100", "alltoall")[0]
        extra = 1 / a2a - 1 / flex      # seconds per 1e12 FLOP the all-to-all stack adds on H100's NVLink
        got = 1 / (1 / (flex * ratio) + extra)
        return got, forced, (f"training {family} on {gpu}, alltoall dispatcher: no published row; 1 / (1 / "
                             f"({flex:.0f} x {ratio:.2f}, the flex figure at the datasheet bf16 peak ratio) + (1/{a2a:.0f} "
                             f"- 1/{flex:.0f}), the time per FLOP the all-to-all stack adds on H100, whose NVLink "
                             f"this GPU shares) = {got:.0f}")
    kin = family.rsplit("_", 1)[0]   # qwen3_moe_30b -> a qwen3_moe family first
    nearest = sorted(fams, key=lambda f: (not f.startswith(kin), f))
    ref = next((f for f in nearest if (f, gpu, kind) in rows and (f, "h100", kind) in rows), None)
    if gpu != "h100" and ref is not None:
        base, forced, how = training_throughput(family, "h100", dispatcher)
        ratio = rows[ref, gpu, kind].tflops / rows[ref, "h100", kind].tflops
        return base * ratio, forced, (f"training {family} on {gpu}, {kind} dispatcher: no published bf16 row; its H100 "
                                      f"figure {base:.0f} x {ratio:.2f} ({ref}: {rows[ref, gpu, kind].tflops:g} on {gpu} / "
                                      f"{rows[ref, 'h100', kind].tflops:g} on h100), from: {how}")
    other = "flex" if kind == "alltoall" else "alltoall"
    ref = next((f for f in nearest if (f, gpu, kind) in rows and (f, gpu, other) in rows), None)
    if ref is not None:
        base, forced, how = training_throughput(family, gpu, other)
        ratio = rows[ref, gpu, kind].tflops / rows[ref, gpu, other].tflops
        return base * ratio, forced, (f"training {family} on {gpu}, {kind} dispatcher: no published row; its {other} "
                                      f"figure {base:.0f} x {ratio:.2f} ({ref} on {gpu}: {rows[ref, gpu, kind].tflops:g} "
                                      f"{kind} / {rows[ref, gpu, other].tflops:g} {other}), from: {how}")
    raise KeyError(f"no published MoE training throughput for {family!r} on {gpu!r} with the {kind} dispatcher")
