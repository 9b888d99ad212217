"""Reward functions by name, or user functions by dotted path.

Contract for every reward function (built-in or user)::

    fn(response: str, answer: str, **extra) -> float

``response`` is the decoded model output (without the prompt), ``answer`` the dataset's gold
answer string, ``extra`` the sample's other dataset columns (e.g. ``data_source``); a function
must accept and may ignore unknown keywords. It runs in a worker process under a timeout
(:class:`megarl.rewards.pool.RewardPool`), so it must be defined at module level. Raising is
allowed: the sample scores 0.0 and is counted as an error.

Names: ``gsm8k`` and ``arithmetic`` (``#### N`` answers), ``math`` (``\\boxed{}`` answers with
math-verify), ``format`` (answer format only). A name that is not registered but contains ``:``
or ``.`` is imported as ``package.module:function`` or ``package.module.function``.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from megarl.rewards.math import boxed_math_reward, format_reward, gsm8k_lenient_reward, gsm8k_reward

__all__ = ["REWARD_FUNCTIONS", "get_reward_fn", "load_function", "resolve"]

RewardFn = Callable[..., float]

REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "gsm8k": gsm8k_reward,
    "gsm8k_lenient": gsm8k_lenient_reward,
    "arithmetic": gsm8k_reward,
    "math": boxed_math_reward,
    "format": format_reward,
}


def load_function(path: str) -> Callable[..., Any]:
    """Import ``package.module:attr`` (attr may be ``Class.method``) or ``package.module.attr``.

    Also used by :mod:`megarl.algorithms.registry`; it lives here so reward workers stay torch-free.
    """
    if ":" in path:
        module_name, _, attr_path = path.partition(":")
    else:
        module_name, _, attr_path = path.rpartition(".")
    if not module_name or not attr_path:
        raise ValueError(f"not a dotted path: {path!r}; expected 'package.module:function' or 'package.module.function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import module {module_name!r} for {path!r}: {exc}") from exc
    for attr in attr_path.split("."):
        if not hasattr(obj, attr):
            raise ValueError(f"{path!r}: {module_name!r} has no attribute {attr_path!r}")
        obj = getattr(obj, attr)
    if not callable(obj):
        raise TypeError(f"{path!r} resolved to {type(obj).__name__}, which is not callable")
    return obj


def resolve(name_or_path: str | Callable[..., Any], registry: dict[str, Callable[..., Any]], kind: str) -> Callable[..., Any]:
    """A callable passes through; a registered name is looked up; a dotted path is imported."""
    if callable(name_or_path):
        return name_or_path
    if not isinstance(name_or_path, str):
        raise TypeError(f"{kind} must be a name, a dotted path or a callable, got {type(name_or_path).__name__}")
    if name_or_path in registry:
        return registry[name_or_path]
    if ":" in name_or_path or "." in name_or_path:
        return load_function(name_or_path)
    raise ValueError(f"unknown {kind} {name_or_path!r}; known: {sorted(registry)} (or a dotted path 'package.module:function')")


def get_reward_fn(name_or_path: str | RewardFn) -> RewardFn:
    """Reward function by registry name, dotted path, or a callable passed through."""
    return resolve(name_or_path, REWARD_FUNCTIONS, "reward function")
