"""The model-family registry: the one place a supported HF ``model_type`` is listed.

Each :class:`Family` names its weight mapping class (:mod:`megarl.bridge.mapping.families`:
Megatron <-> HF <-> vLLM layouts for the engine, the conversion and the weight bridge) and its
mbridge bridge class, which builds the ``TransformerConfig`` and TE layer spec (mbridge's own or a
subclass from :mod:`megarl.models.mbridge_fixes`; mbridge is used for nothing else). Both are
named, not imported, so this module imports neither the bridge package (which imports it) nor
mbridge. Adding a family is one entry in :data:`FAMILIES` plus its mapping class and a tiny
config in :mod:`megarl.models.fixtures`; ``tests/unit/test_engine_registry.py`` checks that every
name resolves. :func:`get_family` raises a ValueError listing the known types.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any



@dataclass(frozen=True)
class Family:
    """One supported architecture."""

    model_type: str
    """HF ``config.model_type``."""
    is_moe: bool
    description: str
    mapping: str
    """Name of the weight mapping class in :mod:`megarl.bridge.mapping.families`."""
    bridge: str
    """Name of the mbridge bridge class in :func:`megarl.models.mbridge_fixes.bridge_classes`."""

    def bridge_class(self) -> type:
        """The mbridge bridge class (imports mbridge and megatron-core)."""
        from megarl.models.mbridge_fixes import bridge_classes

        return bridge_classes()[self.bridge]


FAMILIES: dict[str, Family] = {
    f.model_type: f for f in (
        Family("llama", False, "Llama / SmolLM2 (GQA, optional tied embeddings)", "LlamaMapping", "LLaMABridge"),
        Family("qwen2", False, "Qwen2 / Qwen2.5 (QKV bias)", "Qwen2Mapping", "Qwen2Bridge"),
        Family("qwen3", False, "Qwen3 dense (QK RMSNorm)", "Qwen3Mapping", "Qwen3Bridge"),
        Family("qwen3_moe", True, "Qwen3-MoE (softmax top-k router, grouped experts)", "Qwen3MoeMapping",
               "Qwen3MoeBridge"),
        Family("deepseek_v3", True, "DeepSeek-V3 (MLA, sigmoid group-limited router, shared expert)",
               "DeepseekV3Mapping", "DeepseekV3FixedBridge"),
    )
}


def get_family(model_type: str) -> Family:
    """The registered family for an HF ``model_type``."""
    if model_type not in FAMILIES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported model types: "
                         f"{', '.join(sorted(FAMILIES))}")
    return FAMILIES[model_type]


def make_bridge(hf_config: Any, dtype, extra_args: dict | None = None):
    """The family's mbridge bridge for ``hf_config``: its ``config`` is the megatron
    TransformerConfig and ``get_model`` builds the TE-spec model chunks (weights are loaded by
    :func:`megarl.policy.export.fill_from_hf`, not by mbridge).

    Megatron's parallel state must be initialised (mbridge reads the layout from it).
    ``extra_args`` are TransformerConfig fields that override the family defaults.
    """
    from megarl.models.mbridge_fixes import hf_config_for_mbridge

    bridge = get_family(hf_config.model_type).bridge_class()(hf_config_for_mbridge(hf_config), dtype=dtype)
    if extra_args:
        bridge.set_extra_args(**extra_args)
    return bridge
