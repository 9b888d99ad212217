"""Lossless compaction of the per-token tensors the controller sends to the training ranks.

The per-token extras of a micro-batch (``SequenceBatch.extras``) are mostly redundant at RL
shapes: an outcome reward's advantages and returns are one number per sample, the loss mask is
all true but for tool tokens, token versions change once per weight sync, and vLLM's float32
log-probs travel as float64. :func:`encode` sends a tensor as runs of equal values (:class:`Runs`)
when that is at most half its bytes, else a float64 tensor of float32 values as float32
(:class:`Narrow`), else as it is. Both are checked bit for bit (-0.0, NaN), so :func:`decode`
gives back the very tensor and the numerics cannot change. For an outcome reward this takes the
bytes per response token from 17 to about 8.

Encoding happens where micro-batches leave the controller
(:meth:`megarl.actors.ranks.TrainingRanks.per_rank`), decoding where a worker receives them
(:func:`megarl.actors.worker.receive`), so the micro-batch code sees plain tensors.
"""
from __future__ import annotations

import torch

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Runs:
    """A 1-D tensor as runs of equal values: ``values[k]`` repeated ``lengths[k]`` times."""

    __slots__ = ("values", "lengths")

    def __init__(self, values: torch.Tensor, lengths: torch.Tensor):
        self.values, self.lengths = values, lengths

    def __reduce__(self):
        return Runs, (self.values, self.lengths)

    @property
    def payload(self) -> tuple:
        return self.values, self.lengths

    def decode(self) -> torch.Tensor:
        return torch.repeat_interleave(self.values, self.lengths.long())


class Narrow:
    """A float64 tensor whose every value is a float32 number, sent as float32."""

    __slots__ = ("values",)

    def __init__(self, values: torch.Tensor):
        self.values = values

    def __reduce__(self):
        return Narrow, (self.values,)

    @property
    def payload(self) -> tuple:
        return (self.values,)

    def decode(self) -> torch.Tensor:
        return self.values.to(torch.float64)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.element_size()]) if t.dtype != torch.bool else t.view(torch.uint8)


def encode(t):
    """``t`` as :class:`Runs`, :class:`Narrow` or itself (anything but a 1-D tensor: itself),
    whichever is smallest and decodes to ``t`` bit for bit."""
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() < 2 or t.element_size() not in _BITS:
        return t
    t = t.contiguous()
    bits = _bits(t)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), (bits[1:] != bits[:-1]).nonzero().squeeze(1) + 1])
    if len(starts) * (t.element_size() + 4) * 2 <= t.numel() * t.element_size():
        lengths = torch.diff(starts, append=torch.tensor([t.numel()])).to(torch.int32)
        return Runs(t[starts].clone(), lengths)
    if t.dtype == torch.float64:
        narrow = t.to(torch.float32)
        if torch.equal(_bits(narrow.to(torch.float64)), bits):
            return Narrow(narrow)
    return t


def decode(x):
    """The tensor that :func:`encode` gave ``x`` for (anything else: itself)."""
    return x.decode() if isinstance(x, (Runs, Narrow)) else x


def encode_batches(micro_batches: list) -> list:
    """Every micro-batch's ``extras`` tensors :func:`encode`-d, in place; returns the list."""
    for mb in micro_batches:
        mb.extras = {k: encode(v) for k, v in mb.extras.items()}
    return micro_batches


def decode_batches(micro_batches: list) -> None:
    """Undo :func:`encode_batches` in place."""
    for mb in micro_batches:
        mb.extras = {k: decode(v) for k, v in mb.extras.items()}


__all__ = ["Runs", "Narrow", "encode", "decode", "encode_batches", "decode_batches"]
