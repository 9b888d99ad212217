"""LoRA adapters on the Megatron policy's dense linear layers, sharded the way their layer is.

Targets are megatron-core's layer names: ``linear_qkv`` and ``linear_proj`` (attention),
``linear_fc1`` and ``linear_fc2`` (dense MLP; routed and shared experts are not adapted). Each
adapter adds ``alpha / rank * B(A(dropout(x)))`` to its layer's output through a forward hook, so
the base model's parameters, names, loading and export stay as they are; the adapter's tensors
live under ``<layer>.adapter.`` (``lora_A``, ``lora_B``) and every base parameter is frozen, so
megatron-core DDP and the distributed optimizer hold the adapters only.

Sharding (TP): a column-parallel layer (qkv, fc1: outputs split) holds A ``[r, in]`` whole and
B's rows of its outputs; a row-parallel layer (proj, fc2: inputs split) holds A's columns of its
inputs and B ``[out, r]`` whole. Only the r-wide product ``A x`` travels: copied into the TP
region (column; its gradient is summed) or all-reduced (row); with sequence parallelism it is
gathered over the sequence (column) or reduce-scattered (row), and the whole tensors carry
``sequence_parallel`` so that megatron-core sums their gradients over TP. An LN-fused layer's
adapter reads the normalised input, recomputed from the layer's own norm weights.
Why not Megatron-Bridge's PEFT: it needs Transformer Engine and CUDA-only packages, which do not
install on the CPU path.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megarl.bridge.mapping import MegatronTensor, local_shape, megatron_to_hf, split_shard
from megarl.policy.export import gather_shards, global_name, layer_offset

LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
COLUMN_TARGETS = ("linear_qkv", "linear_fc1")
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(self_attention|mlp)\.(linear_\w+)")
_PARENT = {"linear_qkv": "self_attention", "linear_proj": "self_attention", "linear_fc1": "mlp", "linear_fc2": "mlp"}
HF_MODULES = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
              "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
"""The HF (and PEFT) modules each Megatron layer fuses: their adapters share the layer's A."""
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoraOptions:
    """What to adapt and how (``model.lora``)."""

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple = LORA_TARGETS
    seed: int = 0
    """Seed of A's initialisation (PEFT's: uniform in +-1/sqrt(fan_in); B starts at zero)."""

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class LoraAdapter(torch.nn.Module):
    """The A and B of one layer (this rank's shards) and the hook that adds their product."""

    def __init__(self, name: str, target: str, base, options: LoraOptions, tp_group, sequence_parallel: bool):
        super().__init__()
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        self.name, self.target, self.options = name, target, options
        self.column, self.tp_group, self.sp = target in COLUMN_TARGETS, tp_group, sequence_parallel
        self.enabled = True
        tp = tp_group.size()
        out_local, in_local = base.weight.shape
        out_full, in_full = (out_local * tp, in_local) if self.column else (out_local, in_local * tp)
        layer = int(name.split(".")[2])
        self.a_logical = MegatronTensor(name, (options.rank, in_full), layer, tp_dim=None if self.column else 1)
        self.b_logical = MegatronTensor(name, (out_full, options.rank), layer, tp_dim=0 if self.column else None,
                                        gated=target == "linear_fc1")
        dtype = base.weight.dtype
        self.lora_A = torch.nn.Parameter(torch.empty(local_shape(self.a_logical, tp), dtype=dtype))
        self.lora_B = torch.nn.Parameter(torch.zeros(local_shape(self.b_logical, tp), dtype=dtype))
        whole, split = (self.lora_A, self.lora_B) if self.column else (self.lora_B, self.lora_A)
        setattr(whole, "sequence_parallel", sequence_parallel)
        set_tensor_model_parallel_attributes(split, True, 0 if self.column else 1, 1)
        self.dropout = torch.nn.Dropout(options.dropout) if options.dropout else torch.nn.Identity()
        g = torch.Generator().manual_seed(options.seed * 1_000_003 + zlib.crc32(name.encode()))
        bound = 1 / math.sqrt(in_full)
        self.load_full(torch.empty(self.a_logical.shape).uniform_(-bound, bound, generator=g),
                       torch.zeros(self.b_logical.shape))
        base.register_forward_hook(self._add_delta)

    def delta(self, x: torch.Tensor, base) -> torch.Tensor:
        """``scale * B A dropout(x)`` for the input ``x`` of the layer ``base`` (this rank's
        output shard; an LN-fused layer's input normalised first)."""
        from megatron.core.tensor_parallel import mappings

        if getattr(base, "layer_norm_weight", None) is not None:
            from megarl.compat.te_cpu import te_norm

            x = te_norm(x, base.layer_norm_weight, getattr(base, "layer_norm_bias", None), base.config)
        u = F.linear(self.dropout(x), self.lora_A)
        g = self.tp_group
        if self.column:
            u = (mappings.gather_from_sequence_parallel_region(u, True, group=g) if self.sp
                 else mappings.copy_to_tensor_model_parallel_region(u, group=g))
        else:
            u = (mappings.reduce_scatter_to_sequence_parallel_region(u, group=g) if self.sp
                 else mappings.reduce_from_tensor_model_parallel_region(u, group=g))
        return F.linear(u, self.lora_B) * self.options.scale

    def _add_delta(self, module, args, output):
        if not self.enabled:
            return None
        out, bias = output
        return out + self.delta(args[0], module).to(out.dtype), bias

    def load_full(self, a_full: torch.Tensor, b_full: torch.Tensor) -> None:
        """Set A and B from their whole (logical) tensors; each rank keeps its shards."""
        tp, rank = self.tp_group.size(), self.tp_group.rank()
        with torch.no_grad():
            self.lora_A.copy_(split_shard(self.a_logical, a_full, tp, rank))
            self.lora_B.copy_(split_shard(self.b_logical, b_full, tp, rank))

    def merged(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's shard of ``W + scale * B A`` for the layer's weight shard ``weight`` (a new
        tensor; no communication: a column shard needs its B rows and the whole A, a row shard
        the whole B and its A columns). ``weight`` itself while the adapter is disabled."""
        if not self.enabled:
            return weight
        delta = (self.lora_B.detach().float() @ self.lora_A.detach().float()) * self.options.scale
        return (weight.float() + delta).to(weight.dtype)

    def full(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole A and B (collective over the TP group)."""
        return (gather_shards(self.a_logical, self.lora_A, self.tp_group).clone(),
                gather_shards(self.b_logical, self.lora_B, self.tp_group).clone())

    def peft_tensors(self, mapping) -> dict[str, torch.Tensor]:
        """PEFT's tensors of this layer (collective over TP): ``lora_A`` per fused HF module (one
        tensor object for q/k/v and one for gate/up: the fused layer's A), ``lora_B`` split the way
        the base weight is."""
        a, b = self.full()
        out = {}
        for hf_name, b_part in megatron_to_hf(mapping, self.b_logical, b).items():
            stem = PEFT_PREFIX + hf_name.removesuffix(".weight")
            out[f"{stem}.lora_B.weight"] = b_part.contiguous()
            out[f"{stem}.lora_A.weight"] = a if self.column else \
                megatron_to_hf(mapping, self.a_logical, a)[hf_name].contiguous()
        return out


def attach_lora(modules: list, options: LoraOptions, groups, sequence_parallel: bool) -> list[LoraAdapter]:
    """Freeze every parameter of ``modules`` (this rank's model chunks) and give each targeted
    layer an adapter; returns them in module order. ValueError naming ``model.lora.targets`` for
    a target on a model's routed experts or one that matches no layer."""
    unknown = sorted(set(options.targets) - set(LORA_TARGETS))
    if unknown or not options.targets:
        raise ValueError(f"model.lora.targets={list(options.targets)}: expected a non-empty subset of {list(LORA_TARGETS)}")
    adapters, found = [], set()
    for module in modules:
        module.requires_grad_(False)
        offset = layer_offset(module, groups.pp_rank)
        for local_name, sub in list(module.named_modules()):
            if local_name.endswith(".mlp") and hasattr(sub, "router"):
                mlp_targets = sorted({"linear_fc1", "linear_fc2"} & set(options.targets))
                if mlp_targets:
                    raise ValueError(f"model.lora.targets: {mlp_targets} on a model with MoE layers: adapters on "
                                     "routed experts are not supported; use targets [linear_qkv, linear_proj]")
            m = _LAYER.fullmatch(local_name)
            if m is None or m.group(3) not in options.targets or _PARENT[m.group(3)] != m.group(2):
                continue
            found.add(m.group(3))
            name = global_name(local_name, offset) + ".weight"
            sub.adapter = LoraAdapter(name, m.group(3), sub, options, groups.pgs.tp, sequence_parallel)
            adapters.append(sub.adapter)
    missing = sorted(set(options.targets) - found)
    if missing and modules:
        raise ValueError(f"model.lora.targets: {missing} match no layer of this model (adaptable: dense "
                         f"attention's linear_qkv/linear_proj and dense MLPs' linear_fc1/linear_fc2)")
    return adapters


@contextlib.contextmanager
def adapters_disabled(adapters: list[LoraAdapter]):
    """The base model's forward while the block runs (the reference policy of a LoRA policy)."""
    before = [a.enabled for a in adapters]
    for a in adapters:
        a.enabled = False
    try:
        yield
    finally:
        for a, was in zip(adapters, before):
            a.enabled = was


def peft_state(adapters: list[LoraAdapter], mapping, groups) -> dict[str, torch.Tensor]:
    """Every adapter tensor of the model under its PEFT name, on every rank (collective over TP
    and PP: the stages' adapters are small and gathered as objects)."""
    out = {}
    for a in adapters:
        out.update(a.peft_tensors(mapping))
    if groups.topology.pp > 1:
        every = [None] * groups.topology.pp
        dist.all_gather_object(every, out, group=groups.pgs.pp)
        out = {k: v for stage in every for k, v in stage.items()}
    return out


def peft_config(options: LoraOptions, base_model: str) -> dict:
    """``adapter_config.json`` of a PEFT LoRA adapter with these options."""
    modules = sorted(m for t in options.targets for m in HF_MODULES[t])
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": options.rank, "lora_alpha": options.alpha, "lora_dropout": options.dropout,
            "target_modules": modules, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
            "use_dora": False, "inference_mode": True}


def unshared(tensors: dict) -> dict:
    """``tensors`` with every tensor object that appears under several names copied (safetensors
    refuses tensors sharing memory)."""
    seen, out = set(), {}
    for k, v in tensors.items():
        out[k] = v.contiguous().clone() if id(v) in seen else v.contiguous()
        seen.add(id(v))
    return out


def write_peft_folder(folder: str | os.PathLike, tensors: dict, options: LoraOptions, base_model: str) -> Path:
    """Write a PEFT adapter folder (``adapter_config.json``, ``adapter_model.safetensors``)
    atomically: built in a sibling temp folder, then renamed over ``folder``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    save_file(unshared(tensors), str(staging / "adapter_model.safetensors"))
    (staging / "adapter_config.json").write_text(json.dumps(peft_config(options, base_model), indent=1))
    if folder.exists():
        old = folder.with_name(f".{folder.name}.old")
        os.replace(folder, old)
        os.replace(staging, folder)
        import shutil

        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, folder)
    return folder


def adapter_sharded_state_dict(adapters: list[LoraAdapter], prefix: str = "") -> dict:
    """The adapters as megatron-core ShardedTensors of their parameters (key: the layer's global
    name + ``.adapter.lora_A`` / ``lora_B``), split over TP as they are held (whole tensors are
    written by one rank). What a LoRA checkpoint holds of the model: the frozen base is the model
    folder's, by reference. The split of linear_fc1's B keeps each TP rank's gate and up rows
    together, so such a checkpoint loads at the TP size it was saved at (:func:`lora_layout`)."""
    from megatron.core.utils import make_sharded_tensor_for_checkpoint, make_tp_sharded_tensor_for_checkpoint

    out = {}
    for a in adapters:
        stem = prefix + a.name.removesuffix(".weight") + ".adapter."
        for key, param, split in ((stem + "lora_A", a.lora_A, None if a.column else 1),
                                  (stem + "lora_B", a.lora_B, 0 if a.column else None)):
            out[key] = make_sharded_tensor_for_checkpoint(param, key) if split is None else \
                make_tp_sharded_tensor_for_checkpoint(param, key, tp_axis=split)
    return out


def load_adapter_state(adapters: list[LoraAdapter], loaded: dict, prefix: str = "") -> None:
    """Copy what megatron-core loaded for :func:`adapter_sharded_state_dict` into the adapters."""
    with torch.no_grad():
        for a in adapters:
            stem = prefix + a.name.removesuffix(".weight") + ".adapter."
            a.lora_A.copy_(loaded[stem + "lora_A"])
            a.lora_B.copy_(loaded[stem + "lora_B"])


def lora_layout(options: LoraOptions, tp: int) -> dict:
    """What a LoRA checkpoint must match to load: the adapters' shape and the TP size."""
    return {"rank": options.rank, "alpha": options.alpha, "targets": sorted(options.targets), "tp": tp}
