"""One RL step's training on the ranks, as one call: the forward passes, the advantages and the
updates that follow a scored rollout and precede the weight sync.

:class:`RankStep` runs, in the algorithm's order: the old log-prob pass (when the step needs one,
:func:`megarl.config.passes.needs_old_logprob_pass`), the reference pass, the critic's values,
what reads the old log-probs (through the driver's :attr:`StepHooks.read`), the advantages, the
critic's update and the policy's. The per-token tensors stay on the ranks and in the object
store: this side holds a handle per sample (:class:`megarl.data.store.Rows`) and the per-sample
read-outs, and sends the ranks lengths, rewards, groups and handles. What belongs to the run, not
to the step (the progress line, the alarm, the sample log, the KL controller, the routing
choices of ``algorithm.router_replay``) comes in :class:`StepHooks`, so the step never imports
the driver.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from megarl.data.batch import Rollout, advantages_with_metrics


@dataclass
class StepHooks:
    """What the driver lends one step of training."""

    step: int
    phase: Callable[..., None]
    """``phase(name, **fields)``: the progress line, and where a stop request waits."""
    timer: object
    """A :class:`megarl.observability.PhaseTimer`: ``time/logprobs``, ``time/critic``, ``time/train``."""
    read: Callable[[Rollout, list, dict], None]
    """``read(rollout, readouts, m)``: what the policy's log-probs before the update feed (the
    rollout-vs-train alarm, metrics, the sample log, the KL controller), from the per-sample
    read-outs (:mod:`megarl.data.readout`)."""
    routing: object
    """The run's :class:`megarl.driver.routing_replay.StepRouting`: which MoE routing each pass uses."""
    kl_ctl: object
    """The KL controller (``value``; ``update`` is :attr:`read`'s)."""
    safe_point: Callable[[dict], None] = lambda m: None
    """``safe_point(m)``, called before the first update: where a stop request abandons the step
    (:meth:`megarl.driver.interrupt.StopRequest.abandon_if_requested`)."""


@dataclass
class ForwardPasses:
    """What the forward passes before the update give; None for a pass that does not run. The
    per-token outputs stay on the ranks: this side holds a handle per sample
    (:class:`megarl.data.store.Rows`) and the per-sample read-outs."""

    plan: object
    """The step's micro-batch plan (:meth:`WorkerGroup.plan`)."""
    old: Optional[dict] = None
    """The old-log-prob pass (:meth:`WorkerGroup.logprobs`): per sample, ``old_logprobs_T``, its
    ``readouts``, the rollout correction's ``is_weights_T`` and ``mask_T``, and a routing
    comparison's sums (``routing``)."""
    ref_lp: Optional[list] = None
    values: Optional[list] = None
    routing_out: dict = field(default_factory=dict)
    """The routing the old log-prob pass recorded (MoE routing actions)."""


class RankStep:
    """The training of one RL step on a group's ranks (:meth:`run`), each pass a method. ``group``
    is a :class:`megarl.actors.group.WorkerGroup` or anything with its pass methods (``plan``,
    ``logprobs``, ``values``, ``advantages``, ``train_critic``, ``train``)."""

    def __init__(self, cfg, group):
        from megarl.config.passes import correction_in_forward, needs_old_logprob_pass
        from megarl.actors.algorithm import resolve

        self.cfg, self.group = cfg, group
        self.adv_fn, self.adv_opts, _ = resolve(cfg.algorithm)
        self.old_pass = needs_old_logprob_pass(cfg)
        self.correct_in_forward = not self.old_pass and correction_in_forward(cfg.algorithm)

    def run(self, rollout: Rollout, hooks: StepHooks, m: dict) -> None:
        """Passes, advantages, updates; ``m`` collects the metrics (also when a phase raises)."""
        passes = self.forward_passes(rollout, hooks, m)
        per_sample, returns = self.advantages(rollout, passes, hooks, m)
        hooks.safe_point(m)                                    # last safe point: the updates follow
        self.update(rollout, passes, per_sample, returns, hooks, m)

    def forward_passes(self, rollout: Rollout, hooks: StepHooks, m: dict) -> ForwardPasses:
        """The old log-prob pass (when the step needs one), the reference pass and the critic's
        values, before the update.

        With one update per step the old log-prob pass is skipped (``actor/old_logprob_pass`` 0):
        the update takes its own forward's log-probs as the old ones (ratio 1), and what reads them
        (the rollout-vs-train alarm, entropy, KL and mismatch metrics, the sample log) reads that
        forward's after the update. The alarm then stops a step after its update, still before
        its weight sync and checkpoint."""
        group = self.group
        if self.old_pass or group.has_reference or group.has_critic:
            hooks.phase("logprobs", reward=m["reward/mean"])
        with hooks.timer("logprobs"):   # ~0 s (the plan only) when no pass runs: the phase is always reported
            out = ForwardPasses(plan=group.plan(rollout))
            if self.old_pass:
                self.old_logprobs(rollout, hooks, out)
            if group.has_reference:
                self.reference_logprobs(rollout, hooks, out)
            if group.has_critic:
                out.values = group.values(rollout, out.plan)
        m["actor/old_logprob_pass"] = int(self.old_pass)
        return out

    def old_logprobs(self, rollout: Rollout, hooks: StepHooks, out: ForwardPasses) -> None:
        """The policy's log-probs before the update, into ``out.old``: the tokens stay on the
        ranks, their read-outs come back."""
        from megarl.data.readout import forward_readout_inputs

        version = hooks.step - 1
        out.old = self.group.logprobs(rollout, out.plan, reference=False, version=version,
                                      per_sample=forward_readout_inputs(rollout, version, False),
                                      **hooks.routing.old_pass(rollout))
        out.routing_out = self.group.routing_out

    def reference_logprobs(self, rollout: Rollout, hooks: StepHooks, out: ForwardPasses) -> None:
        """The reference model's log-probs, into ``out.ref_lp`` (handles). After an old pass the
        ranks add each sample's k1 sum (old - reference) to its read-outs."""
        with_kl = out.old is not None
        ref = self.group.logprobs(rollout, out.plan, reference=True, with_kl=with_kl,
                                  per_sample={"old_logprobs_T": out.old["old_logprobs_T"]} if with_kl else None,
                                  **hooks.routing.reference_pass(rollout))
        out.ref_lp = ref["ref_logprobs_T"]
        for readout, kl in zip(out.old["readouts"] if with_kl else (), ref.get("kl", ())):
            readout["kl"] = kl

    def advantages(self, rollout: Rollout, passes: ForwardPasses, hooks: StepHooks, m: dict) -> tuple[dict, list]:
        """The update's per-sample inputs (old and reference log-probs, the rollout correction or
        vLLM's log-probs for the update's forward to read, advantages) and the critic's returns.

        With an old-log-prob pass its read-outs are read here (:attr:`StepHooks.read`), before the
        update. Without one the update's forward reads its own log-probs on the ranks
        (:mod:`megarl.data.readout`): they get vLLM's log-probs, the tokens' versions when some
        are older than the policy trained, and with token-level tis the tokens it weighs.

        Advantages from per-token inputs (a critic's values, a KL reward's old and reference
        log-probs) are computed on rank 0, where those inputs are (:meth:`WorkerGroup.advantages`);
        outcome-reward advantages (one value a sample) here."""
        from megarl.data.readout import forward_readout_inputs

        cfg, per_sample, old = self.cfg, {}, passes.old
        if old is not None:
            hooks.read(rollout, old["readouts"], m)   # with the rollout_corr/* sums
            m.update(hooks.routing.metrics_from_sums(passes.routing_out, old.get("routing", [])))
            per_sample.update({k: old[k] for k in ("old_logprobs_T", "is_weights_T", "mask_T") if k in old})
        else:
            per_sample.update(forward_readout_inputs(rollout, hooks.step - 1, self.correct_in_forward))
        if passes.ref_lp is not None:
            per_sample["ref_logprobs_T"] = passes.ref_lp
        # -beta * k1 as a per-token reward: the advantages read both passes' tokens
        kl_coef = hooks.kl_ctl.value if old is not None and passes.ref_lp is not None and \
            cfg.algorithm.kl_mode == "reward" else None
        old_lp = old["old_logprobs_T"] if old is not None else None
        if kl_coef is not None or passes.values is not None:
            got = self.group.advantages(rollout, self.adv_fn, self.adv_opts, kl_coef, old_lp, passes.ref_lp,
                                        passes.values)
            per_sample["advantages_T"], returns = got["advantages_T"], got["returns_T"]
            m.update(got["metrics"])
            return per_sample, returns
        # outcome advantages (no per-token input): one value a sample, from the rewards
        per_sample["advantages_T"], returns, m_adv = advantages_with_metrics(rollout, self.adv_fn, self.adv_opts)
        m.update(m_adv)
        return per_sample, returns

    def update(self, rollout: Rollout, passes: ForwardPasses, per_sample: dict, returns: list, hooks: StepHooks,
               m: dict) -> None:
        """The critic's update (PPO), then the policy's. Without an old log-prob pass the update's
        own forward gave the old log-probs: their readers come after it, so the alarm raised there
        stops the run after the update but before the weight sync and the step's checkpoint (the
        updated weights never leave the training workers)."""
        group, routing = self.group, hooks.routing
        if passes.values is not None:
            hooks.phase("critic")
            with hooks.timer("critic"):
                m.update(group.train_critic(rollout, passes.plan,
                                            {"old_values_T": passes.values, "returns_T": returns}))
        forward_ran = self.old_pass or group.has_reference or group.has_critic
        hooks.phase("train", **({} if forward_ran else {"reward": m["reward/mean"]}))
        with hooks.timer("train"):
            m_train, readouts = group.train(rollout, passes.plan, per_sample, hooks.kl_ctl.value,
                                            routing=routing.train_routing(rollout, passes.routing_out),
                                            own_old_logprobs=not self.old_pass, version=hooks.step - 1)
        m.update(m_train)
        if readouts is not None:
            hooks.read(rollout, readouts, m)
        routing.write(hooks.step, group.moe_tokens_per_expert, passes.routing_out)
