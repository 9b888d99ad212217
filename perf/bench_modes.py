"""trainer.mode side by side: on_policy vs one_step_off (and async), in one invocation.

Two experiments (each mode's run is a ``megarl train`` subprocess, one after the other, same
recipe and seeds):

* ``quickstart``: configs/quickstart.yaml (SmolLM2-135M, colocated: generation and training share
  the host's cores) for ``--steps`` steps per mode. Reported per mode: wall seconds per step
  (``timeline/step_s``, the time between consecutive step ends, steps >= 2), the union of engine
  busy time (``timeline/generate_s``) and of training-rank busy time (``timeline/train_s``), the
  overlap of the two (``timeline/overlap_s``), and the mean reward of the first and the last 5
  steps (does the off-policy run learn?). On a 2-core host both sides compete for the same cores,
  so the wall-time gain is bounded by that.
* ``split``: the tied tiny llama fixture (tests' e2e model), ``rollout.placement=split`` and
  ``rollout.delay_per_token_s`` (the engine sleeps per generation step: a rollout device of its
  own that is slower than the trainer, not a competitor for the cores). Reported per mode: step
  seconds, generation seconds, training seconds, max(generation, training) and their sum: with
  the scheduling right, one_step_off's step time is near the max, on_policy's near the sum.

Usage:
    python perf/bench_modes.py quickstart [--steps 12] [--modes on_policy:4,one_step_off:10]
    python perf/bench_modes.py split [--steps 6] [--delay 0.05] [--modes on_policy,one_step_off,async]
``--modes``: comma-separated modes, each optionally ``:steps`` (default ``--steps``). Writes
perf/results/modes_<experiment>_cpu_<date>.md (``--out``) and prints the table.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def tiny_recipe(path: Path, model: Path, delay: float) -> Path:
    path.write_text(f"""
model:
  path: {model}
rollout:
  n: 4
  max_prompt_tokens: 128
  max_response_tokens: 24
  placement: split
  delay_per_token_s: {delay}
data:
  prompts_per_step: 4
  reward: rewards_for_tests:token_parity_reward
trainer:
  lr: 2.0e-3
  logprob_diff_threshold: 0.0
  max_tokens_per_micro_batch: 256
logging:
  progress: false
  trackers: [jsonl]
""")
    return path


def run_mode(recipe: Path, mode: str, steps: int, run_dir: Path, extra: list[str]) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'tests' / 'e2e'}:{os.environ.get('PYTHONPATH', '')}",
               RAY_TMPDIR=tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    cmd = [sys.executable, "-m", "megarl.cli", "train", str(recipe), f"trainer.mode={mode}",
           f"trainer.steps={steps}", f"trainer.run_dir={run_dir}", "logging.stdout=false", *extra]
    log = run_dir.with_suffix(".log")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        code = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if code != 0:
        raise SystemExit(f"{mode} run failed ({code}); see {log}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summarise(mode: str, rows: list[dict]) -> dict:
    steady = [r for r in rows if r["step"] >= 2] or rows
    mean = lambda key: sum(r.get(key, 0.0) for r in steady) / len(steady)   # noqa: E731
    gen, train = mean("timeline/generate_s"), mean("timeline/train_s")
    rewards = [r["reward/mean"] for r in rows]
    k = min(5, len(rewards) // 2)
    return {"mode": mode, "steps": len(rows), "step_s": mean("timeline/step_s"), "generate_s": gen,
            "train_s": train, "overlap_s": mean("timeline/overlap_s"), "max_s": max(gen, train), "sum_s": gen + train,
            "reward_first": sum(rewards[:k]) / k, "reward_last": sum(rewards[-k:]) / k,
            "gap_max": max(r.get("offpolicy/version_gap_max", 0) for r in rows)}


COLUMNS = ["mode", "steps", "step_s", "generate_s", "train_s", "overlap_s", "max_s", "sum_s", "reward_first",
           "reward_last", "gap_max"]


def table(rows: list[dict], cols: list[str] = COLUMNS) -> str:
    """A markdown table of ``rows`` (floats with 2 decimals)."""
    fmt = lambda v: f"{v:.2f}" if isinstance(v, float) else str(v)   # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("experiment", choices=["quickstart", "split"])
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--delay", type=float, default=0.05)
    ap.add_argument("--modes", default="on_policy,one_step_off")
    ap.add_argument("--runs", default=str(ROOT / "runs" / "bench_modes"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d")
    runs = Path(args.runs) / f"{args.experiment}-{datetime.datetime.now():%H%M%S}"
    if args.experiment == "quickstart":
        recipe, steps, extra = ROOT / "configs" / "quickstart.yaml", args.steps or 12, []
    else:
        sys.path.insert(0, str(ROOT / "tests" / "e2e"))
        from e2e_common import tied_tiny_llama

        model = tied_tiny_llama(Path(tempfile.gettempdir()) / "megarl-bench-tied-llama")
        runs.mkdir(parents=True, exist_ok=True)
        recipe, steps, extra = tiny_recipe(runs / "recipe.yaml", model, args.delay), args.steps or 6, []
    results = []
    for item in args.modes.split(","):
        mode, _, n = item.partition(":")
        rows = run_mode(recipe, mode, int(n) if n else steps, runs / mode, extra)
        results.append(summarise(mode, rows))
        print(table(results[-1:]), flush=True)
    text = table(results)
    note = (f"# trainer.mode side by side: {args.experiment}, {stamp}\n\n"
            f"`python perf/bench_modes.py {' '.join(argv or sys.argv[1:])}` on this host "
            f"({os.cpu_count()} cores, CPU only). Seconds are per step, averaged over steps >= 2; "
            "generate_s / train_s are the union of the engines' / the training ranks' busy time "
            "(timeline), max_s and sum_s their max and sum; reward_first / reward_last: mean reward "
            "of the first / last 5 steps (half the steps when fewer than 10).\n\n" + text + "\n")
    out = Path(args.out) if args.out else ROOT / "perf" / "results" / f"modes_{args.experiment}_cpu_{stamp}.md"
    out.write_text(note)
    print(text)
    print(f"written: {out}")


if __name__ == "__main__":
    main()
