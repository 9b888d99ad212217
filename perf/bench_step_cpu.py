"""A quickstart-shaped Megatron step on CPU, with and without each of the step's CPU speed-ups (one run).

The quickstart's batch (8 prompts x 4 samples: ~65-token prompts, ``--response`` tokens each) on
SmolLM2-135M at ``--dtype``, one gloo rank with all cores, Adam (megatron's distributed
optimizer): the reference log-prob pass (forward only) and the training step (forward, backward,
update), timed with the speed-ups switched on one after the other in the same process:

1. ``before``: every position's logits, math attention, glibc's default heap;
2. ``+ logits``: the output layer computes the logits of the response positions only
   (:meth:`megarl.policy.schedule.MicroBatchRunner.install_logit_selection`);
3. ``+ fused attention``: the log-prob pass uses ``scaled_dot_product_attention``, as the frozen
   reference model's passes do (``fused_without_grad``, :mod:`megarl.compat.te_cpu`; the trained
   model keeps the math attention, so the training step does not change here);
4. ``+ heap keep``: freed memory stays in the process (:func:`megarl.compat.heap.keep`, set here
   mid-process: the training worker sets it at start, which measured slightly better);
5. the same with ``--large-micro-batch`` tokens per micro-batch.

Rows 1-5 step as megatron-core does unpatched (per-tensor AdamW loop; gloo's one-rank
reduce-scatter and all-gather of the whole buffers). The CPU optimizer cuts (Adam on torch's fused
CPU kernel, :func:`megarl.policy.train.fuse_cpu_adam`; no data-parallel collectives
within a one-rank group, patch P11 of :mod:`megarl.compat.megatron_cpu`) are then compared in two
fresh processes, without and with them, each with the heap kept from its start as the training
worker does, ``--fresh-steps`` training steps at ``--large-micro-batch`` tokens: what they save
is mostly the large temporaries (a 538 MB copy of the gradient buffer, per-tensor Adam
intermediates) that grow and fragment the kept heap, so switching them on mid-process, after
those temporaries existed, measures nothing (tried: 12.3-12.8 s either way).

Each row: the median of ``--repeats`` calls after one warm-up, and the page faults of the last
training step. Prints a markdown table with ratios to ``before`` and the machine line.

Usage: python perf/bench_step_cpu.py [--dtype bfloat16] [--response 40] [--repeats 2] [--only-fresh]
"""
from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def batch(response: int, tokens_per_micro_batch: int, seed: int = 0):
    import torch

    from megarl.policy import SequenceBatch

    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, 49152, (65 + response,), generator=g) for _ in range(32)]
    groups, cur, n = [], [], 0
    for ids in seqs:
        if cur and n + ids.numel() > tokens_per_micro_batch:
            groups.append(cur)
            cur, n = [], 0
        cur.append(ids)
        n += ids.numel()
    groups.append(cur)
    out = []
    for grp in groups:
        r = response * len(grp)
        out.append(SequenceBatch(list(grp), [65] * len(grp),
                                 extras={"advantages_T": torch.randn(r, generator=g), "mask_T": torch.ones(r)}))
    return out


def loss_fn(logprobs_R, mb):
    from megarl.algorithms.losses import ppo_policy_loss

    e = mb.extras
    return ppo_policy_loss(logprobs_R, logprobs_R.detach(), e["advantages_T"], e["mask_T"], mb.cu_seqlens_N1,
                           agg_mode="token-mean", num_tokens=mb.num_global_tokens)


def timed(fn, repeats: int) -> tuple[float, int]:
    fn()   # warm-up
    times, faults = [], 0
    for _ in range(repeats):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    return statistics.median(times), faults


def without_optimizer_cuts(engine) -> None:
    """Step ``engine`` (and every engine in the process) as megatron-core does unpatched: torch's
    per-tensor AdamW loop, and the one-rank collectives patch P11 skips (its ``_megarl_orig``)."""
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup as G

    from megarl.policy.offload import _torch_optimizers

    for opt in _torch_optimizers(engine.optimizer):
        for group in opt.param_groups:
            group["fused"] = False
    G.start_grad_sync = getattr(G.start_grad_sync, "_megarl_orig", G.start_grad_sync)
    G.start_param_sync = getattr(G.start_param_sync, "_megarl_orig", G.start_param_sync)


def one_rank_engine(args):
    """SmolLM2 (``args.model`` at ``args.dtype``) on one gloo rank with all cores and Adam; call
    after :func:`megarl.compat.setup_cpu`."""
    import torch
    import torch.distributed as dist

    from megarl.policy import ModelOptions, OptimOptions, PolicyModel
    from megarl.parallel import Topology, build_process_groups

    torch.set_num_threads(os.cpu_count() or 1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return PolicyModel(ModelOptions(path=args.model, dtype=args.dtype), build_process_groups(Topology(world_size=1)),
                        OptimOptions(optimizer="adam", lr=1e-7))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="fixture:smollm2")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--response", type=int, default=40, help="response tokens per sample")
    ap.add_argument("--micro-batch", type=int, default=512, help="tokens per micro-batch (the quickstart's before)")
    ap.add_argument("--large-micro-batch", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--fresh-steps", type=int, default=5, help="training steps per fresh process (cuts off / on)")
    ap.add_argument("--only-fresh", action="store_true", help="only the fresh-process comparison of the optimizer cuts")
    ap.add_argument("--child-optimizer-cuts", choices=["on", "off"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_optimizer_cuts:
        return fresh_child(args)
    if args.only_fresh:
        return fresh_comparison(args)

    import torch
    import torch.distributed as dist

    from megarl.compat import heap, setup_cpu

    setup_cpu()
    from megarl.compat import te_cpu
    from megarl.precision import cpu_line

    engine = one_rank_engine(args)
    selection = engine.runner.select_logits

    def run(label: str, tokens: int) -> dict:
        logprob_s, _ = timed(lambda: engine.forward_logprobs(batch(args.response, tokens)), args.repeats)
        train_s, faults = timed(lambda: engine.train_step(batch(args.response, tokens), loss_fn), args.repeats)
        row = dict(label=label, tokens_per_micro_batch=tokens, logprob_s=logprob_s, train_s=train_s, faults=faults)
        print(f"  {label}: log-prob pass {logprob_s:.2f} s, train step {train_s:.2f} s, "
              f"{faults} page faults", flush=True)
        return row

    rows = []
    without_optimizer_cuts(engine)
    engine.runner.select_logits, te_cpu.FUSED_INFERENCE_ATTENTION = False, False
    rows.append(run("before", args.micro_batch))
    engine.runner.select_logits = selection
    rows.append(run("+ logits of response positions", args.micro_batch))
    te_cpu.FUSED_INFERENCE_ATTENTION = True
    for chunk in engine.model.chunks:   # as in the reference engine
        for m in chunk.modules():
            if hasattr(m, "fused_without_grad"):
                m.fused_without_grad = True
    rows.append(run("+ fused attention (reference pass)", args.micro_batch))
    heap.keep()
    rows.append(run("+ heap keep", args.micro_batch))
    rows.append(run(f"+ {args.large_micro_batch} tokens per micro-batch", args.large_micro_batch))

    tokens = 32 * (65 + args.response)
    print(f"\n{cpu_line()}; torch {torch.__version__}, {torch.get_num_threads()} threads; {args.model} "
          f"{args.dtype}; 32 sequences of 65 prompt + {args.response} response tokens ({tokens} tokens); "
          f"median of {args.repeats} after a warm-up\n")
    print("| configuration | tokens / micro-batch | log-prob pass s | vs before | train step s | vs before | "
          "page faults (train) |")
    print("|---|---|---|---|---|---|---|")
    b = rows[0]
    for r in rows:
        print(f"| {r['label']} | {r['tokens_per_micro_batch']} | {r['logprob_s']:.2f} | "
              f"{b['logprob_s'] / r['logprob_s']:.2f}x | {r['train_s']:.2f} | {b['train_s'] / r['train_s']:.2f}x | "
              f"{r['faults']} |")
    dist.destroy_process_group()
    fresh_comparison(args)


def fresh_comparison(args) -> None:
    """Training steps without and with the CPU optimizer cuts, each in a fresh process."""
    import json
    import subprocess

    out = {}
    for mode in ("off", "on"):
        cmd = [sys.executable, os.path.abspath(__file__), "--child-optimizer-cuts", mode, "--model", args.model,
               "--dtype", args.dtype, "--response", str(args.response), "--large-micro-batch",
               str(args.large_micro_batch), "--fresh-steps", str(args.fresh_steps)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = [x for x in proc.stdout.splitlines() if x.startswith("FRESH ")]
        if not line:
            raise SystemExit(f"child ({mode}) failed:\n{proc.stderr[-3000:]}")
        out[mode] = json.loads(line[0][len("FRESH "):])
        print(f"  fresh process, optimizer cuts {mode}: steps " + " ".join(f"{t:.2f}" for t in out[mode]["steps"]),
              flush=True)
    skip = min(2, args.fresh_steps - 1)
    med = {m: statistics.median(v["steps"][skip:]) for m, v in out.items()}
    print(f"\nfresh processes, {args.large_micro_batch} tokens per micro-batch, heap kept from the start; "
          f"median of training steps {skip + 1}-{args.fresh_steps}:\n")
    print("| configuration | train step s | vs without | page faults (last step) |")
    print("|---|---|---|---|")
    for mode, label in (("off", "without the CPU optimizer cuts"),
                        ("on", "with them (fused AdamW, no 1-rank collectives)")):
        print(f"| {label} | {med[mode]:.2f} | {med['off'] / med[mode]:.2f}x | {out[mode]['faults']} |")


def fresh_child(args) -> None:
    import json

    from megarl.compat import heap
    heap.keep()                                    # as the training worker does, at start
    import torch.distributed as dist

    from megarl.compat import setup_cpu
    setup_cpu()
    engine = one_rank_engine(args)
    if args.child_optimizer_cuts == "off":   # before any step: no cut's temporaries exist yet
        without_optimizer_cuts(engine)
    steps, faults = [], 0
    for _ in range(args.fresh_steps):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        engine.train_step(batch(args.response, args.large_micro_batch), loss_fn)
        steps.append(time.perf_counter() - t0)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    print("FRESH " + json.dumps({"steps": steps, "faults": faults}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
