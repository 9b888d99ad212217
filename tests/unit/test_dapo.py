"""DAPO dynamic sampling (with a scripted sample_fn) and overlong reward shaping."""

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.algorithms.dapo import dynamic_sampling, informative_group_mask, is_informative_group, overlong_penalty


def scripted(batches):
    """A sample_fn returning the given batches in order, counting calls."""
    calls = iter(batches)
    return lambda: next(calls)


def group(name, rewards):
    return {"name": name, "rewards": rewards}


def test_informative_groups():
    assert is_informative_group([1.0, 0.0])
    assert not is_informative_group([1.0, 1.0, 1.0])
    assert not is_informative_group([0.5])  # a group of one has no spread
    # Groups: 0 -> (1, 0) informative, 1 -> (1, 1) not, 2 -> (0.3,) alone, not.
    keep_N = informative_group_mask(torch.tensor([1.0, 1.0, 1.0, 0.0, 0.3]), torch.tensor([0, 1, 1, 0, 2]))
    assert keep_N.tolist() == [True, False, False, True, False]


def test_dynamic_sampling_fills_the_batch_and_drops_constant_groups():
    # Call 1: A (1, 1) dropped, B (1, 0) kept, C (0, 0) dropped.
    # Call 2: D (0, 1) kept, E (1, 1) dropped, F (0.5, 0) kept -> 3 groups wanted, done after 2 calls.
    batches = [
        [group("A", [1, 1]), group("B", [1, 0]), group("C", [0, 0])],
        [group("D", [0, 1]), group("E", [1, 1]), group("F", [0.5, 0])],
        [group("never", [0, 1])],
    ]
    result = dynamic_sampling(scripted(batches), 3, max_tries=5)
    assert [g["name"] for g in result.groups] == ["B", "D", "F"]
    assert (result.num_tries, result.num_sampled, result.num_dropped) == (2, 6, 3)
    assert not result.exhausted and result.num_discarded == 0
    # Wanting only 2: F is an informative extra from the last call and is discarded.
    result = dynamic_sampling(scripted(batches), 2, max_tries=5)
    assert [g["name"] for g in result.groups] == ["B", "D"]
    assert result.num_discarded == 1


def test_dynamic_sampling_cap_on_tries():
    def all_correct():
        return [group("same", [1.0, 1.0, 1.0])]

    with pytest.warns(RuntimeWarning, match=r"0 of 2 informative groups after max_tries=3 \(3 of 3 sampled groups"):
        result = dynamic_sampling(all_correct, 2, max_tries=3)
    assert result.groups == [] and result.exhausted and result.num_tries == 3
    with pytest.raises(RuntimeError, match="after max_tries=3"):
        dynamic_sampling(all_correct, 2, max_tries=3, allow_partial=False)


def test_dynamic_sampling_attribute_groups_and_custom_accessor():
    groups = [SimpleNamespace(rewards=[0, 1]), SimpleNamespace(rewards=[1, 1])]
    assert dynamic_sampling(lambda: groups, 1).groups == [groups[0]]
    tuples = [("x", [2, 2]), ("y", [2, 3])]
    result = dynamic_sampling(lambda: tuples, 1, rewards_of=lambda g: g[1])
    assert result.groups == [("y", [2, 3])]
    with pytest.raises(ValueError, match="num_groups must be > 0, got 0"):
        dynamic_sampling(lambda: tuples, 0)


def test_overlong_penalty_hand_values():
    # max 20, buffer 5 -> free up to 15, then -(len - 15) / 5, -1 at 20 and beyond.
    penalty_N = overlong_penalty([10, 15, 16, 18, 20, 25], max_response_length=20, buffer_length=5)
    torch.testing.assert_close(penalty_N, torch.tensor([0.0, 0.0, -1 / 5, -3 / 5, -1.0, -1.0]))
    torch.testing.assert_close(overlong_penalty(torch.tensor([18]), 20, 5, penalty_factor=0.5), torch.tensor([-0.3]))
    with pytest.raises(ValueError, match=r"buffer_length must be in \(0, max_response_length=20\], got 30"):
        overlong_penalty([1], 20, 30)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=2, max_size=20), st.integers(1, 100))
def test_overlong_penalty_monotone_and_bounded(lengths, buffer):
    lengths = sorted(lengths)
    penalty_N = overlong_penalty(lengths, 200, buffer)
    assert ((penalty_N <= 0) & (penalty_N >= -1)).all()
    assert (penalty_N[1:] <= penalty_N[:-1]).all()
