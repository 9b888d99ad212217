"""Property and edge-case tests of megarl.data.balance (KK + local search, cost model)."""

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from helpers import flat_sorted

from megarl.data.balance import (balance_partitions, branch_and_bound, flops_cost_coefficients,
                                 flops_cost_coefficients_from_config, imbalance, karmarkar_karp,
                                 partition_loads, refine_partitions, sequence_costs)

SETTINGS = settings(max_examples=80, deadline=None)

costs_st = st.lists(st.integers(min_value=0, max_value=20000), min_size=0, max_size=60)


@SETTINGS
@given(costs=costs_st, k=st.integers(1, 9), equal=st.booleans())
def test_kk_every_item_exactly_once(costs, k, equal):
    parts = karmarkar_karp(costs, k, equal_counts=equal)
    assert len(parts) == k
    assert flat_sorted(parts) == list(range(len(costs)))
    assert all(p == sorted(p) for p in parts)
    if equal:
        sizes = [len(p) for p in parts]
        assert max(sizes) - min(sizes) <= 1
    if len(costs) >= k:
        assert all(parts)


@SETTINGS
@given(costs=costs_st, k=st.integers(1, 9), equal=st.booleans())
def test_refine_never_worse_and_keeps_items(costs, k, equal):
    kk = karmarkar_karp(costs, k, equal_counts=equal)
    ref = refine_partitions(costs, kk, equal_counts=equal)
    assert flat_sorted(ref) == list(range(len(costs)))
    assert max(partition_loads(costs, ref), default=0) <= max(partition_loads(costs, kk), default=0)
    if equal:
        assert sorted(len(p) for p in ref) == sorted(len(p) for p in kk)
    if all(kk) and all(c > 0 for c in costs):
        assert all(ref)


@SETTINGS
@given(costs=costs_st, k=st.integers(1, 6))
def test_refine_respects_capacity_and_min_items(costs, k):
    tokens = [c + 1 for c in costs]
    cap = max(tokens, default=1) * 3
    parts = [[i for i in range(len(costs)) if i % k == p] for p in range(k)]
    if any(sum(tokens[i] for i in p) > cap for p in parts):
        return  # the start must be feasible for this property
    ref = refine_partitions(costs, parts, tokens_N=tokens, capacity=cap, min_items=1)
    assert flat_sorted(ref) == list(range(len(costs)))
    assert all(sum(tokens[i] for i in p) <= cap for p in ref)
    assert all(p for p, q in zip(ref, parts) if q)


def test_lower_bound_reached_with_few_items():
    # n <= k: every item alone, the max is the largest item (optimal).
    costs = [5, 90, 7, 3]
    parts = balance_partitions(costs, 6)
    assert max(partition_loads(costs, parts)) == 90
    assert sum(1 for p in parts if p) == 4


@SETTINGS
@given(costs=st.lists(st.integers(1, 10000), min_size=2, max_size=24)
       .filter(lambda c: len(c) % 2 == 0))
def test_equal_counts_two_per_partition_is_optimal(costs):
    # With 2 items per partition pairing sorted i with n-1-i minimises the max (exchange argument).
    k = len(costs) // 2
    s = sorted(costs)
    optimum = max(s[i] + s[-1 - i] for i in range(k))
    parts = balance_partitions(costs, k, equal_counts=True)
    assert all(len(p) == 2 for p in parts)
    assert max(partition_loads(costs, parts)) == optimum


def test_small_instances_reach_brute_force_optimum():
    rng = random.Random(0)
    for _ in range(40):
        costs = [rng.randint(1, 1000) for _ in range(8)]
        k = 3
        best = min(max(sum(c for c, a in zip(costs, assign) if a == p) for p in range(k))
                   for assign in itertools.product(range(k), repeat=len(costs)))
        assert max(partition_loads(costs, balance_partitions(costs, k))) == best
        # Without the branch-and-bound polish KK + local search stays within 10 %.
        got = max(partition_loads(costs, balance_partitions(costs, k, exact_node_budget=0)))
        assert got <= best * 1.10


def test_all_equal_and_one_huge_many_tiny():
    assert imbalance([100] * 32, balance_partitions([100] * 32, 8)) == 0.0
    costs = [100000] + [10] * 70
    parts = balance_partitions(costs, 4)
    loads = partition_loads(costs, parts)
    assert max(loads) == 100000  # the huge item alone; the tiny ones spread over the rest
    rest = sorted(loads)[:3]
    assert rest[-1] - rest[0] <= 10 and sum(rest) == 700


def test_refine_improves_kk_on_rl_lengths():
    rng = random.Random(1)
    import math
    gains = []
    for _ in range(20):
        lengths = [rng.randint(100, 1500) + min(16384, int(math.exp(rng.gauss(7.6, 0.9))))
                   for _ in range(32)]
        kk = karmarkar_karp(lengths, 8, equal_counts=True)
        gains.append(imbalance(lengths, kk) - imbalance(lengths, balance_partitions(
            lengths, 8, equal_counts=True)))
    assert min(gains) >= 0 and sum(gains) / len(gains) > 0.05


@SETTINGS
@given(sizes=st.lists(st.integers(1, 5), min_size=1, max_size=15), k=st.integers(1, 5),
       seed=st.integers(0, 1000))
def test_groups_stay_together(sizes, k, seed):
    rng = random.Random(seed)
    group_ids = [g for g, s in enumerate(sizes) for _ in range(s)]
    rng.shuffle(group_ids)
    costs = [rng.randint(1, 5000) for _ in group_ids]
    parts = balance_partitions(costs, k, group_ids_N=group_ids)
    assert flat_sorted(parts) == list(range(len(costs)))
    owner = {}
    for p, part in enumerate(parts):
        for i in part:
            assert owner.setdefault(group_ids[i], p) == p


def test_groups_equal_counts():
    group_ids = [i // 4 for i in range(48)]  # 12 prompts x 4 responses
    costs = [random.Random(i).randint(1, 9000) for i in range(48)]
    parts = balance_partitions(costs, 4, group_ids_N=group_ids, equal_counts=True)
    assert [len(p) for p in parts] == [12, 12, 12, 12]
    with pytest.raises(ValueError) as err:
        balance_partitions([1, 2, 3], 2, group_ids_N=["a", "a", "b"], equal_counts=True)
    assert str(err.value) == ("balance_partitions: equal_counts with group_ids needs groups of one "
                              "size, got sizes [1, 2]; drop equal_counts or make the groups equal")
    with pytest.raises(ValueError) as err:
        balance_partitions([1, 2, 3], 2, group_ids_N=["a"])
    assert str(err.value) == ("balance_partitions: len(group_ids)=1 but len(costs)=3; expected "
                              "one group id per sequence")


def test_errors_name_the_field():
    with pytest.raises(ValueError) as err:
        karmarkar_karp([1, 2], 0)
    assert str(err.value) == "karmarkar_karp: num_partitions=0, expected an int >= 1"
    with pytest.raises(ValueError) as err:
        balance_partitions([1, -2], 2)
    assert str(err.value) == "balance_partitions: costs[1]=-2, expected a finite number >= 0"
    with pytest.raises(ValueError) as err:
        refine_partitions([1, 2], [[0], [1]], capacity=3)
    assert str(err.value) == "refine_partitions: capacity is set but tokens_N is None; pass both"


def test_deterministic():
    rng = random.Random(3)
    costs = [rng.randint(1, 100) for _ in range(200)]
    assert balance_partitions(costs, 7) == balance_partitions(list(costs), 7)


def test_flops_coefficients():
    # Llama-like: h=64, 2 layers, gated ffn 128, 4 heads, 2 KV groups, head dim 16, vocab 100.
    a, b = flops_cost_coefficients(hidden_size=64, num_layers=2, ffn_hidden_size=128,
                                   num_attention_heads=4, num_query_groups=2, kv_channels=16,
                                   gated_linear_unit=True, vocab_size=100)
    attn = 64 * 64 + 2 * 64 * 32 + 64 * 64
    mlp = 3 * 64 * 128
    assert a == 2 * 2 * (attn + mlp) + 2 * 64 * 100
    assert b == 2 * 2 * 64  # 4 * layers * q_width / 2 (causal)
    assert sequence_costs([10], a, b) == [a * 10 + b * 100]
    assert sequence_costs([3, 4]) == [3.0, 4.0]

    class Cfg:
        hidden_size, num_layers, ffn_hidden_size, num_attention_heads = 64, 2, 128, 4
        num_query_groups, kv_channels, gated_linear_unit = 2, 16, True
    assert flops_cost_coefficients_from_config(Cfg(), vocab_size=100) == (a, b)
    moe_a, _ = flops_cost_coefficients(hidden_size=64, num_layers=2, ffn_hidden_size=128,
                                       num_attention_heads=4, num_moe_experts=8,
                                       moe_router_topk=2, moe_ffn_hidden_size=32)
    assert moe_a == 2 * 2 * (4 * 64 * 64 + 2 * 64 * 64)
    with pytest.raises(ValueError) as err:
        flops_cost_coefficients(hidden_size=0, num_layers=2, ffn_hidden_size=8,
                                num_attention_heads=1)
    assert str(err.value) == "flops_cost_coefficients: hidden_size=0, expected a positive int"


@SETTINGS
@given(costs=st.lists(st.integers(1, 5000), min_size=2, max_size=20), k=st.integers(2, 5),
       equal=st.booleans())
def test_branch_and_bound_valid_and_better(costs, k, equal):
    base = refine_partitions(costs, karmarkar_karp(costs, k, equal_counts=equal),
                             equal_counts=equal)
    upper = max(partition_loads(costs, base))
    parts = branch_and_bound(costs, k, upper=upper, equal_counts=equal, node_budget=5000)
    if parts is None:
        return
    assert flat_sorted(parts) == list(range(len(costs)))
    assert max(partition_loads(costs, parts)) < upper
    if len(costs) >= k:
        assert all(parts)
    if equal:
        sizes = [len(p) for p in parts]
        assert max(sizes) - min(sizes) <= 1


def test_branch_and_bound_finds_the_optimum_on_a_known_case():
    # 3-way perfect partition exists (sum 60, each 20) that greedy-style pairing misses.
    costs = [8, 7, 6, 5, 4, 4, 4, 4, 3, 3, 3, 3, 2, 2, 2]
    parts = branch_and_bound(costs, 3, upper=10**9, node_budget=100000)
    assert sorted(partition_loads(costs, parts)) == [20, 20, 20]
    assert branch_and_bound(costs, 3, upper=20) is None  # 20 is optimal: nothing below it
