"""Weights out of the engine: full HF-named tensors, and raw local shards with partition metadata.

:func:`export_hf_weights` (collective over all ranks; every rank yields every tensor, in the same
order):

1. Each pipeline stage lists its parameters (and MoE ``expert_bias`` buffers) under their
   *global* megatron names (layer numbers across PP/VPP; expert ids local), all-gathered over PP.
2. For each entry, the owning stage merges the TP shards (expert weights over the expert-TP
   group) into the full megatron tensor, then broadcasts it over PP.
3. Expert weights are all-gathered over EP and renamed to global expert ids.
4. The family bridge maps megatron names/layouts to HF (QKV split, gate/up split, ...).

Deviation from mbridge's ``export_weights``: mbridge gathers expert weights over the *dense* TP
group when ep == 1 (wrong for tp=2, etp=1) and asserts on etp > 1 with tp == 1; it also yields
the tied ``output_layer`` a second time under the embedding's name. The TP merge here is keyed on
the parameter's own group and partition attributes, and tied outputs are skipped.

:func:`local_shards` exposes this rank's raw parameters for the weight bridge, without any
communication.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist


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


def _is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def _is_gated_fc1(name: str, config) -> bool:
    return bool(config.gated_linear_unit) and ("linear_fc1.weight" in name or "linear_fc1.bias" in name)


def named_tensors(module) -> list[tuple[str, torch.Tensor]]:
    """Parameters plus the MoE ``expert_bias`` buffers (not registered as parameters)."""
    out = list(module.named_parameters())
    seen = {n for n, _ in out}
    for name, buf in module.state_dict(keep_vars=True).items():
        if "expert_bias" in name and name not in seen and "_extra_state" not in name:
            out.append((name, buf))
    return out


def _merge_tp(name: str, shards: list[torch.Tensor], dim: int, config) -> torch.Tensor:
    if _is_gated_fc1(name, config):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=dim)


def _full_megatron_tensor(name: str, t: torch.Tensor, groups, config) -> torch.Tensor:
    """All-gather the TP shards of one local parameter (collective over its TP group)."""
    if not getattr(t, "tensor_model_parallel", False):
        return t.detach()
    group = groups.pgs.expt_tp if _is_expert(name) else groups.pgs.tp
    size = dist.get_world_size(group)
    if size == 1:
        return t.detach()
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return _merge_tp(name, parts, t.partition_dim, config)


def _global_names(model) -> list[dict]:
    """Per chunk: local name -> global name (layers global, expert ids local)."""
    return [model.bridge._weight_name_mapping_mcore_local_to_global(m, consider_ep=False)
            for m in model.modules]


def export_hf_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for the whole model on every rank (collective)."""
    groups, config, bridge = model.groups, model.config, model.bridge
    pgs, topo = groups.pgs, groups.topology
    tied = bool(getattr(model.hf_config, "tie_word_embeddings", False))
    names = _global_names(model)
    local = []   # (global name, tensor, shape, dtype) of this stage, in a fixed order
    for module, mapping in zip(model.modules, names):
        for name, t in named_tensors(module):
            gname = mapping[name]
            if tied and gname == "output_layer.weight":
                continue
            local.append((gname, t))
    meta = [(n, None) for n, _ in local]
    if topo.pp > 1:
        all_meta = [None] * topo.pp
        dist.all_gather_object(all_meta, meta, group=pgs.pp)
    else:
        all_meta = [meta]
    local_iter = iter(local)
    for src_stage, entries in enumerate(all_meta):
        for gname, _ in entries:
            if src_stage == groups.pp_rank:
                _, t = next(local_iter)
                full = _full_megatron_tensor(gname, t, groups, config)
                desc = (tuple(full.shape), full.dtype)
            else:
                full, desc = None, None
            if topo.pp > 1:
                box = [desc]
                src = dist.get_global_rank(pgs.pp, src_stage)
                dist.broadcast_object_list(box, src=src, group=pgs.pp)
                if full is None:
                    full = torch.empty(box[0][0], dtype=box[0][1])
                dist.broadcast(full, src=src, group=pgs.pp)
            yield from _to_hf(gname, full, groups, config, bridge)


def _to_hf(gname: str, full: torch.Tensor, groups, config, bridge):
    topo = groups.topology
    if _is_expert(gname) and topo.ep > 1:
        parts = [torch.empty_like(full) for _ in range(topo.ep)]
        dist.all_gather(parts, full.contiguous(), group=groups.pgs.ep)
        prefix, local_id = gname.rsplit(".weight", 1)
        per_rank = config.num_moe_experts // topo.ep
        for ep_rank, part in enumerate(parts):
            name = f"{prefix}.weight{ep_rank * per_rank + int(local_id)}"
            yield from zip(*bridge._weight_to_hf_format(name, part))
        return
    yield from zip(*bridge._weight_to_hf_format(gname, full))


def local_shards(model) -> list[LocalShard]:
    """This rank's parameters with their partition metadata (no communication)."""
    groups, config = model.groups, model.config
    topo = groups.topology
    per_rank = (config.num_moe_experts or 0) // topo.ep
    out = []
    for module, mapping in zip(model.modules, _global_names(model)):
        for name, t in named_tensors(module):
            gname, expert = mapping[name], _is_expert(name)
            if expert and topo.ep > 1:
                prefix, local_id = gname.rsplit(".weight", 1)
                gname = f"{prefix}.weight{groups.ep_rank * per_rank + int(local_id)}"
            split = bool(getattr(t, "tensor_model_parallel", False))
            size = topo.expert_tp if expert else topo.tp
            out.append(LocalShard(
                name=gname, tensor=t.detach(), partition_dim=t.partition_dim if split and size > 1 else None,
                tp_size=size if split else 1, tp_rank=(groups.etp_rank if expert else groups.tp_rank) if split else 0,
                gated_halves=split and size > 1 and _is_gated_fc1(name, config), is_expert=expert,
                ep_rank=groups.ep_rank if expert else 0, ep_size=topo.ep if expert else 1))
    return out
