"""Registries of advantage estimators and policy losses (user functions by dotted path).

Names map to functions in plain dicts; an unknown name raises ValueError listing the known ones.
Anything that is not a registered name but contains ``:`` or ``.`` is imported as a dotted path,
``package.module:function`` or ``package.module.function`` (the function must be importable in
every process that uses it, i.e. defined at module level; the loader is :mod:`megarl.plugins`).

Contracts for user functions (the tests in tests/unit/test_advantages.py and test_losses.py check
the built-ins against them):

- advantage estimator::

      fn(*, rewards_N, cu_seqlens_N1, mask_T, group_ids_N, token_rewards_T=None, values_T=None,
         **options) -> AdvantageResult(advantages_T, returns_T)   # or a 2-tuple of tensors

  Two inputs are passed only to an estimator whose signature names them: ``logprobs_T`` (the
  sampling policy's log-prob of each sampled token, vLLM's; NaN where none, e.g. inserted tool
  results) and ``baseline_rewards_N`` (the reward of the greedy response to each sequence's
  prompt, generated in the same step: ``remax``).

- policy loss::

      fn(logprobs_T, old_logprobs_T, advantages_T, mask_T, cu_seqlens_N1, **options)
          -> (loss: 0-dim tensor, metrics: dict[str, tensor])

See :mod:`megarl.algorithms.advantages` and :mod:`megarl.algorithms.losses` for the layout.
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
