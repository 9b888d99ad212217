"""The RL controller: a single driver that runs the loop over Ray HybridWorkers.

    for step:  generate -> score -> (reward model) -> old/ref log-probs (and critic values) -> advantages
               -> (rollout correction) -> (critic update) -> policy update -> weight sync -> metrics
               -> (eval) -> (checkpoint)

This module owns the order of a step (:class:`StepRunner`) and the run's life (:func:`train`).
Everything the loop calls lives elsewhere (rollout side, worker group, batch helpers, algorithms,
rewards, data plane); where the samples come from and when the weights reach the engines is
``trainer.mode``'s (:mod:`megarl.driver.modes`), and the rest of the step is the same in every mode.

Choices: on success, error or interrupt alike the run releases what it started through one
ExitStack (reward workers, metrics sinks, vLLM engines, Ray actors, Ray); with one update per
step the old log-prob pass is skipped (:mod:`megarl.actors.step`); prompts and vLLM sampling
seeds are functions of (seed, step), so a run resumed from step k's checkpoint repeats steps
k+1.. of an uninterrupted run. SIGINT/SIGTERM stop the run at the next safe point
(:mod:`megarl.driver.interrupt`).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from megarl.config.schema import MegaRLConfig
from megarl.actors.step import StepHooks
from megarl.data.batch import Rollout, critic_metrics
from megarl.driver.interrupt import RunInterrupted, StepAbandoned, StopRequest

HARD_STOP_WAIT_S = 5.0
"""After a second signal: how long the actors' own shutdown (their vLLM engines) may take before
they are killed (an actor busy in a phase would otherwise be waited for)."""


class WeightSyncAlarm(RuntimeError):
    """vLLM's sampling log-probs and Megatron's recomputed ones disagree: weights out of sync.
    Raised before the step's update when the step runs the old log-prob pass, else after it (the
    update's own forward is then the comparison; see the module docstring); always before the
    step's weight sync and checkpoint."""

    def __init__(self, message: str, metrics: dict | None = None):
        super().__init__(message)
        self.metrics = metrics or {}
        """The differences that raised it (written as the failed step's metrics)."""


HF_EXPORT_PREFIX = "hf_step_"
"""``checkpoint.hf_export_every``'s folders, beside the checkpoints: ``hf_step_<8-digit step>``."""
LORA_EXPORT = "export"
"""Where a LoRA run writes its policy at the end, under the run folder: an HF folder of the merged
weights and, in ``adapter/``, the PEFT adapter (:meth:`megarl.actors.roles.PolicyRole.export_hf`)."""


def train(cfg: MegaRLConfig, resume: bool = False, verbose: bool = False,
          after_sync: Optional[Callable] = None, group=None) -> Path:
    """Run ``cfg``; ``verbose`` shows third-party output on the terminal instead of
    <run_dir>/logs/. ``after_sync(group, step)``, when given, runs after each step's weight sync
    (e.g. to probe the engines; :class:`megarl.actors.group.WorkerGroup`). On any exception
    too, the failed step's metrics so far are written and the reward workers, vLLM engines, Ray
    actors and (when started here) Ray are stopped. On SIGINT/SIGTERM the run stops at the next
    safe point, writes a checkpoint of the last completed step when it has none
    (``checkpoint.save_on_interrupt``) and raises :class:`RunInterrupted` once everything is
    released; a second signal stops it at once.

    ``group``: an existing :class:`megarl.actors.group.WorkerGroup` to run on instead of
    starting one (:meth:`WorkerGroup.reuse_for` checks it fits ``cfg``); it is neither released
    nor shut down here, also on error: its owner does that."""
    from megarl.config import save_resolved

    run_dir = Path(cfg.trainer.run_dir)
    save_resolved(cfg, run_dir)
    megarl_log = logging.getLogger("megarl")
    with contextlib.ExitStack() as cleanup:   # unwinds in reverse order, on success, error and interrupt
        run = start_run(cfg, cleanup, resume, verbose, after_sync, group)
        steps, stop = run.steps, run.steps.stop
        stop.last_step = run.start
        steps.window_start = time.monotonic()   # a step's timeline window starts where the last one ended
        for step in range(run.start + 1, cfg.trainer.steps + 1):
            if stop.requested:                                 # safe point between steps
                break
            kl_at_start = steps.kl_ctl.value
            try:
                with steps.log.step(step) as m:                # written also if the step raises
                    steps.run(step, m)
            except StepAbandoned as abandoned:
                steps.kl_ctl.value = kl_at_start               # its KL update belongs to the abandoned step
                megarl_log.info(str(abandoned))
                break
            stop.last_step = step
            if cfg.checkpoint.save_every and (step % cfg.checkpoint.save_every == 0 or step == cfg.trainer.steps):
                run.save(step)
            every = cfg.checkpoint.hf_export_every
            if every and (step % every == 0 or step == cfg.trainer.steps):
                export_hf_step(run.steps.group, run.ckpt.root, step, cfg.checkpoint.keep_last)
        if cfg.model.lora.rank and stop.last_step == cfg.trainer.steps:   # the trained LoRA policy, for serving
            t = time.perf_counter()
            run.steps.group.export_hf(run_dir / LORA_EXPORT)
            megarl_log.info(f"exported the policy to {run_dir / LORA_EXPORT} (merged weights; the PEFT adapter in "
                            f"adapter/) in {time.perf_counter() - t:.1f} s")
        if stop.requested and (done := stop.last_step) < cfg.trainer.steps:
            megarl_log.info(f"stopping after step {done} (interrupt)")
            stop.step, stop.phase = 0, "checkpoint and shutdown"
            if cfg.checkpoint.save_on_interrupt and done > 0 and done not in dict(run.ckpt.complete()):
                megarl_log.info(f"writing the checkpoint of step {done} (checkpoint.save_on_interrupt)")
                run.save(done)
            raise RunInterrupted(stop.signum, done, hard=False)
    return run_dir


@dataclass
class Run:
    """What :func:`train` loops over: the step runner with the run's parts, the checkpoint
    manager and the step the run starts after (0, or the resumed checkpoint's)."""

    steps: "StepRunner"
    ckpt: object
    start: int

    def save(self, step: int) -> None:
        """The checkpoint of ``step``: the workers' shards, the controller's state and, with
        speculative rollouts, the draft store."""
        drafts = self.steps.rollouts.drafts
        self.steps.group.save_checkpoint(self.ckpt, step, self.steps.checkpoint_metadata(),
                                         drafts.save if drafts is not None else None)


def export_hf_step(group, root, step: int, keep_last: int) -> Path:
    """The policy of ``group`` after ``step`` as an HF folder, ``hf_step_<step>`` in ``root`` (beside
    the checkpoints; written under a temporary name and renamed: complete or absent), then all but
    the newest ``keep_last`` such folders removed (``checkpoint.hf_export_every``)."""
    import shutil

    t = time.perf_counter()
    folder = Path(root) / f"{HF_EXPORT_PREFIX}{step:08d}"
    group.export_hf(folder)
    done = sorted(p for p in Path(root).glob(f"{HF_EXPORT_PREFIX}*") if p.is_dir()
                  and p.name[len(HF_EXPORT_PREFIX):].isdigit())
    for old in done[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    logging.getLogger("megarl").info(f"exported the policy of step {step} to {folder} "
                                     f"({time.perf_counter() - t:.1f} s)")
    return folder


def start_run(cfg: MegaRLConfig, cleanup: contextlib.ExitStack, resume: bool, verbose: bool,
              after_sync: Optional[Callable], group) -> Run:
    """Everything a run needs, registered with ``cleanup`` in the order it must be released:
    the console, the stop request, the workers and engines (unless ``group`` is given), the
    metrics sinks, the reward workers and the mode's sample source; resumed from the newest
    intact checkpoint when asked."""
    from megarl.algorithms import build_kl_controller
    from megarl.observability.console import run_console
    from megarl.observability.generations import GenerationLog
    from megarl.observability.metrics import open_metrics
    from megarl.observability.timeline import Timeline
    from megarl.rewards import RewardPool
    from megarl.rewards.model import RewardModelTerm
    from megarl.rewards.spec import model_term, parse_reward
    from megarl.driver.checkpoint import CheckpointManager
    from megarl.driver.modes import SampleLog, make_source
    from megarl.driver.rollouts import Rollouts
    from megarl.driver.routing_replay import StepRouting
    from megarl.actors.group import WorkerGroup

    run_dir = Path(cfg.trainer.run_dir)
    console = cleanup.enter_context(run_console(run_dir / "logs", cfg.logging.level, verbose))
    stop = cleanup.enter_context(StopRequest(console))   # restores the signal handlers once all is released
    if group is None:
        group = WorkerGroup(cfg, None if verbose else run_dir / "logs", verbose)
        cleanup.callback(_release, group, stop)
    else:
        group.reuse_for(cfg)
    stop.arm()                                           # after ray.init, which installs a SIGTERM handler
    precision = precision_line(group.precision(), cfg)
    logging.getLogger("megarl").info(precision)
    rollouts = Rollouts(cfg, group.generate)
    ckpt = CheckpointManager(cfg.checkpoint.dir or run_dir / "checkpoints", cfg.checkpoint.keep_last)
    kl_ctl = build_kl_controller("adaptive", init_kl_coef=cfg.algorithm.kl_coef, target_kl=cfg.algorithm.kl_target,
                                 horizon=10000) if cfg.algorithm.kl_target else \
        build_kl_controller("fixed", init_kl_coef=cfg.algorithm.kl_coef)
    start, state = resume_from(cfg, resume, ckpt, group, rollouts, kl_ctl)
    ckpt.clean_partials()
    timeline = Timeline(run_dir / "timeline.jsonl", resume_step=start + 1)
    group.timeline = timeline
    log = cleanup.enter_context(open_metrics(cfg, run_dir, total_steps=cfg.trainer.steps, start=start, stream=console))
    log.add_text("precision", precision, start + 1)
    rewards = cleanup.enter_context(RewardPool(num_workers=1, timeout_s=cfg.data.reward_timeout_s))
    source = make_source(cfg, rollouts, group, rewards, timeline, start, state.get("rollout_source"))
    cleanup.callback(source.close)   # before the engines stop: the producer must not see them die
    reward_model = None
    if model_term(parse_reward(cfg.data.reward)) is not None:   # scored on the training workers
        reward_model = RewardModelTerm(cfg, state.get("reward_model"))
    steps = StepRunner(cfg, group=group, rollouts=rollouts, source=source, stop=stop, log=log, timeline=timeline,
                       generations=GenerationLog(run_dir, rollouts.tokenizer, cfg.logging.samples_per_step,
                                                 start + 1, log.add_samples, cfg.logging.samples_every),
                       sample_log=SampleLog(run_dir, resume_step=start + 1),
                       routing=StepRouting(cfg, run_dir, resume_step=start + 1), rewards=rewards,
                       reward_model=reward_model, kl_ctl=kl_ctl, after_sync=after_sync)
    return Run(steps, ckpt, start)


def resume_from(cfg: MegaRLConfig, resume: bool, ckpt, group, rollouts, kl_ctl) -> tuple[int, dict]:
    """With ``resume`` (or ``checkpoint.resume``): the newest checkpoint that verifies and loads
    (damaged ones are skipped with a warning) into the workers, the KL coefficient and the draft
    store. Returns its step (0: none) and its metadata (the sample source's and reward model's
    state)."""
    from megarl.checkpoint_files import load_plain

    if not (resume or cfg.checkpoint.resume):
        return 0, {}
    found = ckpt.newest_intact(group.load_checkpoint, group.hash_checkpoint_files)
    if found is None:
        return 0, {}
    start, folder = found
    meta = ckpt.metadata(folder)
    kl_ctl.value = meta.get("kl_coef", kl_ctl.value)
    log = logging.getLogger("megarl")
    log.info(f"resumed from {folder} (step {start})")
    if rollouts.drafts is not None and rollouts.drafts.load(folder, load_plain):
        log.info(f"speculative rollouts: {len(rollouts.drafts)} prompts' drafts restored "
                 f"({rollouts.drafts.bytes / 2**20:.1f} MiB)")
    return start, meta


class StepRunner:
    """The steps of RL, in order, for one run (:meth:`run`), each stage a method: generate, the
    reward model's score, the step's training on the ranks (:meth:`WorkerGroup.train_step`: the
    forward passes, advantages and updates), the weight sync and the step's metrics. :func:`train`
    builds it with the run's parts and loops over the steps; the mode's sample source
    (:mod:`megarl.driver.modes`) decides where samples come from and when the weights reach the
    engines."""

    def __init__(self, cfg: MegaRLConfig, *, group, rollouts, source, stop, log, timeline, generations, sample_log,
                 routing, rewards, reward_model, kl_ctl, after_sync: Optional[Callable] = None):
        self.cfg, self.group, self.rollouts, self.source, self.stop = cfg, group, rollouts, source, stop
        self.log, self.timeline, self.generations, self.sample_log = log, timeline, generations, sample_log
        self.routing, self.rewards, self.reward_model, self.kl_ctl = routing, rewards, reward_model, kl_ctl
        self.after_sync = after_sync
        self.window_start = time.monotonic()
        """Where the next step's timeline window starts (where the last one ended)."""

    # ---------------------------------------------------------------- the step
    def run(self, step: int, m: dict) -> None:
        """One RL step; ``m`` collects its metrics (written also when it raises)."""
        from megarl.observability import PhaseTimer

        timer = PhaseTimer()
        rollout = self.generate(step, m)
        self.score_with_reward_model(step, rollout, m)
        self.generations.write(step, rollout)                  # decoded samples: generations.jsonl
        self.stop.abandon_if_requested(m)                      # safe point: nothing updated yet
        self.group.train_step(rollout, self.hooks(step, timer), m)
        self.phase(step, "sync")
        m.update(self.source.after_update(step, functools.partial(self.sync_weights, step, timer)))
        self.step_metrics(step, rollout, timer, m)

    def hooks(self, step: int, timer) -> StepHooks:
        """What the step's training borrows from the run (:class:`megarl.actors.step.StepHooks`)."""
        return StepHooks(step=step, phase=functools.partial(self.phase, step), timer=timer,
                         read=functools.partial(self.read_logprobs, step), routing=self.routing, kl_ctl=self.kl_ctl,
                         safe_point=self.stop.abandon_if_requested)

    def phase(self, step: int, name: str, **fields) -> None:
        """The progress line; what a stop waits for."""
        self.stop.step, self.stop.phase = step, name
        self.log.progress_line(step, name, **fields)

    def generate(self, step: int, m: dict) -> Rollout:
        from megarl.driver.modes import offpolicy_metrics

        self.phase(step, "generate")
        rollout, m_gen = self.source.batch(step, functools.partial(self.stop.abandon_if_requested, m))  # times itself
        m.update(m_gen, **offpolicy_metrics(rollout, step))
        return rollout

    def score_with_reward_model(self, step: int, rollout: Rollout, m: dict) -> None:
        """A ``model:`` reward term: its own phase, a forward pass on the workers."""
        if self.reward_model is not None:
            self.phase(step, "reward_model")
            m.update(self.reward_model.apply(rollout, self.group))

    def read_logprobs(self, step: int, rollout: Rollout, readouts: list[dict], m: dict) -> None:
        """What the policy's log-probs before the update feed, from the step's per-sample
        read-outs (:mod:`megarl.data.readout`): the alarm, metrics, the sample log, the KL
        controller."""
        from megarl.data.readout import readout_metrics

        got = readout_metrics(readouts)
        m.update(check_alarm({k: got.pop(k) for k in ("rollout/logprob_diff_mean", "rollout/logprob_diff_max")},
                             self.cfg.trainer.logprob_diff_threshold))
        self.sample_log.write(step, rollout, readouts)
        if "actor/kl" in got:
            k1 = got.pop("actor/kl")
            m.setdefault("actor/kl", k1)   # a KL loss term reports its own estimator (the update's metrics win)
            self.kl_ctl.update(k1, len(rollout))
        m.update(got)

    def sync_weights(self, step: int, timer) -> dict:
        """The weight sync, and what needs the engines idle: probes (``after_sync``), evaluation.
        The sample source calls it when its mode syncs (:meth:`SampleSource.after_update`)."""
        with timer("sync"):
            out = self.group.sync_weights()
        if self.after_sync is not None:
            self.after_sync(self.group, step)
        if self.cfg.trainer.eval_every and step % self.cfg.trainer.eval_every == 0:
            with timer("eval"):
                out.update(self.rollouts.evaluate(self.rewards))
        return out

    def step_metrics(self, step: int, rollout: Rollout, timer, m: dict) -> None:
        from megarl.observability import gpu_stats

        m.update(timer.pop())
        now = time.monotonic()
        m.update(self.timeline.step_metrics(step, self.window_start, now))
        self.window_start = now
        m["throughput/tokens_per_s"] = sum(rollout.lengths()) / max(1e-9, sum(
            v for k, v in m.items() if k.startswith("time/")))
        m["actor/kl_coef"] = self.kl_ctl.value
        m.update(gpu_stats())

    def checkpoint_metadata(self) -> dict:
        return {"kl_coef": self.kl_ctl.value, "rollout_source": self.source.state(),
                **({"reward_model": self.reward_model.state()} if self.reward_model is not None else {})}


def _release(group, stop: StopRequest) -> None:
    """Stop the group's engines and actors (and Ray): after a second signal, also one arriving
    during this shutdown, without waiting for actors busy in a phase."""
    if stop.hard:
        group.placement.close(timeout_s=HARD_STOP_WAIT_S)
        return
    try:
        group.shutdown()
    except KeyboardInterrupt:
        group.placement.close(timeout_s=HARD_STOP_WAIT_S)   # idempotent: redoes what was left
        raise


def precision_line(p: dict, cfg: MegaRLConfig) -> str:
    """One line of the run's dtypes (``p``: :meth:`WorkerGroup.precision`) and the alarm bound,
    after why ``model.dtype: auto`` chose its dtype (when it did)."""
    from megarl.precision import auto_reason

    join = lambda names: "/".join(names) if names else "-"   # noqa: E731
    state = join(p["optimizer_state"] or p["main_params"])   # Adam's moments follow the main params
    threshold = cfg.trainer.logprob_diff_threshold
    auto = f"{auto_reason()}; " if auto_reason() else ""
    return (f"{auto}precision: params {join(p['params'])}, main params {join(p['main_params'])}, "
            f"optimizer state {state}, grads {join(p['grads'])}; vLLM {cfg.model.dtype}; rollout-vs-train alarm "
            + (f"at mean |vLLM - Megatron| log-prob > {threshold:g}" if threshold else "off"))


def alarm_metrics(rollout: Rollout, train_lp: list, threshold: float, version: int | None = None) -> dict:
    """|vLLM sampling log-prob - Megatron log-prob| of the sampled tokens; stop when too large.

    With ``version`` (the policy version being trained) and per-token versions in the rollout,
    only the tokens that this version generated count: older ones differ by the updates since
    (off-policy modes); a step with none of them reports NaN and cannot raise. Tokens without a
    vLLM log-prob (NaN: the agent loop's inserted tool results, never sampled) do not count.
    The loop reads the same from per-sample read-outs (:mod:`megarl.data.readout`)."""
    from megarl.data.readout import controller_readouts, readout_metrics

    return check_alarm(readout_metrics(controller_readouts(rollout, train_lp, None, None, version)), threshold)


def check_alarm(out: dict, threshold: float) -> dict:
    """``out`` (``rollout/logprob_diff_mean`` and ``_max``), or :class:`WeightSyncAlarm` when the
    mean passes ``threshold`` (0: off)."""
    if threshold and out["rollout/logprob_diff_mean"] > threshold:
        raise WeightSyncAlarm(
            f"mean |vLLM - Megatron| log-prob of sampled tokens is {out['rollout/logprob_diff_mean']:.4g} "
            f"(max {out['rollout/logprob_diff_max']:.4g}) > trainer.logprob_diff_threshold={threshold}: vLLM is not "
            "sampling from the policy being trained; check the weight sync (megarl.bridge, verify mode) "
            "and that rollout and model dtypes match", out)
    return out


__all__ = ["train", "alarm_metrics", "precision_line", "critic_metrics", "RunInterrupted", "WeightSyncAlarm"]
