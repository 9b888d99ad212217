"""The losses of ``megarl sft`` and ``megarl rm``, in :meth:`megarl.policy.PolicyModel.train_step`'s
convention: each micro-batch returns its share of the step loss (the step loss is the sum over
micro-batches and DP ranks), normalised by the step's global counts.

* SFT: negative log-likelihood of the response tokens (``mask_T`` when present), ``token-mean``
  (over the step's response tokens) or ``seq-mean-token-sum`` (each sequence's sum, averaged
  over the step's sequences).
* RM (Bradley-Terry): the sequences of a micro-batch come in pairs (chosen, rejected); with the
  scores ``r`` read at each sequence's last token, ``-log sigmoid(r_c - r_r - margin)`` averaged
  over the step's pairs (``margin`` 0 unless ``posttrain.margin``).

Metrics come as sums (``*_sum``) with their counts, so that the driver's ratios are exact over
micro-batches of different sizes (the engine averages every metric over micro-batches and DP
ranks alike: the common factor cancels).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megarl.algorithms.losses import aggregate_loss


def _mask(logprobs_R: torch.Tensor, batch) -> torch.Tensor:
    mask = batch.extras.get("mask_T")
    return torch.ones_like(logprobs_R, dtype=torch.bool) if mask is None else mask.bool()


def sft_loss(logprobs_R: torch.Tensor, batch, loss_agg: str = "token-mean") -> tuple[torch.Tensor, dict]:
    mask = _mask(logprobs_R, batch)
    loss = aggregate_loss(-logprobs_R, mask, batch.cu_seqlens_N1, loss_agg,
                          num_tokens=batch.num_global_tokens, num_seqs=batch.num_global_sequences)
    nll = (-logprobs_R.detach() * mask).sum()
    return loss, {"nll_sum": nll, "tokens": mask.sum().float()}


def pair_scores(scores_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) scores ``[P]`` of a micro-batch's ``[2P]`` sequence scores."""
    if scores_N.numel() % 2:
        raise ValueError(f"{scores_N.numel()} sequences in a reward-model micro-batch; expected pairs")
    pairs = scores_N.view(-1, 2)
    return pairs[:, 0], pairs[:, 1]


def bt_loss(scores_N: torch.Tensor, batch, use_margin: bool = False) -> tuple[torch.Tensor, dict]:
    chosen, rejected = pair_scores(scores_N)
    margin = batch.extras["margin_P"].to(chosen.dtype) if use_margin else torch.zeros_like(chosen)
    diff = chosen - rejected
    num_pairs = batch.num_global_sequences / 2 if batch.num_global_sequences else chosen.numel()
    loss = -F.logsigmoid(diff - margin).sum() / num_pairs
    return loss, pair_metrics(chosen.detach(), rejected.detach())


def pair_metrics(chosen: torch.Tensor, rejected: torch.Tensor) -> dict:
    """Sums over a micro-batch's pairs: correct orderings (a tie counts half), margins, scores and
    squared scores."""
    both = torch.cat([chosen, rejected]).double()
    return {"correct_sum": (chosen > rejected).double().sum() + 0.5 * (chosen == rejected).double().sum(), "margin_sum": (chosen - rejected).double().sum(),
            "pairs": torch.tensor(float(chosen.numel())), "score_sum": both.sum(), "score_sq_sum": (both ** 2).sum()}


def make_loss_fn(stage: str, **options):
    """The ``loss_fn`` of a ``stage`` ('sft' with ``loss_agg``; 'rm' with ``use_margin``)."""
    if stage == "sft":
        return lambda lp, batch: sft_loss(lp, batch, options.get("loss_agg", "token-mean"))
    if stage == "rm":
        return lambda scores, batch: bt_loss(scores, batch, options.get("use_margin", False))
    raise ValueError(f"unknown post-training stage {stage!r}; expected 'sft' or 'rm'")


def eval_sums(stage: str, engine, micro_batches, **options) -> dict:
    """This rank's sums of the held-out loss and metrics over ``micro_batches`` (forward only);
    ``loss_sum`` is the loss summed per token (sft token-mean), per sequence (sft
    seq-mean-token-sum) or per pair (rm), with its count in ``count``."""
    out: dict = {}

    def add(d: dict) -> None:
        for k, v in d.items():
            out[k] = out.get(k, 0.0) + float(v)

    if stage == "sft":
        agg = options.get("loss_agg", "token-mean")
        for o, b in zip(engine.forward_logprobs(micro_batches), micro_batches):
            mask = _mask(o.logprobs_R, b)
            nll = -o.logprobs_R.double() * mask
            seqs = len(b.input_ids)
            add({"nll_sum": nll.sum(), "tokens": mask.sum(), "sequences": seqs,
                 "loss_sum": nll.sum(), "count": mask.sum() if agg == "token-mean" else seqs})
        return out
    for scores, b in zip(engine.forward_scores(micro_batches), micro_batches):
        chosen, rejected = pair_scores(scores)
        margin = b.extras["margin_P"].double() if options.get("use_margin") else torch.zeros_like(chosen.double())
        add(pair_metrics(chosen, rejected))
        add({"loss_sum": -F.logsigmoid(chosen.double() - rejected.double() - margin).sum(), "count": chosen.numel()})
    return out


def summarize(stage: str, sums: dict, prefix: str) -> dict:
    """Metrics ``<prefix>/...`` from sums (a train step's averaged ones or :func:`eval_sums`')."""
    m = {}
    if "count" in sums and sums["count"]:
        m[f"{prefix}/loss"] = sums["loss_sum"] / sums["count"]
    if stage == "sft" and sums.get("tokens"):
        m[f"{prefix}/nll_per_token"] = sums["nll_sum"] / sums["tokens"]
    if stage == "rm" and sums.get("pairs"):
        n = sums["pairs"]
        mean = sums["score_sum"] / (2 * n)
        m.update({f"{prefix}/accuracy": sums["correct_sum"] / n, f"{prefix}/margin_mean": sums["margin_sum"] / n,
                  f"{prefix}/score_mean": mean,
                  f"{prefix}/score_std": max(0.0, sums["score_sq_sum"] / (2 * n) - mean ** 2) ** 0.5})
    return m
