"""A roofline estimate of one GRPO step: generation, log-probs, training, weight sync, offload.

Every phase is the larger of its compute time (FLOPs / (peak x efficiency)) and its memory or
network time (bytes / (bandwidth x efficiency)), with the peaks from
:mod:`megarl.planner.hardware` and the efficiencies below, each taken from a published
measurement (never fitted to the rows :mod:`perf.plan_vs_published` compares with). Phases run
one after the other (colocated, on-policy: megarl overlaps none of them).

* **Generation** per engine (``rollout.tp`` GPUs, ``rollout.dp`` engines share the samples):
  prefill of every prompt is compute-bound; decode runs as many steps as the longest response
  (``rollout.max_response_tokens``: with hundreds of samples some reach the cap) with all the
  engine's samples in flight (vLLM keeps them resident when the KV cache holds them, else the
  concurrency the cache allows), and each step reads the engine's dense weights, the routed
  experts its tokens touch (``1 - (1 - k/E)^B`` of them for B tokens in flight) and the KV cache
  of the sequences in flight (mean context ``prompt + response/2``); a step takes the larger of
  that read time and its FLOPs, plus the engine's tensor-parallel all-reduces of the hidden
  states (two per layer, ring: ``2 (G-1)/G x B x h x 2`` bytes per GPU) over NVLink, or over the
  network when the engine spans nodes, at peak bandwidth (latency not modelled).
* **Log-probs**: a forward over every token (the old policy; the reference too when
  ``algorithm.kl_coef > 0``); **training**: forward + backward (3 x forward; full recompute adds
  one forward) per epoch; both compute-bound at the training efficiency, times the pipeline
  bubble ``(M + pp - 1) / M`` (interleaved: ``(M + (pp - 1)/vpp) / M``) for M micro-batches per
  data-parallel rank; plus the MoE token dispatch and combine (all-to-all over the ep group,
  bf16 hidden states, ``top-k`` copies of each token per MoE layer and pass; forward 1,
  backward 2, recompute 1) at peak bandwidth: the share of the ep group on other nodes over
  the network, the rest over NVLink (not overlapped with compute: megarl's dispatcher does not).
* **Weight sync**: each vLLM GPU receives its shard of the bf16 weights over NVLink when the
  engine fits one NVLink domain, else over the scale-out network, at the peak bandwidth (no
  efficiency applied: a lower bound).
* **Offload** (``trainer.offload_train_state``): the training state leaves the device before
  generation and comes back after it, over the host link at peak (lower bound); vLLM's sleep
  level 1 moves its weights the same way.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# --- efficiencies, each from a published measurement -------------------------------------------
TRAIN_EFFICIENCY = 0.39
TRAIN_EFFICIENCY_SOURCE = ("Megatron-Core MoE training MFU on H100: 39.0% for Qwen2-57B-A14B, a fine-grained MoE "
                           "with shared experts (Liu et al., 'MoE Parallel Folding: Heterogeneous Parallelism "
                           "Mappings for Efficient Large-Scale MoE Model Training with Megatron Core', 2025, "
                           "abstract); used for training, log-prob and prefill FLOPs on every GPU type")
HBM_EFFICIENCY = 3000 / 3350
HBM_EFFICIENCY_SOURCE = ("FlashMLA (github.com/deepseek-ai/FlashMLA README): up to 3000 GB/s in the memory-bound "
                         "decode configuration on H800 SXM5, whose HBM3 peak is 3.35 TB/s (0.90); used for "
                         "every decode read (weights and KV cache)")


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

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.phases)

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


def dispatch_seconds(*, dims, gpu, tokens_per_gpu: float, moe_layers: int, ep: int, gpus_per_node: int,
                     passes: float) -> float:
    """Seconds one GPU spends sending MoE tokens to their experts and back (module docstring)."""
    if ep <= 1 or not moe_layers:
        return 0.0
    per_token = 2 * dims.num_experts_per_tok * dims.hidden_size * 2 * passes * moe_layers
    remote = max(0, ep - gpus_per_node) / ep if ep > gpu.nvlink_domain else 0.0
    sent = tokens_per_gpu * per_token * (ep - 1) / ep
    return sent * remote / gpu.internode_bytes_per_s + sent * (1 - remote) / gpu.nvlink_unidir_bytes_per_s


def estimate_step(*, dims, gpu, world: int, pp: int, vpp: int, micro_batches: int, samples: int,
                  mean_prompt: int, mean_response: int, max_response: int, engines: int, engine_tp: int,
                  dense_params: int, expert_params: int, kv_bytes_token: int, kv_capacity_tokens: float,
                  recompute: str, epochs: int, reference: bool, offload_bytes_per_gpu: int,
                  vllm_weight_bytes_per_gpu: int, sleep_level: int, ranks_per_stage: int, ep: int, gpus_per_node: int,
                  moe_layers_per_stage: int) -> StepEstimate:
    """The step-time estimate (module docstring); sizes per the arguments' names, bytes and
    parameter counts of the whole model unless they say per GPU."""
    from megarl.planner.flops import flops_per_token

    est = StepEstimate()
    peak = gpu.bf16_tflops * 1e12
    hbm = gpu.hbm_tbps * 1e12
    seq = mean_prompt + mean_response
    est.tokens_per_step = samples * seq
    est.assumptions += [
        f"peak {gpu.bf16_tflops:g} TFLOPS bf16 dense, HBM {gpu.hbm_tbps:g} TB/s, NVLink {gpu.nvlink_gbps:g} GB/s "
        f"(both directions), network {gpu.internode_gbps:g} GB/s per GPU, host link {gpu.host_gbps:g} GB/s: "
        f"{gpu.source}",
        f"compute efficiency {TRAIN_EFFICIENCY:.2f}: {TRAIN_EFFICIENCY_SOURCE}",
        f"decode memory efficiency {HBM_EFFICIENCY:.2f}: {HBM_EFFICIENCY_SOURCE}",
        f"mean prompt {mean_prompt} and response {mean_response} tokens (plan.mean_prompt_tokens / "
        f"plan.mean_response_tokens); decode runs {max_response} steps (rollout.max_response_tokens: the "
        "longest response decides)",
        "phases run one after the other (colocated, on-policy); communication: MoE all-to-all in training "
        "and log-probs, TP all-reduce in decode, weight sync and offload at peak bandwidth; collective "
        "latency, pipeline sends, data-parallel gradient reduction, kernel launch and host overheads are "
        "not modelled (the estimate is a lower bound of what these efficiencies allow)",
    ]

    # generation
    per_engine = samples / engines
    gpus_gen = engines * engine_tp
    prefill_s = samples * mean_prompt * flops_per_token(dims, mean_prompt, False) / (gpus_gen * peak * TRAIN_EFFICIENCY)
    in_flight = min(per_engine, kv_capacity_tokens / max(1, seq)) if kv_capacity_tokens > 0 else per_engine
    in_flight = max(1.0, in_flight)
    waves = per_engine / in_flight
    context = mean_prompt + mean_response / 2
    touched = experts_touched(in_flight, dims.num_experts, dims.num_experts_per_tok)
    read = ((dense_params + touched * expert_params) * 2 / engine_tp
            + in_flight * context * kv_bytes_token)
    step_mem = read / (hbm * HBM_EFFICIENCY)
    step_flops = in_flight * flops_per_token(dims, int(context), False) / engine_tp / (peak * TRAIN_EFFICIENCY)
    step_comm = 0.0
    if engine_tp > 1:
        reduced = 2 * (engine_tp - 1) / engine_tp * in_flight * dims.hidden_size * 2 * 2 * dims.num_layers
        link = gpu.nvlink_unidir_bytes_per_s if engine_tp <= gpu.nvlink_domain else gpu.internode_bytes_per_s
        step_comm = reduced / link
    decode_s = max_response * (max(step_mem, step_flops) + step_comm) * waves
    bound = "memory" if step_mem >= step_flops else "compute"
    est.phases.append(Phase("generation", prefill_s + decode_s,
                            f"prefill {prefill_s:.1f} s; decode {max_response} steps x "
                            f"{(max(step_mem, step_flops) + step_comm) * 1e3:.1f} "
                            f"ms ({bound}-bound: {read / 1e9:.1f} GB read per GPU per step, {in_flight:.0f} sequences "
                            f"in flight per engine, {touched:.0%} of experts touched; TP all-reduce {step_comm * 1e3:.1f} ms) "
                            f"x {waves:.2f} waves"))

    # log-probs and training
    bubble = pipeline_bubble(micro_batches, pp, vpp)
    fwd = est.tokens_per_step * flops_per_token(dims, seq, False)
    passes = 2 if reference else 1
    tokens_per_gpu = est.tokens_per_step / ranks_per_stage   # MoE with tp > 1 needs sequence parallelism
    a2a = dict(dims=dims, gpu=gpu, tokens_per_gpu=tokens_per_gpu, moe_layers=moe_layers_per_stage, ep=ep,
               gpus_per_node=gpus_per_node)
    logprob_a2a = dispatch_seconds(**a2a, passes=passes)
    logprob_s = passes * fwd / (world * peak * TRAIN_EFFICIENCY) * bubble + logprob_a2a
    est.phases.append(Phase("logprobs", logprob_s, f"{passes} forward pass(es) over {est.tokens_per_step:,.0f} tokens, "
                                                   f"pipeline bubble x{bubble:.2f} ({micro_batches} micro-batches), "
                                                   f"MoE all-to-all {logprob_a2a:.1f} s"))
    est.train_flops = epochs * est.tokens_per_step * flops_per_token(dims, seq, True)
    hardware = est.train_flops * (4 / 3 if recompute == "full" else 1.0)
    train_a2a = dispatch_seconds(**a2a, passes=epochs * (4 if recompute == "full" else 3))
    train_s = hardware / (world * peak * TRAIN_EFFICIENCY) * bubble + train_a2a
    est.phases.append(Phase("train", train_s, f"{est.train_flops / 1e15:,.1f} PFLOP model"
                                              f"{' (+1/3 full recompute)' if recompute == 'full' else ''}, "
                                              f"bubble x{bubble:.2f}, MoE all-to-all {train_a2a:.1f} s"))

    # weight sync
    nvlink = engine_tp <= gpu.nvlink_domain
    bandwidth = gpu.nvlink_unidir_bytes_per_s if nvlink else gpu.internode_bytes_per_s
    sync_s = vllm_weight_bytes_per_gpu / bandwidth
    est.phases.append(Phase("sync", sync_s, f"{vllm_weight_bytes_per_gpu / 1e9:.1f} GB per vLLM GPU over "
                                            f"{'NVLink' if nvlink else 'the network'} at {bandwidth / 1e9:.0f} GB/s"))

    # offload / sleep
    host = gpu.host_gbps * 1e9
    moved = 2 * offload_bytes_per_gpu + (2 * vllm_weight_bytes_per_gpu if sleep_level == 1 else 0)
    est.phases.append(Phase("offload", moved / host, f"{moved / 1e9:.1f} GB per GPU to and from the host at "
                                                     f"{gpu.host_gbps:g} GB/s"))
    return est
