"""KL divergence to the reference policy: estimators, loss term, reward penalty, coefficient control.

With tokens sampled from the policy pi and log-ratio ``d = logp - ref_logp`` (per token), the
estimators of KL(pi || pi_ref) from Schulman, "Approximating KL divergence" (2020) are:
  k1 = d                         unbiased, high variance, can be negative
  k2 = d^2 / 2                   biased, low variance, >= 0
  k3 = exp(-d) - 1 + d           unbiased, low variance, >= 0 ("low_var_kl" in verl)
Two uses:
- as a loss term (GRPO style): :func:`kl_loss`, gradients through ``logprobs_T``. The gradient of
  k3 is not an unbiased KL gradient; it is kept as common practice (DeepSeekMath, verl).
- as a reward penalty (PPO/REINFORCE++ style, Ziegler et al. 2019): :func:`kl_reward_penalty`
  gives detached per-token rewards -beta * k, the ``token_rewards_T`` of an estimator.
The log-ratio is clamped to [-20, 20] before exp (k3), so a stray token cannot produce inf. The
coefficient beta comes from :class:`FixedKLController` or :class:`AdaptiveKLController`.
Shape legend: T packed response tokens, N1 = N + 1 sequence boundaries.
"""

from __future__ import annotations

from typing import Callable

import torch

from megarl.algorithms.losses import aggregate_loss
from megarl.algorithms.packed import masked_mean

__all__ = [
    "KL_ESTIMATORS",
    "kl_estimate",
    "kl_loss",
    "kl_reward_penalty",
    "FixedKLController",
    "AdaptiveKLController",
    "KL_CONTROLLERS",
    "build_kl_controller",
]

_LOG_RATIO_CLAMP = 20.0


def _k1(log_ratio_T: torch.Tensor) -> torch.Tensor:
    return log_ratio_T


def _k2(log_ratio_T: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_ratio_T**2


def _k3(log_ratio_T: torch.Tensor) -> torch.Tensor:
    d_T = log_ratio_T.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    # expm1 keeps the small-|d| case accurate (exp(-d) - 1 cancels to 0 and leaves -d < 0); the
    # clamp removes what rounding is left: k3 >= 0 holds exactly in real arithmetic.
    return (torch.expm1(-d_T) + d_T).clamp(min=0.0)


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_estimate(logprobs_T: torch.Tensor, ref_logprobs_T: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate of the given kind (k1, k2 or k3)."""
    try:
        estimator = KL_ESTIMATORS[kind]
    except KeyError:
        raise ValueError(f"unknown KL estimator {kind!r}; known: {sorted(KL_ESTIMATORS)}") from None
    if logprobs_T.shape != ref_logprobs_T.shape:
        raise ValueError(f"ref_logprobs_T shape {tuple(ref_logprobs_T.shape)} != logprobs_T shape {tuple(logprobs_T.shape)}")
    return estimator(logprobs_T - ref_logprobs_T.detach())


def kl_loss(
    logprobs_T: torch.Tensor,
    ref_logprobs_T: torch.Tensor,
    mask_T: torch.Tensor,
    cu_seqlens_N1: torch.Tensor,
    *,
    kind: str = "k3",
    agg_mode: str = "token-mean",
    **agg_options,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL loss term (multiply by beta and add to the policy loss); metrics hold ``kl``."""
    kl_T = kl_estimate(logprobs_T, ref_logprobs_T, kind)
    loss = aggregate_loss(kl_T, mask_T, cu_seqlens_N1, agg_mode, **agg_options)
    return loss, {"kl": loss.detach()}


def kl_reward_penalty(
    logprobs_T: torch.Tensor, ref_logprobs_T: torch.Tensor, mask_T: torch.Tensor, coef: float, *, kind: str = "k1"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token reward -coef * KL (detached, 0 outside the mask) and the masked mean KL (for a controller)."""
    kl_T = kl_estimate(logprobs_T.detach(), ref_logprobs_T, kind) * mask_T.to(logprobs_T.dtype)
    return -coef * kl_T, masked_mean(kl_T, mask_T)


class FixedKLController:
    """Constant KL coefficient."""

    def __init__(self, init_kl_coef: float):
        if init_kl_coef < 0:
            raise ValueError(f"init_kl_coef must be >= 0, got {init_kl_coef}")
        self.value = float(init_kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (kept so both controllers share one interface)."""


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. (2019), tracking ``target_kl`` over ``horizon`` samples:
    e = clip(KL / target - 1, -0.2, 0.2); beta <- beta * (1 + e * n_steps / horizon), n_steps the
    samples (or steps) since the last update."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        if init_kl_coef <= 0:
            raise ValueError(f"init_kl_coef must be > 0 for the adaptive controller, got {init_kl_coef}")
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


KL_CONTROLLERS = {"fixed": FixedKLController, "adaptive": AdaptiveKLController}


def build_kl_controller(kind: str = "fixed", **options) -> FixedKLController | AdaptiveKLController:
    """Build a KL controller by name: ``fixed(init_kl_coef)`` or ``adaptive(init_kl_coef, target_kl, horizon)``."""
    try:
        cls = KL_CONTROLLERS[kind]
    except KeyError:
        raise ValueError(f"unknown KL controller {kind!r}; known: {sorted(KL_CONTROLLERS)}") from None
    return cls(**options)
