"""Verifiable rewards: math answer checks, a registry by name or dotted path, a timed worker pool.

Imports no torch (reward workers import this package).
"""

from megarl.rewards.math import answers_equivalent, boxed_math_reward, extract_boxed, extract_gsm8k_answer, format_reward, gsm8k_reward
from megarl.rewards.pool import RewardBatchResult, RewardPool, RewardWorkerCrash
from megarl.rewards.registry import REWARD_FUNCTIONS, get_reward_fn

__all__ = [
    "REWARD_FUNCTIONS",
    "RewardBatchResult",
    "RewardPool",
    "RewardWorkerCrash",
    "answers_equivalent",
    "boxed_math_reward",
    "extract_boxed",
    "extract_gsm8k_answer",
    "format_reward",
    "get_reward_fn",
    "gsm8k_reward",
]
