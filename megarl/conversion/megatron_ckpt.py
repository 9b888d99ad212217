"""HF safetensors -> this rank's Megatron shards (streaming), and the Megatron distributed checkpoint.

Filling a model built with ``load_weights=False`` (:func:`fill_from_hf`):

1. Every local parameter (and MoE ``expert_bias`` buffer) gets its *global* Megatron name
   (global layer number; expert weights ``...linear_fcK.weight<j>`` with local id j -> global
   id ``ep_rank * E/ep + j``) and its logical tensor from the family mapping
   (:mod:`megarl.bridge.mapping`: QKV interleaved per query group, ``[gate; up]`` rows, stacked
   experts, MLA projections).
2. :func:`~megarl.bridge.mapping.shard_segments` gives the boxes of the logical tensor this rank
   holds (TP split, fused gate/up as two segments, the expert's row of the stack).
3. Each segment is intersected with the mapping's pieces (logical box -> HF tensor box); only those
   HF boxes are read (:class:`~megarl.conversion.safetensors_io.HFCheckpoint`).

A process therefore reads about its shard's bytes (column-split tensors cost one full row range
as a temporary). Every element of a shard must be written by some piece (checked with a NaN fill).

The checkpoint folder (:func:`save_checkpoint`) is megatron-core ``dist_checkpointing``
(torch_dist) of ``{"model<i>": chunk_i.sharded_state_dict()}`` plus, beside it, the source HF
config / tokenizer files and ``megarl_conversion.json`` (layout written with, dtype, source, MTP
handling). ShardedTensor keys are global, so :func:`load_megatron_checkpoint` loads it at any
tp / pp / vpp / ep / etp (dist_checkpointing reshards).
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Optional

import torch
import torch.distributed as dist

from megarl.bridge.mapping import (MegatronTensor, intersect, local_shape, shard_segments, slices,
                                   translate)
from megarl.conversion.safetensors_io import DTYPE_NAMES, HFCheckpoint
from megarl.engine.export import named_tensors

META_NAME = "megarl_conversion.json"
# HF files copied into the Megatron checkpoint folder (and back out): everything small that is
# not a weight file.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_EXPERT_RE = re.compile(r"^(.*\.mlp\.experts\.linear_fc[12]\.weight)(\d+)$")
_MODEL_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def hf_side_files(folder: str) -> list[str]:
    """Config, tokenizer and generation files of an HF folder (no weights, no index)."""
    out = []
    for fn in sorted(os.listdir(folder)):
        path = os.path.join(folder, fn)
        if (os.path.isfile(path) and not fn.endswith(_WEIGHT_SUFFIXES) and not fn.endswith(".index.json")
                and not fn.startswith(".") and fn != META_NAME and fn != "metadata.json"
                and not fn.endswith((".distcp", ".pt"))):
            out.append(fn)
    return out


def read_meta(path: str) -> dict:
    meta_path = os.path.join(path, META_NAME)
    if not os.path.exists(meta_path):
        raise FileNotFoundError(f"{path!r} is not a megarl Megatron checkpoint ({META_NAME} missing)")
    with open(meta_path) as f:
        return json.load(f)


def model_dtype_for(reader: HFCheckpoint, hf_config: dict) -> str:
    """The Megatron parameter dtype for a source checkpoint: its own float dtype (bf16 for FP8)."""
    dtype = reader.logical_dtype("model.embed_tokens.weight")
    if dtype not in _MODEL_DTYPES:
        raise ValueError(f"source dtype {dtype} is not supported (expected float32, bfloat16 or FP8)")
    return _MODEL_DTYPES[dtype]


# ----------------------------------------------------------------------------- name resolution


def local_targets(model, mapping) -> list[tuple[str, torch.Tensor, MegatronTensor, list]]:
    """``(global name, local tensor, logical tensor, [(local box, logical box)])`` for this rank.

    Expert parameters get 3-D boxes (a leading expert dim of size 1 on the local side)."""
    groups, topo = model.groups, model.groups.topology
    logical = {t.name: t for t in mapping.megatron_tensors()}
    embedding = logical["embedding.word_embeddings.weight"]
    num_experts = mapping.cfg.num_experts
    out = []
    for module in model.modules:
        names = model.bridge._weight_name_mapping_mcore_local_to_global(module, consider_ep=False)
        for local_name, tensor in named_tensors(module):
            gname = names[local_name]
            m = _EXPERT_RE.match(gname)
            if m:
                t = logical.get(m.group(1))
                if t is None:
                    raise ValueError(f"no logical tensor for expert parameter {gname!r}")
                gid = groups.ep_rank * (num_experts // topo.ep) + int(m.group(2))
                gname = f"{m.group(1)}{gid}"
                segs = [(((0, 1),) + lb[1:], ((gid, gid + 1),) + fb[1:])
                        for lb, fb in shard_segments(t, topo.expert_tp, groups.etp_rank)]
                want = (1,) + local_shape(t, topo.expert_tp)[1:]
            else:
                t = logical.get(gname)
                if t is None and gname == "output_layer.weight":   # tied, last stage at pp > 1
                    t = embedding
                if t is None:
                    raise ValueError(f"Megatron parameter {gname!r} has no HF mapping for "
                                     f"{mapping.model_type}")
                segs = shard_segments(t, topo.tp, groups.tp_rank)
                want = local_shape(t, topo.tp)
            got = (1,) + tuple(tensor.shape) if m else tuple(tensor.shape)
            if got != tuple(want):
                raise ValueError(f"Megatron parameter {gname!r} has local shape {got}, the mapping expects "
                                 f"{tuple(want)} (family mapping and model disagree)")
            out.append((gname, tensor, t, segs))
    return out


def expected_hf_shapes(mapping) -> dict[str, tuple]:
    """HF tensor name -> shape for every tensor the Megatron model reads (experts unstacked)."""
    out = {}
    for name, shape in mapping.hf_shapes().items():
        if "*" in name:
            for e in range(shape[0]):
                out[name.replace("*", str(e))] = tuple(shape[1:])
        else:
            out[name] = tuple(shape)
    return out


def check_hf_tensors(reader: HFCheckpoint, mapping, keep_mtp: bool = False) -> list[str]:
    """Raise on missing tensors or shape mismatches; return the source tensors left unused."""
    expected = expected_hf_shapes(mapping)
    for name, shape in expected.items():
        if name not in reader:
            raise ValueError(f"tensor {name!r} (shape {shape} from config.json) is missing from {reader.folder}")
        got = reader.info(name).shape
        if tuple(got) != shape:
            raise ValueError(f"tensor {name!r}: checkpoint shape {tuple(got)} but config.json implies {shape}")
    unused = [n for n in reader.tensors if n not in expected and not n.endswith("_scale_inv")
              and "rotary_emb.inv_freq" not in n]
    mtp = mtp_tensor_names(unused, mapping.cfg.num_layers)
    if mtp and keep_mtp:
        raise ValueError(f"keeping multi-token-prediction layers is not supported ({len(mtp)} MTP tensors, e.g. "
                         f"{mtp[0]!r}); convert without --keep-mtp to drop them")
    other = [n for n in unused if n not in set(mtp)]
    if other:
        raise ValueError(f"{len(other)} tensor(s) of {reader.folder} are not used by the {mapping.model_type} "
                         f"mapping, e.g. {other[:3]} (config.json and weights disagree)")
    return mtp


def mtp_tensor_names(names, num_layers: int) -> list[str]:
    """DeepSeek-V3 multi-token-prediction tensors: ``model.layers.<i>.*`` with i >= num_hidden_layers."""
    out = []
    for n in names:
        m = re.match(r"^model\.layers\.(\d+)\.", n)
        if m and int(m.group(1)) >= num_layers:
            out.append(n)
    return out


# ----------------------------------------------------------------------------- HF -> shards
def _read_hf_box(reader: HFCheckpoint, name: str, box) -> torch.Tensor:
    if "*" not in name:
        return reader.read(name, box)
    (e0, e1), rest = box[0], box[1:]
    return torch.stack([reader.read(name.replace("*", str(e)), rest) for e in range(e0, e1)])


def fill_from_hf(model, reader: HFCheckpoint, mapping) -> int:
    """Copy this rank's shards from the HF checkpoint into the model; returns bytes read."""
    nbytes = 0
    with torch.no_grad():
        for gname, tensor, t, segs in local_targets(model, mapping):
            dst = tensor.data
            view = dst.unsqueeze(0) if len(segs[0][0]) == dst.dim() + 1 else dst
            view.fill_(float("nan"))
            pieces = mapping.to_hf(t)
            for local_box, full_b in segs:
                for p in pieces:
                    mid = intersect(full_b, p.src_box)
                    if mid is None:
                        continue
                    part = _read_hf_box(reader, p.dst_name, translate(mid, p.src_box, p.dst_box))
                    nbytes += part.numel() * part.element_size()
                    view[slices(translate(mid, full_b, local_box))] = part.to(dst.dtype)
                    del part
            if torch.isnan(view).any():
                # vocabulary padding rows (none with mbridge's default) would land here
                raise AssertionError(f"{gname}: parts of the shard were not covered by the HF mapping")
    return nbytes


# ----------------------------------------------------------------------------- dist checkpoint
def _modules(engine_or_model) -> list:
    model = getattr(engine_or_model, "model", engine_or_model)   # PolicyEngine -> BuiltModel
    return model.modules


def sharded_state_dict(engine_or_model) -> dict:
    return {f"model{i}": m.sharded_state_dict() for i, m in enumerate(_modules(engine_or_model))}


def save_checkpoint(model, path: str, hf_folder: str, meta: dict) -> None:
    """Write the distributed checkpoint (collective), then the HF side files and the metadata."""
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
        if os.listdir(path):
            raise ValueError(f"output folder {path!r} is not empty")
    dist.barrier()
    dist_checkpointing.save(sharded_state_dict(model), path)
    dist.barrier()
    if dist.get_rank() == 0:
        for fn in hf_side_files(hf_folder):
            shutil.copy2(os.path.join(hf_folder, fn), os.path.join(path, fn))
        _rewrite_config(os.path.join(path, "config.json"), meta)
        with open(os.path.join(path, META_NAME), "w") as f:
            json.dump(meta, f, indent=2)
    dist.barrier()


def _rewrite_config(config_path: str, meta: dict) -> None:
    """The stored config describes the stored weights: no FP8 quantisation, MTP count as kept."""
    with open(config_path) as f:
        cfg = json.load(f)
    if meta.get("dequantized_fp8"):
        cfg.pop("quantization_config", None)
        cfg["dtype"] = meta["dtype"]
        cfg.pop("torch_dtype", None)
    if meta.get("dropped_mtp_tensors"):
        cfg["num_nextn_predict_layers"] = 0
    with open(config_path, "w") as f:
        json.dump(cfg, f, indent=2)


def load_megatron_checkpoint(engine_or_model, path: str) -> None:
    """Load a checkpoint written by :func:`save_checkpoint` into an engine or BuiltModel built for
    the same model at any layout (collective). Every parameter is overwritten (strict)."""
    from megatron.core import dist_checkpointing

    if not os.path.exists(os.path.join(path, "metadata.json")):
        raise FileNotFoundError(f"{path!r} is not a Megatron distributed checkpoint (metadata.json missing)")
    meta = read_meta(path)
    modules = _modules(engine_or_model)
    model = getattr(engine_or_model, "model", engine_or_model)
    want = meta.get("model_type")
    have = getattr(model.hf_config, "model_type", None)
    if want and have and want != have:
        raise ValueError(f"checkpoint {path!r} holds a {want!r} model, the target model is {have!r}")
    loaded = dist_checkpointing.load(sharded_state_dict(engine_or_model), path)
    for i, module in enumerate(modules):
        module.load_state_dict(loaded[f"model{i}"], strict=True)


def build_model_from_checkpoint(path: str, groups, dtype: Optional[str] = None):
    """A BuiltModel for ``groups``' layout with the checkpoint's weights (the folder holds the HF config)."""
    from megarl.engine.build import ModelOptions, build_model

    meta = read_meta(path)
    model = build_model(ModelOptions(path=path, dtype=dtype or meta["dtype"]), groups, load_weights=False)
    load_megatron_checkpoint(model, path)
    return model


__all__ = ["META_NAME", "build_model_from_checkpoint", "check_hf_tensors", "expected_hf_shapes", "fill_from_hf",
           "hf_side_files", "load_megatron_checkpoint", "local_targets", "model_dtype_for", "read_meta",
           "save_checkpoint", "DTYPE_NAMES"]
