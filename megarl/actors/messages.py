"""What the controller and the HybridWorkers exchange through Ray calls, where a call carries
more than one value: small dataclasses, pickled by Ray, named by field rather than by position.

Requests: :class:`PassRequest` (a forward pass before the update) and :class:`UpdateRequest`
(a policy update). Replies: :class:`WorkerInfo` (where a rank runs), :class:`PassResult` (a
pass's per-micro-batch outputs) and :class:`UpdateResult` (an update's metrics and read-outs).
The per-token tensors stay on the ranks and in Ray's object store; these carry handles,
per-sample read-outs and scalars. Nothing here imports torch or Ray.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class WorkerInfo:
    """A training rank's place in the layout and where it runs (:meth:`HybridWorker.info`; for the
    placement log and error messages)."""

    rank: int
    dp_rank: int
    dp_leader: bool
    """Whether this rank returns its DP group's outputs: TP rank 0, CP rank 0, last pipeline stage."""
    pid: int
    node_id: str
    """Ray's node id (:func:`megarl.parallel.nodes.where`), as the fields below."""
    ip: str
    node_name: str
    node: str
    """The node's label in logs and errors, e.g. ``n2 (127.0.0.12)``."""


@dataclass(frozen=True)
class PassRequest:
    """A forward pass before the update (:meth:`megarl.actors.worker.HybridWorker.logprobs`)."""

    reference: bool
    """The reference model's pass; else the policy's old-log-prob pass."""
    routing: Optional[str] = None
    """What the MoE layers do with the micro-batches' routing: ``compare``, ``replay`` or None
    (:mod:`megarl.policy.replay`)."""
    record_routing: bool = False
    """Keep the model's own routing (put into the object store by the rank)."""
    version: Optional[int] = None
    """The policy version whose alarm the old pass reads."""
    with_kl: bool = False
    """The reference pass's micro-batches carry the old pass's log-probs: add each sample's k1 sum."""


@dataclass(frozen=True)
class UpdateRequest:
    """One policy update (:meth:`megarl.actors.worker.HybridWorker.train`)."""

    kl_coef: float
    replay_routing: bool = False
    """Replay the micro-batches' routing in the MoE layers."""
    own_old_logprobs: bool = False
    """The micro-batches carry no ``old_logprobs_T``: the loss takes the training forward's own
    (:func:`megarl.config.passes.needs_old_logprob_pass`), and the DP leaders return its read-outs."""
    version: Optional[int] = None
    """The policy version being trained (the alarm's)."""


@dataclass
class MicroBatchPass:
    """One micro-batch's share of a forward pass, from a DP leader."""

    outputs: dict
    """Per-sample lists: :func:`megarl.data.readout.old_pass_outputs` or
    :func:`megarl.data.readout.reference_pass_outputs`."""
    recorded_routing: Any = None
    """A handle on the routing the pass recorded (``record_routing``), owned by the rank; else None."""


@dataclass
class PassResult:
    """A DP leader's reply to a forward pass: one :class:`MicroBatchPass` per micro-batch, in order."""

    micro_batches: list
    routing_report: dict
    """The agreement of a routing comparison (:attr:`megarl.policy.model.PolicyModel.routing_report`)."""


@dataclass
class UpdateResult:
    """A rank's reply to an update (policy or critic)."""

    metrics: dict
    """The engine's step metrics (:meth:`megarl.policy.model.PolicyModel.train_step`:
    ``loss``, ``grad_norm``, ``update_successful``, ...); the policy's add ``weight_checksum``."""
    outputs: Optional[list] = None
    """With ``own_old_logprobs``, on DP leaders: per micro-batch its samples' read-outs
    (:func:`megarl.data.readout.micro_batch_readouts`); else None."""
