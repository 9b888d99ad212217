"""From ``algorithm`` config to the advantage estimator and the engine's ``loss_fn``.

``algorithm.name`` is a preset resolved at load time (:mod:`megarl.config.presets`): the config
given here has ``advantage``, ``policy_loss``, the clip range, ``loss_agg_mode`` and (for the
grpo / drgrpo estimators) ``norm_adv_by_std`` set. Build one in code with
``megarl.config.presets.resolve_algorithm(AlgorithmConfig(...), max_response_tokens)``.

Legend: N sequences, T packed response tokens, N1 = N + 1.
"""
from __future__ import annotations

from megarl.config.passes import correction_in_forward
from megarl.config.presets import STD_NORMALISED_ADVANTAGES, unresolved_fields
from megarl.config.schema import AlgorithmConfig


def _check_resolved(cfg: AlgorithmConfig) -> None:
    missing = unresolved_fields(cfg)
    if missing:
        raise ValueError(f"AlgorithmConfig(name={cfg.name!r}) has preset fields still null: {', '.join(missing)}; "
                         "load it with megarl.config.load_config or pass it through "
                         "megarl.config.presets.resolve_algorithm")


def resolve(cfg: AlgorithmConfig):
    """(advantage fn, advantage options, policy-loss fn) for the configured algorithm."""
    from megarl.algorithms import get_advantage_estimator, get_policy_loss

    _check_resolved(cfg)
    adv_opts = {}
    if cfg.advantage in STD_NORMALISED_ADVANTAGES:
        adv_opts["norm_by_std"] = cfg.norm_adv_by_std
    if cfg.advantage in ("reinforce_pp", "reinforce_pp_baseline", "optimal_token_baseline"):
        adv_opts["gamma"] = cfg.gamma
    if needs_critic(cfg):
        adv_opts.update(gamma=cfg.gamma, lam=cfg.lam)
    return get_advantage_estimator(cfg.advantage), adv_opts, get_policy_loss(cfg.policy_loss)


def needs_critic(cfg: AlgorithmConfig) -> bool:
    """GAE advantages need a critic's per-token values."""
    _check_resolved(cfg)
    return cfg.advantage == "gae"


def loss_options(cfg: AlgorithmConfig) -> dict:
    """The options of the configured policy loss (each built-in loss takes only its own); a loss
    given by dotted path gets ppo's: the clip range and dual_clip_c."""
    clip = dict(clip_eps_low=cfg.clip_low, clip_eps_high=cfg.clip_high)
    own = {
        "gspo": clip, "cispo": clip, "geo_mean": clip,
        "sapo": dict(tau_pos=cfg.tau_pos, tau_neg=cfg.tau_neg),
        "clip_cov": dict(cov_clip_ratio=cfg.cov_clip_ratio, cov_low=cfg.cov_low, cov_high=cfg.cov_high),
        "kl_cov": dict(kl_cov_ratio=cfg.kl_cov_ratio, kl_cov_coef=cfg.kl_cov_coef),
        "gpg": {},
    }
    return own.get(cfg.policy_loss, dict(clip, dual_clip_c=cfg.dual_clip_c))


def micro_batch_generator(batch):
    """A torch.Generator seeded from the micro-batch's token ids: the same draws on every rank and
    at every layout that trains this micro-batch (clip_cov's random token choice), whatever order
    the micro-batches come in."""
    import zlib

    import torch

    crc = 0
    for ids in batch.input_ids:
        crc = zlib.crc32(ids.to(torch.int64).numpy().tobytes(), crc)
    return torch.Generator().manual_seed(crc)


def make_value_loss_fn(cfg: AlgorithmConfig, max_response_tokens: int):
    """``loss_fn(values_R, batch)`` for the critic's ``train_step``: clipped value loss towards
    ``extras['returns_T']`` around ``extras['old_values_T']`` (the rollout's values)."""
    from megarl.algorithms.losses import value_loss

    def loss_fn(values_R, batch):
        ex = batch.extras
        return value_loss(values_R, ex["old_values_T"], ex["returns_T"], ex["mask_T"], batch.cu_seqlens_N1,
                          clip_range=cfg.value_clip, agg_mode=cfg.loss_agg_mode,
                          max_response_length=max_response_tokens, num_tokens=batch.num_global_tokens,
                          num_seqs=batch.num_global_sequences)

    return loss_fn


def make_loss_fn(cfg: AlgorithmConfig, max_response_tokens: int, kl_coef: float = 0.0,
                 own_old_logprobs: bool = False):
    """``loss_fn(logprobs_R, batch) -> (loss, metrics)`` for :meth:`PolicyModel.train_step`.

    ``batch.extras`` holds ``old_logprobs_T`` (with ``own_old_logprobs``: absent, the old
    log-probs are the forward's own, ``logprobs_R.detach()``: ratio exactly 1, see
    :func:`needs_old_logprob_pass`), ``advantages_T``, ``mask_T``, with a KL loss
    ``ref_logprobs_T``, and with ``algorithm.rollout_correction`` ``is_weights_T`` (the importance
    weights of :func:`megarl.algorithms.offpolicy.correct_rollout`, multiplying the policy loss
    per token; its corrected ``mask_T`` leaves the dropped tokens out of the policy, entropy and
    KL terms and of the engine's global token count). With ``own_old_logprobs`` and token-level
    tis (:func:`correction_in_forward`) the weights are computed here (:func:`forward_tis_weights`)
    from the forward's own log-probs and vLLM's ``rollout_logprobs_T`` (float64, NaN where none;
    with ``own_old_logprobs`` the extras carry them in any case, for the ranks' read-outs:
    :mod:`megarl.data.readout`), as :func:`megarl.algorithms.offpolicy.correct_rollout`
    computes them from a separate pass. Denominators are the step's global counts, so micro-batch losses sum to
    the loss of the whole step.
    """
    from megarl.algorithms import kl_loss

    _, _, policy_loss = resolve(cfg)
    clip = loss_options(cfg)
    tis_in_forward = correction_in_forward(cfg)

    def loss_fn(logprobs_R, batch):
        ex, cu = batch.extras, batch.cu_seqlens_N1
        counts = dict(num_tokens=batch.num_global_tokens, num_seqs=batch.num_global_sequences,
                      max_response_length=max_response_tokens)
        # only when present: a policy loss given by dotted path need not know the option
        weights = {"is_weights_T": ex["is_weights_T"]} if "is_weights_T" in ex else {}
        if own_old_logprobs and tis_in_forward:   # token-level tis from this forward
            weights = {"is_weights_T": forward_tis_weights(cfg, logprobs_R, batch).to(logprobs_R.dtype)}
        old_T = logprobs_R.detach() if own_old_logprobs else ex["old_logprobs_T"]
        draws = {"generator": micro_batch_generator(batch)} if cfg.policy_loss == "clip_cov" else {}
        loss, metrics = policy_loss(logprobs_R, old_T, ex["advantages_T"], ex["mask_T"], cu,
                                    agg_mode=cfg.loss_agg_mode, entropy_T=ex.get("entropy_T"),
                                    entropy_coef=cfg.entropy_coef, **clip, **counts, **weights, **draws)
        metrics = dict(metrics)
        if kl_coef > 0 and cfg.kl_mode == "loss":
            kl, kl_metrics = kl_loss(logprobs_R, ex["ref_logprobs_T"], ex["mask_T"], cu, kind=cfg.kl_estimator,
                                     agg_mode=cfg.loss_agg_mode, **counts)
            loss = loss + kl_coef * kl
            metrics["kl"] = kl_metrics["kl"]
        return loss, metrics

    return loss_fn


def forward_tis_weights(cfg: AlgorithmConfig, logprobs_R, batch):
    """Token-level tis's weights min(pi_train / pi_vLLM, cap) (float64, detached) of a training
    forward's own log-probs ``logprobs_R`` against ``batch.extras['rollout_logprobs_T']`` (NaN
    where none) on ``extras['mask_T']``: what the loss weighs its tokens by
    (:func:`correction_in_forward`) and the mismatch metrics read (:mod:`megarl.data.readout`),
    as :func:`megarl.algorithms.offpolicy.correct_rollout` computes them from a separate pass."""
    import torch

    from megarl.algorithms.offpolicy import correction_weights

    ex = batch.extras
    train_T = logprobs_R.detach().double()
    rollout_T = ex["rollout_logprobs_T"].to(train_T.device, torch.float64)
    w_T, _ = correction_weights(train_T, torch.where(rollout_T.isnan(), train_T, rollout_T),
                                ex["mask_T"].to(train_T.device), batch.cu_seqlens_N1, mode="tis", cap=cfg.correction_cap)
    return w_T
