"""The controller's handle on the HybridWorkers: one call per phase, fanned out over the workers.

Collective phases (log-probs, values, train steps, weight sync, checkpoints) call every worker
at once with its DP rank's micro-batches and gather the DP leaders' outputs. Generation runs on
the rollout fleet (:class:`megarl.trainer.fleet.Fleet`, ``rollout.dp`` engine actors); what is
generated and how it is scored is :mod:`megarl.trainer.rollout`'s business, where the actors live
is :mod:`megarl.trainer.placement`'s.

Failures: every call waits with :func:`megarl.trainer.calls.wait_all`, so the first failure
surfaces at once, a dead actor as :class:`megarl.trainer.calls.WorkerDied` naming its rank (or
engine), pid, node and the phase. A dead vLLM worker process is named by its engine
(:class:`megarl.rollout.vllm_engine.EngineDied`). After a failure the group's shutdown waits at
most ``FAILED_STOP_WAIT_S`` for the actors before killing them. A worker that hangs without dying
is not detected here.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from megarl.config.schema import MegaRLConfig
from megarl.trainer.batch import Rollout, micro_batches_for, scatter_sequences
from megarl.trainer.calls import wait_all
from megarl.trainer.messages import PassRequest, UpdateRequest

FAILED_STOP_WAIT_S = 10.0
"""After a failed call: how long the actors' own shutdown (their vLLM engines) may take before they
are killed; a rank blocked in a collective whose peer died never runs it."""


class NonFiniteLossError(RuntimeError):
    """More than ``trainer.max_skipped_updates`` optimizer updates in a row were skipped for a NaN
    or inf loss or gradient."""


class WorkerGroup:
    """The HybridWorkers of a run; a context manager that releases them (and Ray) on exit."""

    def __init__(self, cfg: MegaRLConfig, log_dir: Path | None = None, verbose: bool = False, stage: str = "rl"):
        """``stage``: ``rl``, or ``sft`` / ``rm`` (:mod:`megarl.posttrain`): the training workers
        alone, no rollout fleet (``fleet`` None)."""
        from megarl.data.plan import budget_from_config
        from megarl.engine.build import read_hf_config
        from megarl.trainer.algorithm import needs_critic
        from megarl.trainer.placement import Placement

        self.cfg = cfg
        self.has_reference = self.built_reference = cfg.algorithm.kl_coef > 0
        self.has_critic = self.built_critic = needs_critic(cfg.algorithm)
        self.offloaded_bytes = 0
        self.info, self.failed = [], False
        self.skipped_in_a_row = {"actor": 0, "critic": 0}
        self.timeline = None
        """A :class:`megarl.observability.timeline.Timeline`: each call's span per rank (lane rankR)."""
        # trainer.balance_cost=flops: the FLOPs coefficients come from the model's config.json
        self.budget = budget_from_config(cfg.trainer, read_hf_config(cfg.model.path))
        # last: from here on, anything that raises must release the placement
        self.placement = Placement(cfg, log_dir, verbose, stage=stage)
        self.workers, self.fleet = self.placement.workers, None
        if stage != "rl":
            self.has_reference = self.built_reference = self.has_critic = self.built_critic = False
            try:
                self.info = self._all("info")
            except BaseException:
                self.shutdown()
                raise
            return
        try:
            from megarl.trainer.fleet import Fleet

            self.fleet = Fleet(cfg, list(self.placement.engines), [], restart=self._restart_engine)
            self.fleet.infos = self._wait([e.info.remote() for e in self.fleet.engines],
                                          [self.fleet.name(k) for k in range(len(self.fleet.engines))], "start-up")
            self.info = self._all("info")
            self._place(log_dir)
            self._all("attach_engines", self.fleet.engines)
        except BaseException:
            self.shutdown()
            raise

    def _place(self, log_dir: Path | None) -> None:
        """Log where every rank and engine runs (and write it to ``logs/placement.json``); refuse
        an engine whose vLLM ranks would read their weight buffers from another node."""
        import json
        import logging

        tp, infos = self.cfg.rollout.tp, self.fleet.infos
        for k, engine in enumerate(infos):
            for r in range(tp):
                rank = self.info[k * tp + r]
                if rank.node_id != engine["node_id"]:
                    raise ValueError(
                        f"rollout engine {k} runs on {engine['node']}, but its vLLM TP rank {r} would load the weights "
                        f"that training rank {k * tp + r} on {rank.node} writes into node-local memory; place every "
                        "engine on the node of its training ranks (rollout.placement=colocated with rollout.tp dividing "
                        "the devices per node)")
        nodes: dict = {}
        for i, rank in enumerate(self.info):
            nodes.setdefault(rank.node, [[], []])[0].append(i)
        for k, engine in enumerate(infos):
            nodes.setdefault(engine["node"], [[], []])[1].append(k)
        logging.getLogger("megarl").info("placement: " + "; ".join(
            f"{node}: rank(s) {','.join(map(str, ranks)) or '-'}" + (f", engine(s) {','.join(map(str, engines))}"
                                                                     if engines else "")
            for node, (ranks, engines) in nodes.items()))
        if log_dir is not None:
            (log_dir / "placement.json").write_text(json.dumps(
                {"ranks": [{k: getattr(r, k) for k in ("rank", "pid", "node_name", "ip", "node_id")} for r in self.info],
                 "engines": [{k: e[k] for k in ("pid", "node_name", "ip", "node_id")} for e in infos]}, indent=1))

    def __enter__(self) -> "WorkerGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    REUSED_SECTIONS = ("model", "topology", "rollout", "bridge")

    def reuse_for(self, cfg: MegaRLConfig) -> None:
        """Run ``cfg`` on these workers and engines, e.g. a sweep over algorithms without starting
        them again: the sections :data:`REUSED_SECTIONS` must equal the ones the group was built
        from, and a reference or critic the algorithm needs must have been built. The policy, its
        optimizer state and learning-rate schedule carry on from the previous run; the engines
        hold its last synced weights. Unused models (a critic the new algorithm does not need) stay
        loaded and are skipped."""
        from megarl.trainer.algorithm import needs_critic

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
        self.cfg = cfg
        self.has_reference, self.has_critic = cfg.algorithm.kl_coef > 0, needs_critic(cfg.algorithm)
        self.skipped_in_a_row = {"actor": 0, "critic": 0}
        self._all("set_config", cfg)

    def shutdown(self) -> None:
        """Stop the engines and actors, remove the placement group, stop Ray if the run started it."""
        if self.failed:
            self.placement.close(timeout_s=FAILED_STOP_WAIT_S)
        else:
            self.placement.close()

    def _all(self, method: str, *args):
        return self._fan_out(method, [args] * len(self.workers))

    def _fan_out(self, method: str, args_per_worker: list) -> list:
        """``method(*args)`` on every worker (``args_per_worker`` in rank order): their results."""
        t0 = time.monotonic()
        refs = [getattr(w, method).remote(*args) for w, args in zip(self.workers, args_per_worker)]
        done_at: list = [None] * len(refs)
        out = self._wait(refs, [self._who(rank) for rank in range(len(refs))], method, done_at)
        if self.timeline is not None:   # a rank is busy from the call until its own result is in
            for rank, t in enumerate(done_at):
                self.timeline.record(f"rank{rank}", method, t0, t or time.monotonic())
        return out

    def _wait(self, refs: list, names: list[str], phase: str, done_at: list | None = None) -> list:
        try:
            return wait_all(refs, names, phase, done_at=done_at)
        except BaseException:
            self.failed = True   # the shutdown will not wait long for actors that may be stuck
            raise

    def _who(self, rank: int) -> str:
        """``training worker rank R (pid P on NODE)`` (pid and node once known)."""
        notes = f" (pid {self.info[rank].pid} on {self.info[rank].node})" if self.info else ""
        return f"training worker rank {rank}{notes}"

    # ------------------------------------------------------------------ rollout
    def generate(self, prompt_ids: list[list[int]], seeds: list[int], greedy: bool = False, on_done=None,
                 drafts: list | None = None) -> list:
        """Samples of the fleet (:meth:`megarl.trainer.fleet.Fleet.generate`): the ``sample_fn``
        of :class:`megarl.trainer.rollout.Rollouts`. With ``trainer.offload_train_state`` the
        Megatron state is in host memory meanwhile."""
        offload = self.cfg.trainer.offload_train_state
        if offload:
            self.offloaded_bytes = sum(self._all("offload"))
        try:
            gens = self.fleet.generate(prompt_ids, seeds, greedy, on_done, drafts)
        except BaseException:
            self.failed = True   # the shutdown will not wait long for actors that may be stuck
            raise
        if offload:
            self._all("onload")
        return gens

    def _restart_engine(self, k: int):
        """Engine ``k`` died or hung during generation: a new actor in its place, loaded with the
        current weights (:meth:`HybridWorker.replace_engine`); returns its handle and info."""
        offload = self.cfg.trainer.offload_train_state
        where = self.fleet.infos[k]["node"] if k < len(self.fleet.infos) else "its node"
        actor = self.placement.restart_engine(k)
        info = self._wait([actor.info.remote()], [f"rollout engine {k} (restarted on {where})"], "restart")[0]
        if offload:   # the bridge reads the Megatron weights
            self._all("onload")
        self._all("replace_engine", k, actor)
        if offload:
            self._all("offload")
        return actor, info

    def end_rollout(self) -> dict:
        """After a step's generation: the fleet's metrics; GPU colocated, vLLM sleeps to free
        memory for training."""
        from megarl.rollout.engine import sleeps

        if sleeps(self.cfg):
            self._wait_fleet("sleep", self.cfg.rollout.sleep_level)
        m = dict(self.fleet.metrics)
        if self.cfg.trainer.offload_train_state:
            m["memory/offloaded_gb"] = self.offloaded_bytes / 1e9
        return m

    def _wait_fleet(self, method: str, *args) -> list:
        try:
            return self.fleet.call_all(method, *args)
        except BaseException:
            self.failed = True
            raise

    # ------------------------------------------------------------------ training
    def plan(self, rollout: Rollout):
        from megarl.data import plan_batches

        return plan_batches(rollout.lengths(), self.cfg.topology.to_topology(), self.budget)

    def _per_rank(self, rollout, plan, per_sample, routing=None) -> list:
        """Each rank's micro-batches, their extras compacted for the trip (:mod:`megarl.data.wire`:
        lossless; the rank decodes them in :func:`megarl.trainer.worker.receive`)."""
        from megarl.data.wire import encode_batches

        return [encode_batches(micro_batches_for(rollout, plan, i.dp_rank, per_sample, routing)) for i in self.info]

    def _forward(self, method: str, rollout: Rollout, plan, *args, routing=None, per_sample=None) -> dict:
        """A forward-only worker method on every rank's micro-batches (``per_sample``: their
        extras): the DP leaders' outputs (one per micro-batch) by DP rank."""
        outs = self._fan_out(method, [(b, *args) for b in self._per_rank(rollout, plan, per_sample or {}, routing)])
        return {i.dp_rank: o for i, o in zip(self.info, outs) if o is not None}

    def logprobs(self, rollout: Rollout, plan, reference: bool, routing: list | None = None,
                 routing_action: str | None = None, record_routing: bool = False, per_sample: dict | None = None,
                 version: int | None = None, with_kl: bool = False) -> dict:
        """A forward pass before the update (the policy's old log-probs, or with ``reference`` the
        reference model's); its per-token outputs stay on the ranks and in the object store
        (:meth:`megarl.trainer.worker.HybridWorker.logprobs`). Returns per sample what the DP
        leaders made of them: a dict of per-sample lists (``old_logprobs_T`` / ``ref_logprobs_T``
        as :class:`megarl.data.store.Rows`; the old pass adds ``readouts``, ``is_weights_T`` and
        ``mask_T`` of the rollout correction and a routing comparison's ``routing`` sums; the
        reference pass with ``with_kl`` adds ``kl``). ``per_sample``: the micro-batches' extras
        (vLLM's log-probs, versions, the old pass's log-probs); ``version``: the policy version
        whose alarm the old pass reads.

        MoE routing (:mod:`megarl.engine.replay`): ``routing`` per sample ``[P + R, Lm, K]`` is
        compared with (``routing_action`` ``compare``) or replayed in (``replay``) the model's own;
        ``record_routing`` keeps the model's own. :attr:`routing_out` then holds ``recorded`` (per
        sample, a handle on ``[P + R, Lm, K]``) and ``report`` (agreement)."""
        request = PassRequest(reference=reference, routing=routing_action, record_routing=record_routing,
                              version=version, with_kl=with_kl)
        by_rank = self._forward("logprobs", rollout, plan, request, routing=routing if routing_action else None,
                                per_sample=per_sample)

        def per_rank(field: str) -> dict:   # {DP rank: [field of each micro-batch]}
            return {r: [getattr(m, field) for m in p.micro_batches] for r, p in by_rank.items()}

        self.routing_out = {"report": next(iter(by_rank.values())).routing_report,
                            "recorded": scatter_sequences(rollout, plan, per_rank("recorded_routing"))
                            if record_routing else None}
        kept = per_rank("outputs")
        names = next(iter(kept.values()))[0].keys()
        return {k: scatter_sequences(rollout, plan, {r: [x[k] for x in o] for r, o in kept.items()}) for k in names}

    def values(self, rollout: Rollout, plan) -> list:
        """The critic's value of every response token, per sample: a :class:`megarl.data.store.Rows`
        (the DP leaders put them)."""
        return scatter_sequences(rollout, plan, self._forward("values", rollout, plan))

    def advantages(self, rollout: Rollout, adv_fn, adv_opts: dict, kl_coef: float | None, old_lp: list | None,
                   ref_lp: list | None, values: list | None) -> dict:
        """The advantages computed by rank 0 from per-token inputs in the object store (a critic's
        values; with ``kl_coef``, the old and reference log-probs of a KL reward): see
        :func:`megarl.trainer.batch.stored_advantages`. Only lengths, rewards and groups travel."""
        inputs = rollout.advantage_inputs(adv_fn)
        t0 = time.monotonic()
        out = self._wait([self.workers[0].advantages.remote(inputs, adv_fn, adv_opts, kl_coef, old_lp, ref_lp,
                                                            values)], [self._who(0)], "advantages")[0]
        if self.timeline is not None:
            self.timeline.record("rank0", "advantages", t0, time.monotonic())
        return out

    def train(self, rollout: Rollout, plan, per_sample: dict, kl_coef: float, routing: list | None = None,
              own_old_logprobs: bool = False, version: int | None = None) -> tuple[dict, list | None]:
        """One policy update per mini-batch; ``routing`` (per sample ``[P + R, Lm, K]``) is replayed
        in the MoE layers (:mod:`megarl.engine.replay`). Returns ``(metrics, readouts)``.

        ``own_old_logprobs`` (one update per step, no ``old_logprobs_T`` in ``per_sample``; see
        :func:`megarl.config.passes.needs_old_logprob_pass`): the loss takes the training
        forward's own log-probs as the old ones, and ``readouts`` is, per sample, what the
        controller reads of them (:mod:`megarl.trainer.readout`; ``version``: the policy version
        being trained), computed by the DP leaders from ``per_sample``'s ``rollout_logprobs_T``
        (and ``versions_T``, ``ref_logprobs_T``); else ``readouts`` is None."""
        a = self.cfg.algorithm
        assert not own_old_logprobs or (a.ppo_epochs, a.mini_batches) == (1, 1), "own old log-probs: one update only"
        request = UpdateRequest(kl_coef=kl_coef, replay_routing=routing is not None,
                                own_old_logprobs=own_old_logprobs, version=version)
        metrics, outs = self._optimize("train", "actor", rollout, plan, per_sample, request, routing=routing)
        if not own_old_logprobs:
            return metrics, None
        return metrics, scatter_sequences(rollout, plan, outs)

    def posttrain_step(self, batches_per_rank: list, options: dict) -> dict:
        """One optimizer step of an sft / rm stage over each rank's micro-batches (rank order;
        :meth:`HybridWorker.posttrain_step`): rank 0's result; more than
        ``trainer.max_skipped_updates`` skipped in a row raise :class:`NonFiniteLossError`."""
        out = self._fan_out("posttrain_step", [(b, options) for b in batches_per_rank])[0]
        self._count_skips("actor", out)
        return out

    def posttrain_eval(self, batches_per_rank: list, options: dict) -> dict:
        """The held-out sums of an sft / rm stage (:func:`megarl.algorithms.posttrain.eval_sums`, over DP)."""
        return self._fan_out("posttrain_eval", [(b, options) for b in batches_per_rank])[0]

    def reward_model_scores(self, rollout: Rollout, pad_id) -> list[float]:
        """The reward model's score of every sample (prompt + response, trailing ``pad_id``
        tokens off: :func:`megarl.data.packing.trim_pads`), on the training workers: packed,
        balanced over DP ranks like any forward pass."""
        from megarl.data import plan_batches
        from megarl.engine import SequenceBatch
        from megarl.data.packing import trim_pads

        seqs = [trim_pads(p + r, len(p), pad_id) for p, r in zip(rollout.prompt_ids, rollout.responses())]
        plan = plan_batches([len(s) for s in seqs], self.cfg.topology.to_topology(), self.budget)
        batches = [[SequenceBatch([torch.tensor(seqs[i], dtype=torch.long) for i in mb],
                                  [len(rollout.prompt_ids[i]) for i in mb]) for mb in plan.micro_batches[info.dp_rank]]
                   for info in self.info]
        outs = self._fan_out("reward_scores", [(b,) for b in batches])
        by_rank = {i.dp_rank: o for i, o in zip(self.info, outs) if o is not None}
        scores = scatter_sequences(rollout, plan, {r: [s.tolist() for s in o] for r, o in by_rank.items()})
        return [float(s) for s in scores]

    def train_critic(self, rollout: Rollout, plan, per_sample: dict) -> dict:
        return self._optimize("train_critic", "critic", rollout, plan, per_sample)[0]

    def _optimize(self, method: str, tag: str, rollout: Rollout, plan, per_sample: dict, *args,
                  routing: list | None = None) -> tuple[dict, dict]:
        """``ppo_epochs`` passes over ``mini_batches`` chunks of whole groups, one optimizer step each
        (the worker ``method`` returns a :class:`megarl.trainer.messages.UpdateResult`). Returns the metrics and the last pass's ``outputs`` by DP rank (the read-outs of the
        training forward's own log-probs, from the DP leaders of a ``train`` with
        ``own_old_logprobs``; else empty).
        ``<tag>/skipped_updates`` counts the updates skipped for a non-finite loss or gradient
        (:meth:`megarl.engine.policy.PolicyEngine.train_step`), ``<tag>/grad_norm`` averages the
        applied ones; more than ``trainer.max_skipped_updates`` skipped in a row raise
        :class:`NonFiniteLossError`."""
        a = self.cfg.algorithm
        chunks = _mini_batches(rollout, a.mini_batches)
        results = []
        for _ in range(a.ppo_epochs):
            for keep in chunks:
                sub = rollout.select(keep) if len(chunks) > 1 else rollout
                sub_plan = self.plan(sub) if len(chunks) > 1 else plan
                sub_samples = {k: [v[i] for i in keep] for k, v in per_sample.items()} if len(chunks) > 1 \
                    else per_sample
                sub_routing = [routing[i] for i in keep] if routing is not None and len(chunks) > 1 else routing
                batches = self._per_rank(sub, sub_plan, sub_samples, sub_routing)
                outs = self._fan_out(method, [(b, *args) for b in batches])
                outputs = {i.dp_rank: o.outputs for i, o in zip(self.info, outs) if o.outputs is not None}
                results.append(outs[0].metrics)
                self._count_skips(tag, results[-1])
        out = {f"{tag}/{k}": v for k, v in results[-1].items() if isinstance(v, (int, float))}
        self.moe_tokens_per_expert = results[-1].get("moe_tokens_per_expert")   # MoE: [Lm][E], last pass
        applied = [r["grad_norm"] for r in results if r["update_successful"]]
        out[f"{tag}/grad_norm"] = sum(applied) / len(applied) if applied else float("nan")
        out[f"{tag}/optimizer_steps"] = len(results)
        out[f"{tag}/skipped_updates"] = len(results) - len(applied)
        return out, outputs

    def _count_skips(self, tag: str, result: dict) -> None:
        limit = self.cfg.trainer.max_skipped_updates
        self.skipped_in_a_row[tag] = 0 if result["update_successful"] else self.skipped_in_a_row[tag] + 1
        if self.skipped_in_a_row[tag] > limit:
            raise NonFiniteLossError(
                f"{self.skipped_in_a_row[tag]} {tag} updates in a row were skipped for a NaN or inf loss or gradient "
                f"(more than trainer.max_skipped_updates={limit}); the last one's loss: {result['loss']}")

    def sync_weights(self) -> dict:
        """Every engine gets the new weights: ``sync/*`` of rank 0, plus per engine
        ``sync/engine<k>_seconds`` (its loads) and ``sync/engine<k>_bytes`` (what it received), and
        ``sync/bytes_<path>``: the bytes all ranks moved in process, by shared memory within a node
        and over the network between nodes (see :mod:`megarl.bridge.transport`)."""
        from megarl.rollout.engine import sleeps

        if sleeps(self.cfg):
            self._wait_fleet("wake_up")
        stats = self._all("sync_weights")
        out = {f"sync/{k}": v for k, v in stats[0].items()
               if isinstance(v, (int, float)) and not k.startswith("engine_")}
        for s in stats:   # what crossed which path, all ranks: sync/bytes_local, _shm, _gloo or _nccl
            for path, n in s.get("bytes_by_path", {}).items():
                out[f"sync/bytes_{path}"] = out.get(f"sync/bytes_{path}", 0) + n
            if s.get("engine_index") is not None:
                out[f"sync/engine{s['engine_index']}_seconds"] = s["engine_load_seconds"]
                out[f"sync/engine{s['engine_index']}_bytes"] = s["engine_bytes"]
        return out

    def precision(self) -> dict:
        """Rank 0's training dtypes (:meth:`megarl.trainer.worker.HybridWorker.precision`)."""
        return self._wait([self.workers[0].precision.remote()], [self._who(0)], "precision")[0]

    def export_hf(self, folder) -> None:
        """The policy's current weights as an HF folder (:meth:`HybridWorker.export_hf`)."""
        self._all("export_hf", str(folder))

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, ckpt, step: int, metadata: dict, extra=None):
        """Every worker writes its shards (and ``extra(folder)``, when given, the controller's own
        files, e.g. the draft store), then the workers hash them for the manifest
        (:meth:`hash_checkpoint_files`); a failure raises CheckpointError naming step and folder."""
        def write(partial):
            self._all("save_checkpoint", str(partial))
            if extra is not None:
                extra(partial)

        ckpt.save(step, write, metadata, hasher=self.hash_checkpoint_files, tag="run")

    def load_checkpoint(self, folder):
        self._all("load_checkpoint", str(folder))
        if self.fleet is not None:
            self.sync_weights()

    def hash_checkpoint_files(self, folder, relpaths: list[str], sync: bool) -> dict:
        """A :data:`megarl.trainer.checkpoint.Hasher` run by all workers at once, each over the
        slice ``relpaths[rank::world]``: no single process reads a multi-terabyte checkpoint."""
        n = len(self.workers)
        parts = self._fan_out("hash_checkpoint_files", [(str(folder), relpaths[i::n], sync) for i in range(n)])
        return {rel: entry for part in parts for rel, entry in part.items()}


def _mini_batches(rollout: Rollout, count: int) -> list[list[int]]:
    """Split sample indices into ``count`` chunks of whole groups."""
    groups = sorted(set(rollout.group_ids))
    per = [groups[i::count] for i in range(count)]
    chunks = [[j for j, g in enumerate(rollout.group_ids) if g in set(gs)] for gs in per]
    return [c for c in chunks if c]
