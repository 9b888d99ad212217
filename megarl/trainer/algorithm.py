"""From ``algorithm`` config to the advantage estimator and the engine's ``loss_fn``.

Presets (overridable with ``algorithm.advantage`` / ``algorithm.policy_loss``):

========  ==============  ===========  ==============================================
name      advantage       policy loss  notes
========  ==============  ===========  ==============================================
grpo      grpo            ppo          group mean / std
drgrpo    drgrpo          ppo          no std division; pair with seq-mean-token-sum-norm
dapo      grpo            ppo          clip-higher + dynamic sampling + overlong shaping
rloo      rloo            ppo          leave-one-out baseline
reinforce_pp  reinforce_pp  ppo        batch-normalised returns
gspo      grpo            gspo         sequence-level ratio
ppo       gae             ppo          with a critic (value-head GPTModel), gamma / lam
========  ==============  ===========  ==============================================

Legend: N sequences, T packed response tokens, N1 = N + 1.
"""
from __future__ import annotations

from megarl.config.schema import AlgorithmConfig

PRESETS = {
    "grpo": ("grpo", "ppo"),
    "drgrpo": ("drgrpo", "ppo"),
    "dapo": ("grpo", "ppo"),
    "rloo": ("rloo", "ppo"),
    "reinforce_pp": ("reinforce_pp", "ppo"),
    "gspo": ("grpo", "gspo"),
    "ppo": ("gae", "ppo"),
}


def resolve(cfg: AlgorithmConfig):
    """(advantage fn, advantage options, policy-loss fn) for the configured algorithm."""
    from megarl.algorithms import get_advantage_estimator, get_policy_loss

    adv_name, loss_name = PRESETS[cfg.name]
    adv_fn = get_advantage_estimator(cfg.advantage or adv_name)
    adv_opts = {}
    if (cfg.advantage or adv_name) == "grpo":
        adv_opts["norm_by_std"] = cfg.norm_adv_by_std
    if (cfg.advantage or adv_name) == "reinforce_pp":
        adv_opts["gamma"] = cfg.gamma
    if needs_critic(cfg):
        adv_opts.update(gamma=cfg.gamma, lam=cfg.lam)
    return adv_fn, adv_opts, get_policy_loss(cfg.policy_loss or loss_name)


def needs_critic(cfg: AlgorithmConfig) -> bool:
    """GAE advantages need a critic's per-token values."""
    return (cfg.advantage or PRESETS[cfg.name][0]) == "gae"


def make_value_loss_fn(cfg: AlgorithmConfig, max_response_tokens: int):
    """``loss_fn(values_R, batch)`` for the critic's ``train_step``: clipped value loss towards
    ``extras['returns_T']`` around ``extras['old_values_T']`` (the rollout's values)."""
    from megarl.algorithms.losses import value_loss

    def loss_fn(values_R, batch):
        ex = batch.extras
        return value_loss(values_R, ex["old_values_T"], ex["returns_T"], ex["mask_T"], batch.cu_seqlens_N1,
                          clip_range=cfg.value_clip, agg_mode=cfg.loss_agg_mode,
                          max_response_length=max_response_tokens, num_tokens=batch.num_global_tokens,
                          num_seqs=batch.num_global_sequences)

    return loss_fn


def make_loss_fn(cfg: AlgorithmConfig, max_response_tokens: int, kl_coef: float = 0.0):
    """``loss_fn(logprobs_R, batch) -> (loss, metrics)`` for :meth:`PolicyEngine.train_step`.

    ``batch.extras`` holds ``old_logprobs_T``, ``advantages_T``, ``mask_T`` and, with a KL loss,
    ``ref_logprobs_T``. Denominators are the step's global counts, so micro-batch losses sum to
    the loss of the whole step.
    """
    from megarl.algorithms import kl_loss

    _, _, policy_loss = resolve(cfg)
    gspo = (cfg.policy_loss or PRESETS[cfg.name][1]) == "gspo"

    def loss_fn(logprobs_R, batch):
        ex, cu = batch.extras, batch.cu_seqlens_N1
        counts = dict(num_tokens=batch.num_global_tokens, num_seqs=batch.num_global_sequences,
                      max_response_length=max_response_tokens)
        clip = {} if gspo else dict(clip_eps_low=cfg.clip_low, clip_eps_high=cfg.clip_high,
                                    dual_clip_c=cfg.dual_clip_c)
        loss, metrics = policy_loss(logprobs_R, ex["old_logprobs_T"], ex["advantages_T"], ex["mask_T"], cu,
                                    agg_mode=cfg.loss_agg_mode, entropy_T=ex.get("entropy_T"),
                                    entropy_coef=cfg.entropy_coef, **clip, **counts)
        metrics = dict(metrics)
        if kl_coef > 0 and cfg.kl_mode == "loss":
            kl, kl_metrics = kl_loss(logprobs_R, ex["ref_logprobs_T"], ex["mask_T"], cu, kind=cfg.kl_estimator,
                                     agg_mode=cfg.loss_agg_mode, **counts)
            loss = loss + kl_coef * kl
            metrics["kl"] = kl_metrics["kl"]
        return loss, metrics

    return loss_fn
