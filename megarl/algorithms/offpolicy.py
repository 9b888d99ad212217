"""Rollout-training mismatch: importance weights, masks and metrics for samples the trainer did not draw.

A step's samples come from the rollout engine (vLLM), whose distribution mu differs from the
trained policy pi even with the same weights (other kernels, precision, reduction order) and more
so off-policy (``trainer.mode`` one_step_off / async). This is decoupled PPO (Hilton et al. 2022;
AReaL): the PPO ratio and its clip stay against the trainer's own proximal policy (its log-probs
recomputed before the update, ``old_logprobs_T``, by the same kernels as the update), and a
detached importance weight pi_prox / mu corrects the behaviour policy that drew the samples.

Methods (``algorithm.rollout_correction``, :func:`correction_weights`): ``tis`` (truncate the
weight at a cap), ``mask`` (drop tokens or sequences whose ratio leaves a band), ``icepop`` (weight
inside the band, drop outside), ``none``. Only the untruncated weight is unbiased, and its variance
is unbounded (a sequence's ratio grows exponentially with length); truncation and masking trade
bias for bounded variance, masking also giving no gradient to numerically broken tokens.
:func:`mismatch_metrics` shows how far apart the distributions are and how much each method drops.
Layout: packed 1-D per-token tensors (:mod:`megarl.algorithms.packed`); N sequences, T tokens.
"""

from __future__ import annotations

import math

import torch

from megarl.algorithms.packed import broadcast_to_tokens, check_cu_seqlens, segment_sum

__all__ = ["CORRECTION_MODES", "CORRECTION_LEVELS", "correction_weights", "mismatch_metrics", "mismatch_sums",
           "mismatch_from_sums", "correct_rollout", "correction_tensors"]

CORRECTION_MODES = ("none", "tis", "mask", "icepop")
CORRECTION_LEVELS = ("token", "sequence")
_LOG_RATIO_CLAMP = 20.0   # as in megarl.algorithms.losses: exp stays finite in fp32


def _log_ratio(train_logprobs_T: torch.Tensor, rollout_logprobs_T: torch.Tensor) -> torch.Tensor:
    if train_logprobs_T.shape != rollout_logprobs_T.shape:
        raise ValueError(f"rollout_logprobs_T must have the shape of train_logprobs_T {tuple(train_logprobs_T.shape)}, "
                         f"got {tuple(rollout_logprobs_T.shape)}")
    return (train_logprobs_T.detach() - rollout_logprobs_T.detach().to(train_logprobs_T.dtype))


def correction_weights(
    train_logprobs_T: torch.Tensor,
    rollout_logprobs_T: torch.Tensor,
    mask_T: torch.Tensor,
    cu_seqlens_N1: torch.Tensor,
    *,
    mode: str,
    level: str = "token",
    cap: float = 2.0,
    low: float = 0.5,
    high: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights_T, keep_T): detached per-token loss weights (dtype of ``train_logprobs_T``) and the
    corrected mask ``mask_T & kept`` (bool). Weights are 0 outside ``keep_T``. With
    w = exp(train - rollout) per token and, at ``sequence`` level, a sequence's ratio the product
    of its token ratios:

    - ``tis``: truncated IS (Yao et al. 2025, "Your efficient RL framework secretly brings you
      off-policy RL training"): weight min(w, ``cap``), per token or the sequence's on all its
      tokens; nothing is dropped.
    - ``mask``: rejection (sequence level: Liu et al. 2025, "When speed kills stability"): tokens
      or whole sequences whose ratio leaves [``low``, ``high``] are dropped, the rest weighted 1.
    - ``icepop``: IcePop (inclusionAI, Ring-1T, 2025): w inside [``low``, ``high``], dropped
      outside; token level only (a product of many token ratios almost never stays in a band).
    - ``none``: weight 1, nothing dropped.
    """
    if mode not in CORRECTION_MODES:
        raise ValueError(f"unknown rollout correction mode {mode!r}; known: {list(CORRECTION_MODES)}")
    if level not in CORRECTION_LEVELS:
        raise ValueError(f"unknown correction level {level!r}; known: {list(CORRECTION_LEVELS)}")
    if mode == "icepop" and level != "token":
        raise ValueError("icepop masks tokens: level must be 'token', got 'sequence'")
    if mode == "tis" and not cap > 0:
        raise ValueError(f"tis needs cap > 0, got {cap}")
    if mode in ("mask", "icepop") and not 0 < low < high:
        raise ValueError(f"{mode} needs a band 0 < low < high, got low={low}, high={high}")
    if mask_T.shape != train_logprobs_T.shape:
        raise ValueError(f"mask_T must have the packed shape {tuple(train_logprobs_T.shape)}, "
                         f"got {tuple(mask_T.shape)}")
    check_cu_seqlens(cu_seqlens_N1, num_tokens=mask_T.numel())
    mask_b = mask_T.bool()
    log_ratio_T = _log_ratio(train_logprobs_T, rollout_logprobs_T).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    if level == "sequence":
        seq_log_ratio_N = segment_sum(log_ratio_T * mask_b.to(log_ratio_T.dtype), cu_seqlens_N1)
        log_ratio_T = broadcast_to_tokens(seq_log_ratio_N.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP), cu_seqlens_N1)
    ratio_T = torch.exp(log_ratio_T)
    keep_T = mask_b
    if mode == "tis":
        weights_T = torch.exp(log_ratio_T.clamp(max=math.log(cap)))    # min(w, cap) without overflow
    elif mode in ("mask", "icepop"):
        keep_T = mask_b & (ratio_T >= low) & (ratio_T <= high)
        weights_T = ratio_T if mode == "icepop" else torch.ones_like(ratio_T)
    else:
        weights_T = torch.ones_like(ratio_T)
    return torch.where(keep_T, weights_T, torch.zeros_like(weights_T)), keep_T


def mismatch_metrics(
    train_logprobs_T: torch.Tensor,
    rollout_logprobs_T: torch.Tensor,
    mask_T: torch.Tensor,
    keep_T: torch.Tensor | None = None,
    weights_T: torch.Tensor | None = None,
) -> dict[str, float]:
    """How far the rollout's distribution is from the trainer's on the sampled tokens of ``mask_T``.

    ``rollout_corr/log_ratio_abs_mean`` / ``_max``: |log pi_train - log pi_rollout|;
    ``rollout_corr/k3_kl``: mean of k3 = (r - 1) - log r, r = pi_train / pi_rollout, an unbiased
    non-negative estimate of KL(rollout || train) from tokens the rollout sampled (the log-ratio
    clamped to [-20, 20] before exp); ``rollout_corr/masked_frac``: the fraction of ``mask_T``'s
    tokens that ``keep_T`` drops (0 without ``keep_T``); with ``weights_T``,
    ``rollout_corr/weight_mean`` / ``_max`` over the kept tokens. All 0 on an empty mask.
    The same as :func:`mismatch_from_sums` of the :func:`mismatch_sums` of parts of the tokens.
    """
    return mismatch_from_sums([mismatch_sums(train_logprobs_T, rollout_logprobs_T, mask_T, keep_T, weights_T)])


def mismatch_sums(
    train_logprobs_T: torch.Tensor,
    rollout_logprobs_T: torch.Tensor,
    mask_T: torch.Tensor,
    keep_T: torch.Tensor | None = None,
    weights_T: torch.Tensor | None = None,
) -> dict:
    """The sums, maxima and counts behind :func:`mismatch_metrics` (float64), for any part of a
    step's tokens (a sample: :mod:`megarl.data.readout`); :func:`mismatch_from_sums` adds parts up."""
    mask_b = mask_T.bool()
    log_ratio_T = _log_ratio(train_logprobs_T, rollout_logprobs_T).double()[mask_b]
    clamped = log_ratio_T.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    n = log_ratio_T.numel()
    out = {"n": n, "abs_sum": float(log_ratio_T.abs().sum()), "abs_max": float(log_ratio_T.abs().max()) if n else 0.0,
           "k3_sum": float((torch.expm1(clamped) - clamped).sum()),
           "dropped": int((mask_b & ~keep_T.bool()).sum()) if keep_T is not None else 0}
    if weights_T is not None:
        kept = weights_T.detach().double()[mask_b if keep_T is None else keep_T.bool()]
        out.update(w_n=kept.numel(), w_sum=float(kept.sum()), w_max=float(kept.max()) if kept.numel() else 0.0)
    return out


def mismatch_from_sums(parts: list[dict]) -> dict[str, float]:
    """:func:`mismatch_metrics` of the tokens of all ``parts`` (:func:`mismatch_sums` each)."""
    n = sum(p["n"] for p in parts)
    out = {"rollout_corr/log_ratio_abs_mean": 0.0, "rollout_corr/log_ratio_abs_max": 0.0,
           "rollout_corr/k3_kl": 0.0, "rollout_corr/masked_frac": 0.0}
    if n:
        out["rollout_corr/log_ratio_abs_mean"] = sum(p["abs_sum"] for p in parts) / n
        out["rollout_corr/log_ratio_abs_max"] = max(p["abs_max"] for p in parts if p["n"])
        out["rollout_corr/k3_kl"] = sum(p["k3_sum"] for p in parts) / n
        out["rollout_corr/masked_frac"] = sum(p["dropped"] for p in parts) / n
    weighted = [p for p in parts if "w_n" in p]
    if weighted:
        w_n = sum(p["w_n"] for p in weighted)
        out["rollout_corr/weight_mean"] = sum(p["w_sum"] for p in weighted) / w_n if w_n else 0.0
        out["rollout_corr/weight_max"] = max(p["w_max"] for p in weighted if p["w_n"]) if w_n else 0.0
    return out


def correct_rollout(train_lp: list[torch.Tensor], rollout_lp: list[list[float]], cfg_algorithm):
    """The driver's step: per-sample ``is_weights_T`` and corrected ``mask_T`` (bool) for the
    workers' micro-batches, and the mismatch metrics (always, also with ``rollout_correction``
    'none', which returns an empty dict of per-sample tensors).

    ``train_lp``: the trainer's log-probs of each sample's response tokens ([R_i] tensors);
    ``rollout_lp``: vLLM's of the same tokens; ``cfg_algorithm``: an
    :class:`megarl.config.schema.AlgorithmConfig` (its ``rollout_correction`` and
    ``correction_*`` fields). The base mask is every response token with a vLLM log-prob (the
    agent loop's inserted tool-result tokens have NaN: not sampled, no loss).
    """
    if len(train_lp) != len(rollout_lp):
        raise ValueError(f"{len(train_lp)} samples of trainer log-probs but {len(rollout_lp)} of rollout log-probs")
    for i, (t, r) in enumerate(zip(train_lp, rollout_lp)):
        if t.numel() != len(r):
            raise ValueError(f"sample {i}: {t.numel()} trainer log-probs but {len(r)} rollout log-probs "
                             "(expected one per response token)")
    lengths = [t.numel() for t in train_lp]
    cu_N1 = torch.tensor([0] + lengths).cumsum(0)
    train_T = torch.cat([t.detach().double().reshape(-1) for t in train_lp]) if train_lp else torch.zeros(0)
    rollout_T = torch.tensor([x for r in rollout_lp for x in r], dtype=torch.float64)
    train_T, rollout_T, mask_T, weights_T, keep_T = correction_tensors(train_T, rollout_T, cu_N1, cfg_algorithm)
    if weights_T is None:
        return {}, mismatch_metrics(train_T, rollout_T, mask_T)
    metrics = mismatch_metrics(train_T, rollout_T, mask_T, keep_T, weights_T)
    dtype = train_lp[0].dtype if train_lp else torch.float32
    # clones, not views: a pickled view (to the workers) would carry the whole step's storage
    per_sample = {"is_weights_T": [w.clone() for w in torch.split(weights_T.to(dtype), lengths)],
                  "mask_T": [k.clone() for k in torch.split(keep_T, lengths)]}
    return per_sample, metrics


def correction_tensors(train_T: torch.Tensor, rollout_T: torch.Tensor, cu_seqlens_N1: torch.Tensor, cfg_algorithm):
    """The per-token core of :func:`correct_rollout` for packed tensors (any set of whole
    sequences: a step's, or a training rank's micro-batch, with the same result per token):
    ``(train_T, rollout_T, mask_T, weights_T, keep_T)``, float64 log-probs with vLLM's NaNs (the
    tokens it did not sample: ``mask_T`` False) replaced by the trainer's, and the correction's
    weights (float64) and kept tokens, both None with ``rollout_correction`` 'none'."""
    train_T = train_T.detach().double()
    mask_T = ~torch.isnan(rollout_T)
    rollout_T = torch.where(mask_T, rollout_T.double(), train_T)   # unsampled tokens: ratio 1, masked out anyway
    a = cfg_algorithm
    if a.rollout_correction == "none":
        return train_T, rollout_T, mask_T, None, None
    weights_T, keep_T = correction_weights(train_T, rollout_T, mask_T, cu_seqlens_N1, mode=a.rollout_correction,
                                           level=a.correction_level, cap=a.correction_cap,
                                           low=a.correction_low, high=a.correction_high)
    return train_T, rollout_T, mask_T, weights_T, keep_T
