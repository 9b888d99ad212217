"""Waiting for calls of Ray actors, deaths named: what the training ranks' collectives
(:mod:`megarl.actors.ranks`) and the rollout fleet's calls (:mod:`megarl.rollout.fleet`) share.

:func:`wait_all` raises the first failure at once, a dead actor as :class:`WorkerDied` naming its
rank (or engine), pid, node and the phase, with Ray's reason in one line (:func:`death_reason`).
"""
from __future__ import annotations

import time

FAILURE_GRACE_S = 5.0
"""After a call raised on one worker: how long the other workers' calls may still take before the
error is raised. A rank's death makes its peers' collectives fail as well (gloo: connection closed
by peer) or block; the death, not its echo, is the error to report."""
NODE_LOSS_GRACE_S = 60.0
"""The grace period instead when the first failure is a lost connection to a peer rank (gloo or
NCCL): the peer's process or whole node may be gone. A lost node's actors are declared dead only
when Ray's health checks of that node fail (about 15-30 s with Ray's defaults), and that death,
naming the node, is the error to report."""
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "remote process exited",
              "connection refused")


class WorkerDied(RuntimeError):
    """A training worker or a rollout engine (a Ray actor process) died: its rank or engine, pid,
    node, the phase and Ray's reason are in the message."""


def wait_all(refs: list, names: list[str], phase: str, grace_s: float = FAILURE_GRACE_S,
             done_at: list | None = None) -> list:
    """``ray.get(refs)``, except that a failure is raised as soon as it happens, not when the list
    reaches it: the peers of a dead rank may block in a collective for gloo's whole timeout.

    ``names[i]`` names the actor of ``refs[i]`` and ``phase`` the call, for :class:`WorkerDied`,
    raised for a dead actor (Ray's RayActorError). A method's own exception (Ray's RayTaskError,
    also an instance of the worker's exception class) is raised as it is, unless another actor's
    death, seen within ``grace_s`` seconds (``NODE_LOSS_GRACE_S`` when it is a lost connection to a
    peer), explains it. ``done_at``, when given, gets the ``time.monotonic()`` at which each
    result was seen.
    """
    import ray

    index = {ref: i for i, ref in enumerate(refs)}
    values, pending, failure, deadline = [None] * len(refs), list(refs), None, None
    while pending:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        done, pending = ray.wait(pending, num_returns=1, timeout=timeout)
        if not done:
            break                                     # the grace period after a failure is over
        if pending:                                   # the others that are done too: fewer waits
            more, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
            done += more
        for ref in done:
            if done_at is not None:
                done_at[index[ref]] = time.monotonic()
            try:
                values[index[ref]] = ray.get(ref)
            except ray.exceptions.RayActorError as err:
                if not err.actor_init_failed:         # a start-up error is the worker's own exception
                    raise WorkerDied(f"{names[index[ref]]} died during {phase}: {death_reason(err)}") from err
                failure = failure or err
            except Exception as err:
                failure = failure or err
        if failure is not None and deadline is None:
            lost_peer = any(p in str(failure).lower() for p in _PEER_LOST)
            deadline = time.monotonic() + (max(grace_s, NODE_LOSS_GRACE_S) if lost_peer else grace_s)
    if failure is not None:
        raise failure
    return values


def death_reason(err: Exception) -> str:
    """Ray's reason for an actor's death, in one line (its message spans many)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    why = next((line for line in lines if line.startswith("The actor is dead because")), lines[0] if lines else "")
    return f"{type(err).__name__}: {why.split(' Some common causes')[0][:300]}"
