"""Argument parsing and error reporting of the ``conversion/*.py`` commands (run under torchrun,
or as a single process without it)."""
from __future__ import annotations

import argparse
import os
import sys


def _layout_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("layout (world size = number of torchrun processes)")
    g.add_argument("--tp", type=int, default=1)
    g.add_argument("--pp", type=int, default=1)
    g.add_argument("--vpp", type=int, default=None)
    g.add_argument("--ep", type=int, default=1)
    g.add_argument("--etp", type=int, default=None)
    g.add_argument("--first-stage-layers", type=int, default=None,
                   help="decoder layers on the first pipeline stage (uneven pipelines, e.g. 61 layers at --pp 16)")
    g.add_argument("--last-stage-layers", type=int, default=None,
                   help="decoder layers on the last pipeline stage (uneven pipelines)")


def _topology(args):
    from megarl.parallel.topology import Topology

    return Topology(world_size=int(os.environ.get("WORLD_SIZE", "1")), tp=args.tp, pp=args.pp, vpp=args.vpp,
                    ep=args.ep, etp=args.etp, first_stage_layers=args.first_stage_layers,
                    last_stage_layers=args.last_stage_layers)


def _run(argv, parser: argparse.ArgumentParser, body) -> int:
    """Parse ``argv`` (plus the layout options), then run ``body(args, topology)``; user errors ->
    message on stderr and exit code 2 (no traceback)."""
    import torch.distributed as dist

    from megarl.conversion.convert import init_distributed

    _layout_args(parser)
    args = parser.parse_args(argv)
    try:
        init_distributed()
        code = body(args, _topology(args))
    except (ValueError, FileNotFoundError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        code = 2
    if dist.is_initialized():
        dist.destroy_process_group()
    return code


def _hf_to_megatron(args, topology) -> int:
    from megarl.conversion.convert import hf_to_megatron

    hf_to_megatron(args.hf, args.out, topology, keep_mtp=args.keep_mtp)
    return 0


def hf_to_megatron_main(argv=None) -> int:
    p = argparse.ArgumentParser(description="HF safetensors folder -> Megatron distributed checkpoint "
                                "(each process reads only its shard)")
    p.add_argument("hf", help="HF folder (config.json, safetensors, optional index json)")
    p.add_argument("out", help="empty output folder for the Megatron checkpoint")
    p.add_argument("--keep-mtp", action="store_true",
                   help="keep DeepSeek multi-token-prediction layers (not supported: they are dropped by default)")
    return _run(argv, p, _hf_to_megatron)


def _megatron_to_hf(args, topology) -> int:
    from megarl.conversion.convert import megatron_to_hf

    megatron_to_hf(args.ckpt, args.out, topology, max_shard_bytes=int(args.max_shard_gb * 1024 ** 3))
    return 0


def megatron_to_hf_main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Megatron distributed checkpoint (written by hf_to_megatron) -> "
                                "HF safetensors shards + index, config and tokenizer files")
    p.add_argument("ckpt")
    p.add_argument("out")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="size limit of one safetensors file")
    return _run(argv, p, _megatron_to_hf)


def _verify(args, topology) -> int:
    import torch.distributed as dist

    from megarl.conversion.verify import DEFAULT_PROMPTS, verify
    from megarl.parallel.groups import build_process_groups

    result = verify(args.hf, args.ckpt, build_process_groups(topology), prompts=args.prompt or DEFAULT_PROMPTS,
                    tol=args.tol)
    if dist.get_rank() == 0:
        print(result.summary(), flush=True)
    return 0 if result.ok else 1


def verify_main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Compare a Megatron checkpoint with its HF source: every weight "
                                "(exact) and log-probs of a few prompts (transformers vs Megatron)")
    p.add_argument("hf")
    p.add_argument("ckpt")
    p.add_argument("--tol", type=float, default=None, help="log-prob tolerance (default 1e-4 fp32, 0.1 bf16)")
    p.add_argument("--prompt", action="append", default=None, help="prompt text (repeatable)")
    return _run(argv, p, _verify)
