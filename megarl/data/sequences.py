"""The unit a rank's forward and backward take: a micro-batch of whole sequences.

:class:`SequenceBatch` holds each sequence's prompt + response token ids, its prompt length, the
packed per-response-token extras the loss reads, and (MoE) the routing to compare or replay. It
is built by the controller's batch helpers and the post-training stages, sent to the ranks, and
packed there into the THD layout (:func:`megarl.policy.logprobs.pack_micro_batch`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class SequenceBatch:
    """One micro-batch of sequences (prompt + response token ids) and per-response-token data.

    ``extras`` holds packed per-response-token tensors ``[R]`` (advantages, old log-probs, masks,
    ...) in the order of ``cu_seqlens_N1``; the engine does not read them, ``loss_fn`` does.
    ``num_global_tokens`` / ``num_global_sequences`` are filled by ``PolicyModel.train_step``:
    the response-token and sequence counts of the whole step, summed over micro-batches and DP
    ranks; with ``extras['mask_T']``, the masked-in tokens and the sequences that have one.
    """

    input_ids: list
    """Per sequence, a 1-D integer tensor of prompt + response token ids (int64, or int32 from the
    RL controller: half the bytes on the way to the ranks; packing makes them int64)."""
    prompt_lengths: list
    """Per sequence, the number of prompt tokens (>= 1); the rest is the response."""
    extras: dict = field(default_factory=dict)
    num_global_tokens: Optional[int] = None
    num_global_sequences: Optional[int] = None
    routing: Optional[list] = None
    """MoE models: per sequence, an integer tensor ``[L, Lm, K]``: the experts each of its tokens
    was routed to in each MoE layer (the rollout engine's routing, or the trainer's own recorded
    one; -1 rows: unknown, the layer routes that token itself). :mod:`megarl.policy.replay`
    compares it with, or replays it in, the model's routing. A rank receives handles on the
    arrays in Ray's object store instead (:class:`megarl.data.store.Stored`) and fetches them
    (:func:`megarl.data.store.fetch_batches`) before the forward."""

    def __post_init__(self):
        if len(self.input_ids) != len(self.prompt_lengths) or not self.input_ids:
            raise ValueError(f"SequenceBatch: {len(self.input_ids)} sequences but "
                             f"{len(self.prompt_lengths)} prompt_lengths; expected equal and >= 1")
        for i, (ids, p) in enumerate(zip(self.input_ids, self.prompt_lengths)):
            if ids.dim() != 1 or not 1 <= p < ids.numel():
                raise ValueError(f"SequenceBatch: sequence {i} has {ids.numel()} tokens and prompt_length "
                                 f"{p}; expected 1 <= prompt_length < length (a non-empty response)")
        if self.routing is not None:
            if len(self.routing) != len(self.input_ids):
                raise ValueError(f"SequenceBatch: routing for {len(self.routing)} sequences, expected "
                                 f"{len(self.input_ids)}")
            for i, (ids, r) in enumerate(zip(self.input_ids, self.routing)):
                # len(shape): a tensor, or a handle on one in the object store (megarl/data/store.py)
                if len(r.shape) != 3 or r.shape[0] != ids.numel() or \
                        tuple(r.shape[1:]) != tuple(self.routing[0].shape[1:]):
                    raise ValueError(f"SequenceBatch: sequence {i} has {ids.numel()} tokens and routing of shape "
                                     f"{tuple(r.shape)}; expected [{ids.numel()}, MoE layers, top-k], the same "
                                     "layers and top-k for every sequence")

    @property
    def response_lengths(self) -> list[int]:
        return [ids.numel() - p for ids, p in zip(self.input_ids, self.prompt_lengths)]

    @property
    def cu_seqlens_N1(self) -> torch.Tensor:
        """Cumulative response lengths (the layout of ``extras`` and of the returned log-probs)."""
        cu = torch.zeros(len(self.input_ids) + 1, dtype=torch.int64)
        cu[1:] = torch.tensor(self.response_lengths).cumsum(0)
        return cu

    @property
    def num_tokens(self) -> int:
        """All tokens (prompt + response) of the micro-batch."""
        return sum(ids.numel() for ids in self.input_ids)

    @property
    def num_response_tokens(self) -> int:
        return sum(self.response_lengths)
