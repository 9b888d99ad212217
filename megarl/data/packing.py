"""THD packing: variable-length sequences -> one packed row with ``cu_seqlens``.

Sequence i is padded (``pad_value``; position ids keep counting) to the next multiple of
:func:`sequence_alignment`: ``tp`` without context parallelism (sequence parallelism splits the
row over TP ranks), ``2 * cp * tp`` with it (TE's THD CP cuts every sequence into ``2*cp`` chunks,
and each rank's share must still divide by ``tp``). Sequences lie end to end; ``cu_seqlens_N1``
holds the cumulative real lengths and ``cu_seqlens_padded_N1`` the padded ones (int32, from 0), as
TE's fused attention expects for ``qkv_format='thd'``. Position ids restart at every sequence.

Context parallelism (megatron-core / TE causal load balance): CP rank ``r`` keeps chunks ``r``
and ``2*cp-1-r`` of each padded sequence, so every rank does the same causal work; cu_seqlens
stay global (TE divides by ``cp``). :func:`gather_cp_shares` inverts the split. No megatron
import: :func:`packed_seq_params_kwargs` returns ``PackedSeqParams``'s keyword arguments.
Shape legend: ``T`` packed tokens on this rank, ``Tf`` of the full row (before the CP split),
``N`` sequences, ``N1`` = N + 1, ``L`` one sequence, ``...`` any trailing dims.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:  # torch is imported lazily so that `import megarl.data` stays cheap
    import torch

__all__ = [
    "sequence_alignment",
    "padded_length",
    "packed_tokens",
    "PackedSequences",
    "pack_sequences",
    "unpack_sequences",
    "gather_cp_shares",
    "packed_seq_params_kwargs",
]


def _check_parallel(tp: int, cp: int) -> None:
    for name, value in (("tp", tp), ("cp", cp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}, expected an int >= 1")


def sequence_alignment(tp: int = 1, cp: int = 1) -> int:
    """Per-sequence padding multiple: ``tp``, or ``2*cp*tp`` with context parallelism."""
    _check_parallel(tp, cp)
    return 2 * cp * tp if cp > 1 else tp


def padded_length(length: int, tp: int = 1, cp: int = 1) -> int:
    """``length`` rounded up to :func:`sequence_alignment`."""
    align = sequence_alignment(tp, cp)
    return -(-length // align) * align


def packed_tokens(length: int, tp: int = 1, cp: int = 1) -> int:
    """Tokens one sequence adds to each CP rank's packed row: ``padded_length / cp``."""
    return padded_length(length, tp, cp) // cp


def _cp_ranges(start: int, padded: int, cp: int, cp_rank: int) -> list[tuple[int, int]]:
    """[begin, end) ranges, in the full packed row, of CP rank ``cp_rank``'s two chunks of the
    sequence occupying [start, start + padded)."""
    if cp == 1:
        return [(start, start + padded)]
    chunk = padded // (2 * cp)
    first, second = cp_rank, 2 * cp - 1 - cp_rank
    return [(start + first * chunk, start + (first + 1) * chunk),
            (start + second * chunk, start + (second + 1) * chunk)]


@dataclass
class PackedSequences:
    """One packed row (this CP rank's share). Tensors are on the device of the inputs."""

    tokens_T: "torch.Tensor"
    """Packed values, ``[T, ...]`` (padding filled with ``pad_value``)."""
    position_ids_T: "torch.Tensor"
    """int64 ``[T]``: position of each token inside its sequence (restarting at 0)."""
    cu_seqlens_N1: "torch.Tensor"
    """int32 ``[N+1]``: cumulative real lengths of the full sequences (global under CP)."""
    cu_seqlens_padded_N1: "torch.Tensor"
    """int32 ``[N+1]``: cumulative padded lengths of the full sequences (global under CP)."""
    max_seqlen: int
    """Longest padded sequence (TE's ``max_seqlen_q/kv``; divisible by 2*cp under CP)."""
    tp: int = 1
    cp: int = 1
    cp_rank: int = 0

    @property
    def num_sequences(self) -> int:
        return self.cu_seqlens_N1.numel() - 1

    @property
    def lengths(self) -> list[int]:
        return (self.cu_seqlens_N1[1:] - self.cu_seqlens_N1[:-1]).tolist()


def pack_sequences(
    sequences: Sequence["torch.Tensor"],
    *,
    tp: int = 1,
    cp: int = 1,
    cp_rank: int = 0,
    pad_value: Any = 0,
    pad_to: int | None = None,
) -> PackedSequences:
    """Pack ``[L_i, ...]`` tensors into one THD row (this CP rank's share under CP).

    ``pad_to``: the full row's length ``Tf`` (before the CP split) when every micro-batch of a
    call must have one shape (megatron's fixed-shape pipeline exchange, see
    :mod:`megarl.policy.build`): the extra tokens lengthen the last sequence's padding, so the
    result is the same as without them. It must be at least the row's own length and keep the
    alignment (a multiple of :func:`sequence_alignment` more)."""
    import torch

    _check_parallel(tp, cp)
    if not isinstance(cp_rank, int) or not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank={cp_rank!r}, expected an int in [0, cp={cp})")
    if len(sequences) == 0:
        raise ValueError("pack_sequences: sequences is empty; expected at least one tensor")
    first = sequences[0]
    for i, seq in enumerate(sequences):
        if not isinstance(seq, torch.Tensor) or seq.dim() < 1 or seq.shape[0] < 1:
            raise ValueError(f"sequences[{i}] is not a non-empty tensor of shape [L, ...]")
        if seq.shape[1:] != first.shape[1:] or seq.dtype != first.dtype:
            raise ValueError(
                f"sequences[{i}] has trailing shape {tuple(seq.shape[1:])} and dtype {seq.dtype}, "
                f"expected {tuple(first.shape[1:])} and {first.dtype} like sequences[0]")
    lengths = [int(s.shape[0]) for s in sequences]
    padded = [padded_length(n, tp, cp) for n in lengths]
    if pad_to is not None:
        extra = pad_to - sum(padded)
        if extra < 0 or extra % sequence_alignment(tp, cp):
            raise ValueError(f"pack_sequences: pad_to={pad_to} but the sequences pack to {sum(padded)} tokens; "
                             f"expected at least that, more by a multiple of {sequence_alignment(tp, cp)}")
        padded[-1] += extra
    device = first.device
    full_T = sum(padded)
    full = torch.full((full_T, *first.shape[1:]), pad_value, dtype=first.dtype, device=device)
    positions = torch.empty(full_T, dtype=torch.int64, device=device)
    start = 0
    for seq, n, p in zip(sequences, lengths, padded):
        full[start:start + n] = seq
        positions[start:start + p] = torch.arange(p, device=device)
        start += p
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.tensor(lengths, dtype=torch.int32, device=device).cumsum(0)
    cu_padded = torch.zeros_like(cu)
    cu_padded[1:] = torch.tensor(padded, dtype=torch.int32, device=device).cumsum(0)
    if cp > 1:
        index = _cp_index(padded, cp, cp_rank, device)
        full, positions = full.index_select(0, index), positions.index_select(0, index)
    return PackedSequences(tokens_T=full, position_ids_T=positions, cu_seqlens_N1=cu,
                           cu_seqlens_padded_N1=cu_padded, max_seqlen=max(padded), tp=tp, cp=cp,
                           cp_rank=cp_rank)


def _cp_index(padded: Sequence[int], cp: int, cp_rank: int, device: Any) -> "torch.Tensor":
    """Positions in the full packed row of CP rank ``cp_rank``'s tokens, in its order."""
    import torch

    pieces = []
    start = 0
    for p in padded:
        for begin, end in _cp_ranges(start, p, cp, cp_rank):
            pieces.append(torch.arange(begin, end, device=device))
        start += p
    return torch.cat(pieces)


def gather_cp_shares(
    shares: Sequence["torch.Tensor"], cu_seqlens_padded_N1: "torch.Tensor"
) -> "torch.Tensor":
    """Reassemble the full packed row ``[Tf, ...]`` from every CP rank's share (in rank order)."""
    cp = len(shares)
    if cp < 1:
        raise ValueError("gather_cp_shares: shares is empty; expected one tensor per CP rank")
    padded = (cu_seqlens_padded_N1[1:] - cu_seqlens_padded_N1[:-1]).tolist()
    full_T = int(sum(padded))
    for r, share in enumerate(shares):
        if share.shape[0] * cp != full_T:
            raise ValueError(
                f"gather_cp_shares: shares[{r}] has {share.shape[0]} tokens, expected "
                f"{full_T // cp} (= {full_T} padded tokens / cp={cp})")
    if cp == 1:
        return shares[0]
    full = shares[0].new_empty((full_T, *shares[0].shape[1:]))
    for r, share in enumerate(shares):
        full[_cp_index(padded, cp, r, share.device)] = share
    return full


def unpack_sequences(
    packed_T: "torch.Tensor",
    cu_seqlens_N1: "torch.Tensor",
    cu_seqlens_padded_N1: "torch.Tensor",
) -> list["torch.Tensor"]:
    """Split a full packed row ``[Tf, ...]`` back into ``[len_i, ...]`` views (padding dropped).

    Under CP first reassemble the row with :func:`gather_cp_shares` (one rank's share does not
    hold whole sequences).
    """
    if cu_seqlens_N1.shape != cu_seqlens_padded_N1.shape:
        raise ValueError(
            f"cu_seqlens has shape {tuple(cu_seqlens_N1.shape)} but cu_seqlens_padded has "
            f"{tuple(cu_seqlens_padded_N1.shape)}; expected both [N+1]")
    total = int(cu_seqlens_padded_N1[-1])
    if packed_T.shape[0] != total:
        raise ValueError(
            f"packed tensor has {packed_T.shape[0]} tokens, expected cu_seqlens_padded[-1]="
            f"{total} (under context parallelism gather the CP shares first)")
    starts = cu_seqlens_padded_N1[:-1].tolist()
    lengths = (cu_seqlens_N1[1:] - cu_seqlens_N1[:-1]).tolist()
    return [packed_T[s:s + n] for s, n in zip(starts, lengths)]


def packed_seq_params_kwargs(packed: PackedSequences) -> dict[str, Any]:
    """Keyword arguments for megatron-core ``PackedSeqParams`` (``qkv_format='thd'``).

    ``cu_seqlens_q/kv`` are the real lengths, ``*_padded`` the padded ones (megatron's RoPE and
    TE use the padded boundaries to locate sequences; the real ones mask the padding out of
    attention). Values are global under CP; TE divides them by ``cp``.
    """
    return {
        "qkv_format": "thd",
        "cu_seqlens_q": packed.cu_seqlens_N1,
        "cu_seqlens_kv": packed.cu_seqlens_N1,
        "cu_seqlens_q_padded": packed.cu_seqlens_padded_N1,
        "cu_seqlens_kv_padded": packed.cu_seqlens_padded_N1,
        "max_seqlen_q": packed.max_seqlen,
        "max_seqlen_kv": packed.max_seqlen,
    }


def trim_pads(ids: list, prompt_len: int, pad_id) -> list:
    """``ids`` without trailing ``pad_id`` tokens, keeping at least one response token: a reward
    model reads its score at the last token that is not padding, as HF's classifiers do."""
    if pad_id is None:
        return ids
    end = len(ids)
    while end > prompt_len + 1 and ids[end - 1] == pad_id:
        end -= 1
    return ids[:end]
