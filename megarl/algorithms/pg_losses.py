"""More policy losses, each from its paper: SAPO, CISPO, GMPO (geo_mean), Clip-Cov, KL-Cov, GPG.

Same layout and registry signature as :mod:`megarl.algorithms.losses` (packed ``_T`` tensors,
``cu_seqlens_N1``, ``mask_T``; ``agg_mode``, ``num_tokens`` / ``num_seqs`` for the step's global
counts, ``entropy_T`` + ``entropy_coef``, ``is_weights_T`` of the rollout correction). r is the
token ratio pi / pi_old = exp(logp - logp_old) (log-ratio clamped to [-20, 20]), A the advantage.
Each function states its loss, its paper's settings and its metrics. Clip-Cov and KL-Cov act on
the per-token covariance (:func:`token_covariance`), which marks the tokens that drive entropy
collapse.

Shape legend: N sequences, T packed response tokens, N1 = N + 1.
"""
from __future__ import annotations

import torch

from megarl.algorithms.losses import _LOG_RATIO_CLAMP, _check_shapes, _finish, _ratio_metrics
from megarl.algorithms.packed import masked_mean, segment_count, segment_sum

__all__ = ["sapo_policy_loss", "cispo_policy_loss", "geo_mean_policy_loss", "clip_cov_policy_loss",
           "kl_cov_policy_loss", "gpg_policy_loss", "token_covariance"]


def _inputs(logprobs_T, old_logprobs_T, advantages_T, mask_T, cu_seqlens_N1, entropy_T, is_weights_T):
    """Shapes checked; (detached advantages, clamped log-ratio, ratio)."""
    _check_shapes(mask_T, cu_seqlens_N1, old_logprobs_T=old_logprobs_T, advantages_T=advantages_T,
                  logprobs_T=logprobs_T, entropy_T=entropy_T, is_weights_T=is_weights_T)
    log_ratio_T = (logprobs_T - old_logprobs_T.detach()).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return advantages_T.detach(), log_ratio_T, torch.exp(log_ratio_T)


def _weighted(loss_T, is_weights_T):
    return loss_T if is_weights_T is None else loss_T * is_weights_T.detach().to(loss_T.dtype)


def sapo_policy_loss(logprobs_T, old_logprobs_T, advantages_T, mask_T, cu_seqlens_N1, *, tau_pos: float = 1.0,
                     tau_neg: float = 1.05, agg_mode: str = "token-mean", entropy_T=None, entropy_coef: float = 0.0,
                     max_response_length=None, num_tokens=None, num_seqs=None, is_weights_T=None):
    """SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization"): a smooth gate instead of the hard
    clip, l = -A * f(r), f(r) = sigmoid(tau (r - 1)) * 4 / tau, tau = ``tau_pos`` for A > 0 and
    ``tau_neg`` for A < 0 (paper: 1.0 and 1.05). df/dr is 1 at r = 1 (the plain policy gradient
    on-policy) and decays as r leaves 1, faster for negative advantages. Metric ``gate_mean``: the
    mean df/dr over tokens."""
    advantages_T, log_ratio_T, ratio_T = _inputs(logprobs_T, old_logprobs_T, advantages_T, mask_T, cu_seqlens_N1,
                                                 entropy_T, is_weights_T)
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"sapo: tau_pos and tau_neg must be > 0, got {tau_pos}, {tau_neg}")
    tau_T = torch.where(advantages_T > 0, torch.full_like(ratio_T, tau_pos), torch.full_like(ratio_T, tau_neg))
    gate_T = torch.sigmoid(tau_T * (ratio_T - 1.0))
    loss_T = _weighted(-advantages_T * gate_T * 4.0 / tau_T, is_weights_T)
    metrics = _ratio_metrics(ratio_T, log_ratio_T, mask_T)
    metrics["gate_mean"] = masked_mean((4.0 * gate_T * (1.0 - gate_T)).detach(), mask_T)
    return _finish(loss_T, mask_T, cu_seqlens_N1, agg_mode, entropy_T, entropy_coef, max_response_length,
                   num_tokens, num_seqs, metrics)


def cispo_policy_loss(logprobs_T, old_logprobs_T, advantages_T, mask_T, cu_seqlens_N1, *,
                      clip_eps_low: float = 1.0, clip_eps_high: float | None = 3.0, agg_mode: str = "token-mean",
                      entropy_T=None, entropy_coef: float = 0.0, max_response_length=None, num_tokens=None,
                      num_seqs=None, is_weights_T=None):
    """CISPO (MiniMax-M1, 2025): l = -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * logp: the weight
    is clipped and detached, so every token keeps a gradient (PPO zeroes clipped tokens). The paper
    has no lower bound (``clip_eps_low`` = 1: weight >= 0). Metric ``clip_frac``: tokens whose
    weight was clipped."""
    advantages_T, log_ratio_T, ratio_T = _inputs(logprobs_T, old_logprobs_T, advantages_T, mask_T, cu_seqlens_N1,
                                                 entropy_T, is_weights_T)
    clip_eps_high = clip_eps_low if clip_eps_high is None else clip_eps_high
    if not (0.0 <= clip_eps_low <= 1.0 and clip_eps_high >= 0.0):
        raise ValueError(f"cispo: clip_eps_low must be in [0, 1] and clip_eps_high >= 0, got {clip_eps_low}, "
                         f"{clip_eps_high}")
    weight_T = ratio_T.detach().clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    loss_T = _weighted(-weight_T * advantages_T * logprobs_T, is_weights_T)
    metrics = _ratio_metrics(ratio_T, log_ratio_T, mask_T)
    metrics["clip_frac"] = masked_mean((weight_T != ratio_T.detach()).to(ratio_T.dtype), mask_T)
    return _finish(loss_T, mask_T, cu_seqlens_N1, agg_mode, entropy_T, entropy_coef, max_response_length,
                   num_tokens, num_seqs, metrics)


def geo_mean_policy_loss(logprobs_T, old_logprobs_T, advantages_T, mask_T, cu_seqlens_N1, *,
                         clip_eps_low: float = 0.4, clip_eps_high: float | None = 0.4, agg_mode: str = "token-mean",
                         entropy_T=None, entropy_coef: float = 0.0, max_response_length=None, num_tokens=None,
                         num_seqs=None, is_weights_T=None):
    """GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization"): l_i = -A_i * exp(mean_t s_t),
    s_t = min(log r_t, clip(log r_t, -eps_low, eps_high)) for A_i > 0 and max(...) for A_i < 0
    (paper: eps 0.4 both sides), averaged over sequences: a sequence-level objective, so
    ``agg_mode`` does not apply (``num_seqs`` does). Metric ``clip_frac``: tokens whose log-ratio
    was clipped."""
    advantages_T, log_ratio_T, ratio_T = _inputs(logprobs_T, old_logprobs_T, advantages_T, mask_T, cu_seqlens_N1,
                                                 entropy_T, is_weights_T)
    clip_eps_high = clip_eps_low if clip_eps_high is None else clip_eps_high
    if not (clip_eps_low > 0 and clip_eps_high > 0):
        raise ValueError(f"geo_mean: the log-space clip range must be > 0, got {clip_eps_low}, {clip_eps_high}")
    mask_f = mask_T.to(logprobs_T.dtype)
    clipped_T = log_ratio_T.clamp(-clip_eps_low, clip_eps_high)
    s_T = torch.where(advantages_T > 0, torch.minimum(log_ratio_T, clipped_T), torch.maximum(log_ratio_T, clipped_T))
    if is_weights_T is not None:   # a correction weight enters the product as its log
        s_T = s_T + torch.log(is_weights_T.detach().to(s_T.dtype).clamp(min=1e-30))
    count_N = segment_count(mask_T, cu_seqlens_N1).to(s_T.dtype)
    mean_s_N = segment_sum(s_T * mask_f, cu_seqlens_N1) / count_N.clamp(min=1.0)
    # the advantage of a sequence: that of its first masked-in token (constant within a sequence)
    adv_N = segment_sum(advantages_T * mask_f, cu_seqlens_N1) / count_N.clamp(min=1.0)
    loss_N = torch.where(count_N > 0, -adv_N * torch.exp(mean_s_N), torch.zeros_like(mean_s_N))
    denom = (count_N > 0).sum().clamp(min=1).to(s_T.dtype) if num_seqs is None else num_seqs
    pg_loss = loss_N.sum() / denom
    metrics = _ratio_metrics(ratio_T, log_ratio_T, mask_T)
    metrics["clip_frac"] = masked_mean((s_T.detach() != log_ratio_T.detach()).to(s_T.dtype), mask_T)
    metrics["pg_loss"] = pg_loss.detach()
    loss = pg_loss
    if entropy_T is not None:
        from megarl.algorithms.losses import aggregate_loss

        entropy = aggregate_loss(entropy_T, mask_T, cu_seqlens_N1, agg_mode, max_response_length=max_response_length,
                                 num_tokens=num_tokens, num_seqs=num_seqs)
        metrics["entropy"] = entropy.detach()
        if entropy_coef:
            loss = loss - entropy_coef * entropy
    return loss, metrics


def token_covariance(logprobs_T: torch.Tensor, advantages_T: torch.Tensor, mask_T: torch.Tensor) -> torch.Tensor:
    """(logp_t - mean logp) (A_t - mean A) over the masked tokens (0 outside the mask), detached."""
    lp, adv = logprobs_T.detach(), advantages_T.detach().to(logprobs_T.dtype)
    mask_f = mask_T.to(lp.dtype)
    return (lp - masked_mean(lp, mask_T)) * (adv - masked_mean(adv, mask_T)) * mask_f


def _selected_count(ratio: float, num_tokens: int, candidates: int) -> int:
    return min(candidates, max(1, int(ratio * num_tokens))) if candidates else 0


def clip_cov_policy_loss(logprobs_T, old_logprobs_T, advantages_T, mask_T, cu_seqlens_N1, *,
                         cov_clip_ratio: float = 2e-4, cov_low: float = 1.0, cov_high: float = 5.0,
                         generator: torch.Generator | None = None, agg_mode: str = "token-mean", entropy_T=None,
                         entropy_coef: float = 0.0, max_response_length=None, num_tokens=None, num_seqs=None,
                         is_weights_T=None):
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning Language Models"): -r A
    (no clip), with ``cov_clip_ratio`` x tokens (paper 2e-4, at least one when any qualifies) drawn
    at random (``generator``) from those with covariance in [``cov_low``, ``cov_high``] (paper 1
    and 5) cut from the gradient. Covariance means are over the micro-batch (the paper's over the
    batch). Metrics ``cov_selected_frac`` and ``cov_mean``."""
    advantages_T, log_ratio_T, ratio_T = _inputs(logprobs_T, old_logprobs_T, advantages_T, mask_T, cu_seqlens_N1,
                                                 entropy_T, is_weights_T)
    if not (0 < cov_clip_ratio <= 1 and cov_low < cov_high):
        raise ValueError(f"clip_cov: need 0 < cov_clip_ratio <= 1 and cov_low < cov_high, got {cov_clip_ratio}, "
                         f"[{cov_low}, {cov_high}]")
    cov_T = token_covariance(logprobs_T, advantages_T, mask_T)
    mask_b = mask_T.bool()
    candidates = torch.nonzero(mask_b & (cov_T >= cov_low) & (cov_T <= cov_high)).flatten()
    k = _selected_count(cov_clip_ratio, int(mask_b.sum()), candidates.numel())
    pick = candidates[torch.randperm(candidates.numel(), generator=generator)[:k]] if k else candidates[:0]
    cut_T = torch.zeros_like(mask_b).index_fill(0, pick, True)
    ratio_used_T = torch.where(cut_T, ratio_T.detach(), ratio_T)
    loss_T = _weighted(-advantages_T * ratio_used_T, is_weights_T)
    metrics = _ratio_metrics(ratio_T, log_ratio_T, mask_T)
    metrics["cov_selected_frac"] = masked_mean(cut_T.to(ratio_T.dtype), mask_T)
    metrics["cov_mean"] = masked_mean(cov_T, mask_T)
    return _finish(loss_T, mask_T, cu_seqlens_N1, agg_mode, entropy_T, entropy_coef, max_response_length,
                   num_tokens, num_seqs, metrics)


def kl_cov_policy_loss(logprobs_T, old_logprobs_T, advantages_T, mask_T, cu_seqlens_N1, *,
                       kl_cov_ratio: float = 2e-3, kl_cov_coef: float = 1.0, agg_mode: str = "token-mean",
                       entropy_T=None, entropy_coef: float = 0.0, max_response_length=None, num_tokens=None,
                       num_seqs=None, is_weights_T=None):
    """KL-Cov (Cui et al. 2025): -r A, plus ``kl_cov_coef`` x |log r| (paper 1) on the top
    ``kl_cov_ratio`` x tokens by covariance (paper 2e-3); |log r| is the per-token size of the KL
    between old and new policy on the sampled token. Metrics ``cov_selected_frac``, ``cov_mean``."""
    advantages_T, log_ratio_T, ratio_T = _inputs(logprobs_T, old_logprobs_T, advantages_T, mask_T, cu_seqlens_N1,
                                                 entropy_T, is_weights_T)
    if not (0 < kl_cov_ratio <= 1 and kl_cov_coef >= 0):
        raise ValueError(f"kl_cov: need 0 < kl_cov_ratio <= 1 and kl_cov_coef >= 0, got {kl_cov_ratio}, {kl_cov_coef}")
    cov_T = token_covariance(logprobs_T, advantages_T, mask_T)
    mask_b = mask_T.bool()
    masked_idx = torch.nonzero(mask_b).flatten()
    k = _selected_count(kl_cov_ratio, masked_idx.numel(), masked_idx.numel())
    top = masked_idx[torch.topk(cov_T[masked_idx], k).indices] if k else masked_idx[:0]
    sel_T = torch.zeros_like(mask_b).index_fill(0, top, True)
    loss_T = -advantages_T * ratio_T + torch.where(sel_T, kl_cov_coef * log_ratio_T.abs(), torch.zeros_like(ratio_T))
    loss_T = _weighted(loss_T, is_weights_T)
    metrics = _ratio_metrics(ratio_T, log_ratio_T, mask_T)
    metrics["cov_selected_frac"] = masked_mean(sel_T.to(ratio_T.dtype), mask_T)
    metrics["cov_mean"] = masked_mean(cov_T, mask_T)
    return _finish(loss_T, mask_T, cu_seqlens_N1, agg_mode, entropy_T, entropy_coef, max_response_length,
                   num_tokens, num_seqs, metrics)


def gpg_policy_loss(logprobs_T, old_logprobs_T, advantages_T, mask_T, cu_seqlens_N1, *, agg_mode: str = "token-mean",
                    entropy_T=None, entropy_coef: float = 0.0, max_response_length=None, num_tokens=None,
                    num_seqs=None, is_weights_T=None):
    """GPG (Chu et al. 2025): -A * logp, no ratio and no clip (pair it with the gpg advantage, which
    carries the paper's scaling)."""
    advantages_T, log_ratio_T, ratio_T = _inputs(logprobs_T, old_logprobs_T, advantages_T, mask_T, cu_seqlens_N1,
                                                 entropy_T, is_weights_T)
    loss_T = _weighted(-advantages_T * logprobs_T, is_weights_T)
    metrics = _ratio_metrics(ratio_T, log_ratio_T, mask_T)
    return _finish(loss_T, mask_T, cu_seqlens_N1, agg_mode, entropy_T, entropy_coef, max_response_length,
                   num_tokens, num_seqs, metrics)
