"""HF checkpoint checks and the Megatron distributed checkpoint.

Filling a model from HF safetensors is the engine's own loader
(:func:`megarl.policy.export.fill_from_hf`, through the family mapping: each process reads only the
boxes of its shards); this module checks an HF folder against the mapping before that
(:func:`check_hf_tensors`: missing tensors, shapes, unused tensors, DeepSeek MTP layers).

The checkpoint folder (:func:`save_checkpoint`) is megatron-core ``dist_checkpointing``
(torch_dist) of ``{"model<i>": chunk_i.sharded_state_dict()}`` plus, beside it, the source HF
config / tokenizer files and ``megarl_conversion.json`` (layout written with, dtype, source, MTP
handling). ShardedTensor keys are global (a decoder layer is placed by its global layer number,
from megatron's own layer offset, in its key or its offset in the stacked layer axis), so
:func:`load_megatron_checkpoint` loads it at any tp / pp / vpp / ep / etp and any first/last
pipeline stage split, even or uneven (dist_checkpointing reshards).
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Optional

import torch
import torch.distributed as dist

from megarl.models.safetensors_io import DTYPE_NAMES, HFCheckpoint

META_NAME = "megarl_conversion.json"
# HF files copied into the Megatron checkpoint folder (and back out): everything small that is
# not a weight file.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
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


# ----------------------------------------------------------------------------- HF checks
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
        raise ValueError(f"{len(other)} tensor(s) of {reader.folder} are not used by the {mapping.cfg.model_type} "
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


# ----------------------------------------------------------------------------- dist checkpoint
def _modules(engine_or_model) -> list:
    model = getattr(engine_or_model, "model", engine_or_model)   # PolicyModel -> BuiltModel
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
    from megarl.policy.build import ModelOptions, build_model

    meta = read_meta(path)
    model = build_model(ModelOptions(path=path, dtype=dtype or meta["dtype"]), groups, load_weights=False)
    load_megatron_checkpoint(model, path)
    return model


__all__ = ["META_NAME", "build_model_from_checkpoint", "check_hf_tensors", "expected_hf_shapes", "hf_side_files",
           "load_megatron_checkpoint", "model_dtype_for", "read_meta", "save_checkpoint", "DTYPE_NAMES"]
