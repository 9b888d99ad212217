"""Test-only fault injection, read from the ``MEGARL_FAULTS`` environment variable (unset: nothing
is injected). tests/e2e/test_faults_e2e.py uses it to reach failure paths of a real run that no
input can provoke on purpose.

``MEGARL_FAULTS="nan_loss@2"``: the policy loss of each training worker's 2nd ``train`` call (RL
step 2 of a fresh run with ``algorithm.ppo_epochs`` = ``algorithm.mini_batches`` = 1) becomes NaN
on the last training rank (the one that computes a loss under every pipeline layout). Several
faults: comma-separated. :class:`megarl.actors.placement.Placement` forwards the variable to the
Ray actors and checks it before any actor starts.

A training worker reaches the faults through one hook, :func:`train_loss_hook`, which leaves the
loss function unchanged when nothing is planned.
"""
from __future__ import annotations

import os
from typing import Callable

ENV = "MEGARL_FAULTS"
FAULTS = {"nan_loss": "the policy loss of the N-th train call of each training worker becomes NaN (last rank)"}


def planned() -> dict[str, set[int]]:
    """``{fault: {N, ...}}`` of every ``fault@N`` in ``$MEGARL_FAULTS``."""
    out: dict[str, set[int]] = {}
    for item in filter(None, (s.strip() for s in os.environ.get(ENV, "").split(","))):
        name, _, at = item.partition("@")
        if name not in FAULTS or not at.isdigit():
            raise ValueError(f"{ENV}={os.environ[ENV]!r}: {item!r} is not FAULT@N with N a call number and "
                             f"FAULT one of {FAULTS}")
        out.setdefault(name, set()).add(int(at))
    return out


def nan_loss(loss_fn):
    """``loss_fn`` with its loss (not its metrics) multiplied by NaN."""
    def poisoned(logprobs_R, batch):
        loss, metrics = loss_fn(logprobs_R, batch)
        return loss * float("nan"), metrics

    return poisoned


def train_loss_hook(rank: int, world_size: int) -> Callable:
    """What a training worker applies to each ``train`` call's loss function: the identity when
    ``$MEGARL_FAULTS`` plans nothing (checked here, when the worker starts); else a hook that
    counts the calls and poisons the planned ones' loss (:func:`nan_loss`) on the last rank."""
    plan = planned()
    if not plan:
        return _unchanged
    poisoned_calls = plan.get("nan_loss", set()) if rank == world_size - 1 else set()
    num_calls = 0

    def hook(loss_fn):
        nonlocal num_calls
        num_calls += 1
        return nan_loss(loss_fn) if num_calls in poisoned_calls else loss_fn

    return hook


def _unchanged(loss_fn):
    return loss_fn
