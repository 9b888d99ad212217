"""The controller's calls to the training ranks (the HybridWorkers), all at once.

:class:`TrainingRanks` fans a method out over every rank (each with its DP rank's micro-batches,
their extras compacted for the trip by :mod:`megarl.data.wire`), waits with
:func:`megarl.calls.wait_all` (the first failure surfaces at once, a dead rank named by
rank, pid, node and phase) and records each rank's span on the run's timeline; it also carries the
calls of checkpoints, precision and the HF export. :class:`RankPasses` runs the forward passes
before the update (old and reference log-probs, critic values, the reward model's scores) and
rank 0's advantages; the updates are :class:`megarl.actors.updates.RankUpdates`'.
"""
from __future__ import annotations

import time

import torch

from megarl.data.batch import Rollout, micro_batches_for, scatter_sequences
from megarl.calls import wait_all
from megarl.actors.messages import PassRequest, WorkerInfo


class TrainingRanks:
    """The HybridWorkers of a run (``workers``, rank order), called together."""

    def __init__(self, cfg, workers: list, budget):
        """``budget``: the micro-batch budget of :func:`megarl.data.plan_batches`. No call is made
        until :meth:`start`."""
        self.cfg, self.workers, self.budget = cfg, workers, budget
        self.infos: list[WorkerInfo] = []
        """Every rank's :class:`megarl.actors.messages.WorkerInfo`, rank order (from :meth:`start`)."""
        self.failed = False
        """A call failed: the actors may be stuck, the shutdown does not wait long for them."""
        self.timeline = None
        """A :class:`megarl.observability.timeline.Timeline`: each call's span per rank (lane rankR)."""

    def start(self) -> None:
        """Wait for the ranks to start; learn where each runs (:attr:`infos`)."""
        self.infos = self.call("info")

    def call(self, method: str, *args) -> list:
        """``method(*args)`` on every worker: their results, rank order."""
        return self.fan_out(method, [args] * len(self.workers))

    def fan_out(self, method: str, args_per_worker: list) -> list:
        """``method(*args)`` on every worker (``args_per_worker`` in rank order): their results."""
        t0 = time.monotonic()
        refs = [getattr(w, method).remote(*args) for w, args in zip(self.workers, args_per_worker)]
        done_at: list = [None] * len(refs)
        out = self.wait(refs, [self.who(rank) for rank in range(len(refs))], method, done_at)
        if self.timeline is not None:   # a rank is busy from the call until its own result is in
            for rank, t in enumerate(done_at):
                self.timeline.record(f"rank{rank}", method, t0, t or time.monotonic())
        return out

    def rank0(self, method: str, *args, record: bool = False):
        """``method(*args)`` on rank 0 alone: its result (``record``: its span on the timeline)."""
        t0 = time.monotonic()
        out = self.wait([getattr(self.workers[0], method).remote(*args)], [self.who(0)], method)[0]
        if record and self.timeline is not None:
            self.timeline.record("rank0", method, t0, time.monotonic())
        return out

    def wait(self, refs: list, names: list[str], phase: str, done_at: list | None = None) -> list:
        """:func:`megarl.calls.wait_all`; a failure marks the ranks :attr:`failed`."""
        try:
            return wait_all(refs, names, phase, done_at=done_at)
        except BaseException:
            self.failed = True   # the shutdown will not wait long for actors that may be stuck
            raise

    def who(self, rank: int) -> str:
        """``training worker rank R (pid P on NODE)`` (pid and node once known)."""
        notes = f" (pid {self.infos[rank].pid} on {self.infos[rank].node})" if self.infos else ""
        return f"training worker rank {rank}{notes}"

    # ------------------------------------------------------------------ micro-batches
    def plan(self, rollout: Rollout):
        """The step's micro-batch plan: sequences balanced over DP ranks, under the budget."""
        from megarl.data import plan_batches

        return plan_batches(rollout.lengths(), self.cfg.topology.to_topology(), self.budget)

    def per_rank(self, rollout: Rollout, plan, per_sample: dict, routing=None) -> list:
        """Each rank's micro-batches, their extras compacted for the trip (:mod:`megarl.data.wire`:
        lossless; the rank decodes them in :func:`megarl.actors.worker.receive`)."""
        from megarl.data.wire import encode_batches

        return [encode_batches(micro_batches_for(rollout, plan, i.dp_rank, per_sample, routing)) for i in self.infos]

    def forward(self, method: str, rollout: Rollout, plan, *args, routing=None, per_sample=None) -> dict:
        """A forward-only worker method on every rank's micro-batches (``per_sample``: their
        extras): the DP leaders' outputs (one per micro-batch) by DP rank."""
        outs = self.fan_out(method, [(b, *args) for b in self.per_rank(rollout, plan, per_sample or {}, routing)])
        return {i.dp_rank: o for i, o in zip(self.infos, outs) if o is not None}

    # ------------------------------------------------------------------ checkpoints, precision, export
    def save_checkpoint(self, ckpt, step: int, metadata: dict, extra=None):
        """Every worker writes its shards (and ``extra(folder)``, when given, the controller's own
        files, e.g. the draft store), then the workers hash them for the manifest
        (:meth:`hash_checkpoint_files`); a failure raises CheckpointError naming step and folder."""
        def write(partial):
            self.call("save_checkpoint", str(partial))
            if extra is not None:
                extra(partial)

        ckpt.save(step, write, metadata, hasher=self.hash_checkpoint_files, tag="run")

    def load_checkpoint(self, folder) -> None:
        self.call("load_checkpoint", str(folder))

    def hash_checkpoint_files(self, folder, relpaths: list[str], sync: bool) -> dict:
        """A :data:`megarl.checkpoint_files.Hasher` run by all workers at once, each over the
        slice ``relpaths[rank::world]``: no single process reads a multi-terabyte checkpoint."""
        n = len(self.workers)
        parts = self.fan_out("hash_checkpoint_files", [(str(folder), relpaths[i::n], sync) for i in range(n)])
        return {rel: entry for part in parts for rel, entry in part.items()}

    def precision(self) -> dict:
        """Rank 0's training dtypes (:meth:`megarl.actors.roles.PolicyRole.precision`)."""
        return self.rank0("precision")

    def export_hf(self, folder) -> None:
        """The policy's current weights as an HF folder (:meth:`megarl.actors.roles.PolicyRole.export_hf`)."""
        self.call("export_hf", str(folder))


class RankPasses:
    """The forward passes before the update, on the training ranks: their per-token outputs stay
    on the ranks and in the object store; the controller gets per-sample handles and read-outs."""

    def __init__(self, ranks: TrainingRanks):
        self.ranks = ranks
        self.routing_out: dict = {}
        """The last old / reference pass's MoE routing: ``recorded`` (per sample, a handle on
        ``[P + R, Lm, K]``, with ``record_routing``; else None) and ``report`` (agreement)."""

    def logprobs(self, rollout: Rollout, plan, reference: bool, routing: list | None = None,
                 routing_action: str | None = None, record_routing: bool = False, per_sample: dict | None = None,
                 version: int | None = None, with_kl: bool = False) -> dict:
        """A forward pass before the update (the policy's old log-probs, or with ``reference`` the
        reference model's; :meth:`megarl.actors.worker.HybridWorker.logprobs`). Returns per
        sample what the DP leaders made of them: a dict of per-sample lists (``old_logprobs_T`` /
        ``ref_logprobs_T`` as :class:`megarl.data.store.Rows`; the old pass adds ``readouts``,
        ``is_weights_T`` and ``mask_T`` of the rollout correction and a routing comparison's
        ``routing`` sums; the reference pass with ``with_kl`` adds ``kl``). ``per_sample``: the
        micro-batches' extras (vLLM's log-probs, versions, the old pass's log-probs); ``version``:
        the policy version whose alarm the old pass reads.

        MoE routing (:mod:`megarl.policy.replay`): ``routing`` per sample ``[P + R, Lm, K]`` is
        compared with (``routing_action`` ``compare``) or replayed in (``replay``) the model's own;
        ``record_routing`` keeps the model's own (:attr:`routing_out`)."""
        request = PassRequest(reference=reference, routing=routing_action, record_routing=record_routing,
                              version=version, with_kl=with_kl)
        by_rank = self.ranks.forward("logprobs", rollout, plan, request, routing=routing if routing_action else None,
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
        return scatter_sequences(rollout, plan, self.ranks.forward("values", rollout, plan))

    def advantages(self, rollout: Rollout, adv_fn, adv_opts: dict, kl_coef: float | None, old_lp: list | None,
                   ref_lp: list | None, values: list | None) -> dict:
        """The advantages computed by rank 0 from per-token inputs in the object store (a critic's
        values; with ``kl_coef``, the old and reference log-probs of a KL reward): see
        :func:`megarl.data.batch.stored_advantages`. Only lengths, rewards and groups travel."""
        inputs = rollout.advantage_inputs(adv_fn)
        return self.ranks.rank0("advantages", inputs, adv_fn, adv_opts, kl_coef, old_lp, ref_lp, values, record=True)

    def reward_model_scores(self, rollout: Rollout, pad_id) -> list[float]:
        """The reward model's score of every sample (prompt + response, trailing ``pad_id``
        tokens off: :func:`megarl.data.packing.trim_pads`), on the training workers: packed,
        balanced over DP ranks like any forward pass."""
        from megarl.data import plan_batches
        from megarl.data.packing import trim_pads
        from megarl.policy import SequenceBatch

        ranks = self.ranks
        seqs = [trim_pads(p + r, len(p), pad_id) for p, r in zip(rollout.prompt_ids, rollout.responses())]
        plan = plan_batches([len(s) for s in seqs], ranks.cfg.topology.to_topology(), ranks.budget)
        batches = [[SequenceBatch([torch.tensor(seqs[i], dtype=torch.long) for i in mb],
                                  [len(rollout.prompt_ids[i]) for i in mb]) for mb in plan.micro_batches[info.dp_rank]]
                   for info in ranks.infos]
        outs = ranks.fan_out("reward_scores", [(b,) for b in batches])
        by_rank = {i.dp_rank: o for i, o in zip(ranks.infos, outs) if o is not None}
        scores = scatter_sequences(rollout, plan, {r: [s.tolist() for s in o] for r, o in by_rank.items()})
        return [float(s) for s in scores]
