"""Run the same megatron-core code on CPU (gloo) and GPU (NCCL).

``setup_cpu()`` is the single entry point: without CUDA it applies the megatron-core patches of
:mod:`megarl.compat.megatron_cpu` and makes megatron's TE layer-spec builders use the CPU modules
of :mod:`megarl.compat.te_cpu`; with CUDA it does nothing and the real Transformer Engine is used.
vLLM's CPU fixes (:mod:`megarl.compat.vllm_cpu`) are applied in vLLM's own processes through
megarl's ``vllm.general_plugins`` entry point. Optional GPU libraries are detected, never
required: ``has_te()``, ``has_apex()`` (the package index's ``apex`` is an unrelated project).

CPU runs need (:func:`cpu_transformer_overrides`) no fused kernels, CPU initialisation, and
``batch_p2p_comm=False`` under VPP: gloo matches messages between a rank pair in the order they
were issued, and with pp=2 prev == next rank, so batched p2p silently swaps activations and
gradients.
"""
from __future__ import annotations

import importlib.util
import os

_APPLIED = False


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def has_te() -> bool:
    """Transformer Engine importable (GPU builds only)."""
    return importlib.util.find_spec("transformer_engine") is not None and cuda_available()


def has_apex() -> bool:
    """NVIDIA apex (fused optimizers) importable; optional."""
    spec = importlib.util.find_spec("apex")
    if spec is None:
        return False
    try:
        import apex.optimizers  # noqa: F401  (the unrelated PyPI `apex` has no such module)
    except Exception:
        return False
    return True


def install_cpu_te_spec():
    """Point megatron's TE spec builders (and mbridge, which calls them) at the CPU TE modules."""
    from megatron.core.models.gpt import gpt_layer_specs, moe_module_specs
    from megatron.core.transformer import multi_latent_attention, transformer_block

    from megarl.compat import te_cpu

    transformer_block.LayerNormImpl = te_cpu.CpuTENorm   # final norm when a *layer* spec is passed
    gpt_layer_specs.TESpecProvider = te_cpu.CpuTESpecProvider
    gpt_layer_specs.TENorm = te_cpu.CpuTENorm
    moe_module_specs.TESpecProvider = te_cpu.CpuTESpecProvider
    multi_latent_attention.TELinear = te_cpu.CpuTELinear  # MLA checks `down_proj in [TELinear]`


def setup_cpu(force: bool = False) -> bool:
    """Apply the CPU patches once per process if CUDA is absent (or ``force``).

    Returns True when the CPU path is active. Call it before building any megatron model.
    """
    global _APPLIED
    if _APPLIED:
        return True
    if cuda_available() and not force:
        return False
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    from megarl.compat import megatron_cpu

    megatron_cpu.apply_all()
    install_cpu_te_spec()
    _APPLIED = True
    return True


def cpu_transformer_overrides() -> dict:
    """TransformerConfig fields every CPU run sets (no fused kernels, CPU init)."""
    return dict(
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        moe_permute_fusion=False,
        batch_p2p_comm=False,
    )
