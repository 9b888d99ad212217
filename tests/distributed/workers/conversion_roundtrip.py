"""HF -> Megatron -> HF round trips, verify, and resharded loads, in one torchrun launch.

Usage: conversion_roundtrip.py FAMILIES LAYOUT MOE_LAYOUT RELOAD_FAMILIES RELOAD_LAYOUTS WORKDIR
  FAMILIES         comma-separated fixture names (tiny-llama, ..., smollm2) or ``tiny-<family>-<N>l``
                   (a random N-layer variant of the tiny family, built in a temp dir); ``name@layout``
                   overrides the layout (SmolLM2 has 9 heads / 3 KV heads: no tp=2)
  LAYOUT           layout the checkpoint is written and read back with ('tp2.pp2')
  MOE_LAYOUT       the same for MoE families ('tp2.ep2')
  RELOAD_FAMILIES  families whose checkpoint is also loaded at RELOAD_LAYOUTS; ``name:a+b`` loads
                   that one at layouts a and b instead
  RELOAD_LAYOUTS   comma-separated layouts ('-' = all sizes 1)
  WORKDIR          checkpoints and HF outputs are written under it (kept for the caller)

Reports per family: tensors compared, names of tensors not bit-identical, verify's weight and
log-prob results, the layout stored in the checkpoint's metadata, and per reload layout max
|log-probs(HF-loaded engine) - log-probs(after loading the checkpoint into an engine whose
parameters were zeroed)|.
"""
import gc
import json
import os
import re
import sys
import time

import torch
import torch.distributed as dist

from engine_common import (deeper_variant, fixture, groups_for, init, make_batch, micro_batches, parse_layout,
                           remove_dir, report)
from megarl.conversion import (HFCheckpoint, hf_to_megatron, load_megatron_checkpoint, megatron_to_hf, read_meta,
                               verify)
from megarl.policy import ModelOptions, reference_model
from megarl.models.registry import get_family
from megarl.parallel.groups import destroy_process_groups


def compare_folders(src: str, out: str) -> tuple[int, list]:
    a, b = HFCheckpoint(src), HFCheckpoint(out)
    bad = sorted(set(a.tensors) ^ set(b.tensors))
    for name in sorted(set(a.tensors) & set(b.tensors)):
        x, y = a.read_raw(name), b.read_raw(name)
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
            bad.append(name)
    return len(a.tensors), bad


def logprobs(engine, ids, prompts):
    outs = engine.forward_logprobs(micro_batches(ids, prompts))
    return torch.cat([o.logprobs_R for o in outs]).double()


def main():
    rank, world = init()
    families = sys.argv[1].split(",")
    layout, moe_layout = sys.argv[2], sys.argv[3]
    default_reload = [s for s in sys.argv[5].split(",") if s]
    reload_layouts = {}
    for entry in filter(None, sys.argv[4].split(",")):
        name, _, own = entry.partition(":")
        reload_layouts[name] = [s.replace("-", "") for s in (own.split("+") if own else default_reload)]
    workdir = sys.argv[6]
    out = {"world": world}
    for entry in families:
        name, _, override = entry.partition("@")
        t0 = time.time()
        variant = re.fullmatch(r"tiny-(\w+)-(\d+)l", name)
        src = deeper_variant(variant[1], int(variant[2])) if variant else fixture(name)
        cfg = json.load(open(os.path.join(src, "config.json")))
        spec = override or (moe_layout if get_family(cfg["model_type"]).is_moe else layout)
        topo = parse_layout(spec, world)
        ckpt, hf_out = os.path.join(workdir, f"{name}-ckpt"), os.path.join(workdir, f"{name}-hf")
        stats = hf_to_megatron(src, ckpt, topo)
        out[f"{name}|peak_mib"] = stats["memory"]["max_self_mib"]
        megatron_to_hf(ckpt, hf_out, topo, max_shard_bytes=64 * 2 ** 20)
        if rank == 0:
            count, bad = compare_folders(src, hf_out)
            out[f"{name}|tensors"], out[f"{name}|not_identical"] = count, bad
        out[f"{name}|layout"] = read_meta(ckpt)["layout"]
        res = verify(src, ckpt, groups_for(spec, world))
        out[f"{name}|verify"] = {"ok": res.ok, "weight_diffs": res.weight_diffs, "num_weights": res.num_weights,
                                 "logprob_max_diff": res.logprob_max_diff}
        if name in reload_layouts:
            ids, prompts = make_batch(cfg["vocab_size"])
            for target in reload_layouts[name]:
                engine = reference_model(ModelOptions(path=src), groups_for(target, world))
                ref = logprobs(engine, ids, prompts)
                with torch.no_grad():
                    for m in engine.model.modules:
                        for p in m.parameters():
                            p.zero_()
                load_megatron_checkpoint(engine, ckpt)
                got = logprobs(engine, ids, prompts)
                out[f"{name}|reload|{spec}->{target or 'tp1'}"] = (got - ref).abs().max().item()
                del engine
                gc.collect()
        destroy_process_groups()
        if variant:
            remove_dir(src)
        out[f"{name}|seconds"] = round(time.time() - t0, 1)
        if rank == 0:
            print(f"{name}: {json.dumps({k: v for k, v in out.items() if k.startswith(name)})}", flush=True)
    report(out)


if __name__ == "__main__":
    main()
