"""RL algorithms as pure torch functions over packed response tokens.

advantages (GRPO, Dr.GRPO, RLOO, REINFORCE++, GAE), losses (PPO clip / clip-higher / dual-clip,
GSPO, value loss, aggregation modes), kl (k1/k2/k3, loss or reward penalty, controllers),
dapo (dynamic sampling, overlong shaping), offpolicy (rollout-training mismatch: TIS, masked IS,
IcePop, metrics), registry (by name or dotted path). The packed layout shared by all of them is
described in :mod:`megarl.algorithms.packed`.
"""

from megarl.algorithms.advantages import AdvantageResult
from megarl.algorithms.kl import build_kl_controller, kl_estimate, kl_loss, kl_reward_penalty
from megarl.algorithms.losses import AGG_MODES, aggregate_loss, value_loss
from megarl.algorithms.registry import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    get_advantage_estimator,
    get_policy_loss,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGG_MODES",
    "POLICY_LOSSES",
    "AdvantageResult",
    "aggregate_loss",
    "build_kl_controller",
    "get_advantage_estimator",
    "get_policy_loss",
    "kl_estimate",
    "kl_loss",
    "kl_reward_penalty",
    "value_loss",
]
