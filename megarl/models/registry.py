"""Model families keyed by HF ``model_type``: HF config -> mbridge bridge (Megatron config, TE spec,
HF <-> Megatron weight mapping).

``FAMILIES`` is the registry; :func:`get_family` raises a ValueError listing the known types.
The bridge classes are mbridge's, with the fixes of :mod:`megarl.models.mbridge_fixes`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Family:
    """One supported architecture."""

    model_type: str
    is_moe: bool
    description: str


FAMILIES: dict[str, Family] = {
    f.model_type: f for f in (
        Family("llama", False, "Llama / SmolLM2 (GQA, optional tied embeddings)"),
        Family("qwen2", False, "Qwen2 / Qwen2.5 (QKV bias)"),
        Family("qwen3", False, "Qwen3 dense (QK RMSNorm)"),
        Family("qwen3_moe", True, "Qwen3-MoE (softmax top-k router, grouped experts)"),
        Family("deepseek_v3", True, "DeepSeek-V3 (MLA, sigmoid group-limited router, shared expert)"),
    )
}


def get_family(model_type: str) -> Family:
    """The registered family for an HF ``model_type``."""
    if model_type not in FAMILIES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported model types: "
                         f"{', '.join(sorted(FAMILIES))}")
    return FAMILIES[model_type]


def make_bridge(hf_config: Any, dtype, extra_args: dict | None = None):
    """An mbridge bridge (fixed for transformers 5 / megatron-core 0.16) for ``hf_config``.

    Megatron's parallel state must be initialised (mbridge reads the layout from it).
    ``extra_args`` are TransformerConfig fields that override the family defaults.
    """
    from megarl.models.mbridge_fixes import _bridge_classes, hf_config_for_mbridge

    get_family(hf_config.model_type)
    bridge_cls = _bridge_classes()[hf_config.model_type]
    bridge = bridge_cls(hf_config_for_mbridge(hf_config), dtype=dtype)
    if extra_args:
        bridge.set_extra_args(**extra_args)
    return bridge
