"""The two conversions, run by every process of a torchrun job (gloo on CPU, NCCL on GPU).

:func:`hf_to_megatron`: validate (model type, layout, shard files, tensor names and shapes), build
this rank's empty model chunks, fill them from the safetensors boxes they need (the engine's
loader, :func:`~megarl.policy.export.fill_from_hf`) and write the distributed checkpoint.

:func:`megatron_to_hf`: build the model from the checkpoint folder at any layout, load it, stream
full HF tensors out of the engine's exporter (collective; every rank sees every tensor in the same
order) and let each output shard file be kept and written by one rank (file k by rank k % world),
so a rank holds at most the files it owns while they fill. Rank 0 writes the index json and copies
the config and tokenizer files.
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import time

import torch
import torch.distributed as dist

from megarl.bridge.mapping import get_mapping
from megarl.conversion.megatron_ckpt import (META_NAME, build_model_from_checkpoint, check_hf_tensors,
                                             expected_hf_shapes, hf_side_files, model_dtype_for, read_meta,
                                             save_checkpoint)
from megarl.models.dims import ModelDims
from megarl.models.safetensors_io import HFCheckpoint
from megarl.parallel.topology import Topology

DEFAULT_SHARD_BYTES = 5 * 1024 ** 3


def init_distributed() -> None:
    """Initialise torch.distributed from torchrun's env (or a 1-process group without torchrun)."""
    from megarl.compat import setup_cpu

    setup_cpu()   # no-op with CUDA; must precede process groups (megatron's RNG tracker)
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 20000))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    if backend == "gloo":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))


def peak_memory() -> dict:
    """Peak resident memory (MiB) of this process and of its finished children (per rank, gathered)."""
    mine = {"rank": dist.get_rank(),
            "self_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "children_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return {"per_rank": out, "max_self_mib": max(r["self_mib"] for r in out)}


def _log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(f"[convert] {msg}", flush=True)


def read_config(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{folder!r} has no config.json (expected an HF model folder)")
    with open(path) as f:
        return json.load(f)


def hf_to_megatron(hf_folder: str, out: str, topology: Topology, keep_mtp: bool = False) -> dict:
    """Convert an HF folder to a Megatron distributed checkpoint at ``topology`` (collective)."""
    from megarl.policy.build import ModelOptions, build_model
    from megarl.policy.export import fill_from_hf
    from megarl.models.registry import get_family
    from megarl.parallel.groups import build_process_groups, destroy_process_groups

    t0 = time.time()
    cfg = read_config(hf_folder)
    get_family(cfg.get("model_type", "<missing>"))
    topology.check_model(ModelDims.from_hf(cfg))
    reader = HFCheckpoint(hf_folder)
    mapping = get_mapping(cfg)
    mtp = check_hf_tensors(reader, mapping, keep_mtp=keep_mtp)
    dtype = model_dtype_for(reader, cfg)
    groups = build_process_groups(topology)
    model = build_model(ModelOptions(path=hf_folder, dtype=dtype), groups, load_weights=False)
    t_build = time.time()
    nbytes = fill_from_hf(model, reader)
    t_fill = time.time()
    meta = {"model_type": cfg["model_type"], "dtype": dtype, "source": os.path.abspath(hf_folder),
            "layout": {"world_size": topology.world_size, "tp": topology.tp, "pp": topology.pp,
                       "vpp": topology.vpp, "ep": topology.ep, "etp": topology.etp,
                       "first_stage_layers": topology.first_stage_layers,
                       "last_stage_layers": topology.last_stage_layers},
            "dequantized_fp8": any(reader.is_fp8(n) for n in reader.tensors),
            "dropped_mtp_tensors": len(mtp), "format": "megatron-core dist_checkpointing torch_dist"}
    save_checkpoint(model, out, hf_folder, meta)
    read_total = [None] * dist.get_world_size()
    dist.all_gather_object(read_total, nbytes)
    mem = peak_memory()
    del model
    destroy_process_groups()
    stats = {"seconds": {"build": round(t_build - t0, 2), "fill": round(t_fill - t_build, 2),
                         "save": round(time.time() - t_fill, 2)},
             "bytes_read_per_rank": read_total, "dropped_mtp_tensors": len(mtp), "memory": mem}
    stages = f" (layers per stage {list(topology.stage_layers(cfg['num_hidden_layers']))})" if topology.uneven else ""
    _log(f"{hf_folder} -> {out} at tp={topology.tp} pp={topology.pp}{stages} ep={topology.ep}: dtype {dtype}, "
         f"read {[round(b / 2**20, 1) for b in read_total]} MiB per rank"
         + (f", dropped {len(mtp)} MTP tensors" if mtp else ""))
    _log("peak RSS per rank (MiB): " + ", ".join(f"{r['self_mib']:.0f}" for r in mem["per_rank"])
         + f" (max {mem['max_self_mib']:.0f}); seconds {stats['seconds']}")
    return stats


# ----------------------------------------------------------------------------- Megatron -> HF
def plan_files(shapes: dict[str, tuple], dtype: torch.dtype, max_bytes: int) -> dict[str, int]:
    """HF name -> output file index, filling files in order up to ``max_bytes``."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    out, index, used = {}, 0, 0
    for name, shape in shapes.items():
        size = itemsize
        for s in shape:
            size *= s
        if used and used + size > max_bytes:
            index, used = index + 1, 0
        out[name] = index
        used += size
    return out


def file_name(index: int, total: int) -> str:
    return f"model-{index + 1:05d}-of-{total:05d}.safetensors"


def megatron_to_hf(ckpt: str, out: str, topology: Topology, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> dict:
    """Convert a checkpoint written by :func:`hf_to_megatron` to an HF folder (collective)."""
    from safetensors.torch import save_file

    from megarl.policy.export import export_hf_weights
    from megarl.parallel.groups import build_process_groups, destroy_process_groups

    t0 = time.time()
    meta = read_meta(ckpt)
    cfg = read_config(ckpt)
    topology.check_model(ModelDims.from_hf(cfg))
    groups = build_process_groups(topology)
    model = build_model_from_checkpoint(ckpt, groups)
    dtype = next(model.modules[0].parameters()).dtype
    shapes = expected_hf_shapes(get_mapping(cfg))
    files = plan_files(shapes, dtype, max_shard_bytes)
    total = max(files.values()) + 1
    remaining = [0] * total
    for idx in files.values():
        remaining[idx] += 1
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        os.makedirs(out, exist_ok=True)
    dist.barrier()
    held: dict[int, dict] = {}
    seen = set()
    for name, tensor in export_hf_weights(model):
        if name not in files:
            raise ValueError(f"exported tensor {name!r} is not in the {cfg['model_type']} HF layout")
        if name in seen:
            raise ValueError(f"exported tensor {name!r} twice")
        seen.add(name)
        if tuple(tensor.shape) != shapes[name]:
            raise ValueError(f"exported tensor {name!r} has shape {tuple(tensor.shape)}, expected {shapes[name]}")
        idx = files[name]
        if idx % world == rank:
            held.setdefault(idx, {})[name] = tensor.detach().to(dtype).contiguous().clone()
        remaining[idx] -= 1
        if remaining[idx] == 0 and idx in held:
            save_file(held.pop(idx), os.path.join(out, file_name(idx, total)), metadata={"format": "pt"})
    missing = sorted(set(files) - seen)
    if missing:
        raise ValueError(f"{len(missing)} HF tensor(s) were not exported, e.g. {missing[:3]}")
    dist.barrier()
    if rank == 0:
        itemsize = torch.empty((), dtype=dtype).element_size()
        size = sum(itemsize * int(torch.tensor(s).prod().item()) if s else itemsize for s in shapes.values())
        index = {"metadata": {"total_size": size},
                 "weight_map": {n: file_name(i, total) for n, i in sorted(files.items())}}
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
        for fn in hf_side_files(ckpt):
            if fn != META_NAME:
                shutil.copy2(os.path.join(ckpt, fn), os.path.join(out, fn))
    mem = peak_memory()
    del model
    destroy_process_groups()
    _log(f"{ckpt} -> {out}: {len(files)} tensors in {total} file(s), {time.time() - t0:.1f} s; peak RSS per rank "
         f"(MiB): " + ", ".join(f"{r['self_mib']:.0f}" for r in mem["per_rank"]))
    return {"files": total, "tensors": len(files), "seconds": round(time.time() - t0, 2), "memory": mem}
