"""KL estimators, KL loss / reward penalty, and the fixed and adaptive KL controllers.

Legend: T packed tokens, N1 = N + 1.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.algorithms.kl import (
    AdaptiveKLController,
    FixedKLController,
    build_kl_controller,
    kl_estimate,
    kl_loss,
    kl_reward_penalty,
)

LN2 = math.log(2)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=1e-5)


# pi = (0.5, 0.25), pi_ref = (0.25, 0.5) at two sampled tokens: d = logp - ref = (ln 2, -ln 2).
LOGP_T = torch.tensor([math.log(0.5), math.log(0.25)], dtype=torch.float64)
REF_T = torch.tensor([math.log(0.25), math.log(0.5)], dtype=torch.float64)


def test_estimators_hand_values():
    close(kl_estimate(LOGP_T, REF_T, "k1"), [LN2, -LN2])
    close(kl_estimate(LOGP_T, REF_T, "k2"), [0.5 * LN2**2, 0.5 * LN2**2])
    # k3 = exp(-d) - 1 + d: 0.5 - 1 + ln2 and 2 - 1 - ln2
    close(kl_estimate(LOGP_T, REF_T, "k3"), [LN2 - 0.5, 1 - LN2])


def test_k1_and_k3_are_unbiased_over_the_policy():
    # p = (1/2, 1/4, 1/4), q = (1/4, 1/4, 1/2): KL(p || q) = 1/2 ln2 + 0 + 1/4 ln(1/2) = ln2 / 4.
    p = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    q = torch.tensor([0.25, 0.25, 0.5], dtype=torch.float64)
    for kind in ("k1", "k3"):
        expectation = (p * kl_estimate(p.log(), q.log(), kind)).sum()
        close(expectation, LN2 / 4)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-15, 15), min_size=1, max_size=8))
def test_k2_k3_nonnegative_and_zero_at_equal(log_ratios):
    logp_T = torch.tensor(log_ratios, dtype=torch.float64)
    ref_T = torch.zeros_like(logp_T)
    for kind in ("k2", "k3"):
        assert (kl_estimate(logp_T, ref_T, kind) >= 0).all()
        assert (kl_estimate(logp_T, logp_T.clone(), kind) == 0).all()


def test_kl_loss_masks_aggregates_and_gradients():
    # Tokens d = (ln2, -ln2, [masked]) in two sequences (lengths 2 and 1); k1 token-mean = (ln2 - ln2) / 2 = 0,
    # k2 seq-mean-token-sum = (ln2^2 / 2 * 2 + 0) / 1 counted sequence (the second is fully masked).
    logp_T = torch.cat([LOGP_T, torch.tensor([-1.0], dtype=torch.float64)]).requires_grad_(True)
    ref_T = torch.cat([REF_T, torch.tensor([-3.0], dtype=torch.float64)])
    mask_T = torch.tensor([True, True, False])
    cu_N1 = torch.tensor([0, 2, 3])
    loss, metrics = kl_loss(logp_T, ref_T, mask_T, cu_N1, kind="k1")
    close(loss, 0.0)
    loss, metrics = kl_loss(logp_T, ref_T, mask_T, cu_N1, kind="k2", agg_mode="seq-mean-token-sum")
    close(loss, LN2**2)
    close(metrics["kl"], LN2**2)
    loss.backward()
    close(logp_T.grad, [LN2, -LN2, 0.0])  # d(d^2/2)/dlogp = d


def test_kl_reward_penalty():
    # k1 per token (ln2, -ln2, [masked]); coef 0.1 -> rewards (-0.1 ln2, 0.1 ln2, 0); mean KL over mask = 0.
    logp_T = torch.cat([LOGP_T, torch.tensor([-1.0], dtype=torch.float64)]).requires_grad_(True)
    ref_T = torch.cat([REF_T, torch.tensor([-3.0], dtype=torch.float64)])
    penalty_T, mean_kl = kl_reward_penalty(logp_T, ref_T, torch.tensor([True, True, False]), 0.1)
    close(penalty_T, [-0.1 * LN2, 0.1 * LN2, 0.0])
    close(mean_kl, 0.0)
    assert not penalty_T.requires_grad


def test_adaptive_controller_follows_ziegler():
    # init 0.2, target 6, horizon 10000.
    ctl = AdaptiveKLController(0.2, target_kl=6.0, horizon=10000)
    # KL 6.6: error = 6.6/6 - 1 = 0.1; n = 500 -> beta = 0.2 * (1 + 0.1 * 500 / 10000) = 0.2 * 1.005
    ctl.update(6.6, 500)
    assert ctl.value == pytest.approx(0.2 * 1.005)
    # KL 30: error 4 is clipped to 0.2; n = 1000 -> * (1 + 0.02)
    ctl.update(30.0, 1000)
    assert ctl.value == pytest.approx(0.2 * 1.005 * 1.02)
    # KL 0: error -1 is clipped to -0.2; n = 1000 -> * (1 - 0.02)
    ctl.update(0.0, 1000)
    assert ctl.value == pytest.approx(0.2 * 1.005 * 1.02 * 0.98)


def test_fixed_controller_and_builder_errors():
    ctl = build_kl_controller("fixed", init_kl_coef=0.05)
    ctl.update(100.0, 1000)
    assert isinstance(ctl, FixedKLController) and ctl.value == 0.05
    assert isinstance(build_kl_controller("adaptive", init_kl_coef=0.1, target_kl=1.0, horizon=10), AdaptiveKLController)
    with pytest.raises(ValueError) as err:
        build_kl_controller("pid", init_kl_coef=0.1)
    assert str(err.value) == "unknown KL controller 'pid'; known: ['adaptive', 'fixed']"
    with pytest.raises(ValueError) as err:
        kl_estimate(LOGP_T, REF_T, "k4")
    assert str(err.value) == "unknown KL estimator 'k4'; known: ['k1', 'k2', 'k3']"
    with pytest.raises(ValueError, match="target_kl must be > 0, got 0"):
        AdaptiveKLController(0.1, target_kl=0, horizon=10)
