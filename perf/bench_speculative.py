"""Speculative rollouts side by side: rollout.speculative off / exact / lenient, one invocation.

Each mode is a ``megarl train`` subprocess of configs/quickstart.yaml (SmolLM2-135M, arithmetic)
with a fixed pool of ``--prompts`` problems visited for ``--epochs`` epochs (same seeds in every
mode, so epoch 1 is the same plain generation everywhere). Per step it reads the generation
seconds (``time/generate_s``, which includes the verification), the verification and residual
seconds, the share of response tokens reused from drafts, the acceptance, the distinct share of a
group's responses and the mean reward. It reports, per mode, the mean generation seconds of the
steps after the first epoch and their ratio to ``off``'s (below 1: faster), and the trainer's
forward over the same samples (``time/logprobs_s``: the reference model's log-prob pass, the
same tokens a trainer-side verification would run) next to vLLM's verification seconds.

Usage:
    python perf/bench_speculative.py [--prompts 16] [--epochs 4] [--modes off,exact,lenient]

Writes perf/results/speculative_cpu_<date>.md and .png (reward and generation seconds per step,
one plot), and the per-step rows as .json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

KEYS = ("time/generate_s", "spec/verify_s", "spec/residual_s", "spec/reused_frac", "spec/acceptance",
        "spec/full_accept_frac", "spec/residual_tv_bound", "rollout/distinct_frac", "reward/mean",
        "time/logprobs_s", "response_length/mean", "rollout/engine0_tokens")


def run_mode(mode: str, args, run_dir: Path) -> list[dict]:
    env = dict(os.environ, RAY_TMPDIR=tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    cmd = [sys.executable, "-m", "megarl.cli", "train", str(ROOT / "configs" / "quickstart.yaml"),
           f"data.num_prompts={args.prompts}", f"data.prompts_per_step={args.per_step}", f"data.epochs={args.epochs}",
           f"rollout.speculative={mode}", f"trainer.run_dir={run_dir}", "logging.stdout=false",
           "logging.progress=false"]
    log = run_dir.with_suffix(".log")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        code = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if code != 0:
        raise SystemExit(f"{mode} run failed ({code}); see {log}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{"step": r["step"], **{k: r.get(k) for k in KEYS}} for r in rows]


def mean(values) -> float:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(values) / len(values) if values else float("nan")


def summarise(mode: str, rows: list[dict], first_epoch_steps: int) -> dict:
    later = [r for r in rows if r["step"] > first_epoch_steps]
    return {"mode": mode, "steps": len(rows), "generate_s": mean(r["time/generate_s"] for r in later),
            "verify_s": mean(r["spec/verify_s"] for r in later), "residual_s": mean(r["spec/residual_s"] for r in later),
            "trainer_forward_s": mean(r["time/logprobs_s"] for r in later),
            "reused_frac": mean(r["spec/reused_frac"] for r in later),
            "acceptance": mean(r["spec/acceptance"] for r in later),
            "full_accept": mean(r["spec/full_accept_frac"] for r in later),
            "tv_bound": mean(r["spec/residual_tv_bound"] for r in later),
            "distinct": mean(r["rollout/distinct_frac"] for r in later),
            "generated_tokens": mean(r["rollout/engine0_tokens"] for r in later),
            "reward_epoch1": mean(r["reward/mean"] for r in rows if r["step"] <= first_epoch_steps),
            "reward_last_epoch": mean(r["reward/mean"] for r in rows[-first_epoch_steps:])}


def table(rows: list[dict]) -> str:
    cols = list(rows[0])
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)   # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return "\n".join(lines + ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows])


def plot(curves: dict, path: Path, first_epoch_steps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, rows in curves.items():
        steps = [r["step"] for r in rows]
        ax1.plot(steps, [r["reward/mean"] for r in rows], marker="o", label=mode)
        ax2.plot(steps, [r["time/generate_s"] for r in rows], marker="o", label=mode)
    for ax, title in ((ax1, "mean reward"), (ax2, "generation seconds (incl. verification)")):
        ax.axvline(first_epoch_steps + 0.5, color="grey", lw=0.8, ls="--")
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    from megarl.precision import cpu_flags

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--per-step", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--modes", default="off,exact,lenient")
    ap.add_argument("--runs", default=str(ROOT / "runs" / "bench_speculative"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d")
    runs = Path(args.runs) / f"{datetime.datetime.now():%H%M%S}"
    first = math.ceil(args.prompts / args.per_step)
    curves, results = {}, []
    for mode in args.modes.split(","):
        curves[mode] = run_mode(mode, args, runs / mode)
        results.append(summarise(mode, curves[mode], first))
        print(table(results[-1:]), flush=True)
    base = next((r["generate_s"] for r in results if r["mode"] == "off"), None)
    for r in results:
        r["gen_ratio_vs_off"] = r["generate_s"] / base if base else float("nan")
    model, flags = cpu_flags()
    shown = " ".join(sorted(f for f in flags if f in {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}))
    out = Path(args.out) if args.out else ROOT / "perf" / "results" / f"speculative_cpu_{stamp}.md"
    plot(curves, out.with_suffix(".png"), first)
    out.with_suffix(".json").write_text(json.dumps(curves, indent=1) + "\n")
    text = table(results)
    out.write_text(
        f"# Speculative rollouts side by side, {stamp}\n\n"
        f"`python perf/bench_speculative.py {' '.join(argv if argv is not None else sys.argv[1:])}` on {model} "
        f"({os.cpu_count()} cores; flags: {shown or 'none of avx2/avx512/amx'}), CPU only: quickstart recipe, "
        f"a pool of {args.prompts} arithmetic problems, {args.per_step} per step ({first} step(s) an epoch), "
        f"{args.epochs} epochs. Columns are means over the steps after the first epoch (epoch 1 has no "
        "drafts): generate_s includes verify_s and residual_s; trainer_forward_s is the reference "
        "model's log-prob pass over the same samples (what a trainer-side verification would cost); "
        "generated_tokens: tokens vLLM decoded; gen_ratio_vs_off < 1 is faster than plain sampling. "
        f"Plot: {out.with_suffix('.png').name}; per-step rows: {out.with_suffix('.json').name}.\n\n{text}\n")
    print(text)
    print(f"written: {out}")


if __name__ == "__main__":
    main()
