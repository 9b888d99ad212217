"""Engine log-probs vs transformers, for several families and layouts in one torchrun launch.

Usage: engine_parity.py FAMILIES LAYOUTS [MOE_LAYOUTS] [VPP_LAYOUTS] [UNEVEN_LAYOUTS UNEVEN_FAMILIES]
                        [--with-critic-and-compat]
  FAMILIES         comma-separated: tiny families (llama, qwen2, ...) or smollm2 (first layout only)
  LAYOUTS          comma-separated layout specs for every family ('-' = all sizes 1)
  MOE_LAYOUTS      extra layouts for MoE families only
  VPP_LAYOUTS      layouts run on a 4-layer variant of each tiny family (built in a temp dir:
                   the fixtures have 2 layers, pp=2 x vpp=2 needs 4)
  UNEVEN_LAYOUTS   layouts run on a 3-layer variant ('pp2.first1': 1 layer on the first stage,
                   2 on the last; 3 layers cannot split evenly over pp=2)
  UNEVEN_FAMILIES  the tiny families UNEVEN_LAYOUTS run for
  --with-critic-and-compat  then, in the same processes, critic.py's, compat_parity.py's and
                   posttrain.py's checks
                   (one launch instead of three: each torchrun launch costs 15-30 s of imports);
                   the report is then {"parity": ..., "critic": ..., "compat": ..., "posttrain": ...}

Reports per family and layout the max |engine - HF| over the response tokens of 3 packed
sequences (split in 2 micro-batches), and at the first layout packed (THD, one row) vs unpacked
(one sequence per micro-batch); for the uneven layouts also the global decoder layers each
pipeline stage built.
"""
import gc
import json
import sys
import time

import torch
import torch.distributed as dist

from engine_common import (deeper_variant, fixture, groups_for, hf_logprobs, init, make_batch,
                           micro_batches, remove_dir, report)
from megarl.policy import ModelOptions, SequenceBatch, reference_model
from megarl.models.registry import get_family


def layers_by_stage(model) -> list:
    """The global decoder layer numbers (0-based) each pipeline stage built (collective)."""
    mine = (model.groups.pp_rank, sorted(layer.layer_number - 1 for m in model.modules for layer in m.decoder.layers))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return [layers for _, layers in sorted(dict(every).items())]


def engine_logprobs(path, spec, world, ids, prompts, splits=((2,),), placement=None) -> list:
    """Response log-probs of one engine at layout ``spec`` for each micro-batch split in ``splits``
    (one engine build for all of them); ``placement`` (a dict) receives the engine's layers per
    stage under "stages"."""
    engine = reference_model(ModelOptions(path=path), groups_for(spec, world))
    got = [torch.cat([o.logprobs_R for o in engine.forward_logprobs(micro_batches(ids, prompts, split))]).double()
           for split in splits]
    if placement is not None:
        placement["stages"] = layers_by_stage(engine.model)
    del engine
    gc.collect()
    return got


def main():
    rank, world = init()
    others = "--with-critic-and-compat" in sys.argv
    sys.argv = [a for a in sys.argv if a != "--with-critic-and-compat"]
    families = sys.argv[1].split(",")
    layouts = [s for s in sys.argv[2].split(",") if s]
    moe_layouts = [s for s in (sys.argv[3] if len(sys.argv) > 3 else "").split(",") if s]
    vpp_layouts = [s for s in (sys.argv[4] if len(sys.argv) > 4 else "").split(",") if s]
    uneven_layouts = [s for s in (sys.argv[5] if len(sys.argv) > 5 else "").split(",") if s]
    uneven_families = set((sys.argv[6] if len(sys.argv) > 6 else "").split(","))
    out = {"world": world}
    for family in families:
        t0 = time.time()
        name = family if family == "smollm2" else f"tiny-{family}"
        path = fixture(name)
        cfg = json.load(open(f"{path}/config.json"))
        ids, prompts = make_batch(cfg["vocab_size"])
        ref = hf_logprobs(path, ids, prompts)
        todo = layouts + (moe_layouts if get_family(cfg["model_type"]).is_moe else [])
        if family == "smollm2":   # 135M params, 9 heads / 3 KV heads: the first layout only
            todo = layouts[:1]
        for i, spec in enumerate(todo):
            spec = spec.replace("-", "")
            # at the first layout also packed THD (all sequences in one row) and one sequence per
            # micro-batch, from the same engine
            got, *more = engine_logprobs(path, spec, world, ids, prompts, ((2,), (), (1, 2)) if i == 0 else ((2,),))
            out[f"{name}|{spec or 'tp1'}"] = (got - ref).abs().max().item()
            if more:
                packed, single = more
                out[f"{name}|packed_vs_unpacked|{spec or 'tp1'}"] = (packed - single).abs().max().item()
        if vpp_layouts and family != "smollm2":
            deep = deeper_variant(family, 4)
            ref4 = hf_logprobs(deep, ids, prompts)
            for spec in vpp_layouts:
                got, = engine_logprobs(deep, spec, world, ids, prompts)
                out[f"{name}-4l|{spec}"] = (got - ref4).abs().max().item()
            remove_dir(deep)
        if uneven_layouts and family in uneven_families:
            deep = deeper_variant(family, 3)
            ref3 = hf_logprobs(deep, ids, prompts)
            for spec in uneven_layouts:
                placement = {}
                got, = engine_logprobs(deep, spec, world, ids, prompts, placement=placement)
                out[f"{name}-3l|{spec}"] = (got - ref3).abs().max().item()
                out[f"{name}-3l|{spec}|stages"] = placement["stages"]
            remove_dir(deep)
        out[f"{name}|seconds"] = round(time.time() - t0, 1)
        if rank == 0:
            print(f"{name}: {json.dumps({k: v for k, v in out.items() if k.startswith(name)})}", flush=True)
    if others:
        import compat_parity
        import critic
        import posttrain

        out = {"parity": out, "critic": critic.run(world), "compat": compat_parity.run(rank, world),
               "posttrain": posttrain.run(rank, world)}
    report(out)


if __name__ == "__main__":
    main()
