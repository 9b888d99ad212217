"""The quickstart recipe with 2 rollout engines vs 1 engine, side by side in one invocation.

    python perf/bench_fleet.py [--steps 3] [--out perf/results/fleet_quickstart_cpu_<date>.md]

Both runs use configs/quickstart.yaml (SmolLM2-135M-Instruct, GRPO, the same seeds) with a
training world of 2 gloo ranks (dp2): ``rollout.dp=2`` (two EngineActors, one per device) and
``rollout.dp=1`` (one engine, device 1 runs none). Sampling seeds are functions of (seed, step,
prompt), so the per-step rewards must be equal; the table shows them with the generation time and
the engines' busy ratio (max/mean busy seconds) of each run.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(name: str, dp: int, steps: int, root: Path) -> tuple[list[dict], float]:
    run_dir = root / name
    t0 = time.time()
    cmd = [sys.executable, "-m", "megarl.cli", "train", str(REPO / "configs" / "quickstart.yaml"),
           "topology.world_size=2", f"rollout.dp={dp}", f"trainer.steps={steps}", f"trainer.run_dir={run_dir}",
           "logging.progress=false"]
    with open(root / f"{name}.log", "w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows, time.time() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--root", default="/tmp/megarl-bench-fleet")
    ap.add_argument("--out", default=str(REPO / "perf" / "results" /
                                         f"fleet_quickstart_cpu_{datetime.date.today().isoformat()}.md"))
    args = ap.parse_args()
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    two, t_two = run("engines2", 2, args.steps, root)
    one, t_one = run("engines1", 1, args.steps, root)
    lines = [f"# Quickstart recipe: 2 rollout engines vs 1 ({datetime.date.today().isoformat()})", "",
             f"Machine: {os.cpu_count()} CPU cores, no GPU. Command: `python perf/bench_fleet.py --steps {args.steps}` "
             "(configs/quickstart.yaml, topology.world_size=2, rollout.dp=2 vs 1).", "",
             "| step | reward/mean 2 engines | reward/mean 1 engine | equal | generate s (2 / 1) "
             "| busy ratio (2 engines) | tokens per engine (2 engines) |", "|---|---|---|---|---|---|---|"]
    equal = True
    for a, b in zip(two, one):
        same = a["reward/mean"] == b["reward/mean"] and a["response_length/mean"] == b["response_length/mean"]
        equal &= same
        lines.append(f"| {a['step']} | {a['reward/mean']:.5f} | {b['reward/mean']:.5f} | {'yes' if same else 'NO'} "
                     f"| {a['time/generate_s']:.1f} / {b['time/generate_s']:.1f} | {a['rollout/busy_ratio']:.3f} "
                     f"| {a['rollout/engine0_tokens']} / {a['rollout/engine1_tokens']} |")
    lines += ["", f"Whole runs: {t_two:.0f} s with 2 engines, {t_one:.0f} s with 1 (start-up included). "
              f"Per-step rewards and mean response lengths {'equal' if equal else 'DIFFER'} "
              f"over {len(two)} steps."]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)
    sys.exit(0 if equal else 1)


if __name__ == "__main__":
    main()
