"""Which forward passes a step runs, from the config alone (the loop, and the planner's
data-plane bytes, ask the same question).

Here, not in :mod:`megarl.actors.algorithm`, so that :mod:`megarl.planner` can ask without
importing the trainer.
"""
from __future__ import annotations

from megarl.config.schema import AlgorithmConfig


def needs_old_logprob_pass(cfg) -> bool:
    """Whether a step runs the separate old-log-prob pass (a forward of the policy before its
    update) or takes the old log-probs from the training forward itself. ``cfg``: a
    :class:`megarl.config.schema.MegaRLConfig`.

    With one update per step (``algorithm.ppo_epochs`` 1, ``algorithm.mini_batches`` 1) the only
    forward of the policy before that update is the training forward: its log-probs *are* the old
    ones (ratio exactly 1, the clip inactive), so the pass computes nothing the update lacks, and
    the consumers that only read them (the rollout-vs-train alarm, ``actor/entropy``, the sample
    log, the mismatch metrics ``rollout_corr/*``, the k1 ``actor/kl`` metric) take the training
    forward's after the update. The pass stays when something needs them *before* the update:

    - several updates per step (``ppo_epochs`` or ``mini_batches`` > 1): every update after the
      first needs the log-probs of the policy before the first;
    - a KL term that acts before the update (``kl_coef`` > 0 with ``kl_mode`` reward: the penalty
      shapes the advantages; or with ``kl_target``: the adaptive controller sets this step's
      coefficient from this step's KL);
    - ``rollout_correction`` mask or icepop, or tis at sequence level: its masks enter the loss and
      the masked token counts that normalise it, or a whole sequence's weight (token-level tis does
      not: :func:`correction_in_forward`);
    - MoE routing in that pass (``router_replay`` r2 records the routing the updates replay; r3, or
      ``rollout.return_routing``, compares the trainer's routing with vLLM's there: the routing/*
      metrics).

    Not reasons to keep it: a critic (GAE reads the critic's own values pass, not the policy's
    log-probs), advantages from rewards (grpo, rloo, reinforce_pp, drgrpo), a KL loss with a fixed
    coefficient (the reference pass still runs), ``entropy_coef`` and the off-policy trainer modes
    without a rollout correction (decoupled PPO's proximal policy is the current weights, which
    the training forward computes; :mod:`megarl.algorithms.offpolicy`)."""
    a = cfg.algorithm
    return (a.ppo_epochs > 1 or a.mini_batches > 1
            or (a.kl_coef > 0 and (a.kl_mode == "reward" or a.kl_target is not None))
            or a.rollout_correction not in ("none", None) and not correction_in_forward(a)
            or a.router_replay != "off" or cfg.rollout.return_routing)


def correction_in_forward(cfg: AlgorithmConfig) -> bool:
    """Whether the rollout correction's weights can come from the update's own forward when it
    is the step's only one: token-level tis, min(pi_train / pi_vLLM, cap) per token, where pi_train
    is the policy before the update, i.e. that forward's log-probs (detached). Nothing else needs
    them before the update (the kept tokens and their count are those with a vLLM log-prob), so
    the step runs no extra pass for it: the cheap correction for the rollout-training mismatch
    that bf16 brings (:func:`megarl.config.loader.resolve_presets` turns it on under bf16)."""
    return cfg.rollout_correction == "tis" and cfg.correction_level == "token"


__all__ = ["needs_old_logprob_pass", "correction_in_forward"]
