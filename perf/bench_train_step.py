"""Train-step throughput: packed THD vs padded, on one batch of RL-like lengths (same run).

Both modes run the same engine, model, loss and micro-batching; only the layout of the tokens
differs:
- packed: every micro-batch is one THD row of its sequences, no padding;
- padded: every sequence is right-padded to the longest sequence of the batch (pad tokens are
  extra response tokens with mask 0, so the loss is unchanged) -- the compute a [B, S_max]
  padded batch costs.
Throughput counts real (unpadded) tokens per second of ``train_step`` wall time.

Usage: python perf/bench_train_step.py [--model fixture:tiny-qwen2] [--sequences 32] [--steps 3]
(runs as a single process; OMP_NUM_THREADS defaults to 1 per the CPU notes).
Legend: N sequences, R response tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rl_lengths(n: int, seed: int) -> list[tuple[int, int]]:
    """(total length, prompt length): prompts 32-96 tokens, responses log-normal (median ~120,
    long tail capped at 768), as in a GRPO batch of math answers."""
    import torch

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(32, 97, (n,), generator=g)
    responses = torch.exp(torch.randn(n, generator=g) * 0.8 + 4.8).clamp(8, 768).long()
    return [(int(p + r), int(p)) for p, r in zip(prompts, responses)]


def make_micro_batches(lengths, vocab, tokens_per_micro_batch, padded: bool, seed: int):
    import torch

    from megarl.policy import SequenceBatch

    g = torch.Generator().manual_seed(seed)
    longest = max(n for n, _ in lengths)
    mbs, cur, cur_tokens = [], [], 0
    for n, p in lengths:
        size = longest if padded else n
        if cur and cur_tokens + size > tokens_per_micro_batch:
            mbs.append(cur)
            cur, cur_tokens = [], 0
        cur.append((n, p))
        cur_tokens += size
    mbs.append(cur)
    out = []
    for mb in mbs:
        ids, prompts, adv, mask = [], [], [], []
        for n, p in mb:
            real = torch.randint(0, vocab, (n,), generator=g)
            pad = longest - n if padded else 0
            ids.append(torch.cat([real, torch.zeros(pad, dtype=torch.long)]))
            prompts.append(p)
            adv.append(torch.randn(n - p + pad, generator=g))
            mask.append(torch.cat([torch.ones(n - p), torch.zeros(pad)]))
        out.append(SequenceBatch(ids, prompts, extras={"advantages_T": torch.cat(adv), "mask_T": torch.cat(mask)}))
    return out


def loss_fn(logprobs_R, batch):
    from megarl.algorithms.losses import ppo_policy_loss

    e = batch.extras
    return ppo_policy_loss(logprobs_R, logprobs_R.detach(), e["advantages_T"], e["mask_T"], batch.cu_seqlens_N1,
                           agg_mode="token-mean", num_tokens=batch.num_global_tokens)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="fixture:tiny-qwen2")
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--tokens-per-micro-batch", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist

    from megarl.compat import setup_cpu

    setup_cpu()
    from megarl.policy import ModelOptions, OptimOptions, PolicyModel
    from megarl.policy.build import read_hf_config
    from megarl.parallel import Topology, build_process_groups

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    groups = build_process_groups(Topology(world_size=1))
    engine = PolicyModel(ModelOptions(path=args.model), groups, OptimOptions(optimizer="sgd", lr=1e-4))
    vocab = read_hf_config(args.model)["vocab_size"]
    lengths = rl_lengths(args.sequences, args.seed)
    real_tokens = sum(n for n, _ in lengths)
    result = {"model": args.model, "sequences": args.sequences, "real_tokens": real_tokens,
              "max_len": max(n for n, _ in lengths), "median_len": int(statistics.median(n for n, _ in lengths)),
              "tokens_per_micro_batch": args.tokens_per_micro_batch, "steps": args.steps}
    for mode in ("packed", "padded"):
        mbs = make_micro_batches(lengths, vocab, args.tokens_per_micro_batch, mode == "padded", args.seed)
        engine.train_step(mbs, loss_fn)          # warm-up
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            engine.train_step(mbs, loss_fn)
            times.append(time.perf_counter() - t0)
        step_s = statistics.median(times)
        result[mode] = {"micro_batches": len(mbs), "computed_tokens": sum(b.num_tokens for b in mbs),
                        "step_s": round(step_s, 3), "real_tokens_per_s": round(real_tokens / step_s, 1)}
    result["packed_over_padded"] = round(result["packed"]["real_tokens_per_s"] / result["padded"]["real_tokens_per_s"], 2)
    print(json.dumps(result, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
