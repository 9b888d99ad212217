"""Property and edge-case tests of megarl.data.batching.plan_batches."""

import math
import random
from dataclasses import dataclass
from typing import Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.data.balance import flops_cost_coefficients, imbalance
from megarl.data.packing import packed_tokens
from megarl.data.batching import BatchBudget, plan_batches, restore_order

SETTINGS = settings(max_examples=60, deadline=None)


@dataclass
class Topo:
    dp: int = 1
    pp: int = 1
    vpp: Optional[int] = None
    tp: int = 1
    cp: int = 1


def _check_plan(plan, lengths, topo, budget):
    n = len(lengths)
    assert sorted(plan.order) == list(range(n))
    assert len(plan.micro_batches) == topo.dp
    assert {len(mbs) for mbs in plan.micro_batches} == {plan.num_micro_batches}
    if topo.vpp and topo.vpp > 1:
        assert plan.num_micro_batches % topo.pp == 0
    assert plan.num_micro_batches >= budget.min_num_micro_batches
    cap = budget.max_tokens_per_micro_batch
    for mbs in plan.micro_batches:
        for mb in mbs:
            assert mb, "empty micro-batch"
            assert sum(plan.tokens_N[i] for i in mb) <= cap, "cap exceeded"
    for i, length in enumerate(lengths):
        if i not in plan.truncated:
            assert plan.tokens_N[i] == packed_tokens(length, topo.tp, topo.cp)
    assert [i for mbs in plan.micro_batches for mb in mbs for i in mb] == plan.order
    assert restore_order([lengths[i] for i in plan.order], plan) == list(lengths)


@st.composite
def plan_case(draw):
    topo = Topo(dp=draw(st.integers(1, 4)), pp=draw(st.integers(1, 4)),
                vpp=draw(st.sampled_from([None, 1, 2])), tp=draw(st.sampled_from([1, 2])),
                cp=draw(st.sampled_from([1, 2])))
    cap = draw(st.integers(64, 4096))
    # Up to 2x the budget: with truncate=True the longest ones are planned as cut.
    lengths = draw(st.lists(st.integers(1, 2 * cap), min_size=topo.dp, max_size=60))
    cost = draw(st.sampled_from(["tokens", "flops"]))
    budget = BatchBudget(max_tokens_per_micro_batch=cap, cost=cost,
                         flops_coefficients=(1.0, 1e-3) if cost == "flops" else None,
                         equal_counts=draw(st.booleans()), truncate=True,
                         min_num_micro_batches=draw(st.integers(1, 3)))
    return lengths, topo, budget


@pytest.mark.filterwarnings("ignore:plan_batches")  # truncation warnings
@SETTINGS
@given(case=plan_case())
def test_plan_invariants(case):
    lengths, topo, budget = case
    try:
        plan = plan_batches(lengths, topo, budget)
    except ValueError as exc:
        # The only accepted refusal: too few sequences for the agreed micro-batch count.
        assert "empty micro-batches are not allowed" in str(exc)
        return
    _check_plan(plan, lengths, topo, budget)
    for i, orig in plan.truncated.items():
        assert lengths[i] == orig and plan.tokens_N[i] <= budget.max_tokens_per_micro_batch


@SETTINGS
@given(sizes=st.lists(st.integers(1, 4), min_size=2, max_size=16), dp=st.integers(1, 2),
       seed=st.integers(0, 99))
def test_groups_stay_on_one_rank(sizes, dp, seed):
    rng = random.Random(seed)
    group_ids = [f"p{g}" for g, s in enumerate(sizes) for _ in range(s)]
    lengths = [rng.randint(1, 500) for _ in group_ids]
    budget = BatchBudget(max_tokens_per_micro_batch=500, balance_groups=True)
    try:
        plan = plan_batches(lengths, Topo(dp=dp), budget, group_ids=group_ids)
    except ValueError as exc:
        assert "empty micro-batches are not allowed" in str(exc)
        return
    _check_plan(plan, lengths, Topo(dp=dp), budget)
    owner = {}
    for r, mbs in enumerate(plan.micro_batches):
        for mb in mbs:
            for i in mb:
                assert owner.setdefault(group_ids[i], r) == r


def test_fewer_sequences_than_ranks():
    with pytest.raises(ValueError) as err:
        plan_batches([10, 20, 30], Topo(dp=4), BatchBudget(max_tokens_per_micro_batch=100))
    assert str(err.value) == ("plan_batches: 3 sequences cannot fill dp=4 ranks; every DP rank "
                              "needs at least one")
    with pytest.raises(ValueError) as err:
        plan_batches([10] * 6, Topo(dp=4), BatchBudget(max_tokens_per_micro_batch=100,
                                                        balance_groups=True),
                     group_ids=[0, 0, 0, 1, 1, 1])
    assert str(err.value) == ("plan_batches: 2 prompt groups cannot fill dp=4 ranks; every DP "
                              "rank needs at least one")


def test_too_many_micro_batches_for_the_sequences():
    # pp=4 with VPP forces 4 micro-batches per rank, but a rank can only get 2 sequences.
    with pytest.raises(ValueError) as err:
        plan_batches([10] * 4, Topo(dp=2, pp=4, vpp=2), BatchBudget(max_tokens_per_micro_batch=100))
    assert str(err.value) == (
        "plan_batches: a DP rank holds only 2 sequences but every rank must run 4 micro-batches "
        "(max over ranks under the token budget, min_num_micro_batches=1, rounded to a multiple "
        "of 4: pp under VPP); empty micro-batches are not allowed: provide at least 8 "
        "sequences, raise max_tokens_per_micro_batch or lower min_num_micro_batches")


def test_equal_counts_fallback_avoids_empty_micro_batches():
    # Token balance puts the 4000-token sequence alone on one rank (1 sequence, 4 micro-batches
    # needed under VPP); the plan falls back to equal sequence counts instead of failing.
    lengths = [4000] + [100] * 40
    topo = Topo(dp=2, pp=4, vpp=2)
    budget = BatchBudget(max_tokens_per_micro_batch=4000)
    plan = plan_batches(lengths, topo, budget)
    _check_plan(plan, lengths, topo, budget)
    assert sorted(len([i for mb in mbs for i in mb]) for mbs in plan.micro_batches) == [20, 21]


def test_over_budget_errors_and_truncation():
    with pytest.raises(ValueError) as err:
        plan_batches([10, 5000], Topo(), BatchBudget(max_tokens_per_micro_batch=4096))
    assert str(err.value) == ("sequence 1 has 5000 tokens, more than max_tokens_per_micro_batch="
                              "4096; raise the budget or set truncate=True")
    with pytest.raises(ValueError) as err:
        plan_batches([10, 4095], Topo(tp=2), BatchBudget(max_tokens_per_micro_batch=4095))
    assert str(err.value) == ("sequence 1 has 4095 tokens (4096 after padding for tp=2, cp=1), "
                              "more than max_tokens_per_micro_batch=4095; raise the budget or "
                              "set truncate=True")
    with pytest.warns(UserWarning, match="1 sequences over the budget"):
        plan = plan_batches([10, 9000, 20], Topo(cp=2), BatchBudget(max_tokens_per_micro_batch=4096,
                                                                   truncate=True))
    assert plan.truncated == {1: 9000}
    assert plan.tokens_N[1] == 4096  # 8192 real tokens kept, split over cp=2


def test_budget_and_topology_validation():
    with pytest.raises(ValueError) as err:
        BatchBudget(max_tokens_per_micro_batch=0)
    assert str(err.value) == "BatchBudget.max_tokens_per_micro_batch=0, expected an int >= 1"
    with pytest.raises(ValueError) as err:
        BatchBudget(max_tokens_per_micro_batch=10, cost="time")
    assert str(err.value) == "BatchBudget.cost='time', expected one of ('tokens', 'flops')"
    with pytest.raises(ValueError) as err:
        BatchBudget(max_tokens_per_micro_batch=10, cost="flops")
    assert str(err.value).startswith("BatchBudget.flops_coefficients=None, expected (a, b)")
    with pytest.warns(UserWarning, match="flops_coefficients is ignored"):
        BatchBudget(max_tokens_per_micro_batch=10, flops_coefficients=(1.0, 0.0))
    with pytest.raises(TypeError) as err:
        plan_batches([1], object(), BatchBudget(max_tokens_per_micro_batch=10))
    assert str(err.value) == "topology has no attribute 'dp'; expected dp, pp, vpp, tp, cp"
    with pytest.raises(ValueError) as err:
        plan_batches([1], Topo(pp=0), BatchBudget(max_tokens_per_micro_batch=10))
    assert str(err.value) == "topology.pp=0, expected an int >= 1"
    with pytest.raises(ValueError) as err:
        BatchBudget(max_tokens_per_micro_batch=10, exact_node_budget=-1)
    assert str(err.value) == "BatchBudget.exact_node_budget=-1, expected an int >= 0"
    with pytest.raises(ValueError) as err:
        plan_batches([1, 0], Topo(), BatchBudget(max_tokens_per_micro_batch=10))
    assert str(err.value) == "plan_batches: lengths[1]=0, expected an int >= 1"
    with pytest.raises(ValueError) as err:
        plan_batches([1, 2], Topo(), BatchBudget(max_tokens_per_micro_batch=10,
                                                  balance_groups=True))
    assert str(err.value) == ("plan_batches: budget.balance_groups=True but group_ids is None; "
                              "pass one group id per sequence")


def test_rl_batch_is_balanced_and_deterministic():
    rng = random.Random(0)
    lengths = [rng.randint(100, 1500) + min(16384, int(math.exp(rng.gauss(7.6, 0.9))))
               for _ in range(256)]
    topo = Topo(dp=8, pp=2, vpp=2, tp=2, cp=1)
    a, b = flops_cost_coefficients(hidden_size=4096, num_layers=32, ffn_hidden_size=11008,
                                   num_attention_heads=32, gated_linear_unit=True)
    for budget in (BatchBudget(max_tokens_per_micro_batch=20000),
                   BatchBudget(max_tokens_per_micro_batch=20000, cost="flops",
                               flops_coefficients=(a, b))):
        plan = plan_batches(lengths, topo, budget)
        _check_plan(plan, lengths, topo, budget)
        ranks = [[i for mb in mbs for i in mb] for mbs in plan.micro_batches]
        assert imbalance(plan.costs_N, ranks) < 0.01
        assert plan_batches(lengths, topo, budget).micro_batches == plan.micro_batches


def test_numpy_lengths_accepted():
    np = pytest.importorskip("numpy")
    plan = plan_batches(np.array([300, 200, 100, 50]), Topo(dp=2),
                        BatchBudget(max_tokens_per_micro_batch=400))
    assert sorted(plan.order) == [0, 1, 2, 3] and all(type(t) is int for t in plan.tokens_N)
