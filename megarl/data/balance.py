"""Balance sequences across data-parallel ranks (k-way number partitioning).

:func:`balance_partitions` runs three stages, each deterministic (ties broken by input order), so
every rank computes the same answer:

1. Karmarkar-Karp, the k-way largest differencing method (:func:`karmarkar_karp`), with a
   balanced variant for ``equal_counts`` (item counts then differ by at most one).
2. Local search (:func:`refine_partitions`): KK can be 5-30 % off with 2-4 items per partition;
   moves and swaps lower the heaviest partition, honouring an optional per-partition token
   ``capacity`` (:mod:`megarl.data.microbatch` uses it).
3. Budgeted branch-and-bound for small instances (<= 64 items, where KK is weakest): limited
   discrepancy search, then DFS, within a node count (not a time limit) (:func:`branch_and_bound`).

Groups (``group_ids``, e.g. a prompt's n responses) are one item whose cost is the sum. Cost
model (:func:`flops_cost_coefficients`): ``a*len + b*len**2``, a decoder's forward FLOPs; the
backward scales both terms alike, so the forward ratio a:b is all balancing needs.
Shape legend (lists, not tensors): ``_N`` per sequence, ``_K`` per partition, ``_G`` per group.
"""

from __future__ import annotations

import bisect
import heapq
import math
from typing import Any, Optional, Sequence

__all__ = [
    "flops_cost_coefficients",
    "flops_cost_coefficients_from_config",
    "sequence_costs",
    "karmarkar_karp",
    "refine_partitions",
    "branch_and_bound",
    "balance_partitions",
    "partition_loads",
    "imbalance",
]


# ---------------------------------------------------------------------------------------------
# Cost model
# ---------------------------------------------------------------------------------------------


def flops_cost_coefficients(
    *,
    hidden_size: int,
    num_layers: int,
    ffn_hidden_size: int,
    num_attention_heads: int,
    num_query_groups: Optional[int] = None,
    kv_channels: Optional[int] = None,
    gated_linear_unit: bool = False,
    vocab_size: int = 0,
    num_moe_experts: Optional[int] = None,
    moe_router_topk: int = 1,
    moe_ffn_hidden_size: Optional[int] = None,
    moe_shared_expert_intermediate_size: Optional[int] = None,
    causal: bool = True,
) -> tuple[float, float]:
    """Return ``(a, b)`` with ``cost(len) = a*len + b*len**2`` = forward FLOPs of one sequence.

    Names follow megatron-core's ``TransformerConfig``. ``a`` counts 2 FLOPs per multiply-add of
    the QKV/output projections, the MLP (3 matrices when gated) and the output layer
    (``vocab_size``; 0 leaves it out). ``b`` counts QK^T and attention x V, halved when ``causal``.
    MoE: with ``num_moe_experts`` every layer's MLP is ``moe_router_topk`` experts of width
    ``moe_ffn_hidden_size`` plus the shared expert (dense first layers and the router are
    ignored: a few percent of the linear term).
    """
    for name, value in (("hidden_size", hidden_size), ("num_layers", num_layers),
                        ("ffn_hidden_size", ffn_hidden_size),
                        ("num_attention_heads", num_attention_heads)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"flops_cost_coefficients: {name}={value!r}, expected a positive int")
    if vocab_size < 0:
        raise ValueError(f"flops_cost_coefficients: vocab_size={vocab_size!r}, expected >= 0")
    head_dim = kv_channels if kv_channels else hidden_size // num_attention_heads
    num_kv_heads = num_query_groups if num_query_groups else num_attention_heads
    q_width = num_attention_heads * head_dim
    kv_width = num_kv_heads * head_dim
    attn_params = hidden_size * q_width + 2 * hidden_size * kv_width + q_width * hidden_size
    num_mlp_mats = 3 if gated_linear_unit else 2
    if num_moe_experts:
        expert_width = moe_ffn_hidden_size or ffn_hidden_size
        mlp_width = moe_router_topk * expert_width + (moe_shared_expert_intermediate_size or 0)
    else:
        mlp_width = ffn_hidden_size
    mlp_params = num_mlp_mats * hidden_size * mlp_width
    a = 2.0 * num_layers * (attn_params + mlp_params) + 2.0 * hidden_size * vocab_size
    b = 4.0 * num_layers * q_width * (0.5 if causal else 1.0)
    return a, b


def flops_cost_coefficients_from_config(config: Any, vocab_size: int = 0) -> tuple[float, float]:
    """:func:`flops_cost_coefficients` from a megatron-core ``TransformerConfig`` (or any object
    with the same attribute names)."""
    get = lambda name, default=None: getattr(config, name, default)  # noqa: E731
    return flops_cost_coefficients(
        hidden_size=get("hidden_size"),
        num_layers=get("num_layers"),
        ffn_hidden_size=get("ffn_hidden_size") or 4 * get("hidden_size"),
        num_attention_heads=get("num_attention_heads"),
        num_query_groups=get("num_query_groups"),
        kv_channels=get("kv_channels"),
        gated_linear_unit=bool(get("gated_linear_unit", False)),
        vocab_size=vocab_size,
        num_moe_experts=get("num_moe_experts"),
        moe_router_topk=get("moe_router_topk", 1) or 1,
        moe_ffn_hidden_size=get("moe_ffn_hidden_size"),
        moe_shared_expert_intermediate_size=get("moe_shared_expert_intermediate_size"),
    )


def sequence_costs(lengths_N: Sequence[int], a: float = 1.0, b: float = 0.0) -> list[float]:
    """``a*len + b*len**2`` per sequence (tokens when ``a=1, b=0``)."""
    if b == 0.0 and a == 1.0:
        return [float(n) for n in lengths_N]
    return [a * n + b * n * n for n in lengths_N]


# ---------------------------------------------------------------------------------------------
# Karmarkar-Karp
# ---------------------------------------------------------------------------------------------


def _flatten(tree: Any, out: list[int]) -> None:
    """Collect the leaves (item indices) of a merge tree built from nested 2-tuples."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, tuple):
            stack.extend(node)
        else:
            out.append(node)


def _check_costs(costs_N: Sequence[float], num_partitions: int, fn: str) -> None:
    if not isinstance(num_partitions, int) or num_partitions < 1:
        raise ValueError(f"{fn}: num_partitions={num_partitions!r}, expected an int >= 1")
    for i, c in enumerate(costs_N):
        if not (c >= 0 and math.isfinite(c)):
            raise ValueError(f"{fn}: costs[{i}]={c!r}, expected a finite number >= 0")


def karmarkar_karp(
    costs_N: Sequence[float], num_partitions: int, *, equal_counts: bool = False
) -> list[list[int]]:
    """k-way largest differencing method; returns ``num_partitions`` lists of item indices.

    Every item starts as a state (a k-tuple of loads with the item in one slot); the two states
    with the largest spread are repeatedly combined, heaviest slot of one with lightest of the
    other, until one is left. With ``equal_counts`` items sorted by cost are first grouped into
    chunks of k (balanced LDM); n not divisible by k is padded with zero-cost dummies, dropped at
    the end. States store only their non-empty slots, and partition contents are merge trees
    flattened once at the end, so no list is copied while merging.

    Each list is sorted; partitions are ordered by their smallest index, empty ones (only when
    there are fewer items than partitions) last. With ``equal_counts`` the item counts of any two
    partitions differ by at most one.
    """
    _check_costs(costs_N, num_partitions, "karmarkar_karp")
    k = num_partitions
    n = len(costs_N)
    order = sorted(range(n), key=lambda i: (-costs_N[i], i))
    heap: list = []
    tick = 0  # tie-breaker: deterministic, and keeps heapq from comparing the lists
    if equal_counts:
        # Zero-cost dummies (index >= n) make n a multiple of k; a chunk of k consecutive items
        # (descending cost) fills every slot of a state once.
        padded = order + list(range(n, n + (-n) % k))
        for start in range(0, len(padded), k):
            chunk = padded[start:start + k]
            slots = [(costs_N[i] if i < n else 0.0, i) for i in chunk]
            slots.sort(key=lambda s: -s[0])
            heapq.heappush(heap, (-(slots[0][0] - slots[-1][0]), tick, slots))
            tick += 1
    else:
        for i in order:
            spread = costs_N[i] if k > 1 else 0.0
            heapq.heappush(heap, (-spread, tick, [(costs_N[i], i)]))
            tick += 1
    while len(heap) > 1:
        _, _, slots_a = heapq.heappop(heap)
        _, _, slots_b = heapq.heappop(heap)
        # Pair slot j of B (descending) with slot k-1-j of A (so heavy meets light); slots beyond
        # a state's length are implicit empty slots with load 0.
        len_a, len_b = len(slots_a), len(slots_b)
        merged = slots_a[:max(k - len_b, 0)]
        for j, (load_b, tree_b) in enumerate(slots_b):
            i = k - 1 - j
            if i < len_a:
                load_a, tree_a = slots_a[i]
                merged.append((load_a + load_b, (tree_a, tree_b)))
            else:
                merged.append((load_b, tree_b))
        merged.sort(key=lambda s: -s[0])
        low = merged[-1][0] if len(merged) == k else 0.0
        heapq.heappush(heap, (-(merged[0][0] - low), tick, merged))
        tick += 1
    partitions: list[list[int]] = []
    if heap:
        for _, tree in heap[0][2]:
            items: list[int] = []
            _flatten(tree, items)
            partitions.append(sorted(i for i in items if i < n))
    partitions.sort(key=lambda p: p[0] if p else n)
    partitions.extend([] for _ in range(k - len(partitions)))
    return partitions


# ---------------------------------------------------------------------------------------------
# Local search
# ---------------------------------------------------------------------------------------------


def partition_loads(values_N: Sequence[float], partitions: Sequence[Sequence[int]]) -> list[float]:
    """Sum of ``values_N`` over each partition."""
    return [sum(values_N[i] for i in part) for part in partitions]


def imbalance(values_N: Sequence[float], partitions: Sequence[Sequence[int]]) -> float:
    """``max load / mean load - 1`` (0 is perfect; 0 when all loads are 0)."""
    loads = partition_loads(values_N, partitions)
    mean = sum(loads) / len(loads)
    return max(loads) / mean - 1.0 if mean > 0 else 0.0


def refine_partitions(
    costs_N: Sequence[float],
    partitions: Sequence[Sequence[int]],
    *,
    equal_counts: bool = False,
    tokens_N: Optional[Sequence[int]] = None,
    capacity: Optional[float] = None,
    min_items: int = 0,
    max_refine_steps: Optional[int] = None,
) -> list[list[int]]:
    """Lower the heaviest partition by single moves / swaps.

    Take the heaviest partition H and, scanning the others from the lightest L up, apply the best
    move (an item of H to L, not with ``equal_counts``) or swap (an item of H for a lighter one of
    L) whose cost difference d satisfies 0 < d < load(H) - load(L), d closest to the half gap.
    Each step lowers the sorted load vector lexicographically, so it terminates; it also stops
    after ``max_refine_steps``.

    ``capacity`` bounds ``sum(tokens_N)`` of every partition a step touches (partitions already
    above it are only ever lowered); ``min_items`` keeps at least that many items per partition;
    ``equal_counts`` allows swaps only. Returns new sorted lists in the same partition order.
    """
    k = len(partitions)
    parts = [sorted(p, key=lambda i: (costs_N[i], i)) for p in partitions]
    if k < 2:
        return [sorted(p) for p in parts]
    if capacity is not None and tokens_N is None:
        raise ValueError("refine_partitions: capacity is set but tokens_N is None; pass both")
    tokens = tokens_N if tokens_N is not None else costs_N
    loads = [sum(costs_N[i] for i in p) for p in parts]
    toks = [sum(tokens[i] for i in p) for p in parts]
    keys = [[costs_N[i] for i in p] for p in parts]
    cap = math.inf if capacity is None else capacity
    # Float sums drift; a gain below this is noise, not an improvement.
    eps = 1e-9 * max(1.0, max(loads))
    steps = max_refine_steps if max_refine_steps is not None else 20 * len(costs_N) + 100

    def best_step(h: int, lo: int) -> Optional[tuple[float, int, int]]:
        """Best (new pair max, position in H, position in L or -1 for a move)."""
        gap = loads[h] - loads[lo]
        half = gap / 2.0
        best = None
        items_h, items_l, keys_l = parts[h], parts[lo], keys[lo]
        for ph, x in enumerate(items_h):
            cx = costs_N[x]
            if cx <= eps:
                continue
            if not equal_counts and len(items_h) > min_items and cx < gap - eps \
                    and toks[lo] + tokens[x] <= cap:
                score = max(loads[h] - cx, loads[lo] + cx)
                if best is None or score < best[0] - eps:
                    best = (score, ph, -1)
            # Swap: want cost(y) close to cx - half, with 0 < cx - cy < gap.
            pos = bisect.bisect_left(keys_l, cx - half)
            for pl in (pos - 2, pos - 1, pos, pos + 1):
                if 0 <= pl < len(items_l):
                    y = items_l[pl]
                    d = cx - costs_N[y]
                    if eps < d < gap - eps and toks[lo] - tokens[y] + tokens[x] <= cap:
                        score = max(loads[h] - d, loads[lo] + d)
                        if best is None or score < best[0] - eps:
                            best = (score, ph, pl)
        return best

    def remove(p: int, pos: int) -> int:
        item = parts[p].pop(pos)
        keys[p].pop(pos)
        loads[p] -= costs_N[item]
        toks[p] -= tokens[item]
        return item

    def insert(p: int, item: int) -> None:
        pos = bisect.bisect_left(keys[p], costs_N[item])
        parts[p].insert(pos, item)
        keys[p].insert(pos, costs_N[item])
        loads[p] += costs_N[item]
        toks[p] += tokens[item]

    for _ in range(steps):
        h = max(range(k), key=lambda p: (loads[p], -p))
        improved = False
        for lo in sorted(range(k), key=lambda p: (loads[p], p)):
            if lo == h or loads[h] - loads[lo] <= eps:
                break
            step = best_step(h, lo)
            if step is None:
                continue
            _, ph, pl = step
            x = remove(h, ph)
            if pl >= 0:
                insert(h, remove(lo, pl))
            insert(lo, x)
            improved = True
            break
        if not improved:
            break
    return [sorted(p) for p in parts]


# ---------------------------------------------------------------------------------------------
# Budgeted branch-and-bound
# ---------------------------------------------------------------------------------------------


def branch_and_bound(
    costs_N: Sequence[float],
    num_partitions: int,
    *,
    upper: float,
    equal_counts: bool = False,
    node_budget: int = 2000,
) -> Optional[list[list[int]]]:
    """A partition whose max load is below ``upper``, found by branch-and-bound within
    ``node_budget`` nodes, or None (none exists, or the budget ran out first).

    Half the budget goes to limited discrepancy search (iteration d follows the greedy choice,
    the least loaded bin, everywhere except at most d places, at any depth: it changes *early*
    decisions cheaply), the rest to a plain depth-first search from the best partition found.

    Returns the best one found; no partition is empty when there are at least as many items as
    partitions. With ``equal_counts`` counts differ by at most one.
    """
    _check_costs(costs_N, num_partitions, "branch_and_bound")
    k = num_partitions
    order = sorted(range(len(costs_N)), key=lambda i: (-costs_N[i], i))
    items = [costs_N[i] for i in order]
    n = len(items)
    suffix = [0.0] * (n + 1)
    for i in range(n - 1, -1, -1):
        suffix[i] = suffix[i + 1] + items[i]
    # Equal counts: every bin gets floor(n/k) or ceil(n/k) items, and only n % k bins (all k
    # when it divides) may reach ceil(n/k).
    most = -(-n // k)
    num_full_allowed = n % k or k
    loads = [0.0] * k
    counts = [0] * k
    assign = [0] * n
    state = {"best": upper, "found": None, "nodes": 0, "full": 0, "limit": 0, "cut": False}

    def dfs(i: int, cur_max: float, discrepancies: float) -> None:
        if i == n:
            state["best"], state["found"] = cur_max, list(assign)
            return
        state["nodes"] += 1
        if state["nodes"] > state["limit"]:
            return
        best = state["best"]
        if suffix[i] > sum(best - load for load in loads if load < best):
            return  # the remaining items cannot fit under the incumbent
        if counts.count(0) > n - i:
            return  # a partition would stay empty
        x = items[i]
        seen = set()
        branch = 0  # discrepancies this choice costs: 0 for the least loaded bin
        for p in sorted(range(k), key=lambda p: (loads[p], p)):
            if equal_counts and (counts[p] == most or (
                    counts[p] == most - 1 and state["full"] == num_full_allowed)):
                continue
            key = (loads[p], counts[p]) if equal_counts else loads[p]
            if key in seen:
                continue  # symmetric to a bin already tried
            seen.add(key)
            new = loads[p] + x
            if new >= state["best"]:
                break  # bins are in increasing load: the rest are no better
            if branch > discrepancies:
                state["cut"] = True
                break
            loads[p], counts[p], assign[i] = new, counts[p] + 1, p
            state["full"] += counts[p] == most
            dfs(i + 1, max(cur_max, new), discrepancies - branch)
            state["full"] -= counts[p] == most
            loads[p], counts[p] = loads[p] - x, counts[p] - 1
            branch += 1
            if state["nodes"] > state["limit"]:
                return

    state["limit"] = node_budget // 2
    complete = False
    for allowed in range(n * k + 1):
        state["cut"] = False
        dfs(0, 0.0, allowed)
        if state["nodes"] > state["limit"]:
            break  # half the budget is spent
        if not state["cut"]:
            complete = True  # nothing was cut: the search was exhaustive
            break
    if not complete:
        state["limit"] = node_budget
        dfs(0, 0.0, math.inf)
    if state["found"] is None:
        return None
    parts: list[list[int]] = [[] for _ in range(k)]
    for pos, p in enumerate(state["found"]):
        parts[p].append(order[pos])
    parts = [sorted(p) for p in parts]
    parts.sort(key=lambda p: p[0] if p else n)
    return parts


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------

EXACT_MAX_ITEMS = 64
"""Branch-and-bound polishing runs only up to this many items (groups): beyond it KK plus the
local search is already within a fraction of a percent on RL length distributions."""


def _solve(costs: Sequence[float], k: int, equal_counts: bool, refine: bool,
           exact_node_budget: int) -> list[list[int]]:
    parts = karmarkar_karp(costs, k, equal_counts=equal_counts)
    if not refine:
        return parts
    parts = refine_partitions(costs, parts, equal_counts=equal_counts)
    if exact_node_budget > 0 and k < len(costs) <= EXACT_MAX_ITEMS:
        upper = max(partition_loads(costs, parts))
        better = branch_and_bound(costs, k, upper=upper, equal_counts=equal_counts,
                                  node_budget=exact_node_budget)
        if better is not None:
            parts = better
    return parts


def balance_partitions(
    costs_N: Sequence[float],
    num_partitions: int,
    *,
    group_ids_N: Optional[Sequence[Any]] = None,
    equal_counts: bool = False,
    refine: bool = True,
    exact_node_budget: int = 4000,
) -> list[list[int]]:
    """KK + refinement (+ budgeted branch-and-bound for <= ``EXACT_MAX_ITEMS`` items) over
    ``costs_N``; returns ``num_partitions`` sorted index lists.

    ``group_ids_N`` keeps all items with the same id in one partition (hashable ids, any order).
    ``equal_counts`` equalises item counts (group counts with ``group_ids_N``; counts differ by
    at most one item/group). Partitions may be empty only when there are fewer items (groups)
    than partitions; callers that need non-empty partitions check that first.
    """
    _check_costs(costs_N, num_partitions, "balance_partitions")
    if group_ids_N is None:
        return _solve(costs_N, num_partitions, equal_counts, refine, exact_node_budget)
    if len(group_ids_N) != len(costs_N):
        raise ValueError(
            f"balance_partitions: len(group_ids)={len(group_ids_N)} but len(costs)="
            f"{len(costs_N)}; expected one group id per sequence")
    members_G: dict[Any, list[int]] = {}
    for i, g in enumerate(group_ids_N):
        members_G.setdefault(g, []).append(i)
    groups = list(members_G.values())
    if equal_counts and len({len(m) for m in groups}) > 1:
        sizes = sorted({len(m) for m in groups})
        raise ValueError(
            f"balance_partitions: equal_counts with group_ids needs groups of one size, got "
            f"sizes {sizes}; drop equal_counts or make the groups equal")
    group_costs_G = [sum(costs_N[i] for i in m) for m in groups]
    group_parts = _solve(group_costs_G, num_partitions, equal_counts, refine, exact_node_budget)
    parts = [sorted(i for g in gp for i in groups[g]) for gp in group_parts]
    parts.sort(key=lambda p: p[0] if p else len(costs_N))
    return parts
