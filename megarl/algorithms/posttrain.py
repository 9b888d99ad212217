"""The losses of ``megarl sft``, ``megarl rm`` and ``megarl dpo``, in :meth:`megarl.policy.PolicyModel.train_step`'s
convention: each micro-batch returns its share of the step loss (the step loss is the sum over
micro-batches and DP ranks), normalised by the step's global counts.

* SFT: negative log-likelihood of the response tokens (``mask_T`` when present), ``token-mean``
  (over the step's response tokens) or ``seq-mean-token-sum`` (each sequence's sum, averaged
  over the step's sequences).
* RM (Bradley-Terry): the sequences of a micro-batch come in pairs (chosen, rejected); with the
  scores ``r`` read at each sequence's last token, ``-log sigmoid(r_c - r_r - margin)`` averaged
  over the step's pairs (``margin`` 0 unless ``posttrain.margin``).
* DPO: pairs as for RM, through the causal LM; each response's log-probs summed (IPO: averaged)
  over its tokens, for the policy and for the frozen reference (``extras['ref_logprobs_R']``,
  computed on the same ranks before the step, or each sequence's sum ``extras['ref_logps_N']``,
  precomputed for the whole data set), then :func:`dpo_losses` averaged over the step's pairs.

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


def sequence_logps(logprobs_R: torch.Tensor, batch) -> torch.Tensor:
    """``[N]`` each sequence's response log-prob: the sum over its response tokens."""
    lengths = batch.cu_seqlens_N1.diff()
    index = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    return torch.zeros(len(lengths), dtype=logprobs_R.dtype).index_add(0, index, logprobs_R)


def dpo_losses(chosen_logratio, rejected_logratio, beta: float, loss: str = "sigmoid",
               label_smoothing: float = 0.0) -> torch.Tensor:
    """Per pair, with ``x = chosen_logratio - rejected_logratio`` (each ``log pi - log ref``; IPO:
    per response token): DPO's ``-(1 - eps) log sigmoid(beta x) - eps log sigmoid(-beta x)`` or
    IPO's ``(x - 1 / (2 beta))^2``."""
    x = chosen_logratio - rejected_logratio
    if loss == "ipo":
        return (x - 1 / (2 * beta)) ** 2
    return -(1 - label_smoothing) * F.logsigmoid(beta * x) - label_smoothing * F.logsigmoid(-beta * x)


def dpo_terms(logprobs_R: torch.Tensor, batch, beta: float, loss: str = "sigmoid", label_smoothing: float = 0.0,
              sft_weight: float = 0.0) -> tuple[torch.Tensor, dict]:
    """Per pair loss ``[P]`` of a micro-batch of (chosen, rejected) sequences, and its metric sums
    as TRL's DPOTrainer logs them (rewards/chosen and /rejected: beta x the summed log-ratio,
    /accuracies, /margins; logps/chosen and /rejected: the policy's summed log-probs; sums over
    pairs, with ``pairs``). IPO divides each log-ratio by its response's length, as TRL does."""
    policy = sequence_logps(logprobs_R, batch).view(-1, 2)
    ref = batch.extras.get("ref_logps_N")   # precomputed; else this step's reference pass
    ref = (ref.to(logprobs_R.dtype) if ref is not None else
           sequence_logps(batch.extras["ref_logprobs_R"].to(logprobs_R.dtype), batch)).view(-1, 2)
    ratio = policy - ref
    lengths = batch.cu_seqlens_N1.diff().view(-1, 2).to(ratio.dtype)
    scaled = ratio / lengths if loss == "ipo" else ratio
    losses = dpo_losses(scaled[:, 0], scaled[:, 1], beta, loss, label_smoothing)
    if sft_weight:   # the chosen response's mean token NLL
        losses = losses - sft_weight * policy[:, 0] / lengths[:, 0]
    rewards = (beta * ratio).detach().double()
    logps = policy.detach().double()
    return losses, {"rewards_chosen_sum": rewards[:, 0].sum(), "rewards_rejected_sum": rewards[:, 1].sum(),
                    "correct_sum": (rewards[:, 0] > rewards[:, 1]).double().sum(),
                    "margin_sum": (rewards[:, 0] - rewards[:, 1]).sum(), "logps_chosen_sum": logps[:, 0].sum(),
                    "logps_rejected_sum": logps[:, 1].sum(), "pairs": torch.tensor(float(len(losses))),
                    "loss_sum": losses.detach().double().sum()}


def dpo_loss(logprobs_R: torch.Tensor, batch, **options) -> tuple[torch.Tensor, dict]:
    """:func:`dpo_terms`' losses averaged over the step's pairs."""
    losses, sums = dpo_terms(logprobs_R, batch, **options)
    num_pairs = batch.num_global_sequences / 2 if batch.num_global_sequences else len(losses)
    return losses.sum() / num_pairs, sums


def make_loss_fn(stage: str, **options):
    """The ``loss_fn`` of a ``stage`` ('sft' with ``loss_agg``; 'rm' with ``use_margin``; 'dpo'
    with :func:`dpo_terms`' options)."""
    if stage == "sft":
        return lambda lp, batch: sft_loss(lp, batch, options.get("loss_agg", "token-mean"))
    if stage == "rm":
        return lambda scores, batch: bt_loss(scores, batch, options.get("use_margin", False))
    if stage == "dpo":
        return lambda lp, batch: dpo_loss(lp, batch, **options)
    raise ValueError(f"unknown post-training stage {stage!r}; expected 'sft', 'rm' or 'dpo'")


def eval_sums(stage: str, engine, micro_batches, **options) -> dict:
    """This rank's sums of the held-out loss and metrics over ``micro_batches`` (forward only);
    ``loss_sum`` is the loss summed per token (sft token-mean), per sequence (sft
    seq-mean-token-sum) or per pair (rm), with its count in ``count``."""
    out: dict = {}

    def add(d: dict) -> None:
        for k, v in d.items():
            out[k] = out.get(k, 0.0) + float(v)

    if stage == "dpo":
        for o, b in zip(engine.forward_logprobs(micro_batches), micro_batches):
            sums = dpo_terms(o.logprobs_R, b, **options)[1]
            add({**sums, "count": sums["pairs"]})
        return out
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
    if stage == "dpo" and sums.get("pairs"):
        n = sums["pairs"]
        m.update({f"{prefix}/rewards/chosen": sums["rewards_chosen_sum"] / n,
                  f"{prefix}/rewards/rejected": sums["rewards_rejected_sum"] / n,
                  f"{prefix}/rewards/accuracies": sums["correct_sum"] / n,
                  f"{prefix}/rewards/margins": sums["margin_sum"] / n,
                  f"{prefix}/logps/chosen": sums["logps_chosen_sum"] / n,
                  f"{prefix}/logps/rejected": sums["logps_rejected_sum"] / n})
    if stage == "rm" and sums.get("pairs"):
        n = sums["pairs"]
        mean = sums["score_sum"] / (2 * n)
        m.update({f"{prefix}/accuracy": sums["correct_sum"] / n, f"{prefix}/margin_mean": sums["margin_sum"] / n,
                  f"{prefix}/score_mean": mean,
                  f"{prefix}/score_std": max(0.0, sums["score_sq_sum"] / (2 * n) - mean ** 2) ** 0.5})
    return m
