"""The step-time estimate of one GRPO step: generation, log-probs, training, weight sync, offload.

Each phase is priced from published measurements of other systems (:mod:`megarl.planner.published`,
every value quoted with its source and pinned by a unit test) and the datasheet peaks of
:mod:`megarl.planner.hardware`; never from the published GRPO step times the estimates are
compared with.

* Generation per engine: the decode steps of the longest response (:func:`decode_steps`) or, in
  async mode, of the buffered tokens, each priced by :func:`decode_step_s`.
* Log-probs and training: model FLOPs (:mod:`megarl.planner.flops`) at the published MoE training
  throughput of the family and GPU, measured with the recipe's dispatcher (megatron-core's
  all-to-all runs at 0.2-0.7x of DeepEP / HybridEP), shaped for routing and sequence length.
* Weight sync: each vLLM GPU receives its bf16 shard at a published per-GPU refit rate.
* Offload (``trainer.offload_train_state``, ``rollout.sleep_level`` 1): training state and vLLM
  weights cross the host link at the published achieved rates of each direction.
How the phases combine per mode: :func:`estimate_step`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from megarl.planner import published as P

@dataclass
class Phase:
    name: str
    seconds: float
    detail: str


@dataclass
class StepEstimate:
    phases: list[Phase] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=list)
    tokens_per_step: float = 0.0
    train_flops: float = 0.0
    overlapped: bool = False
    """Generation overlaps log-probs + training (off-policy modes on split GPUs)."""

    @property
    def seconds(self) -> float:
        if not self.overlapped:
            return sum(p.seconds for p in self.phases)
        t = {p.name: p.seconds for p in self.phases}
        return max(t["generation"], t["logprobs"] + t["train"]) + t["sync"] + t["offload"]

    def phase(self, name: str) -> Phase:
        return next(p for p in self.phases if p.name == name)


def experts_touched(tokens: float, experts: int, topk: int) -> float:
    """Expected fraction of ``experts`` that ``tokens`` tokens routed uniformly to ``topk`` each touch."""
    if not experts:
        return 1.0
    return 1.0 - (1.0 - topk / experts) ** tokens


def pipeline_bubble(micro_batches: int, pp: int, vpp: int) -> float:
    """Time factor of the 1F1B pipeline bubble (1 without pipelining)."""
    if pp <= 1:
        return 1.0
    return (micro_batches + (pp - 1) / max(1, vpp)) / micro_batches


def harmonic(n: float) -> float:
    """H(n) = 1 + 1/2 + ... + 1/n (n >= 1; ``ln n + 0.5772 + 1/(2n)`` past 1000)."""
    n = max(1, int(round(n)))
    if n > 1000:
        return math.log(n) + 0.5772156649 + 1 / (2 * n)
    return sum(1.0 / i for i in range(1, n + 1))


def decode_steps(samples: int, mean_response: float, cap: int) -> float:
    """Decode steps of a step (on_policy, one_step_off: it waits for its longest response): the
    expected longest of ``samples`` exponentially distributed responses of mean
    ``mean_response``, ``mean x H(n)`` (~``ln n + 0.58``), at most the cap. With hundreds of
    samples and a mean above a fifth of the cap, decode runs to the cap."""
    return min(float(cap), mean_response * harmonic(samples))


GPU_GENERATION = {"h100": "hopper", "h200": "hopper", "h20": "hopper", "gb200": "blackwell"}


def layer_overhead_s(gpu_name: str) -> tuple[float, str]:
    """Per-layer decode time beyond the weight read, from the published batch-1 measurement of the
    GPU's generation: (step - read at the published HBM efficiency - its all-reduces) / layers."""
    eff = P.HBM_EFFICIENCY.value
    if GPU_GENERATION.get(gpu_name, "hopper") == "blackwell":
        m = P.DECODE_BATCH1_BLACKWELL
        step = m.value / 1e3
        read = 22e9 * 2 / 8 / (8.0e12 * eff)                        # 22B active bf16 over TP8, B200 8 TB/s
        comm = 2 * 94 * P.ALLREDUCE_NVLINK.value * 1e-6              # one token: the all-reduce's floor
        layers = 94
    else:
        m = P.DECODE_BATCH1_HOPPER
        step = 1.0 / m.value
        read = 3.3e9 * 2 / (4.0e12 * eff)                           # 3.3B active bf16, H20 4.0 TB/s
        comm, layers = 0.0, 48
    per_layer = (step - read - comm) / layers
    return per_layer, (f"{per_layer * 1e6:.0f} us per layer = ({step * 1e3:.2f} ms measured - {read * 1e3:.2f} ms weight "
                       f"read - {comm * 1e3:.2f} ms all-reduces) / {layers} layers, from {m.name}")


def network_allreduce_s() -> tuple[float, str]:
    """Latency of one tensor-parallel all-reduce whose group spans nodes, from the published
    cross-node decode: (step - weight read - 61 layers x the Hopper per-layer time) / 122."""
    m = P.DECODE_CROSS_NODE
    read = 37e9 * 1 / 16 / (3.35e12 * P.HBM_EFFICIENCY.value)      # 37B active, FP8, over TP16, H100
    layers = 61 * layer_overhead_s("h100")[0]
    latency = (m.value / 1e3 - read - layers) / 122
    return latency, (f"{latency * 1e6:.0f} us per all-reduce across nodes = ({m.value:.1f} ms measured - "
                     f"{read * 1e3:.2f} ms weight read - {layers * 1e3:.2f} ms of 61 layers) / 122, from {m.name}")


def allreduce_s(message_bytes: float, *, nvlink: bool, group: int, link_bytes_per_s: float) -> float:
    """One tensor-parallel all-reduce of ``message_bytes`` over ``group`` GPUs: the published
    NVLink all-reduce (0.5 MB; larger messages in proportion), or across nodes the latency derived
    from the published cross-node decode plus the ring's ``2 (G-1)/G x bytes`` over the NIC."""
    if group <= 1:
        return 0.0
    if nvlink:
        return P.ALLREDUCE_NVLINK.value * 1e-6 * max(1.0, message_bytes / 0.5e6)
    return network_allreduce_s()[0] + 2 * (group - 1) / group * message_bytes / link_bytes_per_s


def decode_step_s(*, dims, gpu, engine_tp: int, in_flight: float, context: float, dense_params: float,
                  expert_params: float, kv_bytes_token: float, weight_bytes: float = 2.0,
                  tflops: float) -> tuple[float, dict]:
    """One decode step of an engine: seconds and its parts, ``max(memory, compute) + layers x
    t_layer + collectives``. memory = the engine's dense weights, the routed experts its tokens
    touch (:func:`experts_touched`) and the KV cache of the sequences in flight, per GPU, at the
    published HBM efficiency; compute = their FLOPs at the published training throughput with the
    flex dispatcher (vLLM's kernels); ``t_layer`` = :func:`layer_overhead_s`; collectives = two
    tensor-parallel all-reduces per layer (:func:`allreduce_s`)."""
    from megarl.planner.flops import flops_per_token

    touched = experts_touched(in_flight, dims.num_experts, dims.num_experts_per_tok)
    read = ((dense_params + touched * expert_params) * weight_bytes / engine_tp + in_flight * context * kv_bytes_token)
    memory = read / (gpu.hbm_tbps * 1e12 * P.HBM_EFFICIENCY.value)
    compute = in_flight * flops_per_token(dims, max(1, int(context)), False) / engine_tp / (tflops * 1e12)
    nvlink = engine_tp <= gpu.nvlink_domain
    comm = 2 * dims.num_layers * allreduce_s(in_flight * dims.hidden_size * 2, nvlink=nvlink, group=engine_tp,
                                             link_bytes_per_s=gpu.internode_bytes_per_s)
    layers = dims.num_layers * layer_overhead_s(gpu.key)[0]
    parts = dict(memory=memory, compute=compute, layers=layers, comm=comm, read=read, touched=touched, nvlink=nvlink)
    return max(memory, compute) + layers + comm, parts


def model_family(dims) -> str:
    """The published training-throughput family of a model (the nearest by activated size)."""
    from megarl.planner.flops import active_matmul_params

    if dims.model_type.startswith("deepseek"):
        return "deepseek_v3"
    return "qwen3_moe_235b" if active_matmul_params(dims) > 10e9 else "qwen3_moe_30b"


@dataclass
class StepInputs:
    """What the step model needs of a plan (sizes of the whole model unless the name says per GPU)."""

    dims: object
    gpu: object
    world: int
    """Training GPUs."""
    pp: int
    vpp: int
    dp: int
    micro_batches: int
    micro_batch_tokens: float
    samples: int
    mean_prompt: int
    mean_response: int
    max_response: int
    engines: int
    engine_tp: int
    dense_params: int
    expert_params: int
    kv_bytes_token: int
    kv_capacity_tokens: float
    recompute: str
    epochs: int
    optimizer_steps: int
    reference: bool
    offload_bytes_per_gpu: int
    vllm_weight_bytes_per_gpu: int
    sleep_level: int
    gpus_per_node: int
    rank_dense_params: int
    rank_expert_params: int
    expert_dp: int
    mode: str = "on_policy"
    staleness: int = 1
    """async: trainer.max_staleness (the fleet runs that many steps ahead)."""
    split: bool = False
    optimizer_offload: bool = False
    optimizer_shard_params: int = 0
    dispatcher: str = "alltoall"
    """model.moe_dispatcher: which published training throughput applies."""


def shaped_tflops(family: str, gpu: str, dispatcher: str, micro_batch_tokens: float,
                  moe: bool = True) -> tuple[float, float, float, float, str]:
    """Training throughput at a recipe's shape: the published figure
    (:func:`megarl.planner.published.training_throughput`) x the published dropless/forced ratio
    where its source forced balanced routing (MoE models) x the published sequence trend for the
    micro-batch length. Returns (TFLOPS, published TFLOPS, routing factor, trend factor, source)."""
    published, forced, how = P.training_throughput(family, gpu, dispatcher)
    routing = P.DROPLESS_SERIES.value if forced and moe else 1.0
    trend = P.SEQUENCE_TREND.value ** math.log2(max(1.0, micro_batch_tokens) / 4096)
    return published * routing * trend, published, routing, trend, how


def estimate_step(x: StepInputs) -> StepEstimate:
    """The step-time estimate. Generation: an engine has ``samples x mean / steps`` sequences in
    flight on average (at most what its KV cache holds; more run in waves); in async mode the
    fleet keeps every KV-cache slot busy (up to a buffer of ``max_staleness + 1`` steps), so a
    step's tokens take ``samples x mean / slots`` decode steps; prefill is compute at the training
    throughput. Log-probs and training: model FLOPs (full recompute adds a forward) at
    :func:`shaped_tflops`, times the pipeline bubble, plus :func:`gradient_reduction_s`,
    :func:`pipeline_send_s` and, with ``trainer.optimizer_offload``, :func:`host_update_s`.
    Modes: on-policy colocated runs the phases in sequence; one_step_off and async with
    ``rollout.placement: split`` take the longer of generation and (log-probs + training), plus
    the weight sync, which stalls the engines."""
    from megarl.planner.flops import flops_per_token

    dims, gpu = x.dims, x.gpu
    est = StepEstimate()
    seq = x.mean_prompt + x.mean_response
    est.tokens_per_step = x.samples * seq
    family = model_family(dims)
    moe = bool(dims.num_experts)
    tflops, published_tflops, routing, trend, train_source = shaped_tflops(family, gpu.key, x.dispatcher,
                                                                           x.micro_batch_tokens, moe)
    t_layer_how = layer_overhead_s(gpu.key)[1]
    est.assumptions += [
        f"peak {gpu.bf16_tflops:g} TFLOPS bf16 dense, HBM {gpu.hbm_tbps:g} TB/s, NVLink {gpu.nvlink_gbps:g} GB/s "
        f"(both directions), network {gpu.internode_gbps:g} GB/s per GPU, host link {gpu.host_gbps:g} GB/s: "
        f"{gpu.source}",
        f"mean prompt {x.mean_prompt} and response {x.mean_response} tokens (plan.mean_prompt_tokens / "
        "plan.mean_response_tokens)",
        *[f"published: {m.line()}" for m in P.ALL],
        f"published: {train_source}",
        *([] if dims.num_experts else [f"dense model: priced with the training throughput of the MoE family "
                                       f"{family} (no dense row in megarl/planner/published.py)"]),
        f"derived: decode overhead {t_layer_how}",
        f"derived: {network_allreduce_s()[1]}",
    ]

    est.assumptions.append(f"derived: training throughput {tflops:.0f} TFLOPS/GPU = {published_tflops:.0f} x "
                           f"{routing:.2f} (dropless) x {trend:.2f} ({x.micro_batch_tokens:,.0f}-token micro-batches "
                           f"vs 4,096); MFU {tflops / gpu.bf16_tflops:.2f}")
    achieved = tflops * 1e12
    # vLLM's kernels are not megatron-core's dispatcher: the engine computes at the flex figure
    engine_tflops = (tflops if x.dispatcher != "alltoall" else
                     shaped_tflops(family, gpu.key, "flex", x.micro_batch_tokens, moe)[0])

    # generation
    per_engine = x.samples / x.engines
    gen_gpus = x.engines * x.engine_tp
    prefill_s = (x.samples * x.mean_prompt * flops_per_token(dims, x.mean_prompt, False)
                 / (gen_gpus * engine_tflops * 1e12))
    continuous = x.mode == "async"
    if continuous:
        # the fleet generates continuously into a buffer of (max_staleness + 1) steps of samples:
        # every slot the KV cache holds stays busy, no step waits for a longest response
        slots = per_engine * (x.staleness + 1)
        resident = max(1.0, min(slots, x.kv_capacity_tokens / max(1, seq)) if x.kv_capacity_tokens > 0 else slots)
        in_flight, waves = resident, 1.0
        steps = per_engine * x.mean_response / resident
    else:
        steps = decode_steps(x.samples, x.mean_response, x.max_response)
        resident = min(per_engine, x.kv_capacity_tokens / max(1, seq)) if x.kv_capacity_tokens > 0 else per_engine
        resident = max(1.0, resident)
        waves = per_engine / resident
        in_flight = max(1.0, resident * min(1.0, x.mean_response / steps))
    context = x.mean_prompt + x.mean_response / 2
    step, d = decode_step_s(dims=dims, gpu=gpu, engine_tp=x.engine_tp, in_flight=in_flight, context=context,
                            dense_params=x.dense_params, expert_params=x.expert_params,
                            kv_bytes_token=x.kv_bytes_token, tflops=engine_tflops)
    nvlink = d["nvlink"]
    decode_s = steps * step * waves
    bound = "memory" if d["memory"] >= d["compute"] else "compute"
    how = "continuous: the step's tokens over the busy slots" if continuous else f"longest of {x.samples} responses"
    generation = Phase("generation", prefill_s + decode_s,
                       f"prefill {prefill_s:.1f} s; decode {steps:,.0f} steps ({how}) x "
                       f"{step * 1e3:.1f} ms = {bound} {max(d['memory'], d['compute']) * 1e3:.1f} ({d['read'] / 1e9:.1f} "
                       f"GB per GPU, {in_flight:.0f} sequences in flight per engine on average"
                       + (f", {d['touched']:.0%} of experts touched" if dims.num_experts else "")
                       + f") + layers {d['layers'] * 1e3:.1f} + TP all-reduce {d['comm'] * 1e3:.1f} "
                       f"({'NVLink' if nvlink else 'across nodes'}) x {waves:.2f} waves")

    # log-probs and training
    bubble = pipeline_bubble(x.micro_batches, x.pp, x.vpp)
    fwd = est.tokens_per_step * flops_per_token(dims, seq, False)
    passes = 2 if x.reference else 1
    sends = pipeline_send_s(x, passes=1)
    logprob_s = passes * (fwd / (x.world * achieved) * bubble + sends)
    logprobs = Phase("logprobs", logprob_s, f"{passes} forward pass(es) over {est.tokens_per_step:,.0f} tokens, "
                                            f"bubble x{bubble:.2f} ({x.micro_batches} micro-batches), "
                                            f"pipeline sends {sends:.2f} s")
    est.train_flops = x.epochs * est.tokens_per_step * flops_per_token(dims, seq, True)
    hardware = est.train_flops * (4 / 3 if x.recompute == "full" else 1.0)
    grad_s = x.optimizer_steps * gradient_reduction_s(x)
    train_sends = x.epochs * pipeline_send_s(x, passes=2)
    update_s = x.optimizer_steps * host_update_s(x) if x.optimizer_offload else 0.0
    train_s = hardware / (x.world * achieved) * bubble + grad_s + train_sends + update_s
    train = Phase("train", train_s, f"{est.train_flops / 1e15:,.1f} PFLOP model"
                                    f"{' (+1/3 full recompute)' if x.recompute == 'full' else ''}, bubble x{bubble:.2f}, "
                                    f"gradient reduction {grad_s:.1f} s, pipeline sends {train_sends:.2f} s"
                                    + (f", host optimizer {update_s:.1f} s" if x.optimizer_offload else ""))

    # weight sync
    sync_rate = P.refit_bytes_per_s(over_network=not nvlink)
    sync = Phase("sync", x.vllm_weight_bytes_per_gpu / sync_rate,
                 f"{x.vllm_weight_bytes_per_gpu / 1e9:.1f} GB per vLLM GPU at {sync_rate / 1e9:.1f} GB/s "
                 f"(published refit {'into engines spanning nodes' if not nvlink else 'within an NVLink domain'})")

    # offload / sleep
    down, up = P.host_link_bytes_per_s(gpu)
    moved = x.offload_bytes_per_gpu + (x.vllm_weight_bytes_per_gpu if x.sleep_level == 1 and not x.split else 0)
    offload = Phase("offload", moved / down + moved / up,
                    f"{moved / 1e9:.1f} GB per GPU to the host at {down / 1e9:.1f} GB/s and back at {up / 1e9:.1f} GB/s")

    est.phases = [generation, logprobs, train, sync, offload]
    if x.mode != "on_policy" and x.split:
        est.overlapped = True
        est.assumptions.append(f"{x.mode} on split GPUs: a step takes max(generation, log-probs + train) + sync + offload")
    return est


def pipeline_send_s(x: StepInputs, passes: int) -> float:
    """Activation sends of one pass (forward: 1; forward and backward: 2) across the pipeline's
    stage boundaries on the critical path: (M + pp - 1) micro-batch hops, bf16 hidden states,
    over the NIC when the stages sit on different nodes (stages are ``world / pp`` ranks apart)."""
    if x.pp <= 1:
        return 0.0
    across = x.world // x.pp >= x.gpus_per_node
    link = P.NIC_BANDWIDTH.value * 1e9 if across else x.gpu.nvlink_unidir_bytes_per_s
    hop = x.micro_batch_tokens * x.dims.hidden_size * 2 / link
    return passes * (x.micro_batches + x.pp - 1) * hop


def gradient_reduction_s(x: StepInputs) -> float:
    """One optimizer step's distributed-optimizer traffic per GPU: reduce-scatter of fp32 grads and
    all-gather of bf16 params, ``(n-1)/n`` of the rank's parameters each, over its data-parallel
    group (dense) and expert-data-parallel group (experts); over the NIC at the published rate
    when the group spans nodes (it does when dp > 1 and the model-parallel ranks fill a node)."""
    total = 0.0
    for params, group in ((x.rank_dense_params, x.dp), (x.rank_expert_params, x.expert_dp)):
        if group <= 1:
            continue
        spans = x.world // group >= x.gpus_per_node or group > x.gpus_per_node
        link = P.NIC_BANDWIDTH.value * 1e9 if spans else x.gpu.nvlink_unidir_bytes_per_s
        total += (4 + 2) * params * (group - 1) / group / link
    return total


def host_update_s(x: StepInputs) -> float:
    """``trainer.optimizer_offload``: the rank's fp32 grads to the host and bf16 params back over the
    host link, and Adam's 28 bytes per parameter (read param, grad, two moments; write param,
    two moments) at the GPU's share of the published host memory bandwidth (2 sockets per
    8 GPUs on DGX H100)."""
    shard = x.optimizer_shard_params
    per_gpu_memory = 2 * P.HOST_MEMORY_BANDWIDTH.value * 1e9 / 8
    down, up = P.host_link_bytes_per_s(x.gpu)
    return 4 * shard / down + 2 * shard / up + 28 * shard / per_gpu_memory
