"""The estimators and losses of the algorithm-breadth issue, against values computed by hand here
from each paper's formula (plain Python arithmetic on small lists, never the function under test),
on packed batches with several groups, uneven lengths and masked-out tokens; the losses' gradients
against a hand derivation or finite differences (float64 gradcheck)."""
import math

import pytest
import torch

from megarl.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, get_advantage_estimator, get_policy_loss

F64 = torch.float64


def packed(lengths, masked_out=()):
    """cu_seqlens and a mask with the packed indices in ``masked_out`` off."""
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()))
    mask = torch.ones(int(cu[-1]), dtype=torch.bool)
    for i in masked_out:
        mask[i] = False
    return cu, mask


def per_token(values_N, lengths, mask):
    """Expected packed tensor: each sequence's value on its masked-in tokens."""
    out = []
    for v, n in zip(values_N, lengths):
        out += [v] * n
    return torch.tensor(out, dtype=F64) * mask.to(F64)


def run_adv(name, rewards, lengths, groups, masked_out=(), **opts):
    cu, mask = packed(lengths, masked_out)
    return get_advantage_estimator(name)(rewards_N=torch.tensor(rewards, dtype=F64), cu_seqlens_N1=cu, mask_T=mask,
                                         group_ids_N=torch.tensor(groups), **opts), mask


# -- advantage estimators -------------------------------------------------------------------------------

LENGTHS, GROUPS = [3, 2, 4, 1, 2, 2, 3], [0, 0, 0, 1, 1, 2, 2]
REWARDS = [1.0, 0.0, 0.5, 2.0, 1.0, 1.0, 1.0]   # group 2 is constant
MASKED_OUT = (4,)   # the second token of sequence 1 (e.g. an inserted tool result)


def test_grpo_passk_only_the_best_gets_best_minus_second():
    result, mask = run_adv("grpo_passk", REWARDS, LENGTHS, GROUPS, MASKED_OUT)
    # group 0: best 1.0 (seq 0), second 0.5 -> 0.5; group 1: 2.0 - 1.0 = 1.0; group 2: a tie -> 0
    expected = per_token([0.5, 0, 0, 1.0, 0, 0, 0], LENGTHS, mask)
    assert torch.allclose(result.advantages_T, expected, atol=1e-12)
    tie, mask = run_adv("grpo_passk", [1.0, 1.0, 0.0], [1, 1, 1], [5, 5, 5])
    assert torch.equal(tie.advantages_T, torch.zeros(3, dtype=F64))
    single, _ = run_adv("grpo_passk", [3.0], [2], [0])
    assert torch.equal(single.advantages_T, torch.zeros(2, dtype=F64))


def test_opo_length_weighted_baseline():
    result, mask = run_adv("opo", REWARDS, LENGTHS, GROUPS, MASKED_OUT)
    # masked-in lengths: group 0 = 3, 1, 4; group 1 = 1, 2; group 2 constant -> 0
    b0 = (3 * 1.0 + 1 * 0.0 + 4 * 0.5) / (3 + 1 + 4)
    b1 = (1 * 2.0 + 2 * 1.0) / (1 + 2)
    expected = per_token([1.0 - b0, 0.0 - b0, 0.5 - b0, 2.0 - b1, 1.0 - b1, 0, 0], LENGTHS, mask)
    assert torch.allclose(result.advantages_T, expected, atol=1e-12)


def test_gpg_group_mean_and_the_papers_scaling():
    result, mask = run_adv("gpg", REWARDS, LENGTHS, GROUPS, MASKED_OUT)
    alpha = 7 / (7 - 2)   # B = 7 responses, M = 2 in the constant group
    means = [0.5, 0.5, 0.5, 1.5, 1.5]
    expected = per_token([alpha * (r - m) for r, m in zip(REWARDS[:5], means)] + [0, 0], LENGTHS, mask)
    assert torch.allclose(result.advantages_T, expected, atol=1e-12)


def test_reinforce_pp_baseline_centres_per_group_then_whitens_the_batch():
    result, mask = run_adv("reinforce_pp_baseline", REWARDS, LENGTHS, GROUPS, MASKED_OUT)
    means = [0.5, 0.5, 0.5, 1.5, 1.5, 1.0, 1.0]
    # gamma = 1: every masked-in token's return is its sequence's centred reward
    returns = []
    for r, m, n in zip(REWARDS, means, LENGTHS):
        returns += [r - m] * n
    kept = [x for x, keep in zip(returns, mask.tolist()) if keep]
    mu = sum(kept) / len(kept)
    sd = math.sqrt(sum((x - mu) ** 2 for x in kept) / (len(kept) - 1))
    expected = torch.tensor([(x - mu) / (sd + 1e-6) if keep else 0.0 for x, keep in zip(returns, mask.tolist())],
                            dtype=F64)
    assert torch.allclose(result.advantages_T, expected, atol=1e-9)


def test_remax_subtracts_the_greedy_reward():
    baseline = [0.5, 0.5, 0.5, 1.0, 1.0, 2.0, 2.0]
    result, mask = run_adv("remax", REWARDS, LENGTHS, GROUPS, MASKED_OUT, baseline_rewards_N=torch.tensor(baseline))
    expected = per_token([r - b for r, b in zip(REWARDS, baseline)], LENGTHS, mask)
    assert torch.allclose(result.advantages_T, expected, atol=1e-12)
    with pytest.raises(ValueError, match="remax needs baseline_rewards_N"):
        run_adv("remax", REWARDS, LENGTHS, GROUPS)


def test_optimal_token_baseline_per_position_energy_weighted():
    # one group: seq 0 (2 tokens, reward 1), seq 1 (1 token, reward 0); another group of one
    p = [0.5, 0.25, 0.8, 0.9]
    logprobs = torch.tensor([math.log(x) for x in p], dtype=F64)
    result, mask = run_adv("optimal_token_baseline", [1.0, 0.0, 3.0], [2, 1, 1], [0, 0, 1], logprobs_T=logprobs)
    e = [(1 - x) ** 2 for x in p]             # 1 - 2 pi + pi^2 (sum of pi^2 not given)
    w00, w01, w10 = e[0], e[0] + e[1], e[2]   # accumulated energy W_t
    b0 = (1 * w00 + 0 * w10) / (w00 + w10 + 1e-8)
    b1 = (1 * w01) / (w01 + 1e-8)             # only seq 0 reaches position 1
    b_other = 3.0 * e[3] / (e[3] + 1e-8)
    expected = torch.tensor([1 - b0, 1 - b1, 0 - b0, 3.0 - b_other], dtype=F64)
    assert torch.allclose(result.advantages_T, expected, atol=1e-9)
    assert torch.equal(result.returns_T, torch.tensor([1.0, 1.0, 0.0, 3.0], dtype=F64))
    # with the vocabulary's sum of pi^2, and without log-probs (every token weighs 1: a plain mean)
    sq = torch.tensor([0.3, 0.1, 0.65, 0.82], dtype=F64)
    result, _ = run_adv("optimal_token_baseline", [1.0, 0.0, 3.0], [2, 1, 1], [0, 0, 1], logprobs_T=logprobs,
                        sum_pi_squared_T=sq)
    e = [1 - 2 * x + s for x, s in zip(p, sq.tolist())]
    b0 = (e[0]) / (e[0] + e[2] + 1e-8)
    assert math.isclose(float(result.advantages_T[0]), 1 - b0, abs_tol=1e-9)
    plain, _ = run_adv("optimal_token_baseline", [1.0, 0.0, 3.0], [2, 1, 1], [0, 0, 1])
    assert torch.allclose(plain.advantages_T, torch.tensor([0.5, 0.0, -0.5, 0.0], dtype=F64), atol=1e-6)


# -- policy losses --------------------------------------------------------------------------------------

# three sequences (lengths 2, 3, 1), one masked-out token, advantages constant per sequence
CU = torch.tensor([0, 2, 5, 6])
MASK = torch.tensor([1, 1, 1, 0, 1, 1], dtype=torch.bool)
OLD = torch.tensor([-1.0, -0.5, -2.0, -1.0, -0.3, -0.7], dtype=F64)
NEW = torch.tensor([-0.8, -0.9, -1.2, -1.1, -0.3, -0.1], dtype=F64)
ADV = torch.tensor([1.0, 1.0, -0.5, -0.5, -0.5, 2.0], dtype=F64)


def loss_of(name, new=NEW, **opts):
    logp = new.clone().requires_grad_(True)
    loss, metrics = get_policy_loss(name)(logp, OLD, ADV, MASK, CU, **opts)
    loss.backward()
    return float(loss.detach()), logp.grad, metrics


def token_mean(values):
    kept = [v for v, m in zip(values, MASK.tolist()) if m]
    return sum(kept) / len(kept)


def ratios(new=NEW):
    return [math.exp(n - o) for n, o in zip(new.tolist(), OLD.tolist())]


def test_sapo_soft_gate_value_and_gradient():
    sig = lambda x: 1 / (1 + math.exp(-x))   # noqa: E731
    taus = [1.0 if a > 0 else 1.05 for a in ADV.tolist()]
    r = ratios()
    per = [-a * sig(t * (x - 1)) * 4 / t for a, t, x in zip(ADV.tolist(), taus, r)]
    value, grad, metrics = loss_of("sapo", tau_pos=1.0, tau_neg=1.05)
    assert math.isclose(value, token_mean(per), rel_tol=1e-12)
    # d/dlogp of -A sig(tau (r - 1)) 4/tau = -A * 4 s (1 - s) * r, over the 5 masked-in tokens
    hand = [(-a * 4 * sig(t * (x - 1)) * (1 - sig(t * (x - 1))) * x / 5) if m else 0.0
            for a, t, x, m in zip(ADV.tolist(), taus, r, MASK.tolist())]
    assert torch.allclose(grad, torch.tensor(hand, dtype=F64), atol=1e-12)
    assert 0 < float(metrics["gate_mean"]) <= 1.0


def test_cispo_clipped_detached_weight():
    r = ratios()
    w = [min(max(x, 1 - 1.0), 1 + 0.2) for x in r]   # no lower bound, cap 1.2
    per = [-wi * a * n for wi, a, n in zip(w, ADV.tolist(), NEW.tolist())]
    value, grad, metrics = loss_of("cispo", clip_eps_low=1.0, clip_eps_high=0.2)
    assert math.isclose(value, token_mean(per), rel_tol=1e-12)
    hand = [(-wi * a / 5) if m else 0.0 for wi, a, m in zip(w, ADV.tolist(), MASK.tolist())]
    assert torch.allclose(grad, torch.tensor(hand, dtype=F64), atol=1e-12)   # the weight is detached
    clipped = sum(1 for x, m in zip(r, MASK.tolist()) if m and x > 1.2) / 5
    assert math.isclose(float(metrics["clip_frac"]), clipped)


def test_geo_mean_sequence_level_value_and_gradcheck():
    eps = 0.4
    lr = [n - o for n, o in zip(NEW.tolist(), OLD.tolist())]
    losses = []
    for i, (a, b) in enumerate(zip(CU[:-1].tolist(), CU[1:].tolist())):
        adv = ADV[a].item()
        s = []
        for t in range(a, b):
            if MASK[t]:
                c = min(max(lr[t], -eps), eps)
                s.append(min(lr[t], c) if adv > 0 else max(lr[t], c))
        losses.append(-adv * math.exp(sum(s) / len(s)))
    value, _, metrics = loss_of("geo_mean", clip_eps_low=eps, clip_eps_high=eps)
    assert math.isclose(value, sum(losses) / 3, rel_tol=1e-12)
    # with the step's global sequence count (micro-batches)
    value10, _, _ = loss_of("geo_mean", clip_eps_low=eps, clip_eps_high=eps, num_seqs=10)
    assert math.isclose(value10, sum(losses) / 10, rel_tol=1e-12)
    # gradient: finite differences, at a point where no log-ratio sits on a clip boundary
    fn = get_policy_loss("geo_mean")
    assert torch.autograd.gradcheck(lambda x: fn(x, OLD, ADV, MASK, CU, clip_eps_low=eps, clip_eps_high=eps)[0],
                                    (NEW.clone().requires_grad_(True),))


def test_gpg_loss_no_ratio():
    per = [-a * n for a, n in zip(ADV.tolist(), NEW.tolist())]
    value, grad, _ = loss_of("gpg")
    assert math.isclose(value, token_mean(per), rel_tol=1e-12)
    hand = [(-a / 5) if m else 0.0 for a, m in zip(ADV.tolist(), MASK.tolist())]
    assert torch.allclose(grad, torch.tensor(hand, dtype=F64), atol=1e-12)


def covariances(new=NEW):
    kept = [i for i, m in enumerate(MASK.tolist()) if m]
    mlp = sum(new[i].item() for i in kept) / len(kept)
    madv = sum(ADV[i].item() for i in kept) / len(kept)
    return [((new[i].item() - mlp) * (ADV[i].item() - madv)) if MASK[i] else 0.0 for i in range(len(MASK))]


def test_clip_cov_cuts_the_selected_tokens_gradient():
    cov = covariances()
    # a band holding exactly the token with the largest covariance: one candidate, ratio -> 1 token
    top = max(range(6), key=lambda i: cov[i])
    value, grad, metrics = loss_of("clip_cov", cov_clip_ratio=1e-6, cov_low=cov[top] - 1e-9, cov_high=cov[top] + 1)
    r = ratios()
    assert math.isclose(value, token_mean([-a * x for a, x in zip(ADV.tolist(), r)]), rel_tol=1e-12)
    hand = [0.0 if (not m or i == top) else -a * x / 5 for i, (a, x, m) in enumerate(zip(ADV.tolist(), r, MASK.tolist()))]
    assert torch.allclose(grad, torch.tensor(hand, dtype=F64), atol=1e-12)
    assert math.isclose(float(metrics["cov_selected_frac"]), 1 / 5)
    assert math.isclose(float(metrics["cov_mean"]), sum(cov) / 5, abs_tol=1e-12)
    # no token in the band: nothing cut, the plain -r A gradient everywhere
    _, grad, metrics = loss_of("clip_cov", cov_low=1e3, cov_high=1e4)
    assert float(metrics["cov_selected_frac"]) == 0.0 and torch.count_nonzero(grad) == 5


def test_kl_cov_penalises_the_top_covariance_tokens():
    cov = covariances()
    top = max(range(6), key=lambda i: cov[i])
    r = ratios()
    lr = [n - o for n, o in zip(NEW.tolist(), OLD.tolist())]
    per = [-a * x + (2.0 * abs(lr[i]) if i == top else 0.0) for i, (a, x) in enumerate(zip(ADV.tolist(), r))]
    value, grad, metrics = loss_of("kl_cov", kl_cov_ratio=1e-6, kl_cov_coef=2.0)   # k = max(1, ...) = 1
    assert math.isclose(value, token_mean(per), rel_tol=1e-12)
    hand = [0.0 if not m else (-a * x + (2.0 * math.copysign(1, lr[i]) if i == top else 0.0)) / 5
            for i, (a, x, m) in enumerate(zip(ADV.tolist(), r, MASK.tolist()))]
    assert torch.allclose(grad, torch.tensor(hand, dtype=F64), atol=1e-12)
    assert math.isclose(float(metrics["cov_selected_frac"]), 1 / 5)


def test_registries_name_every_estimator_and_loss():
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "drgrpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae",
                                         "grpo_passk", "opo", "gpg", "remax", "optimal_token_baseline"}
    assert set(POLICY_LOSSES) == {"ppo", "gspo", "sapo", "cispo", "geo_mean", "clip_cov", "kl_cov", "gpg"}
    with pytest.raises(ValueError, match="unknown policy loss 'gmpo'"):
        get_policy_loss("gmpo")


def test_the_trainer_passes_sample_logprobs_and_greedy_baselines_to_the_estimators_that_name_them():
    from megarl.data.batch import Rollout, compute_advantages

    nan = float("nan")
    roll = Rollout([[1], [1], [2]], [[5, 6], [7], [8, 9]], [[-0.7, -1.4], [-0.2], [nan, -0.1]], [0, 0, 1],
                   ["", "", ""], [False] * 3, rewards=[1.0, 0.0, 2.0], baseline_rewards=[0.5, 0.5, 1.0],
                   loss_masks=[[True, True], [True], [False, True]])
    adv, _ = compute_advantages(roll, get_advantage_estimator("optimal_token_baseline"), {"gamma": 1.0})
    direct = get_advantage_estimator("optimal_token_baseline")(
        rewards_N=torch.tensor([1.0, 0.0, 2.0]), cu_seqlens_N1=torch.tensor([0, 2, 3, 5]),
        mask_T=torch.tensor([True, True, True, False, True]), group_ids_N=torch.tensor([0, 0, 1]),
        logprobs_T=torch.tensor([-0.7, -1.4, -0.2, nan, -0.1]))
    assert torch.allclose(torch.cat(adv), direct.advantages_T, atol=1e-7)
    assert torch.isfinite(torch.cat(adv)).all() and float(adv[2][0]) == 0.0   # the inserted token: no loss
    adv, _ = compute_advantages(roll, get_advantage_estimator("remax"), {})
    assert [a.tolist() for a in adv] == [[0.5, 0.5], [-0.5], [0.0, 1.0]]
