"""The optimizer steps on the training ranks: policy and critic updates of an RL step, and the
steps of an ``sft`` / ``rm`` stage.

An RL update is ``algorithm.ppo_epochs`` passes over ``algorithm.mini_batches`` chunks of whole
prompt groups, one optimizer step per chunk, every rank with its DP rank's micro-batches of the
chunk. A step whose loss or gradient is not finite is skipped by the engine
(:meth:`megarl.policy.model.PolicyModel.train_step`); more than ``trainer.max_skipped_updates``
in a row raise :class:`NonFiniteLossError`.
"""
from __future__ import annotations

from megarl.data.batch import Rollout, scatter_sequences
from megarl.actors.messages import UpdateRequest


class NonFiniteLossError(RuntimeError):
    """More than ``trainer.max_skipped_updates`` optimizer updates in a row were skipped for a NaN
    or inf loss or gradient."""


class RankUpdates:
    """The updates of a run's training ranks (:class:`megarl.actors.ranks.TrainingRanks`)."""

    def __init__(self, ranks):
        self.ranks = ranks
        self.skipped_in_a_row = {"actor": 0, "critic": 0}
        self.moe_tokens_per_expert = None
        """MoE: the last update's tokens per expert ``[Lm][E]`` (its last pass); else None."""

    def reset_skips(self) -> None:
        """A new run on the same ranks counts its skipped updates from zero."""
        self.skipped_in_a_row = {"actor": 0, "critic": 0}

    def train(self, rollout: Rollout, plan, per_sample: dict, kl_coef: float, routing: list | None = None,
              own_old_logprobs: bool = False, version: int | None = None) -> tuple[dict, list | None]:
        """One policy update per mini-batch; ``routing`` (per sample ``[P + R, Lm, K]``) is replayed
        in the MoE layers (:mod:`megarl.policy.replay`). Returns ``(metrics, readouts)``.

        ``own_old_logprobs`` (one update per step, no ``old_logprobs_T`` in ``per_sample``; see
        :func:`megarl.config.passes.needs_old_logprob_pass`): the loss takes the training
        forward's own log-probs as the old ones, and ``readouts`` is, per sample, what the
        controller reads of them (:mod:`megarl.data.readout`; ``version``: the policy version
        being trained), computed by the DP leaders from ``per_sample``'s ``rollout_logprobs_T``
        (and ``versions_T``, ``ref_logprobs_T``); else ``readouts`` is None."""
        a = self.ranks.cfg.algorithm
        assert not own_old_logprobs or (a.ppo_epochs, a.mini_batches) == (1, 1), "own old log-probs: one update only"
        request = UpdateRequest(kl_coef=kl_coef, replay_routing=routing is not None,
                                own_old_logprobs=own_old_logprobs, version=version)
        metrics, outs = self.optimize("train", "actor", rollout, plan, per_sample, request, routing=routing)
        if not own_old_logprobs:
            return metrics, None
        return metrics, scatter_sequences(rollout, plan, outs)

    def train_critic(self, rollout: Rollout, plan, per_sample: dict) -> dict:
        """One critic update per mini-batch (``per_sample``: ``old_values_T``, ``returns_T``): its metrics."""
        return self.optimize("train_critic", "critic", rollout, plan, per_sample)[0]

    def optimize(self, method: str, tag: str, rollout: Rollout, plan, per_sample: dict, *args,
                 routing: list | None = None) -> tuple[dict, dict]:
        """``ppo_epochs`` passes over ``mini_batches`` chunks of whole groups, one optimizer step each
        (the worker ``method`` returns a :class:`megarl.actors.messages.UpdateResult`). Returns the
        metrics and the last pass's ``outputs`` by DP rank (the read-outs of the training forward's
        own log-probs, from the DP leaders of a ``train`` with ``own_old_logprobs``; else empty).
        ``<tag>/skipped_updates`` counts the updates skipped for a non-finite loss or gradient,
        ``<tag>/grad_norm`` averages the applied ones."""
        ranks, a = self.ranks, self.ranks.cfg.algorithm
        chunks = _mini_batches(rollout, a.mini_batches)
        results = []
        for _ in range(a.ppo_epochs):
            for keep in chunks:
                sub = rollout.select(keep) if len(chunks) > 1 else rollout
                sub_plan = ranks.plan(sub) if len(chunks) > 1 else plan
                sub_samples = {k: [v[i] for i in keep] for k, v in per_sample.items()} if len(chunks) > 1 \
                    else per_sample
                sub_routing = [routing[i] for i in keep] if routing is not None and len(chunks) > 1 else routing
                batches = ranks.per_rank(sub, sub_plan, sub_samples, sub_routing)
                outs = ranks.fan_out(method, [(b, *args) for b in batches])
                outputs = {i.dp_rank: o.outputs for i, o in zip(ranks.infos, outs) if o.outputs is not None}
                results.append(outs[0].metrics)
                self.count_skips(tag, results[-1])
        out = {f"{tag}/{k}": v for k, v in results[-1].items() if isinstance(v, (int, float))}
        self.moe_tokens_per_expert = results[-1].get("moe_tokens_per_expert")   # MoE: [Lm][E], last pass
        applied = [r["grad_norm"] for r in results if r["update_successful"]]
        out[f"{tag}/grad_norm"] = sum(applied) / len(applied) if applied else float("nan")
        out[f"{tag}/optimizer_steps"] = len(results)
        out[f"{tag}/skipped_updates"] = len(results) - len(applied)
        return out, outputs

    def posttrain_step(self, batches_per_rank: list, options: dict) -> dict:
        """One optimizer step of an sft / rm stage over each rank's micro-batches (rank order;
        :meth:`megarl.actors.roles.PolicyRole.posttrain_step`): rank 0's metrics."""
        out = self.ranks.fan_out("posttrain_step", [(b, options) for b in batches_per_rank])[0]
        self.count_skips("actor", out)
        return out

    def posttrain_eval(self, batches_per_rank: list, options: dict) -> dict:
        """The held-out sums of an sft / rm stage (:func:`megarl.algorithms.posttrain.eval_sums`, over DP)."""
        return self.ranks.fan_out("posttrain_eval", [(b, options) for b in batches_per_rank])[0]

    def count_skips(self, tag: str, result: dict) -> None:
        """Count an update skipped for a non-finite loss or gradient (``result``: its metrics);
        more than ``trainer.max_skipped_updates`` in a row raise :class:`NonFiniteLossError`."""
        limit = self.ranks.cfg.trainer.max_skipped_updates
        self.skipped_in_a_row[tag] = 0 if result["update_successful"] else self.skipped_in_a_row[tag] + 1
        if self.skipped_in_a_row[tag] > limit:
            raise NonFiniteLossError(
                f"{self.skipped_in_a_row[tag]} {tag} updates in a row were skipped for a NaN or inf loss or gradient "
                f"(more than trainer.max_skipped_updates={limit}); the last one's loss: {result['loss']}")


def _mini_batches(rollout: Rollout, count: int) -> list[list[int]]:
    """Split sample indices into ``count`` chunks of whole groups."""
    groups = sorted(set(rollout.group_ids))
    per = [groups[i::count] for i in range(count)]
    chunks = [[j for j, g in enumerate(rollout.group_ids) if g in set(gs)] for gs in per]
    return [c for c in chunks if c]
