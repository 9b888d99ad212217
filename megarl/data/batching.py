"""One entry point for the data plane: DP balance + micro-batches (+ what packing will cost).

``plan_batches(lengths, topology, budget)``:

1. Tokens per sequence as it sits in one CP rank's packed row, ``padded_length(len, tp, cp) / cp``
   (:mod:`megarl.data.packing`): alignment padding counts against
   ``max_tokens_per_micro_batch``.
2. Cost per sequence: tokens, or FLOPs ``a*len + b*len**2`` (:func:`flops_coefficients` from the
   model's config.json).
3. Balance sequences (or prompt groups) across ``dp`` ranks by cost (:mod:`megarl.data.balance`).
4. Micro-batches per rank (:mod:`megarl.data.microbatch`).

If step 4 needs more micro-batches than some rank has sequences, step 3 is redone with equal
sequence counts per rank; if that is still too few, ``plan_batches`` raises (empty micro-batches
are never produced). Legend (lists): ``_N`` per sequence (original order), ``_R`` per DP rank.
"""

from __future__ import annotations

import numbers
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from megarl.data.balance import balance_partitions, sequence_costs
from megarl.data.microbatch import (min_num_micro_batches, round_num_micro_batches,
                                    split_micro_batches)
from megarl.data.packing import packed_tokens, sequence_alignment

__all__ = ["BatchBudget", "BatchPlan", "budget_from_config", "flops_coefficients", "plan_batches",
           "restore_order"]

_COSTS = ("tokens", "flops")


@dataclass
class BatchBudget:
    """How to cut one training batch into per-rank micro-batches."""

    max_tokens_per_micro_batch: int
    """Hard cap on the packed tokens of one micro-batch on one device (after alignment padding,
    divided by cp)."""
    cost: str = "tokens"
    """Balancing cost: "tokens", or "flops" (``a*len + b*len**2`` with ``flops_coefficients``)."""
    flops_coefficients: Optional[tuple[float, float]] = None
    """``(a, b)`` for cost="flops", e.g. from ``balance.flops_cost_coefficients``."""
    balance_groups: bool = False
    """Keep all samples with the same group id (the responses of one prompt) on one DP rank."""
    equal_counts: bool = False
    """Give every DP rank the same number of sequences (groups), +-1 when not divisible."""
    truncate: bool = False
    """Plan sequences over the cap as if cut to it (``BatchPlan.truncated`` lists them; the
    caller cuts the tokens) instead of raising."""
    min_num_micro_batches: int = 1
    """Lower bound on the micro-batch count (e.g. pp, to fill the pipeline)."""
    refine: bool = True
    """Run the local-search refinement after Karmarkar-Karp (DP balance)."""
    exact_node_budget: int = 4000
    """Branch-and-bound nodes spent polishing small DP balances (<= 64 sequences or groups);
    0 turns it off."""
    pipeline_order: bool = True
    """Place the cheapest micro-batches at the warm-up and cool-down ends."""

    def __post_init__(self) -> None:
        cap = self.max_tokens_per_micro_batch
        if not isinstance(cap, int) or isinstance(cap, bool) or cap < 1:
            raise ValueError(
                f"BatchBudget.max_tokens_per_micro_batch={cap!r}, expected an int >= 1")
        if self.cost not in _COSTS:
            raise ValueError(f"BatchBudget.cost={self.cost!r}, expected one of {_COSTS}")
        if self.cost == "flops":
            coeffs = self.flops_coefficients
            if coeffs is None or len(coeffs) != 2 or min(coeffs) < 0 or max(coeffs) <= 0:
                raise ValueError(
                    f"BatchBudget.flops_coefficients={coeffs!r}, expected (a, b) >= 0, not both 0, "
                    f"when cost='flops' (see megarl.data.balance.flops_cost_coefficients)")
        elif self.flops_coefficients is not None:
            warnings.warn("BatchBudget.flops_coefficients is ignored because cost='tokens'",
                          stacklevel=3)
        m = self.min_num_micro_batches
        if not isinstance(m, int) or m < 1:
            raise ValueError(f"BatchBudget.min_num_micro_batches={m!r}, expected an int >= 1")
        if not isinstance(self.exact_node_budget, int) or self.exact_node_budget < 0:
            raise ValueError(f"BatchBudget.exact_node_budget={self.exact_node_budget!r}, "
                             f"expected an int >= 0")


@dataclass
class BatchPlan:
    """Where every sequence goes. Indices are positions in the ``lengths`` given to the plan."""

    micro_batches: list[list[list[int]]]
    """``[dp_rank][micro_batch]`` -> sequence indices, in execution order."""
    num_micro_batches: int
    """Micro-batches per DP rank (the same on every rank)."""
    order: list[int]
    """All indices in plan order (rank 0's micro-batches first); ``order[j]`` = original index."""
    restore: list[int]
    """Inverse of ``order``: ``restore[i]`` = position of sequence i in ``order``."""
    tokens_N: list[int]
    """Packed tokens per sequence on one device (what the budget bounds)."""
    costs_N: list[float]
    """Balancing cost per sequence."""
    truncated: dict[int, int] = field(default_factory=dict)
    """``{index: original length}`` for sequences planned as cut to the budget."""

    def rank_costs(self) -> list[float]:
        return [sum(self.costs_N[i] for mb in mbs for i in mb) for mbs in self.micro_batches]

    def micro_batch_tokens(self) -> list[list[int]]:
        return [[sum(self.tokens_N[i] for i in mb) for mb in mbs] for mbs in self.micro_batches]


def flops_coefficients(hf_config: Mapping[str, Any]) -> tuple[float, float]:
    """``(a, b)`` of the forward-FLOPs cost ``a*len + b*len**2`` for the model of an HF
    config.json (:func:`megarl.data.balance.flops_cost_coefficients`).

    Read through :class:`megarl.models.dims.ModelDims`; every supported family has a gated (SwiGLU)
    MLP. MoE: ``num_experts_per_tok`` experts of ``moe_intermediate_size`` plus the shared ones
    on every layer (dense first layers counted as MoE: a few percent of ``a``). MLA (DeepSeek):
    approximated as full attention with head width ``qk_nope_head_dim + qk_rope_head_dim``.
    """
    from megarl.data.balance import flops_cost_coefficients
    from megarl.models.dims import ModelDims

    dims = ModelDims.from_hf(dict(hf_config))
    head_dim = dims.head_dim or (dims.qk_nope_head_dim + dims.qk_rope_head_dim)
    return flops_cost_coefficients(
        hidden_size=dims.hidden_size, num_layers=dims.num_layers,
        ffn_hidden_size=dims.intermediate_size or 4 * dims.hidden_size,
        num_attention_heads=dims.num_attention_heads, num_query_groups=dims.num_kv_heads,
        kv_channels=head_dim or None, gated_linear_unit=True, vocab_size=dims.vocab_size,
        num_moe_experts=dims.num_experts or None, moe_router_topk=int(hf_config.get("num_experts_per_tok") or 1),
        moe_ffn_hidden_size=dims.moe_intermediate_size or None,
        moe_shared_expert_intermediate_size=dims.shared_expert_intermediate_size or None)


def budget_from_config(trainer_cfg: Any, hf_config: Optional[Mapping[str, Any]] = None) -> BatchBudget:
    """The :class:`BatchBudget` of the ``trainer`` config section: ``max_tokens_per_micro_batch``
    and ``balance_cost``; with "flops" the coefficients come from ``hf_config`` (the model's
    config.json, required then)."""
    cost = trainer_cfg.balance_cost
    if cost == "flops" and hf_config is None:
        raise ValueError("trainer.balance_cost='flops' needs the model's config.json (hf_config) to derive "
                         "the FLOPs coefficients")
    return BatchBudget(max_tokens_per_micro_batch=trainer_cfg.max_tokens_per_micro_batch, cost=cost,
                       flops_coefficients=flops_coefficients(hf_config) if cost == "flops" else None)


def restore_order(items_in_plan_order: Sequence[Any], plan: BatchPlan) -> list[Any]:
    """Per-sequence results concatenated in plan order -> the original order."""
    if len(items_in_plan_order) != len(plan.order):
        raise ValueError(
            f"restore_order: got {len(items_in_plan_order)} items, expected {len(plan.order)} "
            f"(one per planned sequence)")
    return [items_in_plan_order[j] for j in plan.restore]


def _topology_sizes(topology: Any) -> tuple[int, int, int, int, int]:
    sizes = []
    for name in ("dp", "pp", "vpp", "tp", "cp"):
        if not hasattr(topology, name):
            raise TypeError(f"topology has no attribute {name!r}; expected dp, pp, vpp, tp, cp")
        value = getattr(topology, name)
        if name == "vpp" and value is None:
            value = 1
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"topology.{name}={value!r}, expected an int >= 1")
        sizes.append(value)
    return tuple(sizes)  # type: ignore[return-value]


def plan_batches(
    lengths: Sequence[int],
    topology: Any,
    budget: BatchBudget,
    *,
    group_ids: Optional[Sequence[Any]] = None,
) -> BatchPlan:
    """Plan DP assignment and micro-batches; see the module docstring.

    ``topology``: any object with int attributes ``dp, pp, vpp, tp, cp`` (``vpp`` may be None).
    ``group_ids``: one hashable id per sequence, required with ``budget.balance_groups``.
    Deterministic: every rank computing it from the same input gets the same plan.
    """
    dp, pp, vpp, tp, cp = _topology_sizes(topology)
    lengths = list(lengths)
    n = len(lengths)
    if budget.balance_groups and group_ids is None:
        raise ValueError("plan_batches: budget.balance_groups=True but group_ids is None; "
                         "pass one group id per sequence")
    if group_ids is not None and len(group_ids) != n:
        raise ValueError(f"plan_batches: len(group_ids)={len(group_ids)} but len(lengths)={n}; "
                         f"expected one group id per sequence")
    for i, length in enumerate(lengths):
        if not isinstance(length, numbers.Integral) or isinstance(length, bool) or length < 1:
            raise ValueError(f"plan_batches: lengths[{i}]={length!r}, expected an int >= 1")
        lengths[i] = int(length)  # numpy / torch integers -> int
    cap = budget.max_tokens_per_micro_batch
    tokens = [packed_tokens(length, tp, cp) for length in lengths]
    truncated: dict[int, int] = {}
    if budget.truncate:
        # Largest real length whose packed size fits: cap * cp rounded down to the alignment.
        align = sequence_alignment(tp, cp)
        max_len = (cap * cp) // align * align
        if max_len < 1:
            raise ValueError(
                f"plan_batches: max_tokens_per_micro_batch={cap} is below one aligned chunk "
                f"({align} tokens / cp={cp}); raise the budget")
        for i, length in enumerate(lengths):
            if tokens[i] > cap:
                truncated[i] = length
                lengths[i] = max_len
                tokens[i] = packed_tokens(max_len, tp, cp)
        if truncated:
            warnings.warn(f"plan_batches: {len(truncated)} sequences over the budget are planned "
                          f"as cut to {max_len} tokens (BatchPlan.truncated)", stacklevel=2)
    else:
        for i, t in enumerate(tokens):
            if t > cap:
                extra = "" if t == lengths[i] else f" ({t} after padding for tp={tp}, cp={cp})"
                raise ValueError(
                    f"sequence {i} has {lengths[i]} tokens{extra}, more than "
                    f"max_tokens_per_micro_batch={cap}; raise the budget or set truncate=True")
    if budget.cost == "flops":
        a, b = budget.flops_coefficients  # type: ignore[misc]
        costs = sequence_costs(lengths, a, b)
    else:
        costs = [float(t) for t in tokens]

    use_groups = group_ids if budget.balance_groups else None
    num_units = n if use_groups is None else len(set(use_groups))
    unit = "sequences" if use_groups is None else "prompt groups"
    if num_units < dp:
        raise ValueError(f"plan_batches: {num_units} {unit} cannot fill dp={dp} ranks; every DP "
                         f"rank needs at least one")
    multiple = pp if vpp > 1 else 1

    def assign(equal_counts: bool) -> tuple[list[list[int]], int]:
        ranks = balance_partitions(costs, dp, group_ids_N=use_groups, equal_counts=equal_counts,
                                   refine=budget.refine,
                                   exact_node_budget=budget.exact_node_budget)
        counts = [min_num_micro_batches([tokens[i] for i in r], cap) for r in ranks]
        return ranks, round_num_micro_batches(max(counts), multiple, budget.min_num_micro_batches)

    ranks, num = assign(budget.equal_counts)
    if min(len(r) for r in ranks) < num and not budget.equal_counts:
        try:
            ranks, num = assign(True)
        except ValueError:  # e.g. prompt groups of unequal sizes: keep the first assignment
            pass
    fewest = min(len(r) for r in ranks)
    if fewest < num:
        raise ValueError(
            f"plan_batches: a DP rank holds only {fewest} sequences but every rank must run {num} "
            f"micro-batches (max over ranks under the token budget, min_num_micro_batches="
            f"{budget.min_num_micro_batches}, rounded to a multiple of {multiple}: pp under VPP); "
            f"empty micro-batches are "
            f"not allowed: provide at least {num * dp} sequences, raise "
            f"max_tokens_per_micro_batch or lower min_num_micro_batches")

    micro_batches: list[list[list[int]]] = []
    for rank in ranks:
        local = split_micro_batches([tokens[i] for i in rank], num, cap,
                                    costs_N=[costs[i] for i in rank],
                                    pipeline_order=budget.pipeline_order)
        micro_batches.append([[rank[j] for j in mb] for mb in local])
    order = [i for mbs in micro_batches for mb in mbs for i in mb]
    restore = [0] * n
    for pos, i in enumerate(order):
        restore[i] = pos
    assert sorted(order) == list(range(n))
    return BatchPlan(micro_batches=micro_batches, num_micro_batches=num, order=order,
                     restore=restore, tokens_N=tokens, costs_N=costs, truncated=truncated)
