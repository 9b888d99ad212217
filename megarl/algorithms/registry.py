"""Registries of advantage estimators and policy losses (user functions by dotted path).

Names map to functions in plain dicts; an unknown name raises ValueError listing the known ones.
Anything else containing ``:`` or ``.`` is imported as ``package.module:function`` or
``package.module.function`` by :mod:`megarl.plugins` (module level, so importable in every
process). User functions follow the built-ins' contracts (tests/unit/test_advantages.py and
test_losses.py check those): an estimator as in :mod:`megarl.algorithms.advantages` (returning
an ``AdvantageResult`` or a 2-tuple), a policy loss as in :mod:`megarl.algorithms.losses`.

Two inputs reach only an estimator whose signature names them: ``logprobs_T`` (the sampling
policy's log-prob of each sampled token, vLLM's; NaN where none, e.g. inserted tool results) and
``baseline_rewards_N`` (the reward of the greedy response to each sequence's prompt, generated in
the same step: ``remax``).
"""

from __future__ import annotations

from typing import Any, Callable

from megarl.algorithms.advantages import (
    drgrpo_advantages,
    gae_advantages,
    gpg_advantages,
    grpo_advantages,
    grpo_passk_advantages,
    opo_advantages,
    optimal_token_baseline_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    remax_advantages,
    rloo_advantages,
)
from megarl.algorithms.losses import gspo_policy_loss, ppo_policy_loss
from megarl.algorithms.pg_losses import (
    cispo_policy_loss,
    clip_cov_policy_loss,
    geo_mean_policy_loss,
    gpg_policy_loss,
    kl_cov_policy_loss,
    sapo_policy_loss,
)
from megarl.plugins import resolve

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "POLICY_LOSSES",
    "get_advantage_estimator",
    "get_policy_loss",
]

ADVANTAGE_ESTIMATORS: dict[str, Callable[..., Any]] = {
    "grpo": grpo_advantages,
    "drgrpo": drgrpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp": reinforce_pp_advantages,
    "reinforce_pp_baseline": reinforce_pp_baseline_advantages,
    "gae": gae_advantages,
    "grpo_passk": grpo_passk_advantages,
    "opo": opo_advantages,
    "gpg": gpg_advantages,
    "remax": remax_advantages,
    "optimal_token_baseline": optimal_token_baseline_advantages,
}

POLICY_LOSSES: dict[str, Callable[..., Any]] = {
    "ppo": ppo_policy_loss,
    "gspo": gspo_policy_loss,
    "sapo": sapo_policy_loss,
    "cispo": cispo_policy_loss,
    "geo_mean": geo_mean_policy_loss,
    "clip_cov": clip_cov_policy_loss,
    "kl_cov": kl_cov_policy_loss,
    "gpg": gpg_policy_loss,
}


def get_advantage_estimator(name_or_path: str | Callable[..., Any]) -> Callable[..., Any]:
    """Advantage estimator by name (:data:`ADVANTAGE_ESTIMATORS`) or dotted path."""
    return resolve(name_or_path, ADVANTAGE_ESTIMATORS, "advantage estimator")


def get_policy_loss(name_or_path: str | Callable[..., Any]) -> Callable[..., Any]:
    """Policy loss by name (:data:`POLICY_LOSSES`) or dotted path."""
    return resolve(name_or_path, POLICY_LOSSES, "policy loss")
