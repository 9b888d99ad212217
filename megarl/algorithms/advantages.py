"""Advantage estimators over packed response tokens: GRPO, Dr.GRPO, RLOO, REINFORCE++ (and its
group-baseline variant), GAE, pass@k GRPO, OPO, GPG, ReMax and the Optimal Token Baseline; each
function states its formula and where it deviates from the paper.

Layout (:mod:`megarl.algorithms.packed`): per-token tensors are packed 1-D over the batch's
response tokens (``_T``), sequence boundaries are ``cu_seqlens_N1``, ``mask_T`` marks the tokens
that count, ``group_ids_N`` labels each sequence's prompt (any integers; groups need not be
contiguous or equally sized). Registry signature::

    fn(*, rewards_N, cu_seqlens_N1, mask_T, group_ids_N,
       token_rewards_T=None, values_T=None, **options) -> AdvantageResult(advantages_T, returns_T)

``rewards_N`` is each sequence's outcome score; ``token_rewards_T`` adds dense rewards (typically
the KL penalty of :func:`megarl.algorithms.kl.kl_reward_penalty`). Outcome estimators score a
sequence by ``rewards_N`` plus its masked token rewards; per-token ones put ``rewards_N`` on the
last masked-in token. Advantages are 0 outside ``mask_T``.
Shape legend: N sequences, T packed response tokens, L longest response, G groups, N1 = N + 1.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from megarl.algorithms.packed import (
    broadcast_to_tokens,
    check_cu_seqlens,
    group_index,
    last_token_index_N,
    masked_whiten,
    pad_by_seq,
    segment_sum,
    unpad_by_seq,
)

__all__ = [
    "AdvantageResult",
    "grpo_advantages",
    "drgrpo_advantages",
    "rloo_advantages",
    "reinforce_pp_advantages",
    "gae_advantages",
    "outcome_to_token_rewards",
    "discounted_returns",
    "reinforce_pp_baseline_advantages",
    "grpo_passk_advantages",
    "opo_advantages",
    "gpg_advantages",
    "remax_advantages",
    "optimal_token_baseline_advantages",
]


class AdvantageResult(NamedTuple):
    advantages_T: torch.Tensor
    """Per-token advantages, 0 outside the mask."""
    returns_T: torch.Tensor
    """Per-token regression targets for a critic (GAE) or the un-whitened returns; equals the
    advantages for the group estimators, which have no critic."""


def _float(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype.is_floating_point else x.to(torch.float32)


def _validate(rewards_N: torch.Tensor, cu_seqlens_N1: torch.Tensor, mask_T: torch.Tensor, group_ids_N: torch.Tensor | None) -> None:
    check_cu_seqlens(cu_seqlens_N1, num_tokens=mask_T.numel())
    num_seqs = cu_seqlens_N1.numel() - 1
    if rewards_N.dim() != 1 or rewards_N.numel() != num_seqs:
        raise ValueError(f"rewards_N must have one value per sequence ({num_seqs}), got shape {tuple(rewards_N.shape)}")
    if group_ids_N is not None and group_ids_N.shape != rewards_N.shape:
        raise ValueError(f"group_ids_N must have shape ({num_seqs},), got {tuple(group_ids_N.shape)}")


def _check_token_tensor(name: str, x: torch.Tensor | None, mask_T: torch.Tensor) -> None:
    if x is not None and x.shape != mask_T.shape:
        raise ValueError(f"{name} must have the packed shape {tuple(mask_T.shape)}, got {tuple(x.shape)}")


def _sequence_scores(rewards_N, token_rewards_T, mask_T, cu_seqlens_N1) -> torch.Tensor:
    scores_N = _float(rewards_N)
    if token_rewards_T is not None:
        _check_token_tensor("token_rewards_T", token_rewards_T, mask_T)
        scores_N = scores_N + segment_sum(_float(token_rewards_T) * mask_T.to(scores_N.dtype), cu_seqlens_N1)
    return scores_N


def _group_stats(scores_N: torch.Tensor, group_ids_N: torch.Tensor):
    """Per-sequence (count, sum, constant-group flag) of the sequence's group."""
    index_N, num_groups = group_index(group_ids_N)
    count_G = torch.zeros(num_groups, dtype=scores_N.dtype, device=scores_N.device).index_add(0, index_N, torch.ones_like(scores_N))
    sum_G = torch.zeros_like(count_G).index_add(0, index_N, scores_N)
    max_G = torch.full_like(count_G, -torch.inf).scatter_reduce(0, index_N, scores_N, reduce="amax")
    min_G = torch.full_like(count_G, torch.inf).scatter_reduce(0, index_N, scores_N, reduce="amin")
    return index_N, count_G, sum_G, (max_G == min_G)


def grpo_advantages(
    *,
    rewards_N: torch.Tensor,
    cu_seqlens_N1: torch.Tensor,
    mask_T: torch.Tensor,
    group_ids_N: torch.Tensor,
    token_rewards_T: torch.Tensor | None = None,
    values_T: torch.Tensor | None = None,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> AdvantageResult:
    """GRPO (Shao et al. 2024): A_i = (r_i - mean_g) / (std_g + eps) with the unbiased (n - 1) std as
    in verl, broadcast to the sequence's tokens (``values_T`` is unused). A group whose rewards are
    all equal gets exactly 0 (no float residue from the mean), and so does a group of one."""
    _validate(rewards_N, cu_seqlens_N1, mask_T, group_ids_N)
    scores_N = _sequence_scores(rewards_N, token_rewards_T, mask_T, cu_seqlens_N1)
    index_N, count_G, sum_G, constant_G = _group_stats(scores_N, group_ids_N)
    dev_N = scores_N - (sum_G / count_G)[index_N]
    dev_N = torch.where(constant_G[index_N], torch.zeros_like(dev_N), dev_N)
    if norm_by_std:
        var_G = torch.zeros_like(sum_G).index_add(0, index_N, dev_N**2) / (count_G - 1.0).clamp(min=1.0)
        dev_N = dev_N / (var_G.sqrt()[index_N] + eps)
    adv_T = broadcast_to_tokens(dev_N, cu_seqlens_N1) * mask_T.to(dev_N.dtype)
    return AdvantageResult(adv_T, adv_T.clone())


def drgrpo_advantages(**kwargs) -> AdvantageResult:
    """Dr.GRPO (Liu et al. 2025): GRPO without the std division (``norm_by_std=False``; pair it with
    ``seq-mean-token-sum-norm``)."""
    kwargs.setdefault("norm_by_std", False)
    return grpo_advantages(**kwargs)


def rloo_advantages(
    *,
    rewards_N: torch.Tensor,
    cu_seqlens_N1: torch.Tensor,
    mask_T: torch.Tensor,
    group_ids_N: torch.Tensor,
    token_rewards_T: torch.Tensor | None = None,
    values_T: torch.Tensor | None = None,
) -> AdvantageResult:
    """RLOO (Ahmadian et al. 2024): reward minus the mean reward of the other n - 1 samples of the
    same prompt; a group of one has no baseline and gets 0 (the paper assumes n >= 2)."""
    _validate(rewards_N, cu_seqlens_N1, mask_T, group_ids_N)
    scores_N = _sequence_scores(rewards_N, token_rewards_T, mask_T, cu_seqlens_N1)
    index_N, count_G, sum_G, constant_G = _group_stats(scores_N, group_ids_N)
    count_N = count_G[index_N]
    baseline_N = (sum_G[index_N] - scores_N) / (count_N - 1.0).clamp(min=1.0)
    adv_N = scores_N - baseline_N
    zero_N = constant_G[index_N] | (count_N < 2)
    adv_N = torch.where(zero_N, torch.zeros_like(adv_N), adv_N)
    adv_T = broadcast_to_tokens(adv_N, cu_seqlens_N1) * mask_T.to(adv_N.dtype)
    return AdvantageResult(adv_T, adv_T.clone())


def outcome_to_token_rewards(
    rewards_N: torch.Tensor, mask_T: torch.Tensor, cu_seqlens_N1: torch.Tensor, token_rewards_T: torch.Tensor | None = None
) -> torch.Tensor:
    """Place each sequence's outcome reward on its last masked-in token (plus dense ``token_rewards_T``).

    A sequence without any masked-in token has nowhere to put its reward; it is dropped.
    """
    rewards_N = _float(rewards_N)
    out_T = torch.zeros(mask_T.shape, dtype=rewards_N.dtype, device=rewards_N.device)
    if token_rewards_T is not None:
        _check_token_tensor("token_rewards_T", token_rewards_T, mask_T)
        out_T = out_T + _float(token_rewards_T) * mask_T.to(rewards_N.dtype)
    last_N = last_token_index_N(mask_T, cu_seqlens_N1)
    has_N = last_N >= 0
    return out_T.index_add(0, last_N[has_N], rewards_N[has_N])


def discounted_returns(
    token_rewards_T: torch.Tensor, mask_T: torch.Tensor, cu_seqlens_N1: torch.Tensor, gamma: float = 1.0
) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1} within each sequence; masked-out tokens pass the return through."""
    rewards_NL = pad_by_seq(_float(token_rewards_T), cu_seqlens_N1)
    mask_NL = pad_by_seq(mask_T.to(rewards_NL.dtype), cu_seqlens_N1)
    returns_NL = torch.zeros_like(rewards_NL)
    running_N = rewards_NL.new_zeros(rewards_NL.shape[0])
    for t in reversed(range(rewards_NL.shape[1])):
        m_N = mask_NL[:, t]
        running_N = m_N * (rewards_NL[:, t] + gamma * running_N) + (1.0 - m_N) * running_N
        returns_NL[:, t] = running_N
    return unpad_by_seq(returns_NL, cu_seqlens_N1) * mask_T.to(rewards_NL.dtype)


def reinforce_pp_advantages(
    *,
    rewards_N: torch.Tensor,
    cu_seqlens_N1: torch.Tensor,
    mask_T: torch.Tensor,
    group_ids_N: torch.Tensor | None = None,
    token_rewards_T: torch.Tensor | None = None,
    values_T: torch.Tensor | None = None,
    gamma: float = 1.0,
    group_baseline: bool = False,
    eps: float = 1e-6,
) -> AdvantageResult:
    """REINFORCE++ (Hu 2025): discounted per-token returns, whitened over all masked tokens of the
    batch (unbiased std). ``group_baseline=True`` first subtracts the group mean from the outcome
    rewards ("REINFORCE++-baseline"). Masked-out tokens inside a response neither receive reward
    nor discount: the return passes through them unchanged."""
    _validate(rewards_N, cu_seqlens_N1, mask_T, group_ids_N)
    rewards_N = _float(rewards_N)
    if group_baseline:
        if group_ids_N is None:
            raise ValueError("group_baseline=True needs group_ids_N")
        index_N, count_G, sum_G, _ = _group_stats(rewards_N, group_ids_N)
        rewards_N = rewards_N - (sum_G / count_G)[index_N]
    token_rewards_T = outcome_to_token_rewards(rewards_N, mask_T, cu_seqlens_N1, token_rewards_T)
    returns_T = discounted_returns(token_rewards_T, mask_T, cu_seqlens_N1, gamma)
    return AdvantageResult(masked_whiten(returns_T, mask_T, eps=eps), returns_T)


def gae_advantages(
    *,
    rewards_N: torch.Tensor,
    cu_seqlens_N1: torch.Tensor,
    mask_T: torch.Tensor,
    group_ids_N: torch.Tensor | None = None,
    token_rewards_T: torch.Tensor | None = None,
    values_T: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 0.95,
    whiten: bool = True,
    eps: float = 1e-6,
) -> AdvantageResult:
    """Generalised advantage estimation (Schulman et al. 2016) for PPO with a critic (``values_T``
    required): delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}, V = 0 after
    the last token (no bootstrap: truncated responses count as terminal, as in verl/OpenRLHF).
    Masked-out tokens are skipped by the recursion (value and advantage carry over them). Returns
    are A + V before whitening; advantages are whitened over the batch unless ``whiten=False``."""
    _validate(rewards_N, cu_seqlens_N1, mask_T, group_ids_N)
    if values_T is None:
        raise ValueError("gae needs values_T (the critic's per-token values); got None")
    _check_token_tensor("values_T", values_T, mask_T)
    token_rewards_T = outcome_to_token_rewards(rewards_N, mask_T, cu_seqlens_N1, token_rewards_T)
    values_T = values_T.detach().to(token_rewards_T.dtype)
    rewards_NL = pad_by_seq(token_rewards_T, cu_seqlens_N1)
    values_NL = pad_by_seq(values_T, cu_seqlens_N1)
    mask_NL = pad_by_seq(mask_T.to(rewards_NL.dtype), cu_seqlens_N1)
    adv_NL = torch.zeros_like(rewards_NL)
    next_value_N = rewards_NL.new_zeros(rewards_NL.shape[0])
    last_gae_N = torch.zeros_like(next_value_N)
    for t in reversed(range(rewards_NL.shape[1])):
        m_N, v_N = mask_NL[:, t], values_NL[:, t]
        delta_N = rewards_NL[:, t] + gamma * next_value_N - v_N
        gae_N = delta_N + gamma * lam * last_gae_N
        adv_NL[:, t] = gae_N
        # Masked-out tokens (and padding) are invisible to the recursion: carry both through.
        next_value_N = m_N * v_N + (1.0 - m_N) * next_value_N
        last_gae_N = m_N * gae_N + (1.0 - m_N) * last_gae_N
    mask_f = mask_T.to(rewards_NL.dtype)
    adv_T = unpad_by_seq(adv_NL, cu_seqlens_N1) * mask_f
    returns_T = (adv_T + values_T) * mask_f
    if whiten:
        adv_T = masked_whiten(adv_T, mask_T, eps=eps)
    return AdvantageResult(adv_T, returns_T)


# -- more estimators (each from its paper) --------------------------------------------------------

def reinforce_pp_baseline_advantages(**kwargs) -> AdvantageResult:
    """REINFORCE++-baseline (Hu 2025): the group mean subtracted from the outcome rewards, then the
    per-token returns whitened over the batch (:func:`reinforce_pp_advantages`, group_baseline)."""
    kwargs.setdefault("group_baseline", True)
    return reinforce_pp_advantages(**kwargs)


def _per_sequence(adv_N: torch.Tensor, mask_T: torch.Tensor, cu_seqlens_N1: torch.Tensor) -> AdvantageResult:
    adv_T = broadcast_to_tokens(adv_N, cu_seqlens_N1) * mask_T.to(adv_N.dtype)
    return AdvantageResult(adv_T, adv_T.clone())


def grpo_passk_advantages(
    *,
    rewards_N: torch.Tensor,
    cu_seqlens_N1: torch.Tensor,
    mask_T: torch.Tensor,
    group_ids_N: torch.Tensor,
    token_rewards_T: torch.Tensor | None = None,
    values_T: torch.Tensor | None = None,
) -> AdvantageResult:
    """Pass@k training: in each group only the best response gets an advantage, its score minus
    the second-best score (0 when two share the best score, or the group has one response); the
    first of equal scores counts as the best."""
    _validate(rewards_N, cu_seqlens_N1, mask_T, group_ids_N)
    scores_N = _sequence_scores(rewards_N, token_rewards_T, mask_T, cu_seqlens_N1)
    index_N, num_groups = group_index(group_ids_N)
    adv_N = torch.zeros_like(scores_N)
    for g in range(num_groups):
        members = torch.nonzero(index_N == g).flatten()
        if members.numel() < 2:
            continue
        top = torch.topk(scores_N[members], 2)
        best = members[int(torch.argmax(scores_N[members]))]   # argmax: the first of equal maxima
        adv_N[best] = top.values[0] - top.values[1]
    return _per_sequence(adv_N, mask_T, cu_seqlens_N1)


def opo_advantages(
    *,
    rewards_N: torch.Tensor,
    cu_seqlens_N1: torch.Tensor,
    mask_T: torch.Tensor,
    group_ids_N: torch.Tensor,
    token_rewards_T: torch.Tensor | None = None,
    values_T: torch.Tensor | None = None,
) -> AdvantageResult:
    """OPO (Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline"): the baseline of a group is
    its length-weighted mean score, b = sum_i L_i r_i / sum_i L_i (L_i: the response's masked-in
    tokens), the variance-minimising baseline when the gradient norm grows with length."""
    _validate(rewards_N, cu_seqlens_N1, mask_T, group_ids_N)
    scores_N = _sequence_scores(rewards_N, token_rewards_T, mask_T, cu_seqlens_N1)
    index_N, num_groups = group_index(group_ids_N)
    length_N = segment_sum(mask_T.to(scores_N.dtype), cu_seqlens_N1)
    weighted_G = torch.zeros(num_groups, dtype=scores_N.dtype).index_add(0, index_N, length_N * scores_N)
    length_G = torch.zeros(num_groups, dtype=scores_N.dtype).index_add(0, index_N, length_N)
    adv_N = scores_N - (weighted_G / length_G.clamp(min=1.0))[index_N]
    _, _, _, constant_G = _group_stats(scores_N, group_ids_N)
    adv_N = torch.where(constant_G[index_N], torch.zeros_like(adv_N), adv_N)
    return _per_sequence(adv_N, mask_T, cu_seqlens_N1)


def gpg_advantages(
    *,
    rewards_N: torch.Tensor,
    cu_seqlens_N1: torch.Tensor,
    mask_T: torch.Tensor,
    group_ids_N: torch.Tensor,
    token_rewards_T: torch.Tensor | None = None,
    values_T: torch.Tensor | None = None,
) -> AdvantageResult:
    """GPG (Chu et al. 2025): the group mean subtracted, no std division, times the paper's
    correction alpha = B / (B - M), B the batch's responses and M those of groups whose scores are
    all equal (their advantage is 0: without alpha they would dilute the batch's gradient)."""
    _validate(rewards_N, cu_seqlens_N1, mask_T, group_ids_N)
    scores_N = _sequence_scores(rewards_N, token_rewards_T, mask_T, cu_seqlens_N1)
    index_N, count_G, sum_G, constant_G = _group_stats(scores_N, group_ids_N)
    zero_N = constant_G[index_N]
    adv_N = torch.where(zero_N, torch.zeros_like(scores_N), scores_N - (sum_G / count_G)[index_N])
    valid = int((~zero_N).sum())
    alpha = scores_N.numel() / valid if valid else 1.0
    return _per_sequence(alpha * adv_N, mask_T, cu_seqlens_N1)


def remax_advantages(
    *,
    rewards_N: torch.Tensor,
    cu_seqlens_N1: torch.Tensor,
    mask_T: torch.Tensor,
    group_ids_N: torch.Tensor,
    baseline_rewards_N: torch.Tensor | None = None,
    token_rewards_T: torch.Tensor | None = None,
    values_T: torch.Tensor | None = None,
) -> AdvantageResult:
    """ReMax (Li et al. 2023): REINFORCE whose baseline is the reward of the greedy response to the
    same prompt, A_i = r_i - r(greedy of prompt i); ``baseline_rewards_N`` carries it per sequence
    (the trainer generates and scores one greedy response per prompt in the same step)."""
    _validate(rewards_N, cu_seqlens_N1, mask_T, group_ids_N)
    if baseline_rewards_N is None or baseline_rewards_N.shape != rewards_N.shape:
        raise ValueError("remax needs baseline_rewards_N, the greedy response's reward per sequence "
                         f"(shape {tuple(rewards_N.shape)}), got {None if baseline_rewards_N is None else tuple(baseline_rewards_N.shape)}")
    scores_N = _sequence_scores(rewards_N, token_rewards_T, mask_T, cu_seqlens_N1)
    return _per_sequence(scores_N - _float(baseline_rewards_N), mask_T, cu_seqlens_N1)


def optimal_token_baseline_advantages(
    *,
    rewards_N: torch.Tensor,
    cu_seqlens_N1: torch.Tensor,
    mask_T: torch.Tensor,
    group_ids_N: torch.Tensor,
    logprobs_T: torch.Tensor | None = None,
    sum_pi_squared_T: torch.Tensor | None = None,
    token_rewards_T: torch.Tensor | None = None,
    values_T: torch.Tensor | None = None,
    gamma: float = 1.0,
    eps: float = 1e-8,
) -> AdvantageResult:
    """Optimal Token Baseline (Li et al. 2026, arXiv 2602.07078): a baseline per response position
    t across the group, weighted by each response's accumulated "realized energy",
    B_t = sum_i G_t^i W_t^i / (sum_i W_t^i + eps) over the group's responses that reach position t,
    W_t = sum_{j <= t} (1 - 2 pi_j + sum_v pi_j(v)^2), G_t the return-to-go; A_t = G_t - B_t.
    pi_j: the sampling policy's probability of the sampled token (``logprobs_T``: vLLM's sample
    log-probs); ``sum_pi_squared_T`` = sum over the vocabulary of pi^2 at each position when the
    forward provides it, else pi_j^2 (its lower bound: exact for a one-hot distribution; megarl's
    forward does not return it yet). Without ``logprobs_T`` every token weighs 1 (W_t = t + 1), and
    B_t is the mean return-to-go of the group's responses at position t."""
    _validate(rewards_N, cu_seqlens_N1, mask_T, group_ids_N)
    returns_T = discounted_returns(outcome_to_token_rewards(rewards_N, mask_T, cu_seqlens_N1, token_rewards_T),
                                   mask_T, cu_seqlens_N1, gamma)
    mask_f = mask_T.to(returns_T.dtype)
    if logprobs_T is not None:
        _check_token_tensor("logprobs_T", logprobs_T, mask_T)
        pi_T = torch.exp(torch.nan_to_num(logprobs_T.detach().to(returns_T.dtype), nan=0.0))
        sq_T = pi_T**2 if sum_pi_squared_T is None else sum_pi_squared_T.detach().to(returns_T.dtype)
        energy_T = (1.0 - 2.0 * pi_T + sq_T).clamp(min=0.0)
    else:
        energy_T = torch.ones_like(mask_f)
    weight_NL = torch.cumsum(pad_by_seq(energy_T * mask_f, cu_seqlens_N1), dim=1)
    returns_NL = pad_by_seq(returns_T, cu_seqlens_N1)
    present_NL = pad_by_seq(mask_f, cu_seqlens_N1)
    index_N, num_groups = group_index(group_ids_N)
    length = returns_NL.shape[1]
    num_G = returns_NL.new_zeros(num_groups, length).index_add(0, index_N, returns_NL * weight_NL * present_NL)
    den_G = returns_NL.new_zeros(num_groups, length).index_add(0, index_N, weight_NL * present_NL)
    baseline_NL = (num_G / (den_G + eps))[index_N]
    adv_T = (returns_T - unpad_by_seq(baseline_NL, cu_seqlens_N1)) * mask_f
    return AdvantageResult(adv_T, returns_T)
