"""Advantage estimators on small ragged packed batches, values worked out by hand in comments.

Legend: N sequences, T packed tokens, N1 = N + 1.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.algorithms import ADVANTAGE_ESTIMATORS, AdvantageResult, get_advantage_estimator
from megarl.algorithms.advantages import (
    discounted_returns,
    drgrpo_advantages,
    gae_advantages,
    grpo_advantages,
    outcome_to_token_rewards,
    reinforce_pp_advantages,
    rloo_advantages,
)
from megarl.algorithms.packed import broadcast_to_tokens, pad_by_seq, segment_sum, unpad_by_seq

# Four sequences of lengths 2, 3, 1, 3; the second token of sequence 0 is masked out.
CU_N1 = torch.tensor([0, 2, 5, 6, 9])
MASK_T = torch.tensor([1, 0, 1, 1, 1, 1, 1, 1, 1], dtype=torch.bool)
# Sequences 0, 1, 2 answer prompt 7; sequence 3 is alone in group 3.
GROUPS_N = torch.tensor([7, 7, 7, 3])


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=1e-5)


def test_packed_helpers():
    values_N = torch.tensor([10.0, 20.0, 30.0, 40.0])
    close(broadcast_to_tokens(values_N, CU_N1), [10, 10, 20, 20, 20, 30, 40, 40, 40])
    close(segment_sum(torch.arange(9.0), CU_N1), [0 + 1, 2 + 3 + 4, 5, 6 + 7 + 8])
    padded_NL = pad_by_seq(torch.arange(1.0, 10.0), CU_N1)
    close(padded_NL, [[1, 2, 0], [3, 4, 5], [6, 0, 0], [7, 8, 9]])
    close(unpad_by_seq(padded_NL, CU_N1), torch.arange(1.0, 10.0))


def test_grpo_hand_values():
    # Group 7 rewards (1, 0, 0): mean 1/3, deviations (2/3, -1/3, -1/3),
    # unbiased var = (4/9 + 1/9 + 1/9) / 2 = 1/3, std = sqrt(1/3).
    # Group 3 has one sequence: advantage 0.
    out = grpo_advantages(rewards_N=torch.tensor([1.0, 0.0, 0.0, 5.0]), cu_seqlens_N1=CU_N1, mask_T=MASK_T, group_ids_N=GROUPS_N)
    hi, lo = (2 / 3) / math.sqrt(1 / 3), (-1 / 3) / math.sqrt(1 / 3)
    close(out.advantages_T, [hi, 0, lo, lo, lo, lo, 0, 0, 0])
    assert isinstance(out, AdvantageResult)


def test_drgrpo_has_no_std_division():
    out = drgrpo_advantages(rewards_N=torch.tensor([1.0, 0.0, 0.0, 5.0]), cu_seqlens_N1=CU_N1, mask_T=MASK_T, group_ids_N=GROUPS_N)
    close(out.advantages_T, [2 / 3, 0, -1 / 3, -1 / 3, -1 / 3, -1 / 3, 0, 0, 0])


def test_grpo_adds_token_rewards_to_the_score():
    # Token rewards (masked token 1 is ignored): seq 0 gets -0.5, seq 1 gets 0.5 + 0.5 - 1.0 = 0.
    # Scores (1 - 0.5, 0 + 0, 0) = (0.5, 0, 0) for group 7 -> Dr.GRPO deviations (1/3, -1/6, -1/6).
    token_rewards_T = torch.tensor([-0.5, 100.0, 0.5, 0.5, -1.0, 0.0, 0.0, 0.0, 0.0])
    out = drgrpo_advantages(
        rewards_N=torch.tensor([1.0, 0.0, 0.0, 5.0]), cu_seqlens_N1=CU_N1, mask_T=MASK_T, group_ids_N=GROUPS_N, token_rewards_T=token_rewards_T
    )
    close(out.advantages_T, [1 / 3, 0, -1 / 6, -1 / 6, -1 / 6, -1 / 6, 0, 0, 0])


def test_rloo_hand_values():
    # Lengths 1 each; group 0 = (1, 0, 0, 1), group 1 = (3, 1), group 2 = (4,) alone.
    # group 0: 1 - (0+0+1)/3 = 2/3; 0 - (1+0+1)/3 = -2/3.  group 1: 3 - 1 = 2, 1 - 3 = -2.  group 2: 0.
    cu_N1 = torch.arange(8)
    out = rloo_advantages(
        rewards_N=torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 4.0]),
        cu_seqlens_N1=cu_N1,
        mask_T=torch.ones(7, dtype=torch.bool),
        group_ids_N=torch.tensor([0, 0, 0, 0, 1, 1, 2]),
    )
    close(out.advantages_T, [2 / 3, -2 / 3, -2 / 3, 2 / 3, 2, -2, 0])


@pytest.mark.parametrize("estimator", [grpo_advantages, drgrpo_advantages, rloo_advantages])
def test_identical_rewards_give_exactly_zero(estimator):
    # 0.1 * 3 / 3 != 0.1 in floating point; constant groups must still give exact zeros.
    out = estimator(rewards_N=torch.tensor([0.1, 0.1, 0.1, 0.7]), cu_seqlens_N1=CU_N1, mask_T=MASK_T, group_ids_N=GROUPS_N)
    assert torch.equal(out.advantages_T, torch.zeros(9))


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 4), min_size=1, max_size=10),
    data=st.data(),
)
def test_grpo_advantages_sum_to_zero_per_group(lengths, data):
    num_seqs = len(lengths)
    rewards = data.draw(st.lists(st.floats(-10, 10), min_size=num_seqs, max_size=num_seqs))
    groups = data.draw(st.lists(st.integers(0, 3), min_size=num_seqs, max_size=num_seqs))
    cu_N1 = torch.tensor([0] + lengths).cumsum(0)
    norm = data.draw(st.booleans())
    out = grpo_advantages(
        rewards_N=torch.tensor(rewards, dtype=torch.float64),
        cu_seqlens_N1=cu_N1,
        mask_T=torch.ones(int(cu_N1[-1]), dtype=torch.bool),
        group_ids_N=torch.tensor(groups),
        norm_by_std=norm,
    )
    assert torch.isfinite(out.advantages_T).all()
    adv_N = out.advantages_T[cu_N1[:-1]]  # first token of each sequence carries its advantage
    for g in set(groups):
        members = [i for i in range(num_seqs) if groups[i] == g]
        assert abs(float(adv_N[members].sum())) < 1e-6 * max(1.0, len(members))
        if norm and len(members) > 1 and len({rewards[i] for i in members}) > 1:
            # Divided by (unbiased std + eps): the squares sum to (n - 1) * std^2 / (std + eps)^2.
            n = len(members)
            mean = sum(rewards[i] for i in members) / n
            std = math.sqrt(sum((rewards[i] - mean) ** 2 for i in members) / (n - 1))
            expected = (n - 1) * std**2 / (std + 1e-6) ** 2
            assert float((adv_N[members] ** 2).sum()) == pytest.approx(expected, rel=1e-6)


def test_discounted_returns_skip_masked_tokens():
    # One sequence of 3 tokens, the middle one masked; rewards (-0.1, [ignored], -0.3 + 1), gamma 0.5.
    # G2 = 0.7; the masked token passes it through; G0 = -0.1 + 0.5 * 0.7 = 0.25.
    mask_T = torch.tensor([1, 0, 1], dtype=torch.bool)
    cu_N1 = torch.tensor([0, 3])
    token_rewards_T = outcome_to_token_rewards(torch.tensor([1.0]), mask_T, cu_N1, torch.tensor([-0.1, -0.2, -0.3]))
    close(token_rewards_T, [-0.1, 0.0, 0.7])
    close(discounted_returns(token_rewards_T, mask_T, cu_N1, gamma=0.5), [0.25, 0.0, 0.7])


def test_reinforce_pp_hand_values():
    # Lengths 2 and 3, outcome rewards (1, 0), gamma 0.5: returns (0.5, 1 | 0, 0, 0).
    # Batch mean 1.5 / 5 = 0.3; deviations (0.2, 0.7, -0.3, -0.3, -0.3);
    # unbiased var = (0.04 + 0.49 + 3 * 0.09) / 4 = 0.2.
    cu_N1 = torch.tensor([0, 2, 5])
    out = reinforce_pp_advantages(
        rewards_N=torch.tensor([1.0, 0.0]), cu_seqlens_N1=cu_N1, mask_T=torch.ones(5, dtype=torch.bool), group_ids_N=torch.tensor([0, 0]), gamma=0.5
    )
    close(out.returns_T, [0.5, 1.0, 0.0, 0.0, 0.0])
    std = math.sqrt(0.2)
    close(out.advantages_T, [0.2 / std, 0.7 / std, -0.3 / std, -0.3 / std, -0.3 / std])


def test_reinforce_pp_group_baseline():
    # Group (1, 0): baseline 0.5 -> outcomes (0.5, -0.5); gamma 1, lengths 1 and 1: returns (0.5, -0.5),
    # mean 0, unbiased std = sqrt((0.25 + 0.25) / 1) = sqrt(0.5).
    out = reinforce_pp_advantages(
        rewards_N=torch.tensor([1.0, 0.0]), cu_seqlens_N1=torch.tensor([0, 1, 2]), mask_T=torch.ones(2, dtype=torch.bool),
        group_ids_N=torch.tensor([4, 4]), group_baseline=True,
    )
    close(out.returns_T, [0.5, -0.5])
    close(out.advantages_T, [0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5)])


def test_gae_hand_values():
    # gamma 1, lam 0.5.  Seq 0: values (0.5, 0.2, 0.4), outcome 1 on the last token.
    #   t2: delta = 1 + 0 - 0.4 = 0.6, A = 0.6;  t1: delta = 0.4 - 0.2 = 0.2, A = 0.2 + 0.5*0.6 = 0.5
    #   t0: delta = 0.2 - 0.5 = -0.3, A = -0.3 + 0.5*0.5 = -0.05;  returns A + V = (0.45, 0.7, 1.0)
    # Seq 1: values (0.1, 0.3), outcome 0.
    #   t1: A = -0.3;  t0: delta = 0.3 - 0.1 = 0.2, A = 0.2 + 0.5*(-0.3) = 0.05;  returns (0.15, 0.0)
    out = gae_advantages(
        rewards_N=torch.tensor([1.0, 0.0]), cu_seqlens_N1=torch.tensor([0, 3, 5]), mask_T=torch.ones(5, dtype=torch.bool),
        values_T=torch.tensor([0.5, 0.2, 0.4, 0.1, 0.3]), gamma=1.0, lam=0.5, whiten=False,
    )
    close(out.advantages_T, [-0.05, 0.5, 0.6, 0.05, -0.3])
    close(out.returns_T, [0.45, 0.7, 1.0, 0.15, 0.0])


def test_gae_skips_masked_tokens_and_whitens():
    # Values (0.5, 9 [masked], 0.4), outcome 1, gamma 1, lam 0.5:
    #   t2: A = 0.6; t1 masked (carries V = 0.4, A = 0.6); t0: delta = 0.4 - 0.5 = -0.1, A = -0.1 + 0.3 = 0.2
    kwargs = dict(
        rewards_N=torch.tensor([1.0]), cu_seqlens_N1=torch.tensor([0, 3]), mask_T=torch.tensor([True, False, True]),
        values_T=torch.tensor([0.5, 9.0, 0.4]), gamma=1.0, lam=0.5,
    )
    raw = gae_advantages(**kwargs, whiten=False)
    close(raw.advantages_T, [0.2, 0.0, 0.6])
    close(raw.returns_T, [0.7, 0.0, 1.0])
    # Whitened over the two masked-in tokens: mean 0.4, unbiased std = sqrt(0.04 + 0.04) = sqrt(0.08).
    white = gae_advantages(**kwargs)
    close(white.advantages_T, [-0.2 / math.sqrt(0.08), 0.0, 0.2 / math.sqrt(0.08)])


def test_gae_with_lambda_one_is_monte_carlo():
    # gamma = lam = 1: A_t = R - V_t (the outcome minus the value).
    values_T = torch.tensor([0.3, -0.2, 0.9, 0.0])
    out = gae_advantages(
        rewards_N=torch.tensor([2.0, -1.0]), cu_seqlens_N1=torch.tensor([0, 3, 4]), mask_T=torch.ones(4, dtype=torch.bool),
        values_T=values_T, gamma=1.0, lam=1.0, whiten=False,
    )
    close(out.advantages_T, [2 - 0.3, 2 + 0.2, 2 - 0.9, -1 - 0.0])


def _optional_inputs(fn, num_seqs: int) -> dict:
    """The inputs the registry contract passes only to estimators that name them (remax)."""
    import inspect

    return {"baseline_rewards_N": torch.zeros(num_seqs)} if "baseline_rewards_N" in inspect.signature(fn).parameters else {}


def test_estimators_finite_on_degenerate_batches():
    # Groups of one, all-equal rewards, an empty sequence and a fully masked one.
    cu_N1 = torch.tensor([0, 2, 2, 3])
    mask_T = torch.tensor([True, True, False])
    for name, fn in ADVANTAGE_ESTIMATORS.items():
        out = fn(
            rewards_N=torch.tensor([1.0, 1.0, 1.0]), cu_seqlens_N1=cu_N1, mask_T=mask_T,
            group_ids_N=torch.tensor([0, 1, 2]), values_T=torch.zeros(3), **_optional_inputs(fn, 3),
        )
        assert torch.isfinite(out.advantages_T).all(), name
        assert torch.isfinite(out.returns_T).all(), name
        assert out.advantages_T[2] == 0, name  # masked-out token


def test_input_errors_name_the_field():
    with pytest.raises(ValueError, match=r"rewards_N must have one value per sequence \(4\), got shape \(3,\)"):
        grpo_advantages(rewards_N=torch.zeros(3), cu_seqlens_N1=CU_N1, mask_T=MASK_T, group_ids_N=GROUPS_N)
    with pytest.raises(ValueError, match="gae needs values_T"):
        gae_advantages(rewards_N=torch.zeros(4), cu_seqlens_N1=CU_N1, mask_T=MASK_T)
    with pytest.raises(ValueError, match=r"cu_seqlens_N1\[-1\] = 9 does not match the 8 packed tokens"):
        grpo_advantages(rewards_N=torch.zeros(4), cu_seqlens_N1=CU_N1, mask_T=MASK_T[:8], group_ids_N=GROUPS_N)


def test_registry_names_dotted_paths_and_errors():
    assert get_advantage_estimator("grpo") is grpo_advantages
    assert get_advantage_estimator("gae") is gae_advantages
    assert get_advantage_estimator("megarl.algorithms.advantages:rloo_advantages") is rloo_advantages
    assert get_advantage_estimator("megarl.algorithms.advantages.rloo_advantages") is rloo_advantages
    assert get_advantage_estimator(rloo_advantages) is rloo_advantages
    with pytest.raises(ValueError) as err:
        get_advantage_estimator("ppo2")
    assert str(err.value) == (
        "unknown advantage estimator 'ppo2'; known: ['drgrpo', 'gae', 'gpg', 'grpo', 'grpo_passk', 'opo', "
        "'optimal_token_baseline', 'reinforce_pp', 'reinforce_pp_baseline', 'remax', 'rloo'] "
        "(or a dotted path 'package.module:function')"
    )
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        get_advantage_estimator("megarl.algorithms.advantages:nope")
    with pytest.raises(ValueError, match="cannot import module 'no_such_pkg.mod'"):
        get_advantage_estimator("no_such_pkg.mod:fn")


def test_registry_contract_signature():
    # Every registered estimator accepts the documented keyword signature and returns packed tensors.
    for name, fn in ADVANTAGE_ESTIMATORS.items():
        out = fn(
            rewards_N=torch.tensor([1.0, 0.0, 0.0, 1.0]), cu_seqlens_N1=CU_N1, mask_T=MASK_T, group_ids_N=GROUPS_N,
            token_rewards_T=torch.zeros(9), values_T=torch.zeros(9), **_optional_inputs(fn, 4),
        )
        advantages_T, returns_T = out
        assert advantages_T.shape == (9,) and returns_T.shape == (9,), name
