"""GRPO benchmark row: N steps of a recipe, summarised in the columns of the published tables.

The columns are those of NeMo-RL's and verl's GRPO performance tables (the rows issue 16
compares with): GPUs, mode, seconds per step, tokens/s/GPU, the seconds of generation, log-probs,
training and weight sync, mean response length, MFU.

How each is measured (from the run's own ``metrics.jsonl``; no extra timing in the loop):

* **steady state**: the averages skip step 1 (it pays vLLM's and the allocator's warm-up), so
  at least 2 steps are needed; ``steady_steps`` says which steps were averaged.
* **step seconds**: the sum of the step's ``time/*_s`` phases (generate, score, logprobs, train,
  sync, and critic / eval when the recipe has them): the same sum the loop divides by for
  ``throughput/tokens_per_s``.
* **tokens/s/GPU**: prompt + response tokens of every sample of the step (recovered exactly as
  ``throughput/tokens_per_s`` x step seconds) / step seconds / GPUs. NeMo-RL counts the same
  (its 256-GPU DeepSeek-V3 row: 512 samples x ~810 tokens / 134 s / 256 = 12.1).
* **GPUs**: the devices of the run: ``topology.world_size`` when rollout is colocated, plus
  ``rollout.dp x rollout.tp`` when it is split. On CPU the devices are the training ranks
  (``topology.world_size``).
* **generation / log-prob / train / sync seconds**: ``time/generate_s``, ``time/logprobs_s``
  (policy, and the reference when ``algorithm.kl_coef`` > 0), ``time/train_s``, ``time/sync_s``.
* **MFU**: model FLOPs of the step (:func:`megarl.planner.flops.flops_per_token`, causal
  attention) over step seconds x GPUs x the GPU's bf16 dense peak
  (:data:`megarl.planner.hardware.GPUS`): generation is one forward per token (prefill and
  decode), log-probs one forward per pass that ran (the old-log-prob pass only when
  :func:`megarl.config.passes.needs_old_logprob_pass`; the reference pass when
  ``algorithm.kl_coef`` > 0), training 3 forwards x ``algorithm.ppo_epochs``.
  Sequence lengths are taken as the step's mean (the metrics hold no per-sample lengths), which
  understates the attention term slightly. ``mfu_train`` is the train phase alone (verl's
  ``perf/mfu/actor``). n/a on CPU (no peak to divide by) and on a GPU type megarl has no spec for.
* **mode**: the run's ``trainer.mode`` (on_policy, one_step_off, async). In the off-policy modes
  generation overlaps training, so the step seconds are the wall time between consecutive step
  ends (``timeline/step_s``) rather than the sum of the phases (which then double-counts).

Usage:
    python perf/bench_grpo.py RECIPE [key=value ...] [--steps 5] [--gpu h100] [--label TEXT]
    python perf/bench_grpo.py --from-run RUN_DIR [RECIPE key=value ...] [--gpu h100] [--label TEXT]

The first form runs ``megarl train RECIPE trainer.steps=N trainer.run_dir=RUN_DIR ...`` as a
subprocess (default run dir ``runs/bench_grpo/<recipe>-<time>``); the second summarises a run that
finished elsewhere (a RECIPE given with it only names the row; launch/slurm/bench_grpo.sbatch runs the training with
launch/slurm/megarl.sbatch, then this). Either way the row is printed, appended to
perf/results/bench_grpo.jsonl (``--results``), and perf/results/bench_grpo.md is rewritten from
all rows of that file.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_RESULTS = ROOT / "perf" / "results" / "bench_grpo.jsonl"
PHASES = {"generation_s": "time/generate_s", "logprob_s": "time/logprobs_s", "train_s": "time/train_s",
          "sync_s": "time/sync_s"}
COLUMNS = [("date", "date"), ("recipe", "recipe"), ("label", "label"), ("device", "device"), ("gpus", "GPUs"),
           ("mode", "mode"), ("steady_steps", "steps averaged"), ("step_s", "step s"),
           ("tokens_per_s_per_gpu", "tokens/s/GPU"), ("generation_s", "generation s"), ("logprob_s", "log-prob s"),
           ("train_s", "train s"), ("sync_s", "sync s"), ("mean_response_length", "mean response"),
           ("mfu", "MFU (step)"), ("mfu_train", "MFU (train)")]


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the run wrote no metrics (did `megarl train` fail? see "
                                f"{run_dir / 'logs'})")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def detect_gpu() -> str | None:
    """The :data:`megarl.planner.hardware.GPUS` key of this machine's CUDA device 0, or None."""
    import torch

    from gpu_check import gpu_key   # perf/, beside this file

    return gpu_key(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else None


def device_count(cfg, on_gpu: bool) -> int:
    """Devices the run used (see the module docstring)."""
    if not on_gpu or cfg.rollout.placement == "colocated":
        return cfg.topology.world_size
    return cfg.topology.world_size + (cfg.rollout.dp or 1) * cfg.rollout.tp


def step_flops(dims, cfg, samples: float, mean_len: float) -> tuple[float, float]:
    """(model FLOPs of a whole step, of its train phase) for ``samples`` sequences of ``mean_len``."""
    from megarl.planner.flops import flops_per_token

    length = max(1, round(mean_len))
    fwd = samples * length * flops_per_token(dims, length, training=False)
    train = samples * length * flops_per_token(dims, length, training=True) * cfg.algorithm.ppo_epochs
    from megarl.config.passes import needs_old_logprob_pass

    logprob_passes = int(needs_old_logprob_pass(cfg)) + (cfg.algorithm.kl_coef > 0)
    return fwd * (1 + logprob_passes) + train, train


def summarise(run_dir: Path, gpu: str | None, label: str = "", recipe: str | None = None) -> dict:
    """The benchmark row of a finished run (its config.yaml and metrics.jsonl)."""
    from megarl.config import load_config
    from megarl.config.loader import model_hf_config
    from megarl.models.dims import ModelDims
    from megarl.planner.hardware import get_gpu

    cfg = load_config(run_dir / "config.yaml", check_model=False)
    rows = sorted(read_metrics(run_dir), key=lambda r: r["step"])
    steady = [r for r in rows if r["step"] > 1]
    if not steady:
        raise ValueError(f"{run_dir}: steps {[r['step'] for r in rows]} in metrics.jsonl; the benchmark skips "
                         "step 1 (warm-up), so it needs at least 2 (trainer.steps >= 2)")
    for r in steady:
        missing = [k for k in (*PHASES.values(), "throughput/tokens_per_s", "rollout/num_samples",
                               "response_length/mean") if k not in r]
        if missing:
            raise ValueError(f"{run_dir}/metrics.jsonl step {r['step']} has no {', '.join(missing)} (did it fail?)")
    n = len(steady)
    mean = lambda xs: sum(xs) / n   # noqa: E731
    phase_s = [sum(v for k, v in r.items() if k.startswith("time/")) for r in steady]
    tokens = [r["throughput/tokens_per_s"] * s for r, s in zip(steady, phase_s)]   # the loop's own division
    step_s = [r.get("timeline/step_s", s) for r, s in zip(steady, phase_s)]
    gpus = device_count(cfg, gpu is not None)
    row = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "recipe": recipe or f"(run {run_dir.name})",
           "label": label, "run_dir": str(run_dir), "device": gpu or "cpu", "gpus": gpus, "mode": cfg.trainer.mode,
           "steps": len(rows), "steady_steps": f"{steady[0]['step']}-{steady[-1]['step']}",
           "step_s": mean(step_s), "tokens_per_step": mean(tokens),
           "tokens_per_s_per_gpu": sum(tokens) / sum(step_s) / gpus}
    row.update({name: mean([r[key] for r in steady]) for name, key in PHASES.items()})
    row["score_s"] = mean([r.get("time/score_s", 0.0) for r in steady])
    samples = mean([r["rollout/num_samples"] for r in steady])
    row["mean_response_length"] = mean([r["response_length/mean"] for r in steady])
    row["mean_sequence_length"] = row["tokens_per_step"] / samples
    hf = model_hf_config(cfg.model.path)
    row["mfu"] = row["mfu_train"] = None
    if gpu is not None and hf is not None:
        peak = get_gpu(gpu).bf16_tflops * 1e12
        total, train = step_flops(ModelDims.from_hf(hf), cfg, samples, row["mean_sequence_length"])
        row["mfu"] = total / (row["step_s"] * gpus * peak)
        row["mfu_train"] = train / (row["train_s"] * gpus * peak)
    return row


def _cell(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 1 else f"{value:.1f}"
    return str(value)


def markdown_table(rows: list[dict]) -> str:
    head = "| " + " | ".join(title for _, title in COLUMNS) + " |"
    rule = "|" + "---|" * len(COLUMNS)
    return "\n".join([head, rule] + ["| " + " | ".join(_cell(r.get(k)) for k, _ in COLUMNS) + " |" for r in rows])


def write_results(row: dict, results: Path) -> None:
    """Append the row to the JSONL file and rewrite the markdown table beside it from all rows."""
    results.parent.mkdir(parents=True, exist_ok=True)
    with results.open("a") as f:
        f.write(json.dumps(row) + "\n")
    rows = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    intro = ("# GRPO benchmark rows (perf/bench_grpo.py)\n\nOne row per benchmark run, appended; averages over the "
             "steps named in 'steps averaged' (step 1, the warm-up, is skipped). Columns and how each is measured: "
             "the docstring of perf/bench_grpo.py. MFU is n/a on CPU.\n\n")
    results.with_suffix(".md").write_text(intro + markdown_table(rows) + "\n")


def run_training(recipe: str, overrides: list[str], steps: int, run_dir: Path) -> None:
    cmd = [sys.executable, "-m", "megarl.cli", "train", recipe, *overrides, f"trainer.steps={steps}",
           f"trainer.run_dir={run_dir}"]
    print("bench_grpo: " + " ".join(cmd), flush=True)
    rc = subprocess.call(cmd, cwd=ROOT)
    if rc != 0:
        raise SystemExit(f"bench_grpo: `megarl train` exited with {rc}; no row written (see {run_dir / 'logs'})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recipe", nargs="?", help="recipe YAML (omit with --from-run)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides for megarl train")
    ap.add_argument("--steps", type=int, default=5, help="steps to run (>= 2: step 1 is not averaged)")
    ap.add_argument("--run-dir", type=Path, help="run directory (default runs/bench_grpo/<recipe>-<time>)")
    ap.add_argument("--from-run", type=Path, help="summarise this finished run instead of training")
    ap.add_argument("--gpu", help="GPU type for MFU (a megarl.planner.hardware.GPUS key); default: detected, "
                                  "none on CPU")
    ap.add_argument("--label", default="", help="free text for the row (e.g. the commit)")
    ap.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="JSONL file the row is appended to")
    args = ap.parse_args(argv)
    if args.recipe is None and args.from_run is None:
        ap.error("give a RECIPE to run, or --from-run RUN_DIR to summarise (a RECIPE given with it only names the row)")
    if args.steps < 2:
        ap.error(f"--steps={args.steps}: at least 2 (step 1 is the warm-up and is not averaged)")
    gpu = args.gpu or detect_gpu()
    recipe = " ".join([args.recipe, *args.overrides]) if args.recipe else None
    if args.from_run is not None:
        run_dir = args.from_run
    else:
        stem = Path(args.recipe).stem
        run_dir = args.run_dir or ROOT / "runs" / "bench_grpo" / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"
        run_training(args.recipe, args.overrides, args.steps, run_dir)
    row = summarise(run_dir, gpu, args.label, recipe)
    write_results(row, args.results)
    print(markdown_table([row]))
    finite = all(math.isfinite(row[k]) for k in ("step_s", "tokens_per_s_per_gpu", *PHASES))
    return 0 if finite else 1


if __name__ == "__main__":
    sys.exit(main())
