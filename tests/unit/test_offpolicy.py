"""Rollout-training mismatch corrections (megarl.algorithms.offpolicy): hand values of every mode and
level, the metrics, the loss integration down to the engine's global counts, and unbiasedness of
the importance-weighted gradient on a toy categorical distribution.

Legend: N sequences, T packed tokens, N1 = N + 1, K outcomes of the toy distribution.
"""
import math
from types import SimpleNamespace

import pytest
import torch

from megarl.algorithms.losses import gspo_policy_loss, ppo_policy_loss
from megarl.algorithms.offpolicy import correct_rollout, correction_weights, mismatch_metrics
from megarl.config import ConfigError, load_config

# Two sequences of lengths 3 and 2; the last token is outside the mask. Token ratios
# w = pi_train / pi_rollout = 1, 3, 0.25 | 1.5, (0.4): sequence ratios 0.75 and 1.5 (masked tokens
# do not count in a sequence's product).
CU_N1 = torch.tensor([0, 3, 5])
MASK_T = torch.tensor([True, True, True, True, False])
W_T = torch.tensor([1.0, 3.0, 0.25, 1.5, 0.4], dtype=torch.float64)
ROLLOUT_T = torch.tensor([-1.0, -2.0, -0.5, -1.0, -3.0], dtype=torch.float64)
TRAIN_T = ROLLOUT_T + W_T.log()


def weights(mode, level="token", **band):
    return correction_weights(TRAIN_T, ROLLOUT_T, MASK_T, CU_N1, mode=mode, level=level, **band)


def check(got, weights_T, keep_T):
    w, keep = got
    torch.testing.assert_close(w, torch.tensor(weights_T, dtype=torch.float64), rtol=0, atol=1e-12)
    assert keep.dtype == torch.bool and keep.tolist() == keep_T
    assert not w.requires_grad


def test_tis_token_and_sequence():
    check(weights("tis", cap=2.0), [1.0, 2.0, 0.25, 1.5, 0.0], [True, True, True, True, False])
    check(weights("tis", "sequence", cap=2.0), [0.75, 0.75, 0.75, 1.5, 0.0], [True, True, True, True, False])
    check(weights("tis", "sequence", cap=1.0), [0.75, 0.75, 0.75, 1.0, 0.0], [True, True, True, True, False])


def test_mask_token_and_sequence():
    # band [0.5, 2]: tokens 3 and 0.25 leave it; both sequences (0.75, 1.5) stay
    check(weights("mask", low=0.5, high=2.0), [1.0, 0.0, 0.0, 1.0, 0.0], [True, False, False, True, False])
    check(weights("mask", "sequence", low=0.5, high=2.0), [1.0, 1.0, 1.0, 1.0, 0.0], [True, True, True, True, False])
    # band [0.8, 2]: the first sequence (0.75) is dropped as a whole
    check(weights("mask", "sequence", low=0.8, high=2.0), [0.0, 0.0, 0.0, 1.0, 0.0], [False, False, False, True, False])


def test_icepop_and_none():
    check(weights("icepop", low=0.5, high=2.0), [1.0, 0.0, 0.0, 1.5, 0.0], [True, False, False, True, False])
    check(weights("none"), [1.0, 1.0, 1.0, 1.0, 0.0], [True, True, True, True, False])
    with pytest.raises(ValueError, match="icepop masks tokens: level must be 'token', got 'sequence'"):
        weights("icepop", "sequence")
    with pytest.raises(ValueError, match=r"unknown rollout correction mode 'is'; "
                                         r"known: \['none', 'tis', 'mask', 'icepop'\]"):
        weights("is")


def test_huge_ratio_is_capped_without_overflow():
    # a 200-nat log-ratio (a broken token) in fp32: clamped before exp, capped by tis, masked by icepop
    train, rollout = torch.tensor([0.0, -1.0]), torch.tensor([-200.0, -1.0])
    mask, cu = torch.ones(2, dtype=torch.bool), torch.tensor([0, 2])
    w, _ = correction_weights(train, rollout, mask, cu, mode="tis", level="sequence", cap=2.0)
    assert w.tolist() == [2.0, 2.0]
    w, keep = correction_weights(train, rollout, mask, cu, mode="icepop", low=0.5, high=2.0)
    assert w.tolist() == [0.0, 1.0] and keep.tolist() == [False, True]


def test_mismatch_metrics_hand_values():
    # masked-in |log w| = 0, log 3, log 4, log 1.5; k3 = (w - 1) - log w = 0, 2 - log 3, -0.75 + log 4,
    # 0.5 - log 1.5, mean (1.75 - log 1.125) / 4
    m = mismatch_metrics(TRAIN_T, ROLLOUT_T, MASK_T)
    assert m == pytest.approx({"rollout_corr/log_ratio_abs_mean": math.log(18) / 4,
                               "rollout_corr/log_ratio_abs_max": math.log(4),
                               "rollout_corr/k3_kl": (1.75 - math.log(1.125)) / 4,
                               "rollout_corr/masked_frac": 0.0}, abs=1e-12)
    w, keep = weights("icepop", low=0.5, high=2.0)
    m = mismatch_metrics(TRAIN_T, ROLLOUT_T, MASK_T, keep, w)
    # icepop drops 2 of the 4 masked-in tokens; kept weights 1 and 1.5
    assert m["rollout_corr/masked_frac"] == 0.5
    assert m["rollout_corr/weight_mean"] == pytest.approx(1.25) and m["rollout_corr/weight_max"] == pytest.approx(1.5)
    empty = mismatch_metrics(TRAIN_T, ROLLOUT_T, torch.zeros(5, dtype=torch.bool))
    assert set(empty.values()) == {0.0}


def test_ppo_loss_weights_multiply_and_dropped_tokens_leave_the_denominator():
    # at ratio 1 the per-token PPO loss is -A; advantages 1..5
    adv = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0], dtype=torch.float64)
    lp = TRAIN_T.clone().requires_grad_(True)
    w, keep = weights("tis", cap=2.0)                  # 1, 2, 0.25, 1.5 on the 4 masked-in tokens
    loss, _ = ppo_policy_loss(lp, lp.detach(), adv, keep, CU_N1, is_weights_T=w)
    assert loss.item() == pytest.approx(-(1 * 1 + 2 * 2 + 3 * 0.25 + 4 * 1.5) / 4)
    loss.backward()                                    # d/dlogp of -A w r / 4 at r = 1
    torch.testing.assert_close(lp.grad, torch.tensor([-0.25, -1.0, -0.1875, -1.5, 0.0], dtype=torch.float64))
    w, keep = weights("mask", low=0.5, high=2.0)       # keeps tokens 0 and 3 only
    loss, _ = ppo_policy_loss(lp, lp.detach(), adv, keep, CU_N1, is_weights_T=w)
    assert loss.item() == pytest.approx(-(1 + 4) / 2)
    w, keep = weights("mask", "sequence", low=0.8, high=2.0)   # the first sequence dropped
    loss, _ = ppo_policy_loss(lp, lp.detach(), adv, keep, CU_N1, is_weights_T=w, agg_mode="seq-mean-token-mean")
    assert loss.item() == pytest.approx(-4.0)          # one sequence left, not (0 + -4) / 2
    with pytest.raises(ValueError, match=r"is_weights_T must have the packed shape \(5,\), got \(4,\)"):
        ppo_policy_loss(lp, lp.detach(), adv, keep, CU_N1, is_weights_T=w[:4])


def test_gspo_loss_takes_sequence_weights():
    adv = torch.tensor([1.0, 1.0, 1.0, 2.0, 2.0], dtype=torch.float64)
    w, keep = weights("tis", "sequence", cap=2.0)      # 0.75 on sequence 0, 1.5 on sequence 1
    loss, _ = gspo_policy_loss(TRAIN_T, TRAIN_T, adv, keep, CU_N1, is_weights_T=w)
    assert loss.item() == pytest.approx((-0.75 + -2.0 * 1.5) / 2)   # seq-mean-token-mean


def test_correct_rollout_per_sample_and_metrics():
    cfg = load_config(None, ["algorithm.rollout_correction=mask", "algorithm.correction_level=token",
                             "algorithm.correction_low=0.5", "algorithm.correction_high=2.0"]).algorithm
    rollout_lp = [[-1.0, -2.0, -0.5], [-1.0, -3.0]]
    train_lp = [torch.tensor([-1.0, -2.0 + math.log(3.0), -0.5 + math.log(0.25)]),
                torch.tensor([-1.0 + math.log(1.5), -3.0])]
    per_sample, m = correct_rollout(train_lp, rollout_lp, cfg)
    assert [t.tolist() for t in per_sample["mask_T"]] == [[True, False, False], [True, True]]
    assert [t.tolist() for t in per_sample["is_weights_T"]] == [[1.0, 0.0, 0.0], [1.0, 1.0]]
    assert per_sample["is_weights_T"][0].dtype == torch.float32
    assert m["rollout_corr/masked_frac"] == pytest.approx(2 / 5)
    assert m["rollout_corr/log_ratio_abs_max"] == pytest.approx(math.log(4), abs=1e-6)
    none = load_config(None, ["algorithm.rollout_correction=none"]).algorithm
    per_sample, m_none = correct_rollout(train_lp, rollout_lp, none)
    assert per_sample == {} and m_none["rollout_corr/masked_frac"] == 0.0
    assert m_none["rollout_corr/k3_kl"] == pytest.approx(m["rollout_corr/k3_kl"])
    tis = load_config(None, ["algorithm.rollout_correction=tis", "algorithm.correction_level=sequence",
                             "algorithm.correction_cap=1.2"]).algorithm
    per_sample, _ = correct_rollout(train_lp, rollout_lp, tis)
    assert torch.cat(per_sample["is_weights_T"]).tolist() == pytest.approx([0.75] * 3 + [1.2] * 2)
    with pytest.raises(ValueError, match="sample 1: 2 trainer log-probs but 1 rollout log-probs"):
        correct_rollout(train_lp, [rollout_lp[0], [-1.0]], tis)


def test_corrected_mask_reaches_the_loss_and_the_global_counts():
    """Driver -> micro-batch -> engine counts -> loss_fn: a dropped sequence leaves the token and
    sequence denominators (TrainStep.step sums _masked_counts over micro-batches and DP)."""
    from megarl.policy.train import _masked_counts
    from megarl.actors.algorithm import make_loss_fn
    from megarl.data.batch import Rollout, micro_batches_for

    cfg = load_config(None, ["algorithm.rollout_correction=mask", "algorithm.correction_level=sequence",
                             "algorithm.correction_low=0.8", "algorithm.loss_agg_mode=seq-mean-token-mean"]).algorithm
    rollout_lp = [[-1.0, -2.0, -0.5], [-1.0, -3.0]]
    train_lp = [torch.tensor([-1.0, -2.0 + math.log(3.0), -0.5 + math.log(0.25)]),   # sequence ratio 0.75
                torch.tensor([-1.0 + math.log(1.5), -3.0])]                          # 1.5
    per_sample, _ = correct_rollout(train_lp, rollout_lp, cfg)
    gens = [[{"token_ids": [7, 8, 9], "logprobs": rollout_lp[0], "clipped": False},
             {"token_ids": [7, 8], "logprobs": rollout_lp[1], "clipped": False}]]
    rollout = Rollout.from_generations([[1, 2]], ["a"], gens)
    per_sample.update(old_logprobs_T=train_lp, advantages_T=[torch.full((3,), 1.0), torch.full((2,), 2.0)])
    plan = SimpleNamespace(micro_batches={0: [[0, 1]]})
    (batch,) = micro_batches_for(rollout, plan, 0, per_sample)
    assert batch.extras["mask_T"].tolist() == [False, False, False, True, True]
    assert _masked_counts(batch) == (2, 1)
    batch.num_global_tokens, batch.num_global_sequences = _masked_counts(batch)
    loss, _ = make_loss_fn(cfg, max_response_tokens=8)(torch.cat(train_lp), batch)
    assert loss.item() == pytest.approx(-2.0)          # the kept sequence's mean of -A, over 1 sequence
    del batch.extras["is_weights_T"]                   # no correction: the mask alone still applies
    assert make_loss_fn(cfg, max_response_tokens=8)(torch.cat(train_lp), batch)[0].item() == pytest.approx(-2.0)


# ---------------------------------------------------------------- unbiasedness on a toy distribution
# K = 6 outcomes; pi = softmax(THETA) is trained, mu = softmax(PHI) samples (ratios pi/mu:
# 1.251, 0.460, 2.784, 1.132, 0.252, 0.687); reward F. grad_theta E_pi[F] = pi * (F - E_pi[F]).
THETA = torch.tensor([0.5, -0.3, 1.2, 0.0, -1.0, 0.3], dtype=torch.float64)
PHI = torch.tensor([0.2, 0.4, 0.1, -0.2, 0.3, 0.6], dtype=torch.float64)
F = torch.tensor([1.0, 0.0, 2.0, -1.0, 0.5, 0.0], dtype=torch.float64)
PI, MU = THETA.softmax(0), PHI.softmax(0)
EXACT = PI * (F - (PI * F).sum())


def surrogate_gradient(xs, mode, cap):
    """The policy gradient the trainer follows for samples ``xs`` (one-token sequences): the PPO loss
    at ratio 1 with advantage F(x), IS-weighted by correction_weights, token-mean; returns +grad."""
    theta = THETA.clone().requires_grad_(True)
    lp = theta.log_softmax(0)[xs]
    cu, mask = torch.arange(xs.numel() + 1), torch.ones(xs.numel(), dtype=torch.bool)
    w, keep = correction_weights(lp.detach(), PHI.log_softmax(0)[xs], mask, cu, mode=mode, cap=cap)
    loss, _ = ppo_policy_loss(lp, lp.detach(), F[xs], keep, cu, is_weights_T=w)
    return -torch.autograd.grad(loss, theta)[0]


def expected_under_mu(mode, cap=2.0):
    return sum(MU[x] * surrogate_gradient(torch.tensor([x]), mode, cap) for x in range(6))


def test_uncapped_tis_gradient_is_unbiased_and_truncation_is_not():
    torch.testing.assert_close(expected_under_mu("tis", cap=math.inf), EXACT, rtol=0, atol=1e-6)
    score_KK = torch.eye(6, dtype=torch.float64) - PI                  # grad log pi(x), row x
    # capped at 1.5, only x = 2 (w = 2.78) is truncated: bias (1.5 mu_2 - pi_2) F_2 grad log pi(2)
    capped = expected_under_mu("tis", cap=1.5)
    torch.testing.assert_close(capped - EXACT, (1.5 * MU[2] - PI[2]) * F[2] * score_KK[2], rtol=0, atol=1e-9)
    assert (capped - EXACT).norm().item() == pytest.approx(0.24508, abs=1e-5)
    # uncorrected: E_mu[F grad log pi] - E_pi[F grad log pi] = sum_x (mu - pi) F grad log pi
    plain = expected_under_mu("none")
    torch.testing.assert_close(plain - EXACT, ((MU - PI) * F) @ score_KK, rtol=0, atol=1e-9)
    assert (plain - EXACT).norm().item() == pytest.approx(0.35387, abs=1e-5)


def test_monte_carlo_tis_gradient_matches_the_exact_one():
    gen = torch.Generator().manual_seed(0)
    xs = torch.multinomial(MU, 200_000, replacement=True, generator=gen)
    estimate = surrogate_gradient(xs, "tis", math.inf)
    # standard error of each component over the 200k per-sample gradients w F (e_x - pi): <= 0.0027
    per_sample = ((PI / MU)[xs] * F[xs])[:, None] * (torch.nn.functional.one_hot(xs, 6) - PI)
    stderr = per_sample.std(0) / math.sqrt(xs.numel())
    assert float(stderr.max()) < 0.003
    assert bool(((estimate - EXACT).abs() < 4 * stderr).all()), (estimate - EXACT, stderr)
    assert float((estimate - EXACT).abs().max()) < 0.005
    assert float((estimate - EXACT).abs().max()) < 0.1 * float((expected_under_mu("none") - EXACT).abs().max())


# ---------------------------------------------------------------- config
def test_config_refuses_a_band_without_1_and_sequence_icepop():
    def error_of(overrides):
        with pytest.raises(ConfigError) as exc:
            load_config(None, overrides)
        return str(exc.value)

    assert error_of(["algorithm.correction_low=1.0"]) == (
        "invalid value for config key 'algorithm.correction_low': got 1.0, expected a band around 1: "
        "correction_low < 1 < correction_high")
    assert error_of(["algorithm.correction_high=0.9"]) == (
        "invalid value for config key 'algorithm.correction_high': got 0.9, expected a band around 1: "
        "correction_low < 1 < correction_high")
    assert error_of(["algorithm.rollout_correction=icepop", "algorithm.correction_level=sequence"]) == (
        "invalid value for config key 'algorithm.correction_level': got 'sequence', expected 'token' with "
        "rollout_correction='icepop' (IcePop masks tokens)")
    assert error_of(["algorithm.correction_cap=0"]) == (
        "invalid value for config key 'algorithm.correction_cap': got 0.0, expected a positive number")
