"""Pure per-family weight mappings: Megatron shards <-> HF tensors <-> vLLM fused TP parameters.

This is the only Megatron <-> HF weight map of megarl: the engine (loading HF weights, exporting
HF tensors), the conversion and the weight bridge all go through it. ``get_mapping(hf_config)``
builds the mapping class that the family registry (:mod:`megarl.models.registry`, the list of
supported HF ``model_type`` values) names for the model. The tensor helpers below apply the same
pieces the plan uses, so layout knowledge lives in one place.
"""
from __future__ import annotations

import dataclasses

from megarl.bridge.mapping import families
from megarl.bridge.mapping.base import (Box, FamilyMapping, MegatronTensor, Piece, box_numel, box_shape, compose,
                                        expert_param_name, full_box, intersect, local_shape, piece_extents,
                                        shard_segments, slices, translate, unstack_hf)
from megarl.models.dims import ModelDims
from megarl.models.registry import get_family


def mapping_class(model_type: str) -> type:
    """The mapping class the family registry names for ``model_type`` (ValueError listing the
    supported types when there is none)."""
    return getattr(families, get_family(model_type).mapping)


def get_mapping(hf_config, padded_vocab: int = 0) -> FamilyMapping:
    """The family mapping for an HF config (dict or transformers config object); ``padded_vocab``:
    Megatron's vocabulary rows when it pads the vocabulary (0: not padded)."""
    dims = ModelDims.from_hf(hf_config)
    cls = mapping_class(dims.model_type)
    if padded_vocab:
        dims = dataclasses.replace(dims, padded_vocab_size=padded_vocab)
    return cls(dims)


# ----------------------------------------------------------------------------- tensor helpers
def megatron_to_hf(mapping: FamilyMapping, t: MegatronTensor, full) -> dict:
    """Full logical Megatron tensor -> {HF name: tensor} (stacked experts keep the ``*`` name)."""
    import torch

    pieces = mapping.to_hf(t)
    out = {name: torch.empty(shape, dtype=full.dtype) for name, shape in piece_extents(pieces).items()}
    for p in pieces:
        out[p.dst_name][slices(p.dst_box)] = full[slices(p.src_box)]
    return out


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


__all__ = ["Box", "FamilyMapping", "MegatronTensor", "Piece", "box_numel", "box_shape", "compose",
           "expert_param_name", "full_box", "get_mapping", "hf_to_megatron", "hf_to_vllm_shard", "intersect",
           "local_shape", "mapping_class", "megatron_to_hf", "merge_shards", "piece_extents", "shard_segments",
           "slices", "split_shard", "translate", "unstack_hf"]
