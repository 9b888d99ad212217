"""``megarl sft``, ``megarl rm`` and ``megarl dpo``: supervised fine-tuning, Bradley-Terry
reward-model training and direct preference optimisation (against a frozen reference on the same
ranks) on the RL trainer's engine (the same workers, packing, balancing, parallelism, checkpoints,
metrics and progress line), without a rollout fleet.

    dpo:       (posttrain.dpo.reference=precomputed) the reference's log-probs of every pair
    step 0:    the held-out loss of the starting model (a fresh run)
    for step:  the step's examples (epochs shuffled by data.seed) -> packed micro-batches balanced
               over DP ranks (pairs kept whole) -> one optimizer step -> metrics
               -> (held-out loss every posttrain.eval_every) -> (checkpoint) -> (HF folder,
               checkpoint.hf_export_every)
    end:       held-out loss, then the HF export (posttrain.export_dir)

The data is read, checked and tokenised on the driver before any worker starts
(:mod:`megarl.posttrain.data`). Resume (``--resume`` / ``checkpoint.resume``) continues at the
step after the newest intact checkpoint: a step's examples are a function of (seed, step).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import time
from pathlib import Path

from megarl.data.packing import trim_pads
from megarl.posttrain.data import DataError, Examples

STAGES = {"sft": "sft", "rm": "pairs", "dpo": "pairs"}


def load_stage_data(cfg, stage: str, tokenizer) -> tuple[Examples, Examples | None]:
    """(train, held-out) examples of ``cfg.posttrain`` for ``stage`` (DataError on a bad row)."""
    from megarl.posttrain.data import builtin_rows, load_examples, split_eval

    p, kind = cfg.posttrain, STAGES[stage]
    want = "builtin:arithmetic_sft" if kind == "sft" else "builtin:arithmetic_prefs"

    def load(path: str) -> Examples:
        rows = None
        if path.startswith("builtin:"):
            if path != want:
                raise DataError(f"posttrain.train_file={path!r}: megarl {stage} reads "
                                f"{'SFT rows' if kind == 'sft' else 'preference pairs'}; the built-in set is {want}")
            rows = builtin_rows(path, p.num_examples, cfg.data.difficulty, cfg.data.seed)
        return load_examples(path, kind, tokenizer, use_chat_template=cfg.data.use_chat_template,
                             max_seq_tokens=p.max_seq_tokens, on_bad_row=cfg.data.on_bad_row, rows=rows)

    train = load(p.train_file)
    if p.eval_file:
        held = load(p.eval_file)
    elif p.eval_fraction > 0:
        train, held = split_eval(train, p.eval_fraction, cfg.data.seed)
    else:
        held = None
    if len(train) < p.batch_size:
        raise DataError(f"{p.train_file}: {len(train)} training examples < posttrain.batch_size={p.batch_size}")
    return train, held


def stage_steps(cfg, num_train: int) -> int:
    """Optimizer steps of a stage: ``posttrain.epochs`` x (rows // batch_size), capped by
    ``posttrain.max_steps``."""
    from megarl.posttrain.data import steps_per_epoch

    p = cfg.posttrain
    return int(min(p.epochs * steps_per_epoch(num_train, p.batch_size), p.max_steps or math.inf))


def stage_options(cfg, stage: str) -> dict:
    """The loss options of ``stage`` (:func:`megarl.algorithms.posttrain.make_loss_fn`)."""
    if stage == "dpo":
        d = cfg.posttrain.dpo
        return {"beta": d.beta, "loss": d.loss, "label_smoothing": d.label_smoothing, "sft_weight": d.sft_weight}
    return {"loss_agg": cfg.posttrain.loss_agg} if stage == "sft" else {"use_margin": cfg.posttrain.margin}


def micro_batches(examples: Examples, indices: list, plan, dp_rank: int, pad_id=None, reference=None) -> list:
    """The ``SequenceBatch`` list of one DP rank: plan entries are positions in ``indices``; a
    pair's two sequences are adjacent (chosen, rejected) and its margin is in ``margin_P``;
    ``reference`` (``[pairs, 2]``, by example): the reference's precomputed response log-probs,
    in ``ref_logps_N``."""
    import torch

    from megarl.policy import SequenceBatch

    out = []
    for entry in plan.micro_batches[dp_rank]:
        chosen = [indices[j] for j in entry]
        seqs, prompts = examples.sequences(chosen)
        if examples.kind == "pairs":
            seqs = [trim_pads(s, p, pad_id) for s, p in zip(seqs, prompts)]
        extras = {"margin_P": torch.tensor([examples.margins[i] for i in chosen], dtype=torch.float32)} \
            if examples.kind == "pairs" else {}
        if reference is not None:
            extras["ref_logps_N"] = reference[chosen].reshape(-1)
        out.append(SequenceBatch([torch.tensor(s, dtype=torch.long) for s in seqs], prompts, extras))
    return out


def _plan(group, examples: Examples, indices: list):
    """The data plane's plan (:func:`megarl.data.plan_batches`) of the examples ``indices`` on
    their lengths: a pair is one unit, so its two sequences share a micro-batch."""
    from megarl.data import plan_batches

    topo = group.ranks.cfg.topology.to_topology()
    return plan_batches([examples.length(i, topo.tp, topo.cp) for i in indices], topo, group.ranks.budget)


def _rank_batches(group, examples: Examples, indices: list, pad_id, reference=None) -> list:
    """Every rank's micro-batches of the examples ``indices`` (:func:`_plan`)."""
    plan = _plan(group, examples, indices)
    return [micro_batches(examples, indices, plan, info.dp_rank, pad_id, reference) for info in group.ranks.infos]


def reference_table(group, examples: Examples, chunk: int):
    """``[pairs, 2]`` float64: the frozen reference's response log-prob of every pair's chosen and
    rejected sequence, computed on the training ranks ``chunk`` pairs a call."""
    import torch

    table = torch.full((len(examples), 2), float("nan"), dtype=torch.float64)
    for first in range(0, len(examples), chunk):
        indices = list(range(first, min(len(examples), first + chunk)))
        plan = _plan(group, examples, indices)
        batches = [micro_batches(examples, indices, plan, info.dp_rank) for info in group.ranks.infos]
        for info, sums in zip(group.ranks.infos, group.reference_logps(batches)):
            if sums is not None:   # the DP leaders'
                for entry, s in zip(plan.micro_batches[info.dp_rank], sums):
                    table[[indices[j] for j in entry]] = s.view(-1, 2)
    if torch.isnan(table).any():
        raise RuntimeError(f"no reference log-probs came back for {int(torch.isnan(table[:, 0]).sum())} pairs")
    return table


def run_stage(cfg, stage: str, resume: bool = False, verbose: bool = False) -> Path:
    """Train ``stage`` ('sft', 'rm' or 'dpo') as ``cfg`` says; returns the HF export's folder."""
    from transformers import AutoTokenizer

    from megarl.config import save_resolved
    from megarl.models.fixtures import resolve_model_path
    from megarl.models.seqcls import pad_token_id
    from megarl.observability.console import run_console
    from megarl.observability.metrics import open_metrics
    from megarl.posttrain.data import step_indices, steps_per_epoch
    from megarl.algorithms.posttrain import summarize
    from megarl.driver.checkpoint import CheckpointManager
    from megarl.driver.interrupt import RunInterrupted, StopRequest
    from megarl.driver.loop import _release, export_hf_step, precision_line
    from megarl.actors.group import WorkerGroup

    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; expected one of {sorted(STAGES)}")
    if stage == "rm" and cfg.model.lora.rank:
        from megarl.config.errors import invalid_value

        raise invalid_value("model.lora.rank", cfg.model.lora.rank, "0 for megarl rm (a reward model trains its "
                            "score head, which LoRA would freeze; LoRA serves megarl train and megarl sft)")
    p = cfg.posttrain
    run_dir = Path(cfg.trainer.run_dir)
    export_dir = Path(p.export_dir or run_dir / "hf")
    model_dir = resolve_model_path(cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    t0 = time.time()
    train, held = load_stage_data(cfg, stage, tokenizer)   # before any process starts: a bad row stops here
    load_s = time.time() - t0
    save_resolved(cfg, run_dir)
    per_epoch = steps_per_epoch(len(train), p.batch_size)
    total = stage_steps(cfg, len(train))
    # the workers' LR schedule spans trainer.steps (warm-up, then decay to trainer.min_lr): the stage's steps
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, steps=total))
    # the rm stage scores at the last token before trailing pads: the pad its export's config names
    # (dpo reads every response token's log-prob, as sft does: nothing is trimmed)
    pad_id = pad_token_id(json.loads((Path(model_dir) / "config.json").read_text())) if stage == "rm" else None
    options = stage_options(cfg, stage)
    log = logging.getLogger("megarl")
    with contextlib.ExitStack() as cleanup:
        console = cleanup.enter_context(run_console(run_dir / "logs", cfg.logging.level, verbose))
        stop = cleanup.enter_context(StopRequest(console))
        unit = "sequences" if stage == "sft" else "pairs"
        log.info(f"megarl {stage}: {len(train)} training {unit}, {len(held) if held else 0} held out "
                 f"(read and tokenised in {load_s:.1f} s"
                 + (f"; skipped {sum(train.skipped.values())} bad rows: {dict(train.skipped)}" if train.skipped else "")
                 + f"); {total} steps of {p.batch_size} ({per_epoch} per epoch)")
        group = WorkerGroup(cfg, None if verbose else run_dir / "logs", verbose, stage=stage)
        cleanup.callback(_release, group, stop)
        stop.arm()
        precision = precision_line(group.precision(), cfg).split("; vLLM")[0]
        log.info(precision)
        ckpt = CheckpointManager(cfg.checkpoint.dir or run_dir / "checkpoints", cfg.checkpoint.keep_last)
        start = 0
        if (resume or cfg.checkpoint.resume) and \
                (found := ckpt.newest_intact(group.load_checkpoint, group.hash_checkpoint_files)) is not None:
            start, folder = found
            log.info(f"resumed from {folder} (step {start})")
        ckpt.clean_partials()
        reference = {}   # {"train" | "held": [pairs, 2]} precomputed, else per batch
        if stage == "dpo" and p.dpo.reference == "precomputed":
            t = time.perf_counter()
            reference = {name: reference_table(group, ex, max(p.batch_size, 64))
                         for name, ex in (("train", train), ("held", held)) if ex is not None}
            group.release_reference()
            log.info(f"the reference's log-probs of {sum(len(r) for r in reference.values())} pairs precomputed in "
                     f"{time.perf_counter() - t:.1f} s; a separate reference model is released")
        metrics = cleanup.enter_context(open_metrics(cfg, run_dir, total_steps=total, start=start, stream=console))
        metrics.add_text("precision", precision, start + 1)

        def evaluate() -> dict:
            if held is None:
                return {}
            t = time.perf_counter()
            sums = group.posttrain_eval(_rank_batches(group, held, list(range(len(held))), pad_id,
                                                      reference.get("held")), options)
            return {**summarize(stage, sums, "eval"), "time/eval_s": time.perf_counter() - t}

        if start == 0 and held is not None:   # the starting point: step 0's held-out loss
            metrics.progress_line(0, "eval")
            with metrics.step(0) as m:
                m.update(evaluate())
        stop.last_step = start
        for step in range(start + 1, total + 1):
            if stop.requested:
                break
            with metrics.step(step) as m:
                stop.step, stop.phase = step, "train"
                metrics.progress_line(step, "train")
                t = time.perf_counter()
                epoch, indices = step_indices(len(train), p.batch_size, step, cfg.data.seed)
                out = group.posttrain_step(_rank_batches(group, train, indices, pad_id, reference.get("train")),
                                           options)
                m.update(summarize(stage, out, "train"), **{"train/loss": out["loss"]})
                m.update({"train/grad_norm": out["grad_norm"], "train/lr": out["lr"], "train/epoch": epoch + 1,
                          "train/tokens": out["num_tokens"], "train/skipped_updates": int(not out["update_successful"]),
                          "time/train_s": time.perf_counter() - t})
                m["throughput/tokens_per_s"] = out["num_tokens"] / max(1e-9, m["time/train_s"])
                if step == total or (p.eval_every and step % p.eval_every == 0):
                    metrics.progress_line(step, "eval")
                    m.update(evaluate())
            stop.last_step = step
            if cfg.checkpoint.save_every and (step % cfg.checkpoint.save_every == 0 or step == total):
                group.save_checkpoint(ckpt, step, {"stage": stage})
            if (every := cfg.checkpoint.hf_export_every) and (step % every == 0 or step == total):
                export_hf_step(group, ckpt.root, step, cfg.checkpoint.keep_last)
        if stop.requested and stop.last_step < total:
            done = stop.last_step
            if cfg.checkpoint.save_on_interrupt and done > start and done not in dict(ckpt.complete()):
                group.save_checkpoint(ckpt, done, {"stage": stage})
            raise RunInterrupted(stop.signum, done, hard=False)
        t = time.perf_counter()
        group.export_hf(export_dir)
        log.info(f"exported the {'reward model' if stage == 'rm' else 'model'} to {export_dir} "
                 f"({time.perf_counter() - t:.1f} s)")
    return export_dir
