"""Segment operations on packed per-token tensors (the layout every algorithm in this package uses).

Layout. A batch of N response sequences is packed into 1-D per-token tensors of length
T = sum of the response lengths, sequence after sequence, with no padding (the data plane packs
THD the same way). Sequence i owns tokens ``cu_seqlens_N1[i]:cu_seqlens_N1[i + 1]``.
``mask_T`` (bool or 0/1 float) marks the tokens that count in losses and advantages; tokens
outside it (e.g. tool outputs spliced into a multi-turn response) get zero advantage and are left
out of every mean. A sequence may be empty (cu_seqlens repeats a value) or fully masked.

Shape legend:
  N  sequences in the batch          T  packed response tokens (= cu_seqlens_N1[-1])
  L  longest sequence length         G  distinct groups (prompts); N1 = N + 1
"""

from __future__ import annotations

import torch

__all__ = [
    "check_cu_seqlens",
    "seq_index_T",
    "broadcast_to_tokens",
    "segment_sum",
    "segment_count",
    "segment_mean",
    "last_token_index_N",
    "pad_by_seq",
    "unpad_by_seq",
    "masked_mean",
    "masked_whiten",
    "group_index",
]


def check_cu_seqlens(cu_seqlens_N1: torch.Tensor, num_tokens: int | None = None) -> None:
    """Raise ValueError unless ``cu_seqlens_N1`` is a 1-D non-decreasing integer tensor from 0."""
    if cu_seqlens_N1.dim() != 1 or cu_seqlens_N1.numel() < 1:
        raise ValueError(f"cu_seqlens_N1 must be 1-D with N + 1 >= 1 entries, got shape {tuple(cu_seqlens_N1.shape)}")
    if cu_seqlens_N1.dtype.is_floating_point:
        raise ValueError(f"cu_seqlens_N1 must be an integer tensor, got {cu_seqlens_N1.dtype}")
    if int(cu_seqlens_N1[0]) != 0:
        raise ValueError(f"cu_seqlens_N1[0] must be 0, got {int(cu_seqlens_N1[0])}")
    if cu_seqlens_N1.numel() > 1 and bool((cu_seqlens_N1[1:] < cu_seqlens_N1[:-1]).any()):
        raise ValueError(f"cu_seqlens_N1 must be non-decreasing, got {cu_seqlens_N1.tolist()}")
    if num_tokens is not None and int(cu_seqlens_N1[-1]) != num_tokens:
        raise ValueError(
            f"cu_seqlens_N1[-1] = {int(cu_seqlens_N1[-1])} does not match the {num_tokens} packed tokens"
        )


def seq_index_T(cu_seqlens_N1: torch.Tensor) -> torch.Tensor:
    """Sequence index of every packed token: [0, 0, 0, 1, 1, ...] (int64, length T)."""
    lengths_N = (cu_seqlens_N1[1:] - cu_seqlens_N1[:-1]).long()
    return torch.repeat_interleave(torch.arange(lengths_N.numel(), device=cu_seqlens_N1.device), lengths_N)


def broadcast_to_tokens(values_N: torch.Tensor, cu_seqlens_N1: torch.Tensor) -> torch.Tensor:
    """Repeat one value per sequence over that sequence's tokens: values_N -> values_T."""
    lengths_N = (cu_seqlens_N1[1:] - cu_seqlens_N1[:-1]).long()
    return torch.repeat_interleave(values_N, lengths_N, dim=0)


def segment_sum(values_T: torch.Tensor, cu_seqlens_N1: torch.Tensor) -> torch.Tensor:
    """Per-sequence sum of a packed tensor (differentiable): values_T -> sums_N."""
    num_seqs = cu_seqlens_N1.numel() - 1
    out_N = values_T.new_zeros(num_seqs)
    return out_N.index_add(0, seq_index_T(cu_seqlens_N1), values_T)


def segment_count(mask_T: torch.Tensor, cu_seqlens_N1: torch.Tensor) -> torch.Tensor:
    """Number of tokens inside the mask per sequence, as float (N)."""
    return segment_sum(mask_T.to(torch.float32), cu_seqlens_N1)


def segment_mean(values_T: torch.Tensor, mask_T: torch.Tensor, cu_seqlens_N1: torch.Tensor) -> torch.Tensor:
    """Per-sequence mean over masked tokens; 0 for sequences without any masked-in token."""
    mask_T = mask_T.to(values_T.dtype)
    sums_N = segment_sum(values_T * mask_T, cu_seqlens_N1)
    counts_N = segment_sum(mask_T, cu_seqlens_N1)
    return sums_N / counts_N.clamp(min=1.0)


def last_token_index_N(mask_T: torch.Tensor, cu_seqlens_N1: torch.Tensor) -> torch.Tensor:
    """Packed index of each sequence's last masked-in token; -1 where a sequence has none."""
    idx_T = torch.arange(mask_T.numel(), device=mask_T.device)
    marked_T = torch.where(mask_T.bool(), idx_T, torch.full_like(idx_T, -1))
    num_seqs = cu_seqlens_N1.numel() - 1
    out_N = torch.full((num_seqs,), -1, dtype=torch.long, device=mask_T.device)
    return out_N.scatter_reduce(0, seq_index_T(cu_seqlens_N1), marked_T, reduce="amax", include_self=True)


def _pad_positions(cu_seqlens_N1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    seq_T = seq_index_T(cu_seqlens_N1)
    pos_T = torch.arange(seq_T.numel(), device=cu_seqlens_N1.device) - cu_seqlens_N1[:-1].long()[seq_T]
    lengths_N = cu_seqlens_N1[1:] - cu_seqlens_N1[:-1]
    max_len = int(lengths_N.max()) if lengths_N.numel() else 0
    return seq_T, pos_T, max_len


def pad_by_seq(values_T: torch.Tensor, cu_seqlens_N1: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """Unpack to a right-padded [N, L] tensor (used by the backward recursions of returns and GAE)."""
    seq_T, pos_T, max_len = _pad_positions(cu_seqlens_N1)
    out_NL = values_T.new_full((cu_seqlens_N1.numel() - 1, max_len), fill)
    out_NL[seq_T, pos_T] = values_T
    return out_NL


def unpad_by_seq(values_NL: torch.Tensor, cu_seqlens_N1: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pad_by_seq`: [N, L] -> packed T."""
    seq_T, pos_T, _ = _pad_positions(cu_seqlens_N1)
    return values_NL[seq_T, pos_T]


def masked_mean(values_T: torch.Tensor, mask_T: torch.Tensor) -> torch.Tensor:
    """Mean over masked-in entries; 0 when the mask is empty (never NaN)."""
    mask_T = mask_T.to(values_T.dtype)
    return (values_T * mask_T).sum() / mask_T.sum().clamp(min=1.0)


def masked_whiten(values_T: torch.Tensor, mask_T: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(x - mean) / (std + eps) over masked entries, with the unbiased (n - 1) std; 0 outside the mask.

    With fewer than two entries the std is taken as 0, so constant inputs give exactly 0.
    """
    mask_f = mask_T.to(values_T.dtype)
    count = mask_f.sum()
    mean = (values_T * mask_f).sum() / count.clamp(min=1.0)
    var = (((values_T - mean) * mask_f) ** 2).sum() / (count - 1.0).clamp(min=1.0)
    std = var.sqrt()
    return (values_T - mean) / (std + eps) * mask_f


def group_index(group_ids_N: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Map arbitrary group labels to dense indices 0..G-1; returns (index_N, G)."""
    if group_ids_N.dim() != 1:
        raise ValueError(f"group_ids_N must be 1-D, got shape {tuple(group_ids_N.shape)}")
    uniq_G, index_N = torch.unique(group_ids_N, return_inverse=True)
    return index_N, uniq_G.numel()
