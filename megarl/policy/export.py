"""Weights in and out of the engine, through the family mapping (:mod:`megarl.bridge.mapping`).

:func:`local_targets` places every local parameter (and MoE ``expert_bias`` buffer) in the
mapping once: its global Megatron name (layer number offset by megatron-core's
``get_transformer_layer_offset``; a routed expert's local id j on EP rank k is ``k * E/ep + j``),
its logical tensor, and a check of its local shape against the mapping's shard shape.

- :func:`fill_from_hf` (engine build, HF -> Megatron): each rank reads only its own shards' boxes
  from the safetensors; every element of a shard must be written (NaN check).
- :func:`export_hf_weights` (collective; every rank yields every tensor in the same order): the
  owning pipeline stage gathers and merges the TP shards (expert-TP for experts), broadcasts the
  full tensor over PP, expert weights are all-gathered over EP, and the mapping gives the HF
  tensors. The last stage's copy of tied embeddings is not exported (no ``lm_head`` in HF).
- :func:`local_shards`: this rank's raw parameters for the weight bridge, no communication.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megarl.bridge.mapping import (MegatronTensor, expert_param_name, intersect, local_shape, megatron_to_hf,
                                   merge_shards, shard_segments, slices, translate)


@dataclass
class LocalShard:
    """One parameter shard as held by this rank."""

    name: str
    """Global megatron name (global layer number; expert weights with the *global* expert id)."""
    tensor: torch.Tensor
    """The live parameter data (do not modify)."""
    partition_dim: Optional[int]
    """Dimension split over the TP group (None: replicated)."""
    tp_size: int
    """Size of the group the tensor is split over (expert-TP for expert weights)."""
    tp_rank: int
    gated_halves: bool
    """True for fused gate/up weights (``linear_fc1``): each shard is [gate_r; up_r], so the full
    tensor is [gate_0..gate_{n-1}; up_0..up_{n-1}], not a plain concatenation."""
    is_expert: bool
    ep_rank: int
    ep_size: int


@dataclass(frozen=True)
class LocalTarget:
    """One local parameter placed in the family mapping."""

    name: str
    """Global Megatron name (see the module docstring)."""
    tensor: torch.Tensor
    logical: MegatronTensor
    """The parameter's logical tensor; a routed expert's is a stack of one expert ``[1, ...]``
    (Megatron's per-expert parameter with a leading dim of 1: see :meth:`view`)."""
    expert: Optional[int] = None
    """Global expert id of a routed expert's parameter."""
    tied_output: bool = False
    """The last pipeline stage's copy of tied embeddings (``output_layer.weight`` at pp > 1)."""

    def view(self, tensor: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``tensor`` (default: the parameter) in the logical tensor's dims."""
        tensor = self.tensor if tensor is None else tensor
        return tensor.unsqueeze(0) if self.expert is not None else tensor


_EXPERT_STACKS = (".mlp.experts.linear_fc1.weight", ".mlp.experts.linear_fc2.weight")


ADAPTER_MARK = ".adapter.lora_"
"""In the names of LoRA adapters' parameters (``<layer>.adapter.lora_A``), and in no weight's."""


def named_tensors(module) -> list[tuple[str, torch.Tensor]]:
    """Parameters plus the MoE ``expert_bias`` buffers (not registered as parameters); LoRA
    adapters (:mod:`megarl.policy.lora`) are not the model's weights and are left out."""
    out = [(n, p) for n, p in module.named_parameters() if ADAPTER_MARK not in n]
    seen = {n for n, _ in out}
    for name, buf in module.state_dict(keep_vars=True).items():
        if "expert_bias" in name and name not in seen and "_extra_state" not in name:
            out.append((name, buf))
    return out


def layer_offset(module, pp_rank: int) -> int:
    """Global number of the chunk's first decoder layer (megatron-core's own offset)."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return get_transformer_layer_offset(module.config, module.vp_stage, pp_rank)


def global_name(local_name: str, layer_offset: int) -> str:
    """``decoder.layers.<i>.x`` -> ``decoder.layers.<i + layer_offset>.x`` (other names unchanged)."""
    head, sep, rest = local_name.partition("decoder.layers.")
    if not sep:
        return local_name
    index, _, leaf = rest.partition(".")
    return f"{head}decoder.layers.{int(index) + layer_offset}.{leaf}"


def _split_expert(name: str) -> tuple[str, Optional[int]]:
    """``...mlp.experts.linear_fc1.weight<j>`` -> (the stack's name, j); others (name, None)."""
    for stack in _EXPERT_STACKS:
        head, sep, index = name.rpartition(stack)
        if sep and index.isdigit():
            return head + stack, int(index)
    return name, None


def local_targets(model) -> list[LocalTarget]:
    """This rank's parameters in the family mapping ``model.mapping``, in module order."""
    groups, topo, mapping = model.groups, model.groups.topology, model.mapping
    logical = {t.name: t for t in mapping.megatron_tensors()}
    per_rank = mapping.cfg.num_experts // topo.ep if mapping.cfg.num_experts else 0
    from megarl.policy.value import has_value_head

    out = []
    for module in model.modules:
        offset = layer_offset(module, groups.pp_rank)
        scalar_head = has_value_head(module)
        for local_name, tensor in named_tensors(module):
            if scalar_head and local_name.startswith("output_layer."):   # a critic's or RM's head: no HF name
                continue
            stack, local_id = _split_expert(global_name(local_name, offset))
            expert = None if local_id is None else groups.ep_rank * per_rank + local_id
            tied = stack == "output_layer.weight" and stack not in logical
            t = logical.get("embedding.word_embeddings.weight" if tied else stack)
            if t is None:
                raise ValueError(f"Megatron parameter {global_name(local_name, offset)!r} has no HF mapping for "
                                 f"{mapping.cfg.model_type}")
            tp = topo.expert_tp if expert is not None else topo.tp
            if expert is not None:
                t = replace(t, shape=(1,) + tuple(t.shape[1:]))
                name = expert_param_name(stack, expert)
            else:
                name = stack
            target = LocalTarget(name, tensor, t, expert, tied)
            want = local_shape(t, tp)
            if tuple(target.view().shape) != want:
                raise ValueError(f"Megatron parameter {name!r} has local shape {tuple(target.view().shape)}, the "
                                 f"mapping expects {want} (family mapping and model disagree)")
            out.append(target)
    return out


def _tp_of(target: LocalTarget, groups) -> tuple[int, int, object]:
    """(size, rank, group) of the TP group ``target`` is split over (expert-TP for experts)."""
    if target.expert is not None:
        return groups.topology.expert_tp, groups.etp_rank, groups.pgs.expt_tp
    return groups.topology.tp, groups.tp_rank, groups.pgs.tp


# ----------------------------------------------------------------------------- HF -> shards
def fill_from_hf(model, reader) -> int:
    """Copy this rank's shards from an HF checkpoint (an ``HFCheckpoint``) into the model;
    returns the bytes read."""
    mapping, nbytes = model.mapping, 0
    with torch.no_grad():
        for target in local_targets(model):
            view = target.view(target.tensor.data)
            view.fill_(float("nan"))
            size, rank, _ = _tp_of(target, model.groups)
            pieces = mapping.to_hf(target.logical)
            for local_box, logical_box in shard_segments(target.logical, size, rank):
                for p in pieces:
                    mid = intersect(logical_box, p.src_box)
                    if mid is None:
                        continue
                    hf_box = translate(mid, p.src_box, p.dst_box)
                    if target.expert is None:
                        part = reader.read(p.dst_name, hf_box)
                    else:   # one expert of a '*' stack
                        part = reader.read(p.dst_name.replace("*", str(target.expert)), hf_box[1:])[None]
                    nbytes += part.numel() * part.element_size()
                    view[slices(translate(mid, logical_box, local_box))] = part.to(view.dtype)
                    del part
            if torch.isnan(view).any():
                # Megatron vocabulary padding rows (none: megarl builds without padding) would land here
                raise AssertionError(f"{target.name}: parts of the shard were not covered by the HF mapping")
    return nbytes


# ----------------------------------------------------------------------------- shards -> HF
def merged_targets(model) -> list[LocalTarget]:
    """:func:`local_targets` with each LoRA-adapted weight replaced by its merged shard
    ``W + scale * B A`` (:meth:`megarl.policy.lora.LoraAdapter.merged`): what the exports and the
    weight bridge send is the model the policy runs."""
    targets = local_targets(model)
    adapters = {a.name: a for a in getattr(model, "adapters", ())}
    if not adapters:
        return targets
    return [replace(t, tensor=adapters[t.name].merged(t.tensor.detach())) if t.name in adapters else t
            for t in targets]


def gather_shards(logical: MegatronTensor, shard: torch.Tensor, group, view=lambda t: t) -> torch.Tensor:
    """The whole logical tensor from every rank's ``shard`` of it (collective over ``group``, the
    TP group it is split over; ``view`` turns a shard into the logical tensor's dims)."""
    size = group.size()
    if logical.tp_dim is None or size == 1:
        return view(shard).detach()
    parts = [torch.empty_like(shard) for _ in range(size)]
    dist.all_gather(parts, shard.detach().contiguous(), group=group)
    return merge_shards(logical, {(r, 0): view(p) for r, p in enumerate(parts)}, size)


def _full_tensor(target: LocalTarget, groups) -> torch.Tensor:
    """All-gather and merge the TP shards of one local parameter (collective over its TP group),
    in the logical tensor's dims."""
    return gather_shards(target.logical, target.tensor, _tp_of(target, groups)[2], target.view)


def export_hf_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for the whole model on every rank (collective)."""
    groups = model.groups
    pgs, topo = groups.pgs, groups.topology
    local = [t for t in merged_targets(model) if not t.tied_output]
    meta = [(t.logical, t.expert, t.tensor.dtype) for t in local]
    if topo.pp > 1:
        all_meta = [None] * topo.pp
        dist.all_gather_object(all_meta, meta, group=pgs.pp)
    else:
        all_meta = [meta]
    local_iter = iter(local)
    for src_stage, entries in enumerate(all_meta):
        for logical, expert, dtype in entries:
            if src_stage == groups.pp_rank:
                full = _full_tensor(next(local_iter), groups)
            else:
                full = torch.empty(logical.shape, dtype=dtype)
            if topo.pp > 1:
                dist.broadcast(full, src=dist.get_global_rank(pgs.pp, src_stage), group=pgs.pp)
            yield from _to_hf(model, logical, expert, full)


def _to_hf(model, logical: MegatronTensor, expert: Optional[int], full: torch.Tensor):
    if expert is None:
        yield from megatron_to_hf(model.mapping, logical, full).items()
        return
    topo = model.groups.topology
    per_rank = model.mapping.cfg.num_experts // topo.ep
    parts = [full]
    if topo.ep > 1:   # the same local expert index on every EP rank
        parts = [torch.empty_like(full) for _ in range(topo.ep)]
        dist.all_gather(parts, full.contiguous(), group=model.groups.pgs.ep)
    for ep_rank, part in enumerate(parts):
        expert_id = ep_rank * per_rank + expert % per_rank
        for name, tensor in megatron_to_hf(model.mapping, logical, part).items():
            yield name.replace("*", str(expert_id)), tensor[0]


def local_shards(model) -> list[LocalShard]:
    """This rank's parameters with their partition metadata (no communication)."""
    groups = model.groups
    out = []
    for target in merged_targets(model):
        size, rank, _ = _tp_of(target, groups)
        split, expert = target.logical.tp_dim is not None, target.expert is not None
        param_dim = target.logical.tp_dim - 1 if expert and split else target.logical.tp_dim   # no stack dim
        out.append(LocalShard(
            name=target.name, tensor=target.tensor.detach(), partition_dim=param_dim if split and size > 1 else None,
            tp_size=size if split else 1, tp_rank=rank if split else 0,
            gated_halves=split and size > 1 and target.logical.gated, is_expert=expert,
            ep_rank=groups.ep_rank if expert else 0, ep_size=groups.topology.ep if expert else 1))
    return out
