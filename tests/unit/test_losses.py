"""Policy losses, value loss and aggregation modes on small packed batches, values by hand.

Legend: N sequences, T packed tokens, V vocabulary, N1 = N + 1.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.algorithms import AGG_MODES, POLICY_LOSSES, aggregate_loss, get_policy_loss, value_loss
from megarl.algorithms.losses import entropy_from_logits, gspo_policy_loss, ppo_policy_loss

# Three sequences of lengths 1, 2, 3; token 4 (middle of sequence 2) is masked out.
CU_N1 = torch.tensor([0, 1, 3, 6])
MASK_T = torch.tensor([1, 1, 1, 1, 0, 1], dtype=torch.bool)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=1e-5)


# Per-token values (1, 2, 3, 4, [5], 6):
#   token-mean                 (1 + 2 + 3 + 4 + 6) / 5           = 16 / 5
#   seq-mean-token-sum         (1 + (2 + 3) + (4 + 6)) / 3       = 16 / 3
#   seq-mean-token-mean        (1/1 + 5/2 + 10/2) / 3            = 8.5 / 3
#   seq-mean-token-sum-norm    16 / (3 sequences * max length 4) = 16 / 12
AGG_EXPECTED = {
    "token-mean": 16 / 5,
    "seq-mean-token-sum": 16 / 3,
    "seq-mean-token-mean": 8.5 / 3,
    "seq-mean-token-sum-norm": 16 / 12,
}


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregation_modes(mode):
    loss_T = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    close(aggregate_loss(loss_T, MASK_T, CU_N1, mode, max_response_length=4), AGG_EXPECTED[mode])
    # A fourth, fully masked sequence changes nothing (it is not counted in the sequence means).
    cu_N1 = torch.tensor([0, 1, 3, 6, 8])
    mask_T = torch.cat([MASK_T, torch.zeros(2, dtype=torch.bool)])
    close(aggregate_loss(torch.cat([loss_T, torch.tensor([50.0, 60.0])]), mask_T, cu_N1, mode, max_response_length=4), AGG_EXPECTED[mode])


def test_aggregation_global_denominators_and_errors():
    loss_T = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    close(aggregate_loss(loss_T, MASK_T, CU_N1, "token-mean", num_tokens=10), 16 / 10)
    close(aggregate_loss(loss_T, MASK_T, CU_N1, "seq-mean-token-sum", num_seqs=8), 16 / 8)
    with pytest.raises(ValueError) as err:
        aggregate_loss(loss_T, MASK_T, CU_N1, "sum")
    assert str(err.value) == (
        "unknown agg_mode 'sum'; known: ['token-mean', 'seq-mean-token-sum', 'seq-mean-token-mean', 'seq-mean-token-sum-norm']"
    )
    with pytest.raises(ValueError, match="needs max_response_length > 0, got None"):
        aggregate_loss(loss_T, MASK_T, CU_N1, "seq-mean-token-sum-norm")


# Advantages (1 | -1, 2 | 0.5, [9], -2); masked-in tokens only:
#   token-mean              -(1 - 1 + 2 + 0.5 - 2) / 5          = -0.5 / 5
#   seq-mean-token-sum      -(1 + 1 + (0.5 - 2)) / 3            = -0.5 / 3
#   seq-mean-token-mean     -(1 + 1/2 + (-1.5)/2) / 3           = -0.75 / 3
#   seq-mean-token-sum-norm -0.5 / (3 * 4)
RATIO_ONE_EXPECTED = {
    "token-mean": -0.5 / 5,
    "seq-mean-token-sum": -0.5 / 3,
    "seq-mean-token-mean": -0.75 / 3,
    "seq-mean-token-sum-norm": -0.5 / 12,
}


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("loss_fn", [ppo_policy_loss, gspo_policy_loss])
def test_ratio_one_loss_is_minus_mean_advantage(mode, loss_fn):
    advantages_T = torch.tensor([1.0, -1.0, 2.0, 0.5, 9.0, -2.0])
    logprobs_T = torch.tensor([-1.0, -0.5, -2.0, -0.1, -3.0, -0.7])
    loss, metrics = loss_fn(logprobs_T, logprobs_T.clone(), advantages_T, MASK_T, CU_N1, agg_mode=mode, max_response_length=4)
    close(loss, RATIO_ONE_EXPECTED[mode])
    assert metrics["clip_frac"] == 0
    close(metrics["ratio_mean"], 1.0)
    close(metrics["approx_kl"], 0.0)


def test_ppo_clip_higher_hand_values_and_gradients():
    # Ratios r = (1.5, 0.5, 1.1, 0.7), A = (1, 1, -1, -1), eps_low 0.2, eps_high 0.28:
    #   t0: max(-1.5, -1.28) = -1.28 (clipped: no gradient)
    #   t1: max(-0.5, -0.8)  = -0.5  (unclipped: d/dlogp = -A r = -0.5)
    #   t2: max(1.1, 1.1)    = 1.1   (inside the range: d/dlogp = -A r = 1.1)
    #   t3: max(0.7, 0.8)    = 0.8   (clipped: no gradient)
    # token-mean = (-1.28 - 0.5 + 1.1 + 0.8) / 4 = 0.03
    ratios = [1.5, 0.5, 1.1, 0.7]
    logprobs_T = torch.tensor([math.log(r) for r in ratios], dtype=torch.float64, requires_grad=True)
    old_T = torch.zeros(4, dtype=torch.float64)
    loss, metrics = ppo_policy_loss(
        logprobs_T, old_T, torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=torch.float64), torch.ones(4, dtype=torch.bool),
        torch.tensor([0, 4]), clip_eps_low=0.2, clip_eps_high=0.28,
    )
    close(loss, 0.03)
    loss.backward()
    close(logprobs_T.grad, [0.0, -0.5 / 4, 1.1 / 4, 0.0])
    close(metrics["clip_frac"], 0.5)
    close(metrics["ratio_mean"], (1.5 + 0.5 + 1.1 + 0.7) / 4)
    close(metrics["ratio_min"], 0.5)
    close(metrics["ratio_max"], 1.5)
    k3 = [(r - 1) - math.log(r) for r in ratios]
    close(metrics["approx_kl"], sum(k3) / 4)


def test_dual_clip_hand_values():
    # c = 3, eps 0.2.  A = -1, r = 5: max(5, 1.2) = 5 > 3 -> 3 (no gradient).
    # A = -1, r = 2: max(2, 1.2) = 2 <= 3 -> 2.   A = +1, r = 5: max(-5, -1.2) = -1.2 (dual clip only for A < 0).
    logprobs_T = torch.tensor([math.log(5), math.log(2), math.log(5)], dtype=torch.float64, requires_grad=True)
    loss, metrics = ppo_policy_loss(
        logprobs_T, torch.zeros(3, dtype=torch.float64), torch.tensor([-1.0, -1.0, 1.0], dtype=torch.float64),
        torch.ones(3, dtype=torch.bool), torch.tensor([0, 3]), agg_mode="seq-mean-token-sum", dual_clip_c=3.0,
    )
    close(loss, 3 + 2 - 1.2)
    loss.backward()
    close(logprobs_T.grad, [0.0, 2.0, 0.0])  # t1: -A r = 2
    close(metrics["dual_clip_frac"], 1 / 3)
    with pytest.raises(ValueError, match=r"dual_clip_c must be > 1"):
        ppo_policy_loss(logprobs_T, logprobs_T, logprobs_T, torch.ones(3, dtype=torch.bool), torch.tensor([0, 3]), dual_clip_c=1.0)


@settings(max_examples=60, deadline=None)
@given(
    log_ratio=st.floats(-7.0, 7.0),
    advantage=st.floats(-5.0, 5.0).filter(lambda a: abs(a) > 1e-3),
    eps_low=st.floats(0.05, 0.5),
    eps_high=st.floats(0.05, 0.5),
    c=st.floats(1.5, 10.0),
)
def test_clip_properties(log_ratio, advantage, eps_low, eps_high, c):
    logprobs_T = torch.tensor([log_ratio], dtype=torch.float64, requires_grad=True)
    loss, _ = ppo_policy_loss(
        logprobs_T, torch.zeros(1, dtype=torch.float64), torch.tensor([advantage], dtype=torch.float64),
        torch.ones(1, dtype=torch.bool), torch.tensor([0, 1]), clip_eps_low=eps_low, clip_eps_high=eps_high, dual_clip_c=c,
    )
    loss.backward()
    ratio = math.exp(log_ratio)
    if advantage < 0:
        assert float(loss.detach()) <= -advantage * c + 1e-9  # dual-clip bound
    clipped = (advantage > 0 and ratio > 1 + eps_high) or (advantage < 0 and ratio < 1 - eps_low)
    if clipped:
        assert float(logprobs_T.grad) == 0.0


def test_gspo_sequence_ratio_hand_values():
    # Seq 0 token log-ratios (ln 2, 0): s = exp(ln2 / 2) = sqrt(2) ~ 1.414 > 1 + 0.3 -> clipped at 1.3, A = 1
    #   -> per-token loss -1.3, no gradient.
    # Seq 1 log-ratios (0.1, -0.1, 0): s = 1, A = -1 -> per-token loss 1, d/dlogp_t = -A * s = 1.
    # seq-mean-token-mean = (-1.3 + 1) / 2 = -0.15; gradient weight per token of seq 1 = 1 / (2 * 3).
    logprobs_T = torch.tensor([math.log(2), 0.0, 0.1, -0.1, 0.0], dtype=torch.float64, requires_grad=True)
    loss, metrics = gspo_policy_loss(
        logprobs_T, torch.zeros(5, dtype=torch.float64), torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0], dtype=torch.float64),
        torch.ones(5, dtype=torch.bool), torch.tensor([0, 2, 5]), clip_eps_low=0.2, clip_eps_high=0.3,
    )
    close(loss, -0.15)
    loss.backward()
    close(logprobs_T.grad, [0.0, 0.0, 1 / 6, 1 / 6, 1 / 6])
    close(metrics["ratio_mean"], (2 * math.sqrt(2) + 3 * 1.0) / 5)
    close(metrics["clip_frac"], 2 / 5)


def test_gspo_gradient_matches_sequence_objective():
    # For unclipped sequences, GSPO-token's gradient equals that of the paper's -A * s_i with
    # s_i = exp(mean log-ratio): d/dlogp_t = -A * s_i / |y_i| (one sequence: every sequence mean is its token mean).
    logprobs_T = torch.tensor([0.01, -0.02, 0.005], dtype=torch.float64, requires_grad=True)
    loss, _ = gspo_policy_loss(
        logprobs_T, torch.zeros(3, dtype=torch.float64), torch.full((3,), 2.0, dtype=torch.float64),
        torch.ones(3, dtype=torch.bool), torch.tensor([0, 3]), clip_eps_low=0.1, clip_eps_high=0.1, agg_mode="seq-mean-token-mean",
    )
    loss.backward()
    s = math.exp((0.01 - 0.02 + 0.005) / 3)
    close(logprobs_T.grad, [-2.0 * s / 3] * 3)


def test_entropy_bonus():
    # Ratio 1, A = 0: the policy term is 0; entropies (1, 2 | 3) token-mean = 2, coef 0.1 -> loss -0.2.
    logprobs_T = torch.zeros(3)
    loss, metrics = ppo_policy_loss(
        logprobs_T, logprobs_T, torch.zeros(3), torch.ones(3, dtype=torch.bool), torch.tensor([0, 2, 3]),
        entropy_T=torch.tensor([1.0, 2.0, 3.0]), entropy_coef=0.1,
    )
    close(loss, -0.2)
    close(metrics["entropy"], 2.0)


def test_entropy_from_logits():
    # Uniform over 4 tokens: ln 4.  A near one-hot distribution: ~0.
    close(entropy_from_logits(torch.zeros(2, 4)), [math.log(4), math.log(4)])
    assert float(entropy_from_logits(torch.tensor([[100.0, 0.0, 0.0]]))) < 1e-6


def test_value_loss_clipping_hand_values():
    # V = (1, 0, 2), V_old = 0.5, R = (2, 0, 0), clip 0.2 -> V_clip = (0.7, 0.3, 0.7):
    #   t0: max((1-2)^2 = 1, (0.7-2)^2 = 1.69) = 1.69 (clipped, no gradient)
    #   t1: max(0, 0.09) = 0.09 (clipped, no gradient)
    #   t2: max(4, 0.49) = 4; d/dV of 0.5 * 4 / 3 = 0.5 * 2 * (2 - 0) / 3 = 2/3
    # loss = 0.5 * (1.69 + 0.09 + 4) / 3
    values_T = torch.tensor([1.0, 0.0, 2.0], dtype=torch.float64, requires_grad=True)
    loss, metrics = value_loss(
        values_T, torch.full((3,), 0.5, dtype=torch.float64), torch.tensor([2.0, 0.0, 0.0], dtype=torch.float64),
        torch.ones(3, dtype=torch.bool), torch.tensor([0, 3]), clip_range=0.2,
    )
    close(loss, 0.5 * (1.69 + 0.09 + 4) / 3)
    loss.backward()
    close(values_T.grad, [0.0, 0.0, 2 / 3])
    close(metrics["vf_clip_frac"], 2 / 3)
    unclipped, _ = value_loss(values_T, torch.zeros(3), torch.tensor([2.0, 0.0, 0.0]), torch.ones(3, dtype=torch.bool), torch.tensor([0, 3]), clip_range=None)
    close(unclipped, 0.5 * (1 + 0 + 4) / 3)


def test_shape_and_eps_errors():
    with pytest.raises(ValueError, match=r"advantages_T must have the packed shape \(6,\), got \(5,\)"):
        ppo_policy_loss(torch.zeros(6), torch.zeros(6), torch.zeros(5), MASK_T, CU_N1)
    with pytest.raises(ValueError, match=r"clip_eps_low must be in \[0, 1\), got 1.5"):
        ppo_policy_loss(torch.zeros(6), torch.zeros(6), torch.zeros(6), MASK_T, CU_N1, clip_eps_low=1.5)


def test_policy_loss_registry():
    assert get_policy_loss("ppo") is ppo_policy_loss
    assert get_policy_loss("gspo") is gspo_policy_loss
    assert get_policy_loss("megarl.algorithms.losses:gspo_policy_loss") is gspo_policy_loss
    with pytest.raises(ValueError) as err:
        get_policy_loss("grpo")
    assert str(err.value) == ("unknown policy loss 'grpo'; known: ['cispo', 'clip_cov', 'geo_mean', 'gpg', 'gspo', "
                              "'kl_cov', 'ppo', 'sapo'] (or a dotted path 'package.module:function')")
    for name, fn in POLICY_LOSSES.items():  # contract: (loss scalar, metrics dict)
        loss, metrics = fn(torch.zeros(6), torch.zeros(6), torch.ones(6), MASK_T, CU_N1, agg_mode="token-mean")
        # clip_frac where the loss clips (ppo, gspo, cispo, geo_mean); sapo, the cov losses and gpg do not
        assert loss.dim() == 0 and {"approx_kl", "ratio_mean", "ratio_min", "ratio_max", "pg_loss"} <= set(metrics), name
