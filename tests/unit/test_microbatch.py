"""Property and edge-case tests of megarl.data.microbatch (token-capped micro-batches)."""

import os
import tempfile

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from megarl.data.microbatch import (agree_num_micro_batches, check_lengths, first_fit_decreasing,
                                    micro_batches_all_ranks, micro_batches_this_rank,
                                    min_num_micro_batches, order_for_pipeline,
                                    round_num_micro_batches, split_micro_batches)

SETTINGS = settings(max_examples=60, deadline=None)


def _check(parts, tokens, cap, num):
    assert len(parts) == num
    assert sorted(i for p in parts for i in p) == list(range(len(tokens)))
    assert all(p for p in parts), "empty micro-batch"
    assert all(sum(tokens[i] for i in p) <= cap for p in parts), "cap exceeded"


@st.composite
def rank_case(draw):
    cap = draw(st.integers(10, 5000))
    tokens = draw(st.lists(st.integers(1, cap), min_size=1, max_size=40))
    return tokens, cap


@SETTINGS
@given(case=rank_case(), extra=st.integers(0, 40), flops=st.booleans())
def test_split_never_exceeds_cap(case, extra, flops):
    tokens, cap = case
    need = min_num_micro_batches(tokens, cap)
    num = min(need + extra, len(tokens))
    costs = [t + t * t / 1000 for t in tokens] if flops else None
    parts = split_micro_batches(tokens, num, cap, costs_N=costs)
    _check(parts, tokens, cap, num)


@SETTINGS
@given(ranks=st.lists(st.lists(st.integers(1, 1000), min_size=8, max_size=30), min_size=1,
                      max_size=4),
       multiple=st.sampled_from([1, 2, 4]), minimum=st.integers(1, 4))
def test_all_ranks_same_count_and_multiple(ranks, multiple, minimum):
    cap = 1000
    counts = [min_num_micro_batches(t, cap) for t in ranks]
    num = round_num_micro_batches(max(counts), multiple, minimum)
    assume(num <= min(len(t) for t in ranks))
    out = micro_batches_all_ranks(ranks, cap, multiple=multiple, minimum=minimum)
    assert {len(mbs) for mbs in out} == {num}
    assert num % multiple == 0 and num >= minimum
    for mbs, tokens in zip(out, ranks):
        _check(mbs, tokens, cap, num)


@SETTINGS
@given(case=rank_case())
def test_ffd_is_feasible_and_above_lower_bound(case):
    tokens, cap = case
    bins = first_fit_decreasing(tokens, cap)
    assert all(sum(tokens[i] for i in b) <= cap for b in bins)
    assert len(bins) >= -(-sum(tokens) // cap)


def test_pipeline_order_puts_cheapest_at_both_ends():
    parts = [[0], [1], [2], [3], [4], [5]]
    costs = [5, 1, 4, 2, 6, 3]
    ordered = order_for_pipeline(parts, costs)
    loads = [costs[p[0]] for p in ordered]
    assert loads == [1, 3, 5, 6, 4, 2]
    out = split_micro_batches([100] * 6 + [600, 10], 4, 700)
    loads = [sum(([100] * 6 + [600, 10])[i] for i in mb) for mb in out]
    assert {loads[0], loads[-1]} == set(sorted(loads)[:2])


def test_count_can_exceed_ceil_of_total():
    # ceil(2000 / 1000) = 2 micro-batches cannot hold [700, 700, 600] under 1000: FFD says 3.
    assert min_num_micro_batches([700, 700, 600], 1000) == 3
    parts = split_micro_batches([600, 600, 400, 400], 2, 1000)
    assert sorted(sorted([600, 600, 400, 400][i] for i in p) for p in parts) == [[400, 600]] * 2


def test_one_huge_many_tiny_and_all_equal():
    tokens = [1000] + [1] * 50
    parts = split_micro_batches(tokens, 2, 1000)
    _check(parts, tokens, 1000, 2)
    assert [0] in parts
    tokens = [250] * 16
    parts = split_micro_batches(tokens, 4, 1000)
    assert all(len(p) == 4 for p in parts)
    parts = split_micro_batches(tokens, 16, 1000)
    assert all(len(p) == 1 for p in parts)


def test_errors_are_exact():
    with pytest.raises(ValueError) as err:
        split_micro_batches([10, 1200, 30], 3, 1000)
    assert str(err.value) == ("sequence 1 has 1200 tokens, more than max_tokens_per_micro_batch="
                              "1000; raise the budget or set truncate=True")
    with pytest.raises(ValueError) as err:
        split_micro_batches([10, 20, 30], 4, 1000)
    assert str(err.value) == ("cannot split 3 sequences into 4 micro-batches: empty micro-batches "
                              "are not allowed; give this rank at least 4 sequences or lower the "
                              "micro-batch count")
    with pytest.raises(ValueError) as err:
        split_micro_batches([700, 700, 600], 2, 1000)
    assert str(err.value) == ("num_micro_batches=2 is below the 3 micro-batches needed to keep "
                              "every micro-batch within max_tokens_per_micro_batch=1000")
    with pytest.raises(ValueError) as err:
        micro_batches_all_ranks([[10] * 8, [10, 10]], 20, multiple=1)
    assert str(err.value).startswith("cannot split 2 sequences into 4 micro-batches")
    with pytest.raises(TypeError) as err:
        agree_num_micro_batches(3)
    assert str(err.value) == ("agree_num_micro_batches: counts is one int but process_group is "
                              "None; pass every rank's count (a list) or a process group")
    with pytest.raises(ValueError) as err:
        round_num_micro_batches(3, multiple=0)
    assert str(err.value) == "multiple=0, expected an int >= 1"
    with pytest.raises(ValueError) as err:
        check_lengths([3, 0], 10)
    assert str(err.value) == "sequence 1 has length 0, expected an int >= 1"


def test_truncate_reports_cut_sequences():
    tokens, truncated = check_lengths([5, 50, 7], 10, truncate=True)
    assert tokens == [5, 10, 7] and truncated == {1: 50}


def test_agree_rounds_up():
    assert agree_num_micro_batches([3, 5, 2], multiple=4) == 8
    assert agree_num_micro_batches([1, 1], minimum=3, multiple=2) == 4


def _dist_worker(rank, world, init_file, results):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    group = dist.new_group([0, 1])
    lengths = [[500, 400, 300, 200, 100, 90, 80], [900, 900, 900, 10, 10, 10, 10]][rank]
    out = micro_batches_this_rank(lengths, 1000, process_group=group, multiple=2)
    try:
        micro_batches_this_rank([5, 2000] if rank == 0 else [5, 6], 1000, process_group=group)
        err = None
    except ValueError as exc:
        err = str(exc)
    results[rank] = (out, err)
    dist.destroy_process_group()


def test_process_group_agrees_with_local_computation():
    import torch.multiprocessing as mp

    lengths = [[500, 400, 300, 200, 100, 90, 80], [900, 900, 900, 10, 10, 10, 10]]
    expected = micro_batches_all_ranks(lengths, 1000, multiple=2)
    with tempfile.TemporaryDirectory() as tmp:
        manager = mp.Manager()
        results = manager.dict()
        mp.spawn(_dist_worker, args=(2, os.path.join(tmp, "init"), results), nprocs=2, join=True)
        got = [results[0], results[1]]
    assert [g[0] for g in got] == expected
    assert len(expected[0]) == 4  # rank 1 needs 3 -> MAX 3 -> multiple of 2
    assert got[0][1].startswith("sequence 1 has 2000 tokens")
    assert got[1][1] == ("micro_batches_this_rank: another DP rank rejected its lengths (see that "
                         "rank's error)")
