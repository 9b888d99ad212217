"""Split one DP rank's sequences into micro-batches under a hard token budget.

1. Count: each rank's smallest feasible count is the number of first-fit-decreasing bins under
   ``max_tokens``; all DP ranks run the MAX over ranks (an all-reduce, or computed locally),
   raised to ``minimum`` and rounded up to ``multiple`` (megatron's VPP schedule needs
   ``num_microbatches % pipeline_size == 0``).
2. Split into exactly that many: Karmarkar-Karp on the cost (tokens or FLOPs,
   :mod:`megarl.data.balance`), a repair pass for micro-batches over the cap, and if that gets
   stuck the FFD bins split until there are enough; then the capped local search of
   :func:`megarl.data.balance.refine_partitions`. The cap is an invariant of every step (verl's
   ``ceil(total / cap)`` count is only a lower bound, retried until the cap holds).
3. Order for the pipeline: cheapest micro-batches at both ends (1F1B warm-up and cool-down).

Empty micro-batches are never produced: more micro-batches than sequences is a ``ValueError``
(:func:`megarl.data.batching.plan_batches` avoids it by balancing equal sequence counts first).
Shape legend (lists): ``_N`` per sequence of one rank (indices 0..N-1), ``_M`` per micro-batch,
``_R`` per rank.
"""

from __future__ import annotations

import numbers
from typing import Any, Optional, Sequence

from megarl.data.balance import karmarkar_karp, refine_partitions

__all__ = [
    "check_lengths",
    "first_fit_decreasing",
    "min_num_micro_batches",
    "round_num_micro_batches",
    "agree_num_micro_batches",
    "split_micro_batches",
    "order_for_pipeline",
    "micro_batches_all_ranks",
    "micro_batches_this_rank",
]


def check_lengths(
    tokens_N: Sequence[int], max_tokens: int, *, truncate: bool = False
) -> tuple[list[int], dict[int, int]]:
    """Validate lengths against the cap; returns (lengths to plan with, {index: original length}
    of truncated sequences). Without ``truncate`` a sequence over the cap is a ValueError."""
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens_per_micro_batch={max_tokens!r}, expected an int >= 1")
    out: list[int] = []
    truncated: dict[int, int] = {}
    for i, t in enumerate(tokens_N):
        if not isinstance(t, numbers.Integral) or isinstance(t, bool) or t < 1:
            raise ValueError(f"sequence {i} has length {t!r}, expected an int >= 1")
        t = int(t)  # numpy / torch integers -> int
        if t > max_tokens:
            if not truncate:
                raise ValueError(
                    f"sequence {i} has {t} tokens, more than max_tokens_per_micro_batch="
                    f"{max_tokens}; raise the budget or set truncate=True")
            truncated[i] = t
            t = max_tokens
        out.append(t)
    return out, truncated


def first_fit_decreasing(tokens_N: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Bin packing by FFD; every bin's token sum is <= ``max_tokens`` (items must fit)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(tokens_N)), key=lambda i: (-tokens_N[i], i)):
        t = tokens_N[i]
        assert t <= max_tokens, f"item {i} ({t}) over the cap {max_tokens}"
        for b, r in enumerate(room):
            if t <= r:
                bins[b].append(i)
                room[b] -= t
                break
        else:
            bins.append([i])
            room.append(max_tokens - t)
    return bins


def min_num_micro_batches(tokens_N: Sequence[int], max_tokens: int) -> int:
    """Smallest count this module can always realise: the FFD bin count (0 for no sequences)."""
    return len(first_fit_decreasing(tokens_N, max_tokens))


def round_num_micro_batches(count: int, multiple: int = 1, minimum: int = 1) -> int:
    """``max(count, minimum)`` rounded up to a multiple of ``multiple``."""
    for name, value in (("multiple", multiple), ("minimum", minimum)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}, expected an int >= 1")
    count = max(count, minimum)
    return -(-count // multiple) * multiple


def agree_num_micro_batches(
    counts: Any, *, multiple: int = 1, minimum: int = 1, process_group: Any = None
) -> int:
    """The micro-batch count every DP rank runs: MAX over ranks, >= ``minimum``, rounded up to a
    multiple of ``multiple``.

    With ``process_group`` (a ``torch.distributed`` group) ``counts`` is this rank's count and
    the MAX is an all-reduce; with ``None`` ``counts`` is the sequence of all ranks' counts.
    """
    round_num_micro_batches(0, multiple, minimum)  # validates before any collective
    if process_group is None:
        if isinstance(counts, int):
            raise TypeError(
                "agree_num_micro_batches: counts is one int but process_group is None; pass "
                "every rank's count (a list) or a process group")
        local_max = max(counts) if len(counts) else 0
    else:
        local_max = _all_reduce_max([int(counts)], process_group)[0]
    return round_num_micro_batches(local_max, multiple, minimum)


def _all_reduce_max(values: list[int], process_group: Any) -> list[int]:
    """Element-wise MAX over the group (on the current CUDA device for NCCL, else on CPU)."""
    import torch
    import torch.distributed as dist

    device = "cpu"
    if dist.get_backend(process_group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    buf = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=process_group)
    return [int(v) for v in buf.tolist()]


def order_for_pipeline(micro_batches_M: Sequence[list[int]],
                       costs_N: Sequence[float]) -> list[list[int]]:
    """Cheapest micro-batches at both ends, most expensive in the middle (ties: input order)."""
    loads = [sum(costs_N[i] for i in mb) for mb in micro_batches_M]
    ascending = sorted(range(len(micro_batches_M)), key=lambda m: (loads[m], m))
    front = ascending[0::2]
    back = ascending[1::2]
    return [micro_batches_M[m] for m in front + back[::-1]]


def _repair(tokens_N: Sequence[int], parts: list[list[int]], cap: int) -> Optional[list[list[int]]]:
    """Move/swap sequences out of micro-batches over ``cap``; None if stuck. Each step lowers the
    total excess over the cap and never makes a micro-batch empty or pushes one over."""
    parts = [list(p) for p in parts]
    toks = [sum(tokens_N[i] for i in p) for p in parts]
    while True:
        over = [p for p in range(len(parts)) if toks[p] > cap]
        if not over:
            return parts
        v = max(over, key=lambda p: (toks[p], -p))
        best = None  # (token reduction of v, position in v, target, position in target or -1)
        for lo in range(len(parts)):
            if lo == v or toks[lo] >= cap:
                continue
            room = cap - toks[lo]
            for pv, x in enumerate(parts[v]):
                tx = tokens_N[x]
                if len(parts[v]) > 1 and tx <= room and (best is None or tx > best[0]):
                    best = (tx, pv, lo, -1)
                for pl, y in enumerate(parts[lo]):
                    d = tx - tokens_N[y]
                    if 0 < d <= room and (best is None or d > best[0]):
                        best = (d, pv, lo, pl)
        if best is None:
            return None
        _, pv, lo, pl = best
        x = parts[v].pop(pv)
        if pl >= 0:
            y = parts[lo].pop(pl)
            parts[v].append(y)
            toks[v] += tokens_N[y]
            toks[lo] -= tokens_N[y]
        parts[lo].append(x)
        toks[lo] += tokens_N[x]
        toks[v] -= tokens_N[x]


def _ffd_split(tokens_N: Sequence[int], num: int, cap: int) -> list[list[int]]:
    """FFD bins, then split the fullest multi-item bin in two (LPT) until there are ``num``."""
    bins = first_fit_decreasing(tokens_N, cap)
    assert len(bins) <= num <= len(tokens_N)
    while len(bins) < num:
        b = max((b for b in range(len(bins)) if len(bins[b]) > 1),
                key=lambda b: (sum(tokens_N[i] for i in bins[b]), -b))
        halves: list[list[int]] = [[], []]
        sums = [0, 0]
        for i in sorted(bins[b], key=lambda i: (-tokens_N[i], i)):
            side = 0 if sums[0] <= sums[1] else 1
            halves[side].append(i)
            sums[side] += tokens_N[i]
        bins[b] = halves[0]
        bins.append(halves[1])
    return bins


def split_micro_batches(
    tokens_N: Sequence[int],
    num_micro_batches: int,
    max_tokens: int,
    *,
    costs_N: Optional[Sequence[float]] = None,
    pipeline_order: bool = True,
) -> list[list[int]]:
    """Exactly ``num_micro_batches`` non-empty micro-batches of local indices, each with a token
    sum <= ``max_tokens``, balanced by ``costs_N`` (default: tokens).

    Raises ValueError when a sequence is over the cap, when there are fewer sequences than
    micro-batches (empty micro-batches are not allowed) or when fewer micro-batches than the FFD
    count are requested.
    """
    tokens, _ = check_lengths(tokens_N, max_tokens)
    n = len(tokens)
    if not isinstance(num_micro_batches, int) or num_micro_batches < 1:
        raise ValueError(f"num_micro_batches={num_micro_batches!r}, expected an int >= 1")
    if num_micro_batches > n:
        raise ValueError(
            f"cannot split {n} sequences into {num_micro_batches} micro-batches: empty "
            f"micro-batches are not allowed; give this rank at least {num_micro_batches} "
            f"sequences or lower the micro-batch count")
    needed = min_num_micro_batches(tokens, max_tokens)
    if num_micro_batches < needed:
        raise ValueError(
            f"num_micro_batches={num_micro_batches} is below the {needed} micro-batches needed "
            f"to keep every micro-batch within max_tokens_per_micro_batch={max_tokens}")
    costs = [float(t) for t in tokens] if costs_N is None else list(costs_N)
    if len(costs) != n:
        raise ValueError(f"len(costs)={len(costs)} but len(tokens)={n}; expected one cost each")
    parts = _repair(tokens, karmarkar_karp(costs, num_micro_batches), max_tokens)
    if parts is None:
        parts = _ffd_split(tokens, num_micro_batches, max_tokens)
    parts = refine_partitions(costs, parts, tokens_N=tokens, capacity=max_tokens, min_items=1)
    assert all(p and sum(tokens[i] for i in p) <= max_tokens for p in parts)
    if pipeline_order:
        return order_for_pipeline(parts, costs)
    return sorted(parts, key=lambda p: p[0])


def micro_batches_all_ranks(
    tokens_R: Sequence[Sequence[int]],
    max_tokens: int,
    *,
    costs_R: Optional[Sequence[Sequence[float]]] = None,
    multiple: int = 1,
    minimum: int = 1,
    pipeline_order: bool = True,
) -> list[list[list[int]]]:
    """Micro-batches of every DP rank, computed locally; all ranks get the same count."""
    counts = [min_num_micro_batches(check_lengths(t, max_tokens)[0], max_tokens) for t in tokens_R]
    num = agree_num_micro_batches(counts, multiple=multiple, minimum=minimum)
    return [
        split_micro_batches(t, num, max_tokens, costs_N=None if costs_R is None else costs_R[r],
                            pipeline_order=pipeline_order)
        for r, t in enumerate(tokens_R)
    ]


def micro_batches_this_rank(
    tokens_N: Sequence[int],
    max_tokens: int,
    *,
    process_group: Any,
    costs_N: Optional[Sequence[float]] = None,
    multiple: int = 1,
    minimum: int = 1,
    pipeline_order: bool = True,
) -> list[list[int]]:
    """This rank's micro-batches; the count is agreed over ``process_group`` (DP group) by an
    all-reduce MAX. Every rank of the group must call it (a collective)."""
    if process_group is None:
        raise ValueError(
            "micro_batches_this_rank: process_group is None; pass the DP group, or call "
            "micro_batches_all_ranks with every rank's lengths")
    round_num_micro_batches(0, multiple, minimum)  # validates before the collective
    # One all-reduce carries the count and both failure conditions, so that every rank raises
    # together instead of one rank raising and the others hanging in their next collective.
    error = None
    try:
        tokens, _ = check_lengths(tokens_N, max_tokens)
        count = min_num_micro_batches(tokens, max_tokens)
    except ValueError as exc:
        error, tokens, count = exc, [], 0
    max_count, any_error, neg_min_seqs = _all_reduce_max(
        [count, int(error is not None), -len(tokens_N)], process_group)
    min_num_seqs = -neg_min_seqs
    if error is not None:
        raise error
    if any_error:
        raise ValueError("micro_batches_this_rank: another DP rank rejected its lengths "
                         "(see that rank's error)")
    num = round_num_micro_batches(max_count, multiple, minimum)
    if num > min_num_seqs:
        raise ValueError(
            f"cannot split {min_num_seqs} sequences into {num} micro-batches: empty "
            f"micro-batches are not allowed; give every DP rank at least {num} sequences or "
            f"lower the micro-batch count")
    return split_micro_batches(tokens, num, max_tokens, costs_N=costs_N,
                               pipeline_order=pipeline_order)
