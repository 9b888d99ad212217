"""The controller's handle on a run's HybridWorkers and rollout engines: one call per phase.

A :class:`WorkerGroup` starts them (:class:`megarl.actors.placement.Placement`), hands each phase
of the loop to the part that owns it and releases them on exit; a step's training (passes,
advantages, updates) is one call, :meth:`WorkerGroup.train_step` (:mod:`megarl.actors.step`).
Its parts: ``ranks`` (:class:`megarl.actors.ranks.TrainingRanks`: calls fanned out over the
training ranks, each with its DP rank's micro-batches; checkpoints, precision, the HF export),
``passes`` (:class:`megarl.actors.ranks.RankPasses`: the forward passes before the update),
``updates`` (:class:`megarl.actors.updates.RankUpdates`: the optimizer steps) and ``rollout``
(:class:`FleetOwner`: the rollout fleet beside the training ranks: generation with the training
state offloaded, engine restarts, sleep and wake, the weight sync, the placement log).

Failures: every call waits with :func:`megarl.calls.wait_all`, so the first failure
surfaces at once, a dead actor as :class:`megarl.calls.WorkerDied` naming its rank (or
engine), pid, node and the phase; a dead vLLM worker process is named by its engine
(:class:`megarl.rollout.vllm_engine.EngineDied`). After a failure the shutdown waits at most
``FAILED_STOP_WAIT_S`` for the actors before killing them. A worker that hangs without dying is
not detected here.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

from megarl.config.schema import MegaRLConfig
from megarl.calls import wait_all
from megarl.rollout.fleet import Fleet
from megarl.actors.ranks import RankPasses, TrainingRanks
from megarl.actors.step import RankStep
from megarl.actors.updates import RankUpdates

FAILED_STOP_WAIT_S = 10.0
"""After a failed call: how long the actors' own shutdown (their vLLM engines) may take before they
are killed; a rank blocked in a collective whose peer died never runs it."""


class WorkerGroup:
    """The HybridWorkers and engines of a run; a context manager that releases them (and Ray) on
    exit. The phase methods hand each call to the part that owns it (see the module docstring)."""

    REUSED_SECTIONS = ("model", "topology", "rollout", "bridge")

    def __init__(self, cfg: MegaRLConfig, log_dir: Path | None = None, verbose: bool = False, stage: str = "rl"):
        """``stage``: ``rl``, or ``sft`` / ``rm`` (:mod:`megarl.posttrain`): the training workers
        alone, no rollout fleet (``rollout`` and ``fleet`` None)."""
        from megarl.data.batching import budget_from_config
        from megarl.policy.build import read_hf_config
        from megarl.actors.algorithm import needs_critic
        from megarl.actors.placement import Placement

        self.cfg = cfg
        self.has_reference = self.built_reference = cfg.algorithm.kl_coef > 0 and stage == "rl"
        self.has_critic = self.built_critic = needs_critic(cfg.algorithm) and stage == "rl"
        self.rollout: FleetOwner | None = None
        self.fleet: Fleet | None = None
        # trainer.balance_cost=flops: the FLOPs coefficients come from the model's config.json
        budget = budget_from_config(cfg.trainer, read_hf_config(cfg.model.path))
        # last: from here on, anything that raises must release the placement
        self.placement = Placement(cfg, log_dir, verbose, stage=stage)
        self.ranks = TrainingRanks(cfg, self.placement.workers, budget)
        self.passes, self.updates = RankPasses(self.ranks), RankUpdates(self.ranks)
        try:
            if stage == "rl":
                self.rollout = FleetOwner(self.placement, self.ranks)
                self.fleet = self.rollout.fleet   # the same object for the run (its engines may be replaced)
                self.rollout.start()
            self.ranks.start()
            if self.rollout is not None:
                self.rollout.attach(log_dir)
        except BaseException:
            self.shutdown()
            raise

    def __enter__(self) -> "WorkerGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def reuse_for(self, cfg: MegaRLConfig) -> None:
        """Run ``cfg`` on these workers and engines, e.g. a sweep over algorithms without starting
        them again: the sections :data:`REUSED_SECTIONS` must equal the ones the group was built
        from, and a reference or critic the algorithm needs must have been built. The policy, its
        optimizer state and learning-rate schedule carry on from the previous run; the engines
        hold its last synced weights. Unused models (a critic the new algorithm does not need) stay
        loaded and are skipped."""
        from megarl.actors.algorithm import needs_critic

        differ = [name for name in self.REUSED_SECTIONS if getattr(cfg, name) != getattr(self.cfg, name)]
        if differ:
            raise ValueError(f"WorkerGroup.reuse_for: {', '.join(differ)} differ from the config the workers were "
                             "built from; start a new WorkerGroup")
        if cfg.algorithm.kl_coef > 0 and not self.built_reference:
            raise ValueError("WorkerGroup.reuse_for: algorithm.kl_coef > 0 needs a reference model, which this group "
                             "was built without")
        if needs_critic(cfg.algorithm) and not self.built_critic:
            raise ValueError(f"WorkerGroup.reuse_for: algorithm.advantage={cfg.algorithm.advantage!r} needs a critic, "
                             "which this group was built without")
        self.cfg = self.ranks.cfg = cfg
        self.has_reference, self.has_critic = cfg.algorithm.kl_coef > 0, needs_critic(cfg.algorithm)
        self.updates.reset_skips()
        self.ranks.call("set_config", cfg)

    def shutdown(self) -> None:
        """Stop the engines and actors, remove the placement group, stop Ray if the run started it."""
        if self.ranks.failed or (self.rollout is not None and self.rollout.failed):
            self.placement.close(timeout_s=FAILED_STOP_WAIT_S)
        else:
            self.placement.close()

    # ------------------------------------------------------------------ the loop's phases, by owner
    def generate(self, prompt_ids: list[list[int]], seeds: list[int], greedy: bool = False, on_done=None,
                 drafts: list | None = None) -> list:
        """:meth:`FleetOwner.generate`: the ``sample_fn`` of :class:`megarl.driver.rollouts.Rollouts`."""
        return self.rollout.generate(prompt_ids, seeds, greedy, on_done, drafts)

    def end_rollout(self) -> dict:
        """:meth:`FleetOwner.end_rollout`."""
        return self.rollout.end_rollout()

    def sync_weights(self) -> dict:
        """:meth:`FleetOwner.sync_weights`."""
        return self.rollout.sync_weights()

    def train_step(self, rollout, hooks, m: dict) -> None:
        """One step's training after its rollout is scored (:meth:`megarl.actors.step.RankStep.run`):
        the forward passes, the advantages, the critic's and the policy's updates; ``m`` collects
        the metrics, ``hooks`` (:class:`megarl.actors.step.StepHooks`) is what the driver lends it."""
        RankStep(self.cfg, self).run(rollout, hooks, m)

    def plan(self, rollout):
        """:meth:`megarl.actors.ranks.TrainingRanks.plan`."""
        return self.ranks.plan(rollout)

    def logprobs(self, rollout, plan, reference: bool, **options) -> dict:
        """:meth:`megarl.actors.ranks.RankPasses.logprobs` (its routing: :attr:`routing_out`)."""
        return self.passes.logprobs(rollout, plan, reference, **options)

    @property
    def routing_out(self) -> dict:
        """The last forward pass's MoE routing (:attr:`megarl.actors.ranks.RankPasses.routing_out`)."""
        return self.passes.routing_out

    def values(self, rollout, plan) -> list:
        """:meth:`megarl.actors.ranks.RankPasses.values`."""
        return self.passes.values(rollout, plan)

    def advantages(self, rollout, adv_fn, adv_opts: dict, kl_coef, old_lp, ref_lp, values) -> dict:
        """:meth:`megarl.actors.ranks.RankPasses.advantages`."""
        return self.passes.advantages(rollout, adv_fn, adv_opts, kl_coef, old_lp, ref_lp, values)

    def reward_model_scores(self, rollout, pad_id) -> list[float]:
        """:meth:`megarl.actors.ranks.RankPasses.reward_model_scores`."""
        return self.passes.reward_model_scores(rollout, pad_id)

    def train(self, rollout, plan, per_sample: dict, kl_coef: float, **options) -> tuple[dict, list | None]:
        """:meth:`megarl.actors.updates.RankUpdates.train`."""
        return self.updates.train(rollout, plan, per_sample, kl_coef, **options)

    def train_critic(self, rollout, plan, per_sample: dict) -> dict:
        """:meth:`megarl.actors.updates.RankUpdates.train_critic`."""
        return self.updates.train_critic(rollout, plan, per_sample)

    @property
    def moe_tokens_per_expert(self):
        """:attr:`megarl.actors.updates.RankUpdates.moe_tokens_per_expert`."""
        return self.updates.moe_tokens_per_expert

    def posttrain_step(self, batches_per_rank: list, options: dict) -> dict:
        """:meth:`megarl.actors.updates.RankUpdates.posttrain_step`."""
        return self.updates.posttrain_step(batches_per_rank, options)

    def posttrain_eval(self, batches_per_rank: list, options: dict) -> dict:
        """:meth:`megarl.actors.updates.RankUpdates.posttrain_eval`."""
        return self.updates.posttrain_eval(batches_per_rank, options)

    def reference_logps(self, batches_per_rank: list) -> list:
        """Every rank's :meth:`megarl.actors.worker.HybridWorker.reference_logps` of its
        micro-batches (DP leaders: per micro-batch ``[N]``; else None)."""
        return self.ranks.fan_out("reference_logps", [(b,) for b in batches_per_rank])

    def release_reference(self) -> None:
        """:meth:`megarl.actors.worker.HybridWorker.release_reference` on every rank."""
        self.ranks.call("release_reference")

    def precision(self) -> dict:
        """:meth:`megarl.actors.ranks.TrainingRanks.precision`."""
        return self.ranks.precision()

    def export_hf(self, folder) -> None:
        """:meth:`megarl.actors.ranks.TrainingRanks.export_hf`."""
        self.ranks.export_hf(folder)

    def save_checkpoint(self, ckpt, step: int, metadata: dict, extra=None):
        """:meth:`megarl.actors.ranks.TrainingRanks.save_checkpoint`."""
        return self.ranks.save_checkpoint(ckpt, step, metadata, extra)

    def load_checkpoint(self, folder) -> None:
        """The ranks load ``folder``; the engines, when there are any, get its weights."""
        self.ranks.load_checkpoint(folder)
        if self.rollout is not None:
            self.rollout.sync_weights()

    def hash_checkpoint_files(self, folder, relpaths: list[str], sync: bool) -> dict:
        """:meth:`megarl.actors.ranks.TrainingRanks.hash_checkpoint_files`."""
        return self.ranks.hash_checkpoint_files(folder, relpaths, sync)

    @property
    def timeline(self):
        """The run's :class:`megarl.observability.timeline.Timeline` (:attr:`TrainingRanks.timeline`)."""
        return self.ranks.timeline

    @timeline.setter
    def timeline(self, timeline) -> None:
        self.ranks.timeline = timeline


class FleetOwner:
    """The rollout fleet as the group owns it beside the training ranks: the engines share the
    ranks' devices (colocated), so generation, restarts, sleep and the weight sync involve both."""

    def __init__(self, placement, ranks: TrainingRanks):
        """No call is made until :meth:`start`."""
        self.placement, self.ranks = placement, ranks
        self.fleet = Fleet(ranks.cfg, list(placement.engines), [], restart=self.restart_engine)
        self.offloaded_bytes = 0
        """What the last generation moved to host memory (``trainer.offload_train_state``)."""
        self.failed = False
        """A call failed: the actors may be stuck, the shutdown does not wait long for them."""

    @contextlib.contextmanager
    def _failures(self):
        try:
            yield
        except BaseException:
            self.failed = True   # the shutdown will not wait long for actors that may be stuck
            raise

    def _wait(self, refs: list, names: list[str], phase: str) -> list:
        with self._failures():
            return wait_all(refs, names, phase)

    def _call(self, method: str, *args) -> list:
        """``method(*args)`` on every engine (:meth:`megarl.rollout.fleet.Fleet.call_all`)."""
        with self._failures():
            return self.fleet.call_all(method, *args)

    def start(self) -> None:
        """Wait for the engines to start; learn where each runs (the fleet's ``infos``)."""
        engines = self.fleet.engines
        self.fleet.infos = self._wait([e.info.remote() for e in engines],
                                      [self.fleet.name(k) for k in range(len(engines))], "start-up")

    def attach(self, log_dir: Path | None) -> None:
        """Log where every rank and engine runs, then build the weight bridge to the engines."""
        self._place(log_dir)
        self.ranks.call("attach_engines", self.fleet.engines)

    def _place(self, log_dir: Path | None) -> None:
        """Log where every rank and engine runs (and write it to ``logs/placement.json``); refuse
        an engine whose vLLM ranks would read their weight buffers from another node."""
        import json
        import logging

        tp, infos, ranks = self.ranks.cfg.rollout.tp, self.fleet.infos, self.ranks.infos
        for k, engine in enumerate(infos):
            for r in range(tp):
                rank = ranks[k * tp + r]
                if rank.node_id != engine["node_id"]:
                    raise ValueError(
                        f"rollout engine {k} runs on {engine['node']}, but its vLLM TP rank {r} would load the weights "
                        f"that training rank {k * tp + r} on {rank.node} writes into node-local memory; place every "
                        "engine on the node of its training ranks (rollout.placement=colocated with rollout.tp dividing "
                        "the devices per node)")
        nodes: dict = {}
        for i, rank in enumerate(ranks):
            nodes.setdefault(rank.node, [[], []])[0].append(i)
        for k, engine in enumerate(infos):
            nodes.setdefault(engine["node"], [[], []])[1].append(k)
        logging.getLogger("megarl").info("placement: " + "; ".join(
            f"{node}: rank(s) {','.join(map(str, on_node)) or '-'}" + (f", engine(s) {','.join(map(str, engines))}"
                                                                       if engines else "")
            for node, (on_node, engines) in nodes.items()))
        if log_dir is not None:
            (log_dir / "placement.json").write_text(json.dumps(
                {"ranks": [{k: getattr(r, k) for k in ("rank", "pid", "node_name", "ip", "node_id")} for r in ranks],
                 "engines": [{k: e[k] for k in ("pid", "node_name", "ip", "node_id")} for e in infos]}, indent=1))

    def generate(self, prompt_ids: list[list[int]], seeds: list[int], greedy: bool = False, on_done=None,
                 drafts: list | None = None) -> list:
        """Samples of the fleet (:meth:`megarl.rollout.fleet.Fleet.generate`). With
        ``trainer.offload_train_state`` the Megatron state is in host memory meanwhile."""
        offload = self.ranks.cfg.trainer.offload_train_state
        if offload:
            self.offloaded_bytes = sum(self.ranks.call("offload"))
        with self._failures():
            gens = self.fleet.generate(prompt_ids, seeds, greedy, on_done, drafts)
        if offload:
            self.ranks.call("onload")
        return gens

    def restart_engine(self, k: int):
        """Engine ``k`` died or hung during generation: a new actor in its place, loaded with the
        current weights (:meth:`megarl.actors.roles.BridgeEnd.replace_engine`); returns its
        handle and info (the fleet's ``restart``)."""
        offload = self.ranks.cfg.trainer.offload_train_state
        where = self.fleet.infos[k]["node"] if k < len(self.fleet.infos) else "its node"
        actor = self.placement.restart_engine(k)
        info = self._wait([actor.info.remote()], [f"rollout engine {k} (restarted on {where})"], "restart")[0]
        if offload:   # the bridge reads the Megatron weights
            self.ranks.call("onload")
        self.ranks.call("replace_engine", k, actor)
        if offload:
            self.ranks.call("offload")
        return actor, info

    def end_rollout(self) -> dict:
        """After a step's generation: the fleet's metrics; GPU colocated, vLLM sleeps to free
        memory for training."""
        from megarl.rollout.build import sleeps

        cfg = self.ranks.cfg
        if sleeps(cfg):
            self._call("sleep", cfg.rollout.sleep_level)
        m = dict(self.fleet.metrics)
        if cfg.trainer.offload_train_state:
            m["memory/offloaded_gb"] = self.offloaded_bytes / 1e9
        return m

    def sync_weights(self) -> dict:
        """Every engine gets the new weights: ``sync/*`` of rank 0, plus per engine
        ``sync/engine<k>_seconds`` (its loads) and ``sync/engine<k>_bytes`` (what it received), and
        ``sync/bytes_<path>``: the bytes all ranks moved in process, by shared memory within a node
        and over the network between nodes (see :mod:`megarl.bridge.transport`)."""
        from megarl.rollout.build import sleeps

        if sleeps(self.ranks.cfg):
            self._call("wake_up")
        stats = self.ranks.call("sync_weights")
        out = {f"sync/{k}": v for k, v in stats[0].items()
               if isinstance(v, (int, float)) and not k.startswith("engine_")}
        for s in stats:   # what crossed which path, all ranks: sync/bytes_local, _shm, _gloo or _nccl
            for path, n in s.get("bytes_by_path", {}).items():
                out[f"sync/bytes_{path}"] = out.get(f"sync/bytes_{path}", 0) + n
            if s.get("engine_index") is not None:
                out[f"sync/engine{s['engine_index']}_seconds"] = s["engine_load_seconds"]
                out[f"sync/engine{s['engine_index']}_bytes"] = s["engine_bytes"]
        return out
