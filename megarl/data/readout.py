"""What the controller reads of a forward's per-token log-probs: per-sample sums, not tokens.

The readers of the policy's log-probs before its update -- the rollout-vs-train alarm, the
mismatch metrics ``rollout_corr/*``, ``actor/entropy``, the k1 ``actor/kl`` metric and the sample
log (``samples.jsonl``) -- need sums, maxima and counts per sample, never the tokens. A
:func:`sample_readout` holds them for one sample; :func:`readout_metrics` and
:func:`megarl.driver.loop.check_alarm` add up a step's.

Choices: the read-outs are computed on the training ranks, where the tokens are, and only they
come back: from the update's own forward when the step has no old-log-prob pass
(:func:`micro_batch_readouts`), else from that pass (:func:`old_pass_outputs`;
:func:`reference_pass_outputs` adds the k1 sums). :func:`controller_readouts` computes the same
read-outs in one process: the oracle the tests hold the ranks' numbers against. Sums are float64
whatever the log-probs' dtype; a mean is the step's sum over its count.
"""
from __future__ import annotations

import math

import torch

from megarl.algorithms.offpolicy import mismatch_from_sums, mismatch_sums
from megarl.data.batch import version_runs


def routing_sums(vllm_R: torch.Tensor, lp_R: torch.Tensor, miss_R: torch.Tensor,
                 versions_R: torch.Tensor | None = None, version: int | None = None) -> dict:
    """One sample's part of the routing/* metrics: ``tokens`` and ``disagree`` (response tokens,
    and those with at least one MoE layer routed differently: ``miss_R`` > 0), and [sum, count] of
    |vLLM - trainer| over the agreeing (``agree``) and disagreeing (``disagree_diff``) tokens, of
    the trained ``version`` only when ``versions_R`` is given (NaN where vLLM has no log-prob
    propagates, as a mean over them would)."""
    diff = (vllm_R.double() - lp_R.detach().double()).abs()
    bad = miss_R > 0
    out = {"tokens": bad.numel(), "disagree": int(bad.sum())}
    if version is not None and versions_R is not None:
        keep = versions_R == version
        diff, bad = diff[keep], bad[keep]
    out["agree"] = [float(diff[~bad].sum()), int((~bad).sum())]
    out["disagree_diff"] = [float(diff[bad].sum()), int(bad.sum())]
    return out


def sample_readout(lp_R: torch.Tensor, rollout_R: torch.Tensor, *, loss_mask_R: torch.Tensor | None = None,
                   versions_R: torch.Tensor | None = None, version: int | None = None,
                   entropy_R: torch.Tensor | None = None, ref_R: torch.Tensor | None = None,
                   mismatch: bool = False, weights_R: torch.Tensor | None = None,
                   keep_R: torch.Tensor | None = None) -> dict:
    """One sample's read-out. ``lp_R``: the trainer's log-probs of its response tokens;
    ``rollout_R``: vLLM's (float64, NaN where none: tokens the agent loop inserted);
    ``loss_mask_R``: the tokens that carry loss (default all); ``versions_R``: each token's policy
    version, and ``version``: the one being trained (the alarm counts only its tokens; without
    ``versions_R`` every token is of it); ``entropy_R``, ``ref_R``: the policy's entropy and the
    reference model's log-probs, when there are; ``mismatch``: also the sums of
    :func:`megarl.algorithms.offpolicy.mismatch_sums` over the tokens with a vLLM log-prob
    (``weights_R``: the rollout correction's weights; ``keep_R``: the tokens it keeps, default all
    of them when there are weights: token-level tis).

    Keys: ``tokens``; ``alarm``: [sum, count, max] of |vLLM - trainer| over the tokens with a
    vLLM log-prob of the trained version; ``sampled`` (loss-carrying tokens with a vLLM log-prob),
    ``sampled_max`` (their largest difference, None without) and ``runs`` (per run of equal
    versions, the mean difference over its sampled tokens, None without: the sample log);
    ``entropy`` and ``kl`` (sums of the entropy and of lp - ref), when given; ``mismatch``."""
    lp = lp_R.detach().double()
    rollout = rollout_R.double()
    diff = (rollout - lp).abs()
    has = ~diff.isnan()
    counted = has if versions_R is None or version is None else has & (versions_R == version)
    d = diff[counted]
    out = {"tokens": lp.numel(),
           "alarm": [float(d.sum()), d.numel(), float(d.max()) if d.numel() else math.nan]}
    sampled = has if loss_mask_R is None else has & loss_mask_R.bool()
    out["sampled"] = int(sampled.sum())
    out["sampled_max"] = float(diff[sampled].max()) if out["sampled"] else None
    runs = ([lp.numel()] if lp.numel() else []) if versions_R is None \
        else [count for _, count in version_runs(versions_R.tolist())]   # the sample log's runs
    out["runs"] = []
    for part, keep in zip(torch.split(diff, runs), torch.split(sampled, runs)):
        out["runs"].append(float(part[keep].sum()) / int(keep.sum()) if keep.any() else None)
    if entropy_R is not None:
        out["entropy"] = float(entropy_R.detach().double().sum())
    if ref_R is not None:
        out["kl"] = k1_sum(lp_R, ref_R)
    if mismatch:
        keep = keep_R if keep_R is not None else has if weights_R is not None else None
        out["mismatch"] = mismatch_sums(lp, torch.where(has, rollout, lp), has, keep, weights_R)
    return out


def k1_sum(lp_R: torch.Tensor, ref_R: torch.Tensor) -> float:
    """A sample's k1 KL sum, lp - ref over its tokens, the difference in the log-probs' dtype."""
    return float((lp_R.detach() - ref_R.to(lp_R.dtype)).double().sum())


def micro_batch_readouts(lp_R: torch.Tensor, entropy_R: torch.Tensor | None, batch, version: int | None,
                         weights_R: torch.Tensor | None = None, keep_R: torch.Tensor | None = None) -> list[dict]:
    """The read-outs of a training micro-batch's samples (the update's own forward: ``lp_R``,
    ``entropy_R`` packed in ``batch.cu_seqlens_N1``'s layout) from its extras
    (:func:`megarl.data.batch.micro_batches_for`): ``rollout_logprobs_T``, ``mask_T`` (the loss
    mask, with tis also the tokens with a vLLM log-prob), ``versions_T`` and ``ref_logprobs_T``
    when present; ``weights_R``: the rollout correction's weights (in-forward tis's, or an old
    pass's), ``keep_R`` the tokens it keeps.

    Without an old-log-prob pass (one update a step:
    :func:`megarl.config.passes.needs_old_logprob_pass`) each DP leader reads the update's own
    forward here: ``versions_T`` is there when some token is of another version than the one
    trained, ``ref_logprobs_T`` with a reference model."""
    ex, sizes = batch.extras, batch.response_lengths
    split = lambda t: torch.split(t.cpu(), sizes) if t is not None else [None] * len(sizes)   # noqa: E731
    columns = zip(split(lp_R), split(ex["rollout_logprobs_T"]), split(ex["mask_T"]), split(ex.get("versions_T")),
                  split(entropy_R), split(ex.get("ref_logprobs_T")), split(weights_R), split(keep_R))
    return [sample_readout(lp, rollout, loss_mask_R=mask, versions_R=versions, version=version, entropy_R=entropy,
                           ref_R=ref, mismatch=True, weights_R=weights, keep_R=keep)
            for lp, rollout, mask, versions, entropy, ref, weights, keep in columns]


def old_pass_outputs(lp_R: torch.Tensor, entropy_R: torch.Tensor | None, batch, version: int | None,
                     cfg_algorithm, miss_R: torch.Tensor | None = None) -> dict:
    """What a DP leader gives of an old-log-prob pass's micro-batch: the log-probs into the object store (``old_logprobs_T``: one object, a
    :class:`~megarl.data.store.Rows` per sample) and, per sample, the read-outs (the alarm, the
    sample log, ``actor/entropy``, and the mismatch sums of ``rollout_corr/*``). With a
    ``rollout_correction`` its weights and kept tokens are computed here, per sequence as on the
    controller (:func:`megarl.algorithms.offpolicy.correction_tensors`), and stored too
    (``is_weights_T`` in the log-probs' dtype, ``mask_T``). The micro-batch's extras: vLLM's
    ``rollout_logprobs_T``, the loss mask ``mask_T``, ``versions_T`` when some token is of another
    version than ``version``. ``miss_R``: the MoE layers per token whose routing differed from
    vLLM's (a routing comparison): each sample's ``routing`` sums
    (:func:`routing_sums`) instead of the tokens. The update's ranks fetch
    the stored tokens."""
    from megarl.algorithms.offpolicy import correction_tensors
    from megarl.data.store import put_rows

    sizes = batch.response_lengths
    lp = lp_R.detach().cpu()
    *_, weights_T, keep_T = correction_tensors(lp, batch.extras["rollout_logprobs_T"], batch.cu_seqlens_N1,
                                               cfg_algorithm)
    out = {"old_logprobs_T": put_rows(lp, sizes),
           "readouts": micro_batch_readouts(lp, entropy_R, batch, version, weights_T, keep_T)}
    if weights_T is not None:
        out.update(is_weights_T=put_rows(weights_T.to(lp.dtype), sizes), mask_T=put_rows(keep_T, sizes))
    if miss_R is not None:
        ex = batch.extras
        versions = torch.split(ex["versions_T"], sizes) if "versions_T" in ex else [None] * len(sizes)
        out["routing"] = [routing_sums(vllm, x, miss.cpu(), v, version) for vllm, x, miss, v in
                          zip(torch.split(ex["rollout_logprobs_T"], sizes), torch.split(lp, sizes),
                              torch.split(miss_R, sizes), versions)]
    return out


def reference_pass_outputs(ref_R: torch.Tensor, batch, with_kl: bool) -> dict:
    """What a DP leader gives of a reference pass's micro-batch: the log-probs into the object store (``ref_logprobs_T``) and, after an old pass
    (``with_kl``: its log-probs in the extras' ``old_logprobs_T``), each sample's k1 sum ``kl``
    (:func:`k1_sum`, as :func:`sample_readout`'s)."""
    from megarl.data.store import put_rows

    sizes = batch.response_lengths
    ref = ref_R.detach().cpu()
    out = {"ref_logprobs_T": put_rows(ref, sizes)}
    if with_kl:
        old = batch.extras["old_logprobs_T"]
        out["kl"] = [k1_sum(lp, r) for lp, r in zip(torch.split(old, sizes), torch.split(ref, sizes))]
    return out


def controller_readouts(rollout, lp: list, entropy: list | None, ref_lp: list | None,
                        version: int | None) -> list[dict]:
    """The read-outs of a step's samples from per-token tensors in this process (the oracle of
    :func:`old_pass_outputs`' read-outs, and what :func:`megarl.driver.loop.alarm_metrics` uses);
    the mismatch metrics come with :func:`megarl.algorithms.offpolicy.correct_rollout`."""
    out, vllm = [], rollout.vllm_logprobs()
    for i, lp_R in enumerate(lp):
        versions = rollout.token_versions[i] if rollout.token_versions else None
        out.append(sample_readout(
            lp_R, torch.tensor(vllm[i], dtype=torch.float64),
            loss_mask_R=rollout.loss_mask_T(i) if rollout.loss_masks else None,
            versions_R=versions.tensor(torch.long) if versions is not None else None, version=version,
            entropy_R=entropy[i] if entropy is not None else None, ref_R=ref_lp[i] if ref_lp is not None else None))
    return out


def forward_readout_inputs(rollout, version: int, tis_in_forward: bool) -> dict:
    """What the update's micro-batches carry for its ranks to read their own forward
    (:func:`micro_batch_readouts`), per sample: vLLM's log-probs ``rollout_logprobs_T`` (float64,
    NaN where none), ``versions_T`` (int32) only when some token is of another version than
    ``version`` (on-policy: nothing to send), and with token-level tis in the forward
    (:func:`megarl.config.passes.correction_in_forward`) ``mask_T``, the tokens it weighs. A
    sample whose engine put its log-probs into the object store (``Rollout.stored_logprobs``)
    sends the handle (:class:`megarl.data.store.Rows`: the rank fetches them)."""
    from megarl.data.store import Rows

    rollout_lp = [None if lp is None else torch.tensor(lp, dtype=torch.float64) for lp in rollout.sample_logprobs]
    out = {"rollout_logprobs_T": rollout_lp}
    if rollout.stored_logprobs:
        out["rollout_logprobs_T"] = [lp if h is None else Rows(h, 0, h.shape[0])
                                     for lp, h in zip(rollout_lp, rollout.stored_logprobs)]
    if tis_in_forward:   # NaN: the agent loop's inserted tokens (it keeps its copy); vLLM's own are finite
        out["mask_T"] = [~lp.isnan() if lp is not None else torch.ones(h.shape[0], dtype=torch.bool)
                         for lp, h in zip(rollout_lp, rollout.stored_logprobs or [None] * len(rollout))]
    if rollout.token_versions and any(vs.distinct() - {version} for vs in rollout.token_versions):
        out["versions_T"] = [vs.tensor(torch.int32) for vs in rollout.token_versions]
    return out


def readout_metrics(readouts: list[dict]) -> dict:
    """``rollout/logprob_diff_mean`` / ``_max`` (NaN when no token counts), ``actor/entropy``,
    ``actor/kl`` (k1, with a reference model) and, when the read-outs carry them, the mismatch
    metrics ``rollout_corr/*``, over a step's read-outs."""
    n = sum(r["alarm"][1] for r in readouts)
    out = {"rollout/logprob_diff_mean": sum(r["alarm"][0] for r in readouts) / n if n else math.nan,
           "rollout/logprob_diff_max": max(r["alarm"][2] for r in readouts if r["alarm"][1]) if n else math.nan}
    tokens = sum(r["tokens"] for r in readouts)
    if readouts and "entropy" in readouts[0]:
        out["actor/entropy"] = sum(r["entropy"] for r in readouts) / tokens if tokens else math.nan
    if readouts and "kl" in readouts[0]:
        out["actor/kl"] = sum(r["kl"] for r in readouts) / tokens if tokens else math.nan
    if readouts and "mismatch" in readouts[0]:
        out.update(mismatch_from_sums([r["mismatch"] for r in readouts]))
    return out


__all__ = ["sample_readout", "micro_batch_readouts", "controller_readouts", "forward_readout_inputs", "readout_metrics",
           "old_pass_outputs", "reference_pass_outputs"]
