"""DAPO extras (Yu et al. 2025): dynamic sampling and overlong reward shaping.

Dynamic sampling: a group whose rewards are all equal has zero group-relative advantage and adds
only noise to the normaliser, so DAPO drops such groups and generates more until the batch holds
enough informative ones. :func:`dynamic_sampling` takes a ``sample_fn()`` callback (so it runs
without an engine) and, unlike the paper, returns a partial batch at ``max_tries`` by default.

Overlong reward shaping (:func:`overlong_penalty`): the "soft overlong punishment", a penalty that
grows linearly over the last ``buffer_length`` tokens before the response limit, added to the
task reward.

Shape legend: N sequences, G groups.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from megarl.algorithms.packed import group_index

__all__ = [
    "is_informative_group",
    "informative_group_mask",
    "DynamicSamplingResult",
    "dynamic_sampling",
    "overlong_penalty",
]


def _default_rewards_of(group: Any) -> Sequence[float]:
    if isinstance(group, Mapping):
        return group["rewards"]
    return group.rewards


def is_informative_group(rewards: Sequence[float]) -> bool:
    """True when a group's rewards are not all equal (so its GRPO advantages are not all zero)."""
    values = [float(r) for r in rewards]
    return len(values) > 1 and max(values) != min(values)


def informative_group_mask(rewards_N: torch.Tensor, group_ids_N: torch.Tensor) -> torch.Tensor:
    """Per-sequence bool: True where the sequence's group has rewards that are not all equal."""
    index_N, num_groups = group_index(group_ids_N)
    rewards_N = rewards_N.to(torch.float64)
    max_G = torch.full((num_groups,), -math.inf, dtype=torch.float64).scatter_reduce(0, index_N, rewards_N, reduce="amax")
    min_G = torch.full((num_groups,), math.inf, dtype=torch.float64).scatter_reduce(0, index_N, rewards_N, reduce="amin")
    return (max_G > min_G)[index_N]


@dataclass
class DynamicSamplingResult:
    groups: list
    """The kept informative groups, at most ``num_groups`` of them, in sampling order."""
    num_tries: int
    """Calls made to ``sample_fn``."""
    num_sampled: int
    """Groups returned by ``sample_fn`` over all calls."""
    num_dropped: int
    """Groups dropped because their rewards were all equal."""
    exhausted: bool = False
    """True when ``max_tries`` was reached before ``num_groups`` groups were collected."""
    num_discarded: int = field(default=0)
    """Informative groups beyond ``num_groups`` from the last call, discarded."""


def dynamic_sampling(
    sample_fn: Callable[[], Sequence[Any]],
    num_groups: int,
    *,
    max_tries: int = 10,
    rewards_of: Callable[[Any], Sequence[float]] = _default_rewards_of,
    allow_partial: bool = True,
) -> DynamicSamplingResult:
    """Call ``sample_fn()`` until ``num_groups`` informative groups are collected or ``max_tries`` calls.

    ``sample_fn`` returns a list of groups; ``rewards_of(group)`` gives a group's rewards (default:
    ``group["rewards"]`` for mappings, else ``group.rewards``). Extra groups from the last call are
    discarded, as in DAPO, so the batch size stays fixed. Deviation: the paper (and verl) aborts at
    the cap; here the default returns the partial batch with ``exhausted=True`` and a warning (a
    step on fewer groups beats a dead run); ``allow_partial=False`` raises instead.
    """
    if num_groups <= 0:
        raise ValueError(f"num_groups must be > 0, got {num_groups}")
    if max_tries <= 0:
        raise ValueError(f"max_tries must be > 0, got {max_tries}")
    kept: list = []
    num_sampled = num_dropped = num_tries = 0
    while len(kept) < num_groups and num_tries < max_tries:
        num_tries += 1
        new_groups = list(sample_fn())
        num_sampled += len(new_groups)
        for group in new_groups:
            if is_informative_group(rewards_of(group)):
                kept.append(group)
            else:
                num_dropped += 1
    exhausted = len(kept) < num_groups
    if exhausted:
        message = (
            f"dynamic sampling: {len(kept)} of {num_groups} informative groups after max_tries={max_tries} "
            f"({num_dropped} of {num_sampled} sampled groups had all-equal rewards)"
        )
        if not allow_partial:
            raise RuntimeError(message)
        warnings.warn(message + "; continuing with a partial batch", RuntimeWarning, stacklevel=2)
    return DynamicSamplingResult(
        groups=kept[:num_groups],
        num_tries=num_tries,
        num_sampled=num_sampled,
        num_dropped=num_dropped,
        exhausted=exhausted,
        num_discarded=max(len(kept) - num_groups, 0),
    )


def overlong_penalty(
    response_lengths_N: torch.Tensor | Sequence[int],
    max_response_length: int,
    buffer_length: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """DAPO soft overlong punishment per sequence (float32, values in [-penalty_factor, 0]).

    With L_max = ``max_response_length`` and L_cache = ``buffer_length``, before the factor:
    0 if |y| <= L_max - L_cache, ((L_max - L_cache) - |y|) / L_cache up to L_max, -1 beyond.
    """
    if max_response_length <= 0:
        raise ValueError(f"max_response_length must be > 0, got {max_response_length}")
    if not 0 < buffer_length <= max_response_length:
        raise ValueError(f"buffer_length must be in (0, max_response_length={max_response_length}], got {buffer_length}")
    lengths_N = torch.as_tensor(response_lengths_N, dtype=torch.float32)
    expected = max_response_length - buffer_length
    penalty_N = ((expected - lengths_N) / buffer_length).clamp(min=-1.0, max=0.0)
    return penalty_N * penalty_factor
