"""Reward functions by name, or user functions by dotted path.

Contract for every reward function: ``fn(response: str, answer: str, **extra) -> float`` with the
decoded response (no prompt), the gold answer string, and the prompt row's other columns as
keywords (``data_source``, and e.g. a ``target_len`` column as ``target_len=...``); the pool passes
only the keywords a function accepts. It runs in a worker process under a timeout
(:class:`megarl.rewards.pool.RewardPool`), so it must be defined at module level. Raising scores
0.0 and counts an error; ending the worker on every call stops the run.

Names: ``gsm8k`` and ``arithmetic`` (``#### N``), ``math`` (``\\boxed{}`` with math-verify),
``format``, ``calculator`` and ``calculator_bonus`` (:mod:`megarl.rewards.agent`; the second adds
0.1 for well-formed tool calls). Anything else with ``:`` or ``.`` is imported as
``package.module:function`` or ``package.module.function`` (:mod:`megarl.plugins`).
"""

from __future__ import annotations

from typing import Callable

from megarl.plugins import resolve
from megarl.rewards.agent import calculator_bonus_reward, calculator_reward
from megarl.rewards.math import boxed_math_reward, format_reward, gsm8k_lenient_reward, gsm8k_reward

__all__ = ["REWARD_FUNCTIONS", "get_reward_fn"]

RewardFn = Callable[..., float]

REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "gsm8k": gsm8k_reward,
    "gsm8k_lenient": gsm8k_lenient_reward,
    "arithmetic": gsm8k_reward,
    "math": boxed_math_reward,
    "format": format_reward,
    "calculator": calculator_reward,
    "calculator_bonus": calculator_bonus_reward,
}


def get_reward_fn(name_or_path: str | RewardFn) -> RewardFn:
    """Reward function by registry name, dotted path, or a callable passed through."""
    return resolve(name_or_path, REWARD_FUNCTIONS, "reward function")
