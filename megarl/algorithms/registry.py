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
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from megarl.algorithms.losses import gspo_policy_loss, ppo_policy_loss
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
    "gae": gae_advantages,
}

POLICY_LOSSES: dict[str, Callable[..., Any]] = {
    "ppo": ppo_policy_loss,
    "gspo": gspo_policy_loss,
}


def get_advantage_estimator(name_or_path: str | Callable[..., Any]) -> Callable[..., Any]:
    """Advantage estimator by name (grpo, drgrpo, rloo, reinforce_pp, gae) or dotted path."""
    return resolve(name_or_path, ADVANTAGE_ESTIMATORS, "advantage estimator")


def get_policy_loss(name_or_path: str | Callable[..., Any]) -> Callable[..., Any]:
    """Policy loss by name (ppo, gspo) or dotted path."""
    return resolve(name_or_path, POLICY_LOSSES, "policy loss")
