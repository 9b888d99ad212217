"""The ``megarl`` command line. Heavy libraries are imported inside each subcommand.

    megarl fixtures [NAME ...] [--rebuild] [--verify]   build offline model fixtures
    megarl config [RECIPE] [key=value ...]             validate, print and save a resolved config
    megarl generate [RECIPE] [key=value ...]           sample from the model with vLLM
    megarl plot RUN_DIR                                PNG curves and timeline of a run
    megarl train [RECIPE] [key=value ...] [--resume]   RL training (GRPO by default) on Ray
    megarl sft [RECIPE] [key=value ...] [--resume]     supervised fine-tuning on the same engine
    megarl rm [RECIPE] [key=value ...] [--resume]      a Bradley-Terry reward model on the same engine
    megarl data NAME OUT [--num-examples N]           write a built-in SFT / preference set
    megarl convert {hf-to-megatron,megatron-to-hf,verify} ...   checkpoint conversion (one process;
                                                       use torchrun conversion/*.py for several)
    megarl checkpoint verify DIR                       check training checkpoints against their manifests
    megarl plan RECIPE [key=value ...]                 memory and step time of a recipe: no GPU, no weights
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def _cmd_fixtures(args) -> int:
    from megarl.models import fixtures

    names = args.names or list(fixtures.FIXTURES)
    for name in names:
        t0 = time.time()
        path = fixtures.ensure_fixture(name, rebuild=args.rebuild)
        print(f"{name:18s} {path}  ({time.time() - t0:.1f}s)", flush=True)
    if args.verify and "smollm2" in names:
        diff = fixtures.verify_smollm2()
        print(f"smollm2: max |logits(HF folder) - logits(GGUF)| = {diff:.3e}")
        if diff != 0.0:
            print("error: the HF folder does not reproduce the GGUF model", file=sys.stderr)
            return 1
    return 0


def _preflight(args, cfg, command: str) -> None:
    """:mod:`megarl.preflight`'s checks of data, model shapes and output folders (before anything
    starts; a failure is a ConfigError), unless ``--no-preflight``; warnings go to stderr."""
    if args.no_preflight:
        return
    from megarl.preflight import preflight

    for warning in preflight(cfg, command):
        print(f"megarl: warning: {warning}", file=sys.stderr)


_NO_PREFLIGHT = "skip the preflight checks of data files, model shapes and output folders (megarl/preflight.py)"


def _cmd_config(args) -> int:
    from megarl.config import load_config, save_resolved, to_yaml
    from megarl.config.docs import describe

    if args.describe:
        print(describe())
        return 0
    cfg = load_config(args.recipe, args.overrides)
    _preflight(args, cfg, "config")
    print(to_yaml(cfg), end="")
    if args.save:
        print(f"# written to {save_resolved(cfg, cfg.trainer.run_dir)}")
    return 0


def _cmd_generate(args) -> int:
    """Samples of the configured model for the task's held-out prompts (or ``--prompt``s), with
    the training run's chat template, sampling settings and reward (:mod:`megarl.driver.rollouts`)."""
    import logging
    from pathlib import Path

    from megarl.config import load_config, save_resolved
    from megarl.observability.console import run_console

    cfg = load_config(args.recipe, args.overrides)
    _preflight(args, cfg, "generate")
    run_dir = Path(cfg.trainer.run_dir)
    save_resolved(cfg, run_dir)
    with run_console(run_dir / "logs", cfg.logging.level, args.verbose):
        log = logging.getLogger("megarl")
        from megarl.models.fixtures import resolve_model_path
        from megarl.rewards import RewardPool
        from megarl.rollout.build import make_rollout_llm
        from megarl.rollout.sampling import sample
        from megarl.rollout.vllm_engine import shutdown_llm
        from megarl.tasks import PromptRecord
        from megarl.driver.rollouts import Rollouts

        t0 = time.time()
        model_dir = resolve_model_path(cfg.model.path)
        log.info(f"model: {cfg.model.path} -> {model_dir} ({time.time() - t0:.1f}s)")
        t0 = time.time()
        llm = make_rollout_llm(cfg, model_dir)
        start_s = time.time() - t0
        try:
            rollouts = Rollouts(cfg, lambda ids, seeds, greedy, on_done=None: sample(llm, cfg.rollout, ids, seeds,
                                                                                     greedy))
            records = [PromptRecord(p, answer="", data_source="cli") for p in args.prompt] if args.prompt else \
                rollouts.prompts.eval_batch(args.num_prompts)
            t0 = time.time()
            rollout = rollouts.generate(0, records)
            gen_s = time.time() - t0
        finally:
            shutdown_llm(llm)
        scored = {}
        if not args.prompt:
            with RewardPool(num_workers=1, timeout_s=cfg.data.reward_timeout_s) as pool:
                scored = rollouts.score(rollout, pool)
        texts = rollouts.decode(rollout)
        with open(run_dir / "generations.jsonl", "w") as fh:
            for i, text in enumerate(texts):
                rec = records[rollout.group_ids[i]]
                fh.write(json.dumps({"prompt": rec.prompt, "answer": rec.answer or None, "response": text,
                                     "num_tokens": rollout.response_length(i),
                                     "cumulative_logprob": sum(rollout.sample_logprobs[i]),
                                     "reward": rollout.rewards[i] if scored else None}) + "\n")
                if i % cfg.rollout.n == 0:
                    log.info(f"--- {rec.prompt!r}\n>>> {text.strip()[:300]!r}")
        if scored:
            log.info(f"reward ({cfg.data.reward}): mean {sum(rollout.rewards) / len(rollout):.3f} over "
                     f"{len(rollout)} samples ({scored['reward/errors']} errors, {scored['reward/timeouts']} timeouts)")
        num_tokens = sum(rollout.response_lengths())
        log.info(f"engine start {start_s:.1f}s; generated {num_tokens} tokens for {len(records)} prompts x "
                 f"n={cfg.rollout.n} in {gen_s:.1f}s ({num_tokens / max(gen_s, 1e-9):.0f} tok/s); "
                 f"written to {run_dir}/generations.jsonl")
    return 0


def _cmd_train(args) -> int:
    """RL training (:func:`_run_guarded`'s exit codes)."""
    from megarl.config import load_config

    cfg = load_config(args.recipe, args.overrides)
    _preflight(args, cfg, "train")
    from megarl.driver.loop import train   # imports torch (seconds): only once the checks passed

    return _run_guarded(args, cfg, lambda: train(cfg, resume=args.resume, verbose=args.verbose),
                        lambda run_dir: f"run finished: {run_dir}/metrics.jsonl (megarl plot {run_dir})")


def _cmd_stage(args) -> int:
    """``megarl sft`` / ``rm`` / ``dpo`` (:mod:`megarl.posttrain.run`; :func:`_run_guarded`'s exit
    codes, a bad data row is a 2 before any process starts)."""
    from megarl.config import load_config

    cfg = load_config(args.recipe, args.overrides)
    _preflight(args, cfg, args.command)
    from megarl.posttrain.run import run_stage

    use = "data.reward=model:{}" if args.command == "rm" else "model.path"
    return _run_guarded(args, cfg, lambda: run_stage(cfg, args.command, resume=args.resume, verbose=args.verbose),
                        lambda export: f"{args.command} finished: {cfg.trainer.run_dir}/metrics.jsonl; the model: "
                                       f"{export} ({use.format(export)})")


def _run_guarded(args, cfg, run, finished) -> int:
    """``run()``, and ``finished(its result)`` printed. A run that stops early ends with one line:
    what stopped it and where it can resume from. Exit code 128 + the signal's number (130 SIGINT,
    143 SIGTERM), 1 for an error (its traceback is in <run_dir>/logs/driver.log, on the terminal
    with --verbose), 2 for a config or data error."""
    import signal
    import traceback
    from pathlib import Path

    from megarl.config.errors import ConfigError
    from megarl.posttrain.data import DataError
    from megarl.checkpoint_files import describe_error   # torch-free
    from megarl.driver.interrupt import RunInterrupted

    try:
        result = run()
    except DataError as err:
        print(f"megarl: data error: {err}", file=sys.stderr)
        return 2
    except RunInterrupted as stop:
        print(_resume_line(str(stop), cfg, args), file=sys.stderr)
        return stop.exit_code
    except KeyboardInterrupt:   # SIGINT during start-up, before the run's own handlers
        print(_resume_line("stopped by SIGINT during start-up", cfg, args), file=sys.stderr)
        return 128 + signal.SIGINT
    except SystemExit as exc:   # SIGTERM during start-up: ray.init's handler calls sys.exit(signum)
        if exc.code != signal.SIGTERM:
            raise
        print(_resume_line("stopped by SIGTERM during start-up", cfg, args), file=sys.stderr)
        return 128 + signal.SIGTERM
    except ConfigError:
        raise
    except Exception as err:
        driver_log = Path(cfg.trainer.run_dir) / "logs" / "driver.log"
        if args.verbose:
            traceback.print_exc()
        where = f" (traceback in {driver_log})" if not args.verbose and driver_log.exists() else ""
        print(_resume_line(f"error: {describe_error(err)}{where}", cfg, args), file=sys.stderr)
        return 1
    print(finished(result))
    return 0


def _resume_line(what: str, cfg, args) -> str:
    """``megarl: <what>``, then the run's newest complete checkpoint and the command that resumes
    from it (the recipe and overrides as given, plus --resume)."""
    import shlex
    from pathlib import Path

    from megarl.driver.checkpoint import CheckpointManager

    latest = CheckpointManager(cfg.checkpoint.dir or Path(cfg.trainer.run_dir) / "checkpoints").latest()
    if latest is None:
        return f"megarl: {what}; no checkpoint to resume from"
    command = shlex.join(["megarl", getattr(args, "command", "train"), *([args.recipe] if args.recipe else []),
                          *args.overrides, "--resume"])
    return f"megarl: {what}; resume from {latest[1]} (step {latest[0]}): {command}"


def _cmd_data(args) -> int:
    from megarl.posttrain.data import builtin_rows, write_rows

    rows = builtin_rows(f"builtin:{args.name}", args.num_examples, args.difficulty, args.seed)
    write_rows(rows, args.out)
    print(f"written {len(rows)} rows of builtin:{args.name} to {args.out}")
    return 0


_CONVERTERS = {"hf-to-megatron": "hf_to_megatron_main", "megatron-to-hf": "megatron_to_hf_main",
               "verify": "verify_main"}


def _cmd_convert(args) -> int:
    from megarl.conversion import cli as conversion_cli

    return getattr(conversion_cli, _CONVERTERS[args.what])(args.rest)


def _cmd_plot(args) -> int:
    from megarl.observability.plot import plot_run, plot_timeline

    print(f"written {plot_run(args.run_dir, args.out)}")
    timeline = plot_timeline(args.run_dir, last_steps=args.timeline_steps)
    if timeline is not None:
        print(f"written {timeline}")
    return 0


def _cmd_checkpoint(args) -> int:
    """One line per checkpoint of ``args.dir``; exit 0 when all are intact, 1 when any is damaged,
    2 when there is none (:mod:`megarl.driver.checkpoint`: torch-free, so this starts fast)."""
    from megarl.driver.checkpoint import CheckpointManager, find_checkpoints

    folders = find_checkpoints(args.dir)
    if not folders:
        print(f"megarl: no checkpoint in {args.dir} (expected a step_NNNNNNNN folder, a folder of them, "
              "or a run dir with checkpoints/)", file=sys.stderr)
        return 2
    damaged = 0
    for folder in folders:
        mgr = CheckpointManager(folder.parent)
        t0 = time.time()
        problems = mgr.verify(folder)
        seconds = time.time() - t0
        if problems:
            damaged += 1
            print(f"{folder}  DAMAGED  {'; '.join(problems)}", flush=True)
        elif (manifest := mgr.manifest(folder)) is None:
            print(f"{folder}  ok, unverified (no MANIFEST.json: written by an older megarl)", flush=True)
        else:
            num_bytes = sum(f["size"] for f in manifest["files"].values())
            print(f"{folder}  ok  {len(manifest['files'])} files, {num_bytes / 1e6:.1f} MB, checked in "
                  f"{seconds:.2f} s ({num_bytes / 1e6 / max(seconds, 1e-9):.0f} MB/s)", flush=True)
    return 1 if damaged else 0


def _cmd_plan(args) -> int:
    """Exit 0 when the recipe fits, 1 when it does not (each component over budget named) or a
    rank's model cannot be built, 2 for a config error (:mod:`megarl.planner.plan`)."""
    from megarl.config import load_config

    import warnings

    cfg = load_config(args.recipe, args.overrides)
    # megatron-core and mbridge warn about Apex, Transformer Engine and settings of a GPU run: not a plan's concern
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|cuda_graph_scope|fp32 routing).*")
    from megarl.planner.plan import PlanError, format_plan, make_plan   # imports torch and megatron-core

    t0 = time.time()
    try:
        plan = make_plan(cfg, args.recipe or "")
    except (PlanError, RuntimeError) as err:
        print(f"megarl plan: cannot plan {args.recipe}: {err}", file=sys.stderr)
        return 1
    print(format_plan(plan, cfg))
    print(f"(planned in {time.time() - t0:.1f} s)")
    if plan.problems:
        print("megarl plan: the recipe does not fit: " + "; ".join(plan.problems), file=sys.stderr)
        return 1
    return 0


def _cmd_samples(args) -> int:
    from megarl.observability.generations import main as samples

    return samples(args.run_dir, step=args.step, order=args.order, count=args.count)


def _cmd_doctor(args) -> int:
    from megarl.doctor import main as doctor

    return doctor(probe=not args.no_probe, run_dir=args.run_dir)


_VERBOSE = ("show Ray, vLLM, megatron and library output on the terminal (default: in "
            "<trainer.run_dir>/logs/, the terminal shows megarl's own lines only)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="megarl", description="Megatron-native RL post-training with vLLM rollout")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("fixtures", help="build offline model fixtures into ~/.cache/megarl")
    p.add_argument("names", nargs="*", help="fixture names (default: all)")
    p.add_argument("--rebuild", action="store_true", help="rebuild even if cached")
    p.add_argument("--verify", action="store_true", help="check SmolLM2's HF folder against the GGUF")
    p.set_defaults(func=_cmd_fixtures)

    p = sub.add_parser("config", help="validate a recipe with overrides and print the resolved config")
    p.add_argument("recipe", nargs="?", help="YAML recipe (default: built-in defaults)")
    p.add_argument("overrides", nargs="*", help="section.field=value")
    p.add_argument("--save", action="store_true", help="also write <trainer.run_dir>/config.yaml")
    p.add_argument("--describe", action="store_true", help="list every key with its default and docstring")
    p.add_argument("--no-preflight", action="store_true", help=_NO_PREFLIGHT)
    p.set_defaults(func=_cmd_config)

    p = sub.add_parser("generate", help="sample from the configured model with vLLM")
    p.add_argument("recipe", nargs="?")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable); default: task prompts")
    p.add_argument("--num-prompts", type=int, default=8, help="held-out task prompts when no --prompt")
    p.add_argument("--verbose", action="store_true", help=_VERBOSE)
    p.add_argument("--no-preflight", action="store_true", help=_NO_PREFLIGHT)
    p.set_defaults(func=_cmd_generate)

    for name, what, func in (
            ("train", "RL training: generate -> score -> train -> sync, on Ray workers", _cmd_train),
            ("sft", "supervised fine-tuning (posttrain.*): loss on response tokens, packed, every parallelism; exports "
                    "an HF folder", _cmd_stage),
            ("rm", "a Bradley-Terry reward model (posttrain.*) on preference pairs; exports an HF "
                   "*ForSequenceClassification folder", _cmd_stage),
            ("dpo", "direct preference optimisation (posttrain.dpo: DPO, IPO, cDPO) on preference pairs against the "
                    "frozen starting model; exports an HF folder", _cmd_stage)):
        p = sub.add_parser(name, help=what)
        p.add_argument("recipe", nargs="?")
        p.add_argument("overrides", nargs="*")
        p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
        p.add_argument("--verbose", action="store_true", help=_VERBOSE)
        p.add_argument("--no-preflight", action="store_true", help=_NO_PREFLIGHT)
        p.set_defaults(func=func)

    p = sub.add_parser("data", help="write a built-in data set (arithmetic SFT rows or preference pairs) to a file")
    p.add_argument("name", choices=["arithmetic_sft", "arithmetic_prefs"])
    p.add_argument("out", help="a .jsonl or .parquet path")
    p.add_argument("--num-examples", type=int, default=2000)
    p.add_argument("--difficulty", type=int, default=2, help="the arithmetic level (data.difficulty, >= 2)")
    p.add_argument("--seed", type=int, default=0, help="data.seed")
    p.set_defaults(func=_cmd_data)

    p = sub.add_parser("convert", help="HF <-> Megatron distributed checkpoint conversion and verification")
    p.add_argument("what", choices=sorted(_CONVERTERS))
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of the converter (see --help)")
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser("plot", help="write PNG curves (reward, length, KL, phase times) and the timeline of a run")
    p.add_argument("run_dir")
    p.add_argument("--out", help="PNG path (default: <run_dir>/curves.png)")
    p.add_argument("--timeline-steps", type=int, default=20,
                   help="the last steps drawn in <run_dir>/timeline.png (default 20)")
    p.set_defaults(func=_cmd_plot)

    p = sub.add_parser("plan", help="memory per device and step time of a recipe (no GPU, no weights)")
    p.add_argument("recipe", help="YAML recipe")
    p.add_argument("overrides", nargs="*", help="section.field=value")
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser("checkpoint", help="check training checkpoints (files, sizes, checksums)")
    p.add_argument("action", choices=["verify"])
    p.add_argument("dir", help="a checkpoint folder, a folder of step_* checkpoints, or a run dir")
    p.set_defaults(func=_cmd_checkpoint)

    p = sub.add_parser("samples", help="print a run's decoded samples (generations.jsonl): prompt, response or agent "
                                       "turns, reward, length, version gap")
    p.add_argument("run_dir")
    p.add_argument("--step", type=int, help="the step (default: the last one written)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--best", dest="order", action="store_const", const="best", help="highest reward first")
    which.add_argument("--worst", dest="order", action="store_const", const="worst", help="lowest reward first")
    p.add_argument("-n", type=int, dest="count", help="at most this many samples")
    p.set_defaults(func=_cmd_samples)

    p = sub.add_parser("doctor", help="report the environment: packages, CPU and bf16 probe, GPUs, Slurm, sandbox, disk, "
                                      "fixtures (ok / warning / missing with the fix)")
    p.add_argument("--no-probe", action="store_true", help="skip the sub-second bf16 / fp32 matmul probe")
    p.add_argument("--run-dir", default="runs", help="the folder whose free disk to report (default: runs)")
    p.set_defaults(func=_cmd_doctor)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    # A recipe-less call may put an override where argparse expects the recipe.
    if getattr(args, "recipe", None) and "=" in args.recipe and not args.recipe.endswith((".yaml", ".yml")):
        args.overrides = [args.recipe] + list(args.overrides)
        args.recipe = None
    from megarl.config.errors import ConfigError

    try:
        return args.func(args) or 0
    except ConfigError as err:
        print(f"megarl: config error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:   # Ctrl-C outside a training run (which ends with its own line)
        print(f"megarl: {args.command} interrupted (SIGINT)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
