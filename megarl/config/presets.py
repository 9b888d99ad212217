"""``algorithm.name`` as a preset: the values it gives the algorithm fields a recipe leaves unset.

The preset fields of :class:`megarl.config.schema.AlgorithmConfig` default to ``None`` ("from the
preset"); :func:`resolve_algorithm` fills them from :data:`ALGORITHM_PRESETS` at load time, so the
resolved config in the run folder shows the effective values, and a value the user sets wins.
Formulas, papers, the options each reads and what each refuses: docs/algorithms.md.

- The clip range follows the policy loss, not the name (:data:`CLIP_RANGES`): ppo 0.2 / 0.2, gspo
  the paper's 3e-4 / 4e-4, cispo's IS weight in [0, 4] (no lower bound, as in MiniMax-M1),
  geo_mean +-0.4; dapo raises ``clip_high`` to 0.28 for its ppo loss. ``kl_coef`` is 0 for all.
- dapo's overlong buffer is a fifth of ``rollout.max_response_tokens`` (paper: 4096 of 20480).
- A field set where it would do nothing is an error naming it: ``norm_adv_by_std`` (grpo / drgrpo
  only) or ``critic_lr`` (gae only) with another advantage, ``dual_clip_c`` with a non-ppo loss,
  an ``overlong_buffer`` longer than the response limit.
- gspo aggregates with token-mean (the paper averages per sequence: ``seq-mean-token-mean``).
"""
from __future__ import annotations

import dataclasses

from megarl.config.errors import invalid_value


def default_overlong_buffer(max_response_tokens: int) -> int:
    """DAPO's soft-overlong buffer: a fifth of the response limit (paper: 4096 of 20480)."""
    return max(1, max_response_tokens // 5)


# name -> values of the preset fields (those left out take _COMMON's)
ALGORITHM_PRESETS: dict[str, dict] = {
    "grpo": dict(advantage="grpo", policy_loss="ppo"),
    "drgrpo": dict(advantage="drgrpo", policy_loss="ppo", norm_adv_by_std=False,
                   loss_agg_mode="seq-mean-token-sum-norm"),
    "dapo": dict(advantage="grpo", policy_loss="ppo", clip_high=0.28, dynamic_sampling=True,
                 overlong_buffer=default_overlong_buffer),
    "rloo": dict(advantage="rloo", policy_loss="ppo"),
    "reinforce_pp": dict(advantage="reinforce_pp", policy_loss="ppo"),
    "gspo": dict(advantage="grpo", policy_loss="gspo"),
    "ppo": dict(advantage="gae", policy_loss="ppo"),
    "reinforce_pp_baseline": dict(advantage="reinforce_pp_baseline", policy_loss="ppo"),
    "remax": dict(advantage="remax", policy_loss="ppo"),
    "gpg": dict(advantage="gpg", policy_loss="gpg"),
    "opo": dict(advantage="opo", policy_loss="ppo"),
    "cispo": dict(advantage="grpo", policy_loss="cispo"),
    "sapo": dict(advantage="grpo", policy_loss="sapo"),
    "gmpo": dict(advantage="grpo", policy_loss="geo_mean"),
    "clip_cov": dict(advantage="grpo", policy_loss="clip_cov"),
    "kl_cov": dict(advantage="grpo", policy_loss="kl_cov"),
    "grpo_passk": dict(advantage="grpo_passk", policy_loss="ppo"),
    "pf_ppo": dict(advantage="gae", policy_loss="ppo", sample_filter="best_worst"),
}
_COMMON = dict(norm_adv_by_std=True, loss_agg_mode="token-mean", dynamic_sampling=False, overlong_buffer=0,
               sample_filter="none")
# policy loss -> (clip_low, clip_high); any other loss (a dotted path) gets the ppo range
CLIP_RANGES = {"ppo": (0.2, 0.2), "gspo": (3e-4, 4e-4), "cispo": (1.0, 3.0), "geo_mean": (0.4, 0.4)}
# the built-in losses (a dotted-path loss gets the clip range and dual_clip_c like ppo)
POLICY_LOSS_NAMES = ("ppo", "gspo", "sapo", "cispo", "geo_mean", "clip_cov", "kl_cov", "gpg")
# estimators that take the ``norm_by_std`` option
STD_NORMALISED_ADVANTAGES = ("grpo", "drgrpo")
PRESET_FIELDS = ("advantage", "policy_loss", "norm_adv_by_std", "loss_agg_mode", "clip_low", "clip_high",
                 "dynamic_sampling", "overlong_buffer", "sample_filter")


def resolve_algorithm(algorithm, max_response_tokens: int):
    """A copy of ``algorithm`` (an :class:`AlgorithmConfig`) with every unset preset field filled
    from ``ALGORITHM_PRESETS[algorithm.name]``; explicit values are kept. Idempotent. Raises
    :class:`ConfigError` naming the key for combinations that would silently do nothing."""
    preset = {**_COMMON, **ALGORITHM_PRESETS[algorithm.name]}
    filled = {}
    for name in ("advantage", "policy_loss", "loss_agg_mode", "dynamic_sampling", "sample_filter"):
        if getattr(algorithm, name) is None:
            filled[name] = preset[name]
    advantage = filled.get("advantage", algorithm.advantage)
    policy_loss = filled.get("policy_loss", algorithm.policy_loss)
    if advantage in STD_NORMALISED_ADVANTAGES:
        if algorithm.norm_adv_by_std is None:
            filled["norm_adv_by_std"] = preset["norm_adv_by_std"]
    elif algorithm.norm_adv_by_std is not None:
        raise invalid_value("algorithm.norm_adv_by_std", algorithm.norm_adv_by_std,
                            f"null with algorithm.advantage={advantage!r} (only the "
                            f"{' and '.join(STD_NORMALISED_ADVANTAGES)} advantages divide by the group std)")
    low, high = CLIP_RANGES.get(policy_loss, CLIP_RANGES["ppo"])
    if algorithm.clip_low is None:
        filled["clip_low"] = low
    if algorithm.clip_high is None:   # dapo's clip-higher is for its own (ppo) loss
        filled["clip_high"] = preset.get("clip_high", high) if policy_loss == preset["policy_loss"] else high
    if algorithm.rollout_correction is None:   # load_config chooses by the dtype; built in code: none
        filled["rollout_correction"] = "none"
    if algorithm.overlong_buffer is None:
        buffer = preset["overlong_buffer"]   # a number, or a function of the response limit
        filled["overlong_buffer"] = buffer(max_response_tokens) if callable(buffer) else buffer
    resolved = dataclasses.replace(algorithm, **filled)
    if resolved.overlong_buffer > max_response_tokens:
        raise invalid_value("algorithm.overlong_buffer", resolved.overlong_buffer,
                            f"at most rollout.max_response_tokens={max_response_tokens} (the soft penalty "
                            "starts this many tokens before the limit)")
    if resolved.critic_lr is not None and advantage != "gae":
        raise invalid_value("algorithm.critic_lr", resolved.critic_lr,
                            f"null with algorithm.advantage={advantage!r} (only the gae advantage trains a critic)")
    if resolved.dual_clip_c is not None and policy_loss in POLICY_LOSS_NAMES and policy_loss != "ppo":
        raise invalid_value("algorithm.dual_clip_c", resolved.dual_clip_c,
                            f"null with algorithm.policy_loss={policy_loss!r} (dual-clip is an option of the ppo loss)")
    return resolved


def unresolved_fields(algorithm) -> list[str]:
    """The preset fields still unset (None) in ``algorithm`` (norm_adv_by_std only where it applies)."""
    missing = [name for name in PRESET_FIELDS if name != "norm_adv_by_std" and getattr(algorithm, name) is None]
    if algorithm.advantage in STD_NORMALISED_ADVANTAGES and algorithm.norm_adv_by_std is None:
        missing.append("norm_adv_by_std")
    return missing


