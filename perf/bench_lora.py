"""Full fine-tuning vs LoRA (adapter sync) vs LoRA (merged sync) on the same GRPO recipe, side by
side in one invocation (CPU).

Every side runs ``megarl train configs/quickstart.yaml`` (SmolLM2-135M, the arithmetic task, one
gloo rank, one colocated vLLM engine, a KL term to the reference) with the same seeds and steps,
one after the other: ``full`` at the quickstart's learning rate; ``adapter`` and ``merged`` with
``model.lora.rank`` (all four targets, alpha 2 x rank) at ``--lora-lr`` and ``bridge.lora_sync``
adapter / merged. Per side: the median step time by phase (steps after the first), the weight
sync's bytes and seconds, the peak PSS of the training rank's process (``ray::HybridWorker``: the
policy, its gradients and optimizer state, and the full side's reference copy) and of the run's
process tree (sampled every 0.25 s), the mean reward of the first and last five steps. Ratios:
full / each LoRA side for step time, sync bytes and the training rank's peak PSS. ``--bytes-rank``
adds a short adapter side at that rank (2 steps) for its sync bytes only.

    python perf/bench_lora.py                     # 25 steps a side, writes perf/results/
    python perf/bench_lora.py --steps 4 --no-write
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from bench_grpo import read_metrics  # noqa: E402  (perf/, beside this file)
from bench_grpo_cpu import run_measured  # noqa: E402


def run_side(a, work: Path, name: str, overrides: list[str]) -> dict:
    run_dir = work / name
    cmd = [sys.executable, "-m", "megarl.cli", "train", str(ROOT / "configs" / "quickstart.yaml"),
           f"trainer.steps={a.steps}", f"trainer.run_dir={run_dir}", "checkpoint.save_every=0", *overrides]
    wall, pss = run_measured(cmd, work / f"{name}.log", env=dict(os.environ, HF_HUB_OFFLINE="1"), sample=True)
    rows = sorted(read_metrics(run_dir), key=lambda r: r["step"])
    steady = rows[1:] or rows
    sync_bytes = [sum(v for k, v in r.items() if k.startswith("sync/bytes_") and k != "sync/bytes_sent_by_rank")
                  for r in steady]
    phases = sorted({k for r in steady for k in r if k.startswith("time/") and k.endswith("_s")})
    worker = sum(g["pss_mib"] for g in pss.table() if g["process"].startswith("ray::HybridWorker"))
    rewards = [r["reward/mean"] for r in rows]
    return {"side": name, "steps": len(rows), "wall_s": wall, "overrides": overrides,
            "phases": {k[5:-2]: statistics.median(r[k] for r in steady) for k in phases},
            "step_s": statistics.median(sum(r[k] for k in phases) for r in steady),
            "sync_bytes": statistics.median(sync_bytes),
            "sync_s": statistics.median(r["sync/seconds"] for r in steady),
            "worker_pss_mib": worker, "tree_pss_gib": pss.peak_kib / 2**20,
            "first5": statistics.mean(rewards[:5]), "last5": statistics.mean(rewards[-5:]), "rewards": rewards,
            "gap_max": max(r.get("rollout/logprob_diff_mean", 0.0) for r in rows)}


def report(a, sides: list[dict]) -> str:
    from megarl.precision import cpu_line

    full, extra = sides[0], [s for s in sides if s["side"].startswith("adapter-r")]
    sides = [s for s in sides if s not in extra]
    lines = [f"# Full fine-tuning vs LoRA, GRPO quickstart on CPU ({time.strftime('%Y-%m-%d', time.gmtime())})", "",
             f"Machine: {cpu_line()}. configs/quickstart.yaml, {a.steps} steps a side, one after the other; "
             f"LoRA rank {a.rank}, alpha {2 * a.rank}, all four targets, lr {a.lora_lr:g}; full at the "
             f"quickstart's lr. Medians over steps 2-{a.steps}. Command: `python perf/bench_lora.py "
             f"{' '.join(sys.argv[1:])}`.", "",
             "| side | step s | per-phase s | sync MB | sync s | training rank peak PSS MiB | run tree peak PSS GiB "
             "| reward first 5 -> last 5 | max mean rollout-vs-train gap |", "|---|---|---|---|---|---|---|---|---|"]
    for s in sides:
        phases = ", ".join(f"{k} {v:.2f}" for k, v in s["phases"].items())
        lines.append(f"| {s['side']} | {s['step_s']:.2f} | {phases} | {s['sync_bytes'] / 1e6:.1f} | {s['sync_s']:.2f} "
                     f"| {s['worker_pss_mib']:.0f} | {s['tree_pss_gib']:.2f} | {s['first5']:.3f} -> {s['last5']:.3f} "
                     f"| {s['gap_max']:.2e} |")
    for lora in sides[1:]:
        lines += ["", f"Ratios full / {lora['side']}: step time {full['step_s'] / lora['step_s']:.2f}x, sync bytes "
                  f"{full['sync_bytes'] / lora['sync_bytes']:.1f}x, training rank peak PSS "
                  f"{full['worker_pss_mib'] / lora['worker_pss_mib']:.2f}x."]
    for s in extra:
        lines += ["", f"{s['side']} ({s['steps']} steps, bytes only): sync {s['sync_bytes'] / 1e6:.2f} MB, full / "
                  f"{s['side']} sync bytes {full['sync_bytes'] / s['sync_bytes']:.1f}x."]
    for s in sides:
        lines += ["", f"{s['side']}: reward per step {[round(r, 3) for r in s['rewards']]}"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--lora-lr", type=float, default=2e-4)
    p.add_argument("--bytes-rank", type=int, default=8, help="rank of the short bytes-only side (0: none)")
    p.add_argument("--sides", default="full,adapter,merged")
    p.add_argument("--work", default=None, help="run folders (default: a temp dir)")
    p.add_argument("--no-write", action="store_true", help="print only; no perf/results file")
    a = p.parse_args(argv)
    import tempfile

    work = Path(a.work or tempfile.mkdtemp(prefix="bench-lora-"))
    work.mkdir(parents=True, exist_ok=True)
    lora = [f"model.lora.rank={a.rank}", f"model.lora.alpha={2 * a.rank}", f"trainer.lr={a.lora_lr}",
            f"trainer.min_lr={a.lora_lr}"]
    sides = [run_side(a, work, "full", [])] if "full" in a.sides else []
    for mode in ("adapter", "merged"):
        if mode in a.sides:
            sides.append(run_side(a, work, mode, lora + [f"bridge.lora_sync={mode}"]))
    if a.bytes_rank:
        r = a.bytes_rank
        sides.append(run_side(argparse.Namespace(**{**vars(a), "steps": 2}), work, f"adapter-r{r}",
                              [f"model.lora.rank={r}", f"model.lora.alpha={2 * r}", f"trainer.lr={a.lora_lr}",
                               f"trainer.min_lr={a.lora_lr}"]))
    text = report(a, sides)
    print(text)
    if not a.no_write:
        from megarl.precision import cpu_flags

        tag = "avx512bf16" if "avx512_bf16" in cpu_flags()[1] else "avx2"
        out = ROOT / "perf" / "results" / f"lora_cpu_{time.strftime('%Y-%m-%d', time.gmtime())}_{tag}.md"
        out.write_text(text)
        print(f"written: {out}")


if __name__ == "__main__":
    main()
