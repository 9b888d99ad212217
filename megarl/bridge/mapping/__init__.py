"""Pure per-family weight mappings: Megatron shards <-> HF tensors <-> vLLM fused TP parameters.

``get_mapping(hf_config)`` picks the family by HF ``model_type`` from :data:`MAPPINGS` (a
ValueError lists the supported types). Tensor helpers (used by tests, the baseline and the
vLLM-side loader) apply the same pieces the plan uses, so layout knowledge lives in one place.
"""
from __future__ import annotations

from megarl.bridge.mapping.base import (Box, FamilyMapping, MegatronTensor, ModelConfig, Piece, box_numel,
                                        box_shape, compose, full_box, intersect, local_shape, shard_segments,
                                        slices, translate, unstack_hf)
from megarl.bridge.mapping.families import DeepseekV3Mapping, DenseGQAMapping, Qwen3MoeMapping


def _named(cls, model_type):
    return type(f"{model_type.title().replace('_', '')}Mapping", (cls,), {"model_type": model_type})


MAPPINGS: dict[str, type] = {
    "llama": _named(DenseGQAMapping, "llama"),
    "qwen2": _named(DenseGQAMapping, "qwen2"),
    "qwen3": _named(DenseGQAMapping, "qwen3"),
    "qwen3_moe": Qwen3MoeMapping,
    "deepseek_v3": DeepseekV3Mapping,
}


def get_mapping(hf_config, padded_vocab: int = 0) -> FamilyMapping:
    """The family mapping for an HF config (dict or transformers config object)."""
    cfg = ModelConfig.from_hf(hf_config)
    if cfg.model_type not in MAPPINGS:
        raise ValueError(f"unsupported model_type {cfg.model_type!r} for the weight bridge; supported: "
                         f"{', '.join(sorted(MAPPINGS))}")
    if padded_vocab:
        import dataclasses

        cfg = dataclasses.replace(cfg, padded_vocab=padded_vocab)
    return MAPPINGS[cfg.model_type](cfg)


# ----------------------------------------------------------------------------- tensor helpers
def megatron_to_hf(mapping: FamilyMapping, t: MegatronTensor, full) -> dict:
    """Full logical Megatron tensor -> {HF name: tensor} (stacked experts keep the ``*`` name)."""
    import torch

    out = {}
    for p in mapping.to_hf(t):
        if p.dst_name not in out:
            out[p.dst_name] = torch.empty(_hf_shape(mapping, p.dst_name), dtype=full.dtype)
        out[p.dst_name][slices(p.dst_box)] = full[slices(p.src_box)]
    return out


def _hf_shape(mapping, name):
    cache = getattr(mapping, "_hf_shape_cache", None)
    if cache is None:
        cache = mapping._hf_shape_cache = mapping.hf_shapes()
    return cache[name]


def hf_to_megatron(mapping: FamilyMapping, t: MegatronTensor, hf: dict):
    """{HF name: tensor} (stacked experts under ``*`` names) -> the full logical Megatron tensor.

    Megatron's vocabulary padding rows (if any) are zero."""
    import torch

    pieces = mapping.to_hf(t)
    dtype = hf[pieces[0].dst_name].dtype
    full = torch.zeros(t.shape, dtype=dtype)
    for p in pieces:
        full[slices(p.src_box)] = hf[p.dst_name][slices(p.dst_box)]
    return full


def split_shard(t: MegatronTensor, full, tp_size: int, tp_rank: int, ep_size: int = 1, ep_rank: int = 0):
    """This rank's Megatron shard of the logical tensor ``full``."""
    import torch

    out = torch.empty(local_shape(t, tp_size if t.tp_dim is not None else 1, ep_size if t.expert else 1),
                      dtype=full.dtype)
    for local_box, full_b in shard_segments(t, tp_size, tp_rank, ep_size, ep_rank):
        out[slices(local_box)] = full[slices(full_b)]
    return out


def merge_shards(t: MegatronTensor, shards: dict, tp_size: int, ep_size: int = 1):
    """{(tp_rank, ep_rank): shard} -> the full logical tensor."""
    import torch

    first = next(iter(shards.values()))
    full = torch.empty(t.shape, dtype=first.dtype)
    for (tp_rank, ep_rank), shard in shards.items():
        for local_box, full_b in shard_segments(t, tp_size, tp_rank, ep_size, ep_rank):
            full[slices(full_b)] = shard[slices(local_box)]
    return full


def hf_to_vllm_shard(mapping: FamilyMapping, hf: dict, tp: int, rank: int) -> dict:
    """{HF name: full tensor} -> {vLLM param: this rank's checkpoint-format shard} (padding rows 0)."""
    import torch

    shapes = mapping.vllm_shapes(tp)
    out = {}
    for name, tensor in hf.items():
        for p in mapping.vllm_pieces(name, tuple(tensor.shape), tp, rank):
            if p.dst_name not in out:
                out[p.dst_name] = torch.zeros(shapes[p.dst_name], dtype=tensor.dtype)
            out[p.dst_name][slices(p.dst_box)] = tensor[slices(p.src_box)]
    return out


__all__ = ["MAPPINGS", "Box", "FamilyMapping", "MegatronTensor", "ModelConfig", "Piece", "box_numel", "box_shape",
           "compose", "full_box", "get_mapping", "hf_to_megatron", "hf_to_vllm_shard", "intersect", "local_shape",
           "megatron_to_hf", "merge_shards", "shard_segments", "slices", "split_shard", "translate", "unstack_hf"]
