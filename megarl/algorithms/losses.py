"""Policy losses (PPO clip with clip-higher and dual-clip, GSPO), value loss, loss aggregation.

Layout: packed 1-D per-token tensors (``_T``) with ``cu_seqlens_N1`` and ``mask_T``, see
:mod:`megarl.algorithms.packed`. Every policy loss has the registry signature::

    fn(logprobs_T, old_logprobs_T, advantages_T, mask_T, cu_seqlens_N1, **options)
        -> (loss: 0-dim tensor, metrics: dict[str, 0-dim detached tensor])

Common options: ``agg_mode`` (:func:`aggregate_loss`), ``clip_eps_low`` / ``clip_eps_high``,
``entropy_T`` + ``entropy_coef`` (the loss gets ``- coef * agg(entropy_T)``), and ``num_tokens`` /
``num_seqs``: the step's global counts as aggregation denominators, so that the micro-batch losses
of a split step sum to the step's loss (verl's "global token" normalisation). ``is_weights_T``: the
detached per-token weights of the rollout correction (:mod:`megarl.algorithms.offpolicy`); tokens
it drops are left out of ``mask_T``. Log-ratios are clamped to [-20, 20] before exp.
Shape legend: N sequences, T packed response tokens, V vocabulary, N1 = N + 1.
"""

from __future__ import annotations

import torch

from megarl.algorithms.packed import check_cu_seqlens, masked_mean, segment_count, segment_sum, seq_index_T

__all__ = [
    "AGG_MODES",
    "aggregate_loss",
    "ppo_policy_loss",
    "gspo_policy_loss",
    "value_loss",
    "entropy_from_logits",
]

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
_LOG_RATIO_CLAMP = 20.0


def aggregate_loss(
    loss_T: torch.Tensor,
    mask_T: torch.Tensor,
    cu_seqlens_N1: torch.Tensor,
    agg_mode: str = "token-mean",
    *,
    max_response_length: int | None = None,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss l with mask m to a scalar with one of :data:`AGG_MODES`:
    ``token-mean`` = sum(l m) / sum(m); ``seq-mean-token-sum`` = mean over sequences of sum(l m);
    ``seq-mean-token-mean`` = mean over sequences of the per-sequence token mean;
    ``seq-mean-token-sum-norm`` (Dr.GRPO, Liu et al. 2025) = sum(l m) / (N * max_response_length),
    a constant normaliser with no length bias. The sequence means count only sequences with at
    least one masked-in token (an all-masked sequence would dilute the mean)."""
    mask_f = mask_T.to(loss_T.dtype)
    masked_T = loss_T * mask_f
    if agg_mode == "token-mean":
        denom = mask_f.sum().clamp(min=1.0) if num_tokens is None else num_tokens
        return masked_T.sum() / denom
    if agg_mode not in AGG_MODES:
        raise ValueError(f"unknown agg_mode {agg_mode!r}; known: {list(AGG_MODES)}")
    counts_N = segment_count(mask_T, cu_seqlens_N1).to(loss_T.dtype)
    seq_denom = (counts_N > 0).sum().clamp(min=1).to(loss_T.dtype) if num_seqs is None else num_seqs
    if agg_mode == "seq-mean-token-sum":
        return segment_sum(masked_T, cu_seqlens_N1).sum() / seq_denom
    if agg_mode == "seq-mean-token-mean":
        return (segment_sum(masked_T, cu_seqlens_N1) / counts_N.clamp(min=1.0)).sum() / seq_denom
    if max_response_length is None or max_response_length <= 0:
        raise ValueError(
            f"agg_mode 'seq-mean-token-sum-norm' needs max_response_length > 0, got {max_response_length!r}"
        )
    return masked_T.sum() / (seq_denom * max_response_length)


def _check_shapes(mask_T: torch.Tensor, cu_seqlens_N1: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    check_cu_seqlens(cu_seqlens_N1, num_tokens=mask_T.numel())
    for name, t in tensors.items():
        if t is not None and t.shape != mask_T.shape:
            raise ValueError(f"{name} must have the packed shape {tuple(mask_T.shape)}, got {tuple(t.shape)}")


def _check_eps(clip_eps_low: float, clip_eps_high: float | None) -> float:
    if clip_eps_high is None:
        clip_eps_high = clip_eps_low
    if not 0.0 <= clip_eps_low < 1.0:
        raise ValueError(f"clip_eps_low must be in [0, 1), got {clip_eps_low}")
    if clip_eps_high < 0.0:
        raise ValueError(f"clip_eps_high must be >= 0, got {clip_eps_high}")
    return clip_eps_high


def _ratio_metrics(ratio_T: torch.Tensor, log_ratio_T: torch.Tensor, mask_T: torch.Tensor) -> dict[str, torch.Tensor]:
    ratio_T, log_ratio_T = ratio_T.detach(), log_ratio_T.detach()
    mask_b = mask_T.bool()
    any_token = bool(mask_b.any())
    k3_T = (ratio_T - 1.0) - log_ratio_T
    zero = ratio_T.new_zeros(())
    return {
        "approx_kl": masked_mean(k3_T, mask_T),
        "ratio_mean": masked_mean(ratio_T, mask_T),
        "ratio_min": ratio_T[mask_b].min() if any_token else zero,
        "ratio_max": ratio_T[mask_b].max() if any_token else zero,
    }


def _finish(
    loss_T, mask_T, cu_seqlens_N1, agg_mode, entropy_T, entropy_coef, max_response_length, num_tokens, num_seqs, metrics
):
    agg = dict(max_response_length=max_response_length, num_tokens=num_tokens, num_seqs=num_seqs)
    pg_loss = aggregate_loss(loss_T, mask_T, cu_seqlens_N1, agg_mode, **agg)
    metrics["pg_loss"] = pg_loss.detach()
    loss = pg_loss
    if entropy_T is not None:
        entropy = aggregate_loss(entropy_T, mask_T, cu_seqlens_N1, agg_mode, **agg)
        metrics["entropy"] = entropy.detach()
        if entropy_coef:
            loss = loss - entropy_coef * entropy
    return loss, metrics


def ppo_policy_loss(
    logprobs_T: torch.Tensor,
    old_logprobs_T: torch.Tensor,
    advantages_T: torch.Tensor,
    mask_T: torch.Tensor,
    cu_seqlens_N1: torch.Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip_c: float | None = None,
    agg_mode: str = "token-mean",
    entropy_T: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    max_response_length: int | None = None,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    is_weights_T: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate per token (Schulman et al. 2017): r = exp(logp - logp_old),
    l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)); ``clip_eps_high=None`` means symmetric
    (= ``clip_eps_low``), separate epsilons are DAPO's clip-higher. Dual-clip (Ye et al. 2020,
    c > 1) further caps the loss of A < 0 tokens at -A c, so a huge ratio on a bad token cannot
    blow up the update. Metrics: ``clip_frac``, ``dual_clip_frac``, ``approx_kl`` (mean of k3 =
    (r - 1) - log r, Schulman's KL(old || new) estimate; verl reports the k1 mean) and
    ``ratio_mean/min/max`` over masked tokens."""
    _check_shapes(mask_T, cu_seqlens_N1, old_logprobs_T=old_logprobs_T, advantages_T=advantages_T, entropy_T=entropy_T,
                  logprobs_T=logprobs_T, is_weights_T=is_weights_T)
    clip_eps_high = _check_eps(clip_eps_low, clip_eps_high)
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1 (it caps negative-advantage losses at -A * c), got {dual_clip_c}")
    advantages_T = advantages_T.detach()
    log_ratio_T = (logprobs_T - old_logprobs_T.detach()).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio_T = torch.exp(log_ratio_T)
    unclipped_T = -advantages_T * ratio_T
    clipped_T = -advantages_T * torch.clamp(ratio_T, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    loss_T = torch.maximum(unclipped_T, clipped_T)
    metrics = _ratio_metrics(ratio_T, log_ratio_T, mask_T)
    metrics["clip_frac"] = masked_mean((clipped_T > unclipped_T).to(ratio_T.dtype).detach(), mask_T)
    if dual_clip_c is not None:
        cap_T = -advantages_T * dual_clip_c
        dual_T = (advantages_T < 0) & (loss_T > cap_T)
        loss_T = torch.where(advantages_T < 0, torch.minimum(loss_T, cap_T), loss_T)
        metrics["dual_clip_frac"] = masked_mean(dual_T.to(ratio_T.dtype).detach(), mask_T)
    if is_weights_T is not None:
        loss_T = loss_T * is_weights_T.detach().to(loss_T.dtype)
    return _finish(loss_T, mask_T, cu_seqlens_N1, agg_mode, entropy_T, entropy_coef, max_response_length, num_tokens, num_seqs, metrics)


def gspo_policy_loss(
    logprobs_T: torch.Tensor,
    old_logprobs_T: torch.Tensor,
    advantages_T: torch.Tensor,
    mask_T: torch.Tensor,
    cu_seqlens_N1: torch.Tensor,
    *,
    clip_eps_low: float = 3e-4,
    clip_eps_high: float | None = 4e-4,
    agg_mode: str = "seq-mean-token-mean",
    entropy_T: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    max_response_length: int | None = None,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    is_weights_T: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025): clip the length-normalised sequence ratio exp(mean_t log r_t)
    instead of token ratios, in the "GSPO-token" form s_i,t = sg[s_i] * pi_t / sg[pi_t] (the value
    s_i, and the gradient of the sequence-level objective when advantages are constant within a
    sequence). Dual-clip does not apply; the defaults are the paper's epsilons (3e-4 / 4e-4) and
    ``seq-mean-token-mean``."""
    _check_shapes(mask_T, cu_seqlens_N1, old_logprobs_T=old_logprobs_T, advantages_T=advantages_T, entropy_T=entropy_T,
                  logprobs_T=logprobs_T, is_weights_T=is_weights_T)
    clip_eps_high = _check_eps(clip_eps_low, clip_eps_high)
    advantages_T = advantages_T.detach()
    mask_f = mask_T.to(logprobs_T.dtype)
    token_log_ratio_T = logprobs_T - old_logprobs_T.detach()
    seq_log_ratio_N = segment_sum(token_log_ratio_T * mask_f, cu_seqlens_N1) / segment_count(mask_T, cu_seqlens_N1).clamp(min=1.0)
    # GSPO-token: value = sequence log-ratio, gradient = that of each token's own logprob.
    log_ratio_T = seq_log_ratio_N.detach()[seq_index_T(cu_seqlens_N1)] + logprobs_T - logprobs_T.detach()
    log_ratio_T = log_ratio_T.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio_T = torch.exp(log_ratio_T)
    unclipped_T = -advantages_T * ratio_T
    clipped_T = -advantages_T * torch.clamp(ratio_T, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    loss_T = torch.maximum(unclipped_T, clipped_T)
    metrics = _ratio_metrics(ratio_T, log_ratio_T, mask_T)
    metrics["clip_frac"] = masked_mean((clipped_T > unclipped_T).to(ratio_T.dtype).detach(), mask_T)
    if is_weights_T is not None:
        loss_T = loss_T * is_weights_T.detach().to(loss_T.dtype)
    return _finish(loss_T, mask_T, cu_seqlens_N1, agg_mode, entropy_T, entropy_coef, max_response_length, num_tokens, num_seqs, metrics)


def value_loss(
    values_T: torch.Tensor,
    old_values_T: torch.Tensor,
    returns_T: torch.Tensor,
    mask_T: torch.Tensor,
    cu_seqlens_N1: torch.Tensor,
    *,
    clip_range: float | None = 0.2,
    agg_mode: str = "token-mean",
    max_response_length: int | None = None,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss for the PPO critic, 0.5 * max((V - R)^2, (V_clip - R)^2) with
    V_clip = V_old + clamp(V - V_old, -clip, clip); ``clip_range=None`` disables clipping."""
    _check_shapes(mask_T, cu_seqlens_N1, values_T=values_T, old_values_T=old_values_T, returns_T=returns_T)
    returns_T, old_values_T = returns_T.detach(), old_values_T.detach()
    loss_T = (values_T - returns_T) ** 2
    metrics: dict[str, torch.Tensor] = {}
    if clip_range is not None:
        if clip_range <= 0:
            raise ValueError(f"clip_range must be > 0 or None, got {clip_range}")
        clipped_values_T = old_values_T + (values_T - old_values_T).clamp(-clip_range, clip_range)
        clipped_loss_T = (clipped_values_T - returns_T) ** 2
        metrics["vf_clip_frac"] = masked_mean((clipped_loss_T > loss_T).to(loss_T.dtype).detach(), mask_T)
        loss_T = torch.maximum(loss_T, clipped_loss_T)
    loss = 0.5 * aggregate_loss(
        loss_T, mask_T, cu_seqlens_N1, agg_mode, max_response_length=max_response_length, num_tokens=num_tokens, num_seqs=num_seqs
    )
    metrics["vf_loss"] = loss.detach()
    return loss, metrics


def entropy_from_logits(logits_TV: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax over the vocabulary per token: logsumexp(z) - sum(p z)."""
    logp_TV = torch.log_softmax(logits_TV.float(), dim=-1)
    return -(logp_TV.exp() * logp_TV).sum(dim=-1)
