"""Reward functions by name, or user functions by dotted path.

Contract for every reward function (built-in or user)::

    fn(response: str, answer: str, **extra) -> float

``response`` is the decoded model output (without the prompt), ``answer`` the dataset's gold
answer string, ``extra`` the prompt row's other columns as keywords: ``data_source`` and every
column beyond the required ones (a ``target_len`` column arrives as ``target_len=...``). The pool
passes only the keywords a function accepts: all of them to ``**extra`` (the built-in rewards take
``**extra`` and ignore what they do not know), else the ones its signature names. It runs in a
worker process under a timeout (:class:`megarl.rewards.pool.RewardPool`), so it must be defined at
module level. Raising is allowed: the sample scores 0.0 and is counted as an error; ending the
worker process on every call stops the run (:class:`megarl.rewards.pool.RewardWorkerCrash`).

Names: ``gsm8k`` and ``arithmetic`` (``#### N`` answers), ``math`` (``\\boxed{}`` answers with
math-verify), ``format`` (answer format only), ``calculator`` and ``calculator_bonus``
(multi-turn tool trajectories, :mod:`megarl.rewards.agent`: the final turn's ``#### N``; the
second adds 0.1 for well-formed tool calls). A name that is not registered but contains ``:``
or ``.`` is imported as ``package.module:function`` or ``package.module.function``
(:mod:`megarl.plugins`).
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
