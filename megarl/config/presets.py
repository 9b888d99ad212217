"""``algorithm.name`` as a preset: the values it gives the algorithm fields a recipe leaves unset.

The preset fields of :class:`megarl.config.schema.AlgorithmConfig` default to ``None`` ("from the
preset"); :func:`resolve_algorithm` fills them at load time, so the resolved config written to
the run folder shows the effective values, and a value the user sets always wins.

============  ============  ===========  ===============  =======================  =========  ========
name          advantage     policy_loss  norm_adv_by_std  loss_agg_mode            clip_high  DAPO
                                                                                               extras
============  ============  ===========  ===============  =======================  =========  ========
grpo          grpo          ppo          true             token-mean               0.2        off
drgrpo        drgrpo        ppo          false            seq-mean-token-sum-norm  0.2        off
dapo          grpo          ppo          true             token-mean               0.28       on
rloo          rloo          ppo          (n/a)            token-mean               0.2        off
reinforce_pp  reinforce_pp  ppo          (n/a)            token-mean               0.2        off
gspo          grpo          gspo         true             token-mean               4e-4       off
ppo           gae           ppo          (n/a)            token-mean               0.2        off
============  ============  ===========  ===============  =======================  =========  ========

"DAPO extras": ``dynamic_sampling`` and ``overlong_buffer`` (off: false and 0).

- DAPO (Yu et al. 2025) = clip-higher (0.28) + dynamic sampling + overlong reward shaping +
  token-level loss, and no KL term (``kl_coef`` defaults to 0 for every name). The overlong buffer
  defaults to a fifth of ``rollout.max_response_tokens`` (at least 1 token): the paper uses a
  4096-token buffer under a 20480-token limit.
- The clip range follows the policy loss, not the name: ``ppo`` clips token ratios at 0.2 / 0.2,
  ``gspo`` the sequence ratio at the GSPO paper's 3e-4 / 4e-4 (also with ``algorithm.name=grpo
  policy_loss=gspo``); DAPO's preset raises ``clip_high`` to 0.28 for its ppo loss.
- ``norm_adv_by_std`` is an option of the grpo / drgrpo estimators only ("n/a": left null). A
  field set where it would do nothing is an error naming it: ``norm_adv_by_std`` or
  ``critic_lr`` with an advantage that does not use it, ``dual_clip_c`` with the gspo loss, an
  ``overlong_buffer`` longer than the response limit.
- ``gspo`` keeps the token-mean aggregation it has always used here (the GSPO paper averages per
  sequence: set ``loss_agg_mode=seq-mean-token-mean``).
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
}
_COMMON = dict(norm_adv_by_std=True, loss_agg_mode="token-mean", dynamic_sampling=False, overlong_buffer=0)
# policy loss -> (clip_low, clip_high); any other loss (a dotted path) gets the ppo range
CLIP_RANGES = {"ppo": (0.2, 0.2), "gspo": (3e-4, 4e-4)}
# estimators that take the ``norm_by_std`` option
STD_NORMALISED_ADVANTAGES = ("grpo", "drgrpo")
PRESET_FIELDS = ("advantage", "policy_loss", "norm_adv_by_std", "loss_agg_mode", "clip_low", "clip_high",
                 "dynamic_sampling", "overlong_buffer")


def resolve_algorithm(algorithm, max_response_tokens: int):
    """A copy of ``algorithm`` (an :class:`AlgorithmConfig`) with every unset preset field filled
    from ``ALGORITHM_PRESETS[algorithm.name]``; explicit values are kept. Idempotent. Raises
    :class:`ConfigError` naming the key for combinations that would silently do nothing."""
    preset = {**_COMMON, **ALGORITHM_PRESETS[algorithm.name]}
    filled = {}
    for name in ("advantage", "policy_loss", "loss_agg_mode", "dynamic_sampling"):
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
    if resolved.dual_clip_c is not None and policy_loss == "gspo":
        raise invalid_value("algorithm.dual_clip_c", resolved.dual_clip_c,
                            "null with algorithm.policy_loss='gspo' (dual-clip applies to token ratios: ppo)")
    return resolved


def unresolved_fields(algorithm) -> list[str]:
    """The preset fields still unset (None) in ``algorithm`` (norm_adv_by_std only where it applies)."""
    missing = [name for name in PRESET_FIELDS if name != "norm_adv_by_std" and getattr(algorithm, name) is None]
    if algorithm.advantage in STD_NORMALISED_ADVANTAGES and algorithm.norm_adv_by_std is None:
        missing.append("norm_adv_by_std")
    return missing


