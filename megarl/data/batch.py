"""Rollout samples -> advantages -> per-DP-rank packed micro-batches, and back.

Legend: N samples (sequences), T packed response tokens of the whole step, R of a micro-batch.
"""
from __future__ import annotations

import inspect
import itertools
import math
from dataclasses import dataclass, field, fields
from typing import Any

import torch



STORED = ("stored_ids", "stored_logprobs")
""":class:`Rollout`'s per-sample object-store handles (None: inline)."""
SPARSE = STORED + ("texts", "digests")
""":class:`Rollout`'s per-sample fields that some samples may lack (None) and a rollout may lack
entirely (empty): the handles, and the metadata an engine sends in place of the ids."""


def response_length(sample: dict) -> int:
    """A sample's (a ``sample_fn``'s dict) response tokens: its ids, or without them (in the
    object store only: :func:`to_metadata`) its ``response_length``."""
    ids = sample["token_ids"]
    return len(ids) if ids is not None else int(sample["response_length"])


class TokenVersions:
    """The policy version that generated each token of one response, held as runs
    ``[[version, count], ...]``: one run for a sample generated in one call, one more per weight
    sync a resumed sample spans. This is what the controller keeps per sample instead of one int
    a token. It reads as the per-token sequence (``len``, iteration, indexing, ``==`` with a list);
    :meth:`min`, :meth:`distinct` and :meth:`tensor` read the runs."""

    __slots__ = ("runs",)
    __hash__ = None

    def __init__(self, runs=()):
        self.runs: list[list[int]] = []
        for version, count in runs:
            self.extend(version, count)

    @classmethod
    def of(cls, versions) -> "TokenVersions":
        """From per-token versions."""
        out = cls()
        for v in versions:
            out.extend(v, 1)
        return out

    def extend(self, version: int, count: int) -> None:
        """``count`` more tokens of ``version``."""
        if count <= 0:
            return
        if self.runs and self.runs[-1][0] == version:
            self.runs[-1][1] += count
        else:
            self.runs.append([int(version), int(count)])

    def copy(self) -> "TokenVersions":
        return TokenVersions(self.runs)

    def min(self) -> int:
        return min(v for v, _ in self.runs)

    def distinct(self) -> set[int]:
        return {v for v, _ in self.runs}

    def tensor(self, dtype=torch.long) -> torch.Tensor:
        """The per-token versions as a tensor."""
        if not self.runs:
            return torch.zeros(0, dtype=dtype)
        versions, counts = zip(*self.runs)
        return torch.repeat_interleave(torch.tensor(versions, dtype=dtype), torch.tensor(counts))

    def __len__(self) -> int:
        return sum(n for _, n in self.runs)

    def __bool__(self) -> bool:
        return bool(self.runs)

    def __iter__(self):
        for v, n in self.runs:
            yield from itertools.repeat(v, n)

    def __getitem__(self, i: int) -> int:
        i = i + len(self) if i < 0 else i
        for v, n in self.runs:
            if i < n:
                return v
            i -= n
        raise IndexError("token index out of range")

    def __eq__(self, other) -> bool:
        if isinstance(other, TokenVersions):
            return self.runs == other.runs
        try:
            return list(self) == list(other)
        except TypeError:
            return NotImplemented

    def __repr__(self) -> str:
        return f"TokenVersions({self.runs})"


@dataclass
class Rollout:
    """One step's samples, prompt-major: the n samples of prompt i are rows i*n .. i*n+n-1.

    Every field is a per-sample list; :meth:`select` and :meth:`concat` treat them all alike, so a
    new field stays aligned without touching either."""

    prompt_ids: list[list[int]]
    response_ids: list
    """Each sample's response token ids, or None for a sample whose engine put them into the
    object store and sent its metadata instead (``stored_ids``, ``texts``, ``digests``): read
    lengths with :meth:`response_lengths`, the ids themselves with :meth:`responses`."""
    sample_logprobs: list
    """vLLM's log-prob of each sampled token (for the rollout-vs-train alarm), or None for a
    sample whose engine put them into the object store and kept no copy for the controller
    (``stored_logprobs``; :meth:`vllm_logprobs` fetches them)."""
    group_ids: list[int]
    answers: list[str]
    clipped: list[bool]
    extras: list[dict[str, Any]] = field(default_factory=list)
    """The prompt row's keyword arguments for the reward function: ``data_source`` and the other
    columns (:class:`megarl.tasks.PromptRecord`); empty when the rollout was built without them."""
    rewards: list[float] = field(default_factory=list)
    sample_ids: list[str] = field(default_factory=list)
    """A unique name per sample, from its prompt's origin (:mod:`megarl.driver.modes`)."""
    token_versions: list[TokenVersions] = field(default_factory=list)
    """Per sample, the policy version (optimizer steps of the run) that generated each of its
    response tokens, as runs (:class:`TokenVersions`)."""
    routed_experts: list = field(default_factory=list)
    """MoE models with rollout.return_routing (or router_replay r3): per sample, the experts vLLM
    routed each prompt and response token to, int16 ``[P + R, Lm, K]`` (-1 rows: not computed,
    e.g. the last token); empty otherwise."""
    baseline_rewards: list[float] = field(default_factory=list)
    """algorithm.advantage=remax: per sample, the reward of the greedy response to its prompt
    (generated and scored in the same step, not trained on); empty otherwise."""
    reward_terms: list[dict] = field(default_factory=list)
    """A weighted-sum ``data.reward``: per sample, each rule term's raw reward by its label (the
    reward-model term's raw score too, once scored); empty otherwise."""
    loss_masks: list[list[bool]] = field(default_factory=list)
    """rollout.agent=tools: per response token, whether it carries loss (true: sampled by the
    model; false: inserted tool-result tokens, whose ``sample_logprobs`` are NaN); empty: every
    response token does."""
    stored_ids: list = field(default_factory=list)
    """Per sample, a handle on its token ids (prompt +
    response, int32) in Ray's object store, put by the engine that sampled it
    (:class:`megarl.data.store.Stored`; the micro-batches carry it and the ranks fetch it), or
    None (the ids go inline); empty: none stored."""
    stored_logprobs: list = field(default_factory=list)
    """The same for vLLM's log-probs of the response tokens (float64)."""
    texts: list = field(default_factory=list)
    """Per sample, its response decoded by the engine that sampled it (special tokens skipped,
    as the rewards read it), or None (the controller decodes the ids it holds); empty: none."""
    digests: list = field(default_factory=list)
    """Per sample, the engine's :func:`megarl.data.store.digest` of its response ids (distinct
    responses without the tokens), or None; empty: none."""

    @classmethod
    def from_generations(cls, prompt_ids, answers, generations, extras=None) -> "Rollout":
        """``extras``: one dict per prompt (default: none), repeated for each of its samples."""
        r = cls([], [], [], [], [], [])
        for i, (prompt, answer, samples) in enumerate(zip(prompt_ids, answers, generations)):
            prompt = list(prompt)   # one list a prompt, which its samples share (nothing writes into it)
            for s in samples:
                if s["token_ids"] is None and s.get("stored_ids") is None:
                    raise ValueError(f"a sample of prompt {i} has neither token_ids nor stored_ids")
                size = response_length(s)
                r.prompt_ids.append(prompt)
                r.response_ids.append(s["token_ids"])
                r.texts.append(s.get("text"))
                r.digests.append(s.get("digest"))
                r.sample_logprobs.append(s["logprobs"])
                r.group_ids.append(i)
                r.answers.append(answer)
                r.clipped.append(s["clipped"])
                if extras is not None:
                    r.extras.append(dict(extras[i]))
                if "loss_mask" in s:
                    if len(s["loss_mask"]) != size:
                        raise ValueError(f"a sample of prompt {i} has a loss_mask of {len(s['loss_mask'])} tokens "
                                         f"for {size} response tokens")
                    r.loss_masks.append(list(s["loss_mask"]))
                if "routed_experts" in s:
                    routing, rows = s["routed_experts"], len(prompt) + size
                    if routing.shape[0] != rows:
                        raise ValueError(f"a sample of prompt {i} has routed_experts for {routing.shape[0]} tokens, "
                                         f"expected {rows} (prompt + response)")
                    r.routed_experts.append(routing)
                if s["logprobs"] is None and s.get("stored_logprobs") is None:
                    raise ValueError(f"a sample of prompt {i} has neither logprobs nor stored_logprobs")
                for name, expect in (("stored_ids", len(prompt) + size), ("stored_logprobs", size)):
                    handle = s.get(name)
                    if handle is not None and tuple(handle.shape) != (expect,):
                        raise ValueError(f"a sample of prompt {i} has {name} of shape {tuple(handle.shape)}, "
                                         f"expected ({expect},)")
                    getattr(r, name).append(handle)
        for name in SPARSE:   # none given: empty, as every optional field
            if all(h is None for h in getattr(r, name)):
                getattr(r, name).clear()
        if r.loss_masks and len(r.loss_masks) != len(r):
            raise ValueError(f"{len(r.loss_masks)} of {len(r)} samples have a loss_mask; expected all "
                             "or none")
        if r.routed_experts and len(r.routed_experts) != len(r):
            raise ValueError(f"{len(r.routed_experts)} of {len(r)} samples have routed_experts; "
                             "expected all or none (every engine captures routing, or none)")
        return r

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def select(self, keep: list[int]) -> "Rollout":
        # an empty list (rewards before scoring, extras not given) stays empty
        return Rollout(**{f.name: [getattr(self, f.name)[i] for i in keep] if getattr(self, f.name) else []
                          for f in fields(Rollout)})

    def concat(self, other: "Rollout") -> "Rollout":
        """This rollout's samples, then ``other``'s (both scored, or both not)."""
        def joined(name: str) -> list:
            a, b = getattr(self, name), getattr(other, name)
            if name in SPARSE and bool(a) != bool(b):   # one part has them: None for the other's samples
                a, b = a or [None] * len(self), b or [None] * len(other)
            return a + b

        return Rollout(**{f.name: joined(f.name) for f in fields(Rollout)})

    def loss_mask_T(self, i: int) -> torch.Tensor:
        """Sample ``i``'s loss mask over its response tokens (all true without loss_masks)."""
        return _loss_mask(self.loss_masks[i] if self.loss_masks else None, self.response_length(i))

    def loss_mask_all_T(self) -> torch.Tensor:
        """Every sample's loss mask, packed in sample order."""
        return torch.cat([self.loss_mask_T(i) for i in range(len(self))])

    def cu_seqlens_N1(self) -> torch.Tensor:
        return _cu_seqlens(self.response_lengths())

    def response_length(self, i: int) -> int:
        """Sample ``i``'s response tokens: its ids here, or its stored ids' length less the prompt."""
        ids = self.response_ids[i]
        return len(ids) if ids is not None else int(self.stored_ids[i].shape[0]) - len(self.prompt_ids[i])

    def response_lengths(self) -> list[int]:
        return [self.response_length(i) for i in range(len(self))]

    def lengths(self) -> list[int]:
        """Prompt + response tokens of every sample."""
        return [len(p) + n for p, n in zip(self.prompt_ids, self.response_lengths())]

    def responses(self, indices: list[int] | None = None) -> list[list[int]]:
        """The response ids of samples ``indices`` (default: all): the controller's copy, or for
        the samples that have none here the engine's object (prompt + response), fetched in one
        ``ray.get``."""
        indices = range(len(self)) if indices is None else indices
        out = [self.response_ids[i] for i in indices]
        missing = [j for j, ids in enumerate(out) if ids is None]
        if missing:
            from megarl.data.store import fetch

            for j, t in zip(missing, fetch([self.stored_ids[indices[j]] for j in missing])):
                out[j] = t[len(self.prompt_ids[indices[j]]):].tolist()
        return out

    def response_digests(self) -> list[bytes]:
        """Every sample's :func:`megarl.data.store.digest`: the engine's, or of the ids here."""
        from megarl.data.store import digest

        return [self.digests[i] if self.digests and self.digests[i] is not None else digest(self.response_ids[i])
                for i in range(len(self))]

    def vllm_logprobs(self, indices: list[int] | None = None) -> list:
        """The vLLM log-probs of samples ``indices`` (default: all) as lists: the controller's copy,
        or for the samples that have none here (:attr:`sample_logprobs` None) the engine's object,
        fetched in one ``ray.get``."""
        out = list(self.sample_logprobs) if indices is None else [self.sample_logprobs[i] for i in indices]
        indices = range(len(self)) if indices is None else indices
        missing = [j for j, lp in enumerate(out) if lp is None]
        if missing:
            from megarl.data.store import fetch

            for j, t in zip(missing, fetch([self.stored_logprobs[indices[j]] for j in missing])):
                out[j] = t.tolist()
        return out

    def advantage_inputs(self, adv_fn) -> "AdvantageInputs":
        """What the estimator ``adv_fn`` reads of these samples (:func:`compute_advantages`):
        lengths, rewards, groups and masks, not the tokens; vLLM's log-probs only when it takes
        them (``logprobs_T``)."""
        with_logprobs = "logprobs_T" in inspect.signature(adv_fn).parameters
        return AdvantageInputs(self.rewards, self.group_ids, self.response_lengths(), self.loss_masks,
                               self.baseline_rewards, self.vllm_logprobs() if with_logprobs else [])


@dataclass
class AdvantageInputs:
    """A step's samples as the advantage estimators see them (:meth:`Rollout.advantage_inputs`):
    what a training rank needs to compute the advantages where the per-token inputs are
    (:func:`stored_advantages`) without the samples' tokens."""

    rewards: list[float]
    group_ids: list[int]
    response_lengths: list[int]
    loss_masks: list[list[bool]]
    """As :attr:`Rollout.loss_masks` (empty: every token carries loss)."""
    baseline_rewards: list[float]
    sample_logprobs: list[list[float]]
    """vLLM's log-probs, for an estimator that takes them (``logprobs_T``); else empty."""

    def cu_seqlens_N1(self) -> torch.Tensor:
        return _cu_seqlens(self.response_lengths)

    def loss_mask_all_T(self) -> torch.Tensor:
        return torch.cat([_loss_mask(self.loss_masks[i] if self.loss_masks else None, n)
                          for i, n in enumerate(self.response_lengths)])


def _cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.zeros(1, dtype=torch.long), torch.tensor(lengths, dtype=torch.long).cumsum(0)])


def _loss_mask(mask: list[bool] | None, length: int) -> torch.Tensor:
    return torch.tensor(mask, dtype=torch.bool) if mask is not None else torch.ones(length, dtype=torch.bool)


def compute_advantages(rollout: Rollout | AdvantageInputs, adv_fn, adv_opts: dict, token_rewards=None, values=None):
    """Per sample, the advantages and the returns of its response tokens.

    ``token_rewards`` (e.g. a KL penalty) and ``values`` (a critic's, for GAE) are per-sample
    lists of ``[R_i]`` tensors, or None.
    """
    if isinstance(rollout, Rollout):
        rollout = rollout.advantage_inputs(adv_fn)
    takes = inspect.signature(adv_fn).parameters
    cu = rollout.cu_seqlens_N1()
    cat = lambda xs: torch.cat([x.float() for x in xs]) if xs is not None else None   # noqa: E731
    extra = {"values_T": cat(values)} if values is not None else {}
    if "logprobs_T" in takes:          # the sampling policy's (vLLM's) log-probs, NaN where none
        extra["logprobs_T"] = torch.tensor([lp for s in rollout.sample_logprobs for lp in s], dtype=torch.float32)
    if "baseline_rewards_N" in takes and rollout.baseline_rewards:
        extra["baseline_rewards_N"] = torch.tensor(rollout.baseline_rewards, dtype=torch.float32)
    result = adv_fn(rewards_N=torch.tensor(rollout.rewards, dtype=torch.float32), cu_seqlens_N1=cu,
                    mask_T=rollout.loss_mask_all_T(),
                    group_ids_N=torch.tensor(rollout.group_ids),
                    token_rewards_T=cat(token_rewards), **extra, **adv_opts)
    return split_tokens(result.advantages_T, cu), split_tokens(result.returns_T, cu)


def advantage_metrics(rollout: Rollout | AdvantageInputs, advantages: list[torch.Tensor]) -> dict:
    """actor/adv_mean and actor/adv_abs_max over the loss-carrying tokens, and
    actor/adv_nonzero_frac: the share of samples with any non-zero advantage (pass@k GRPO: one per
    group; a constant group: none)."""
    adv = torch.cat([a.float() for a in advantages])[rollout.loss_mask_all_T()]
    if adv.numel() == 0:
        return {}
    return {"actor/adv_mean": float(adv.mean()), "actor/adv_abs_max": float(adv.abs().max()),
            "actor/adv_nonzero_frac": sum(bool((a != 0).any()) for a in advantages) / len(advantages)}


def critic_metrics(values: list, returns: list) -> dict:
    """Mean value and return, and the explained variance 1 - Var(R - V) / Var(R) of the rollout."""
    v, r = torch.cat(values).double(), torch.cat(returns).double()
    var_r = float(r.var(unbiased=False))
    return {"critic/values_mean": float(v.mean()), "critic/returns_mean": float(r.mean()),
            "critic/explained_variance": 1.0 - float((r - v).var(unbiased=False)) / var_r if var_r > 0 else math.nan}


def advantages_with_metrics(rollout: Rollout | AdvantageInputs, adv_fn, adv_opts: dict,
                            kl_coef: float | None = None, old_lp: list | None = None, ref_lp: list | None = None,
                            values: list | None = None) -> tuple[list, list, dict]:
    """Per sample, the advantages and returns (:func:`compute_advantages`), and their metrics
    (:func:`advantage_metrics`, with ``values`` also :func:`critic_metrics`). ``kl_coef``: a KL
    reward, -kl_coef * (old - ref) a token from ``old_lp`` and ``ref_lp``; ``values``: a critic's
    (GAE); per-sample tensors. The controller calls it, or a rank (:func:`stored_advantages`)."""
    kl_rewards = [-kl_coef * (a - b) for a, b in zip(old_lp, ref_lp)] if kl_coef is not None else None
    adv, returns = compute_advantages(rollout, adv_fn, adv_opts, kl_rewards, values)
    metrics = advantage_metrics(rollout, adv)
    if values is not None:
        metrics.update(critic_metrics(values, returns))
    return adv, returns, metrics


def stored_advantages(inputs: AdvantageInputs, adv_fn, adv_opts: dict, kl_coef: float | None = None,
                      old_lp: list | None = None, ref_lp: list | None = None, values: list | None = None) -> dict:
    """:func:`advantages_with_metrics` on a training rank, where the per-token inputs are:
    ``values`` and, with ``kl_coef``, ``old_lp`` and
    ``ref_lp`` are per-sample :class:`megarl.data.store.Rows`, fetched here in one ``ray.get``; the
    same function on the same bits as on the controller, so the same numbers.

    Returns ``advantages_T`` and ``returns_T`` (per sample, :class:`~megarl.data.store.Rows` of
    one object each, put by this process) and ``metrics`` (scalars): the tokens never reach the
    controller."""
    from megarl.data.store import fetch_rows, put_rows

    columns = {"values": values, **({"old_lp": old_lp, "ref_lp": ref_lp} if kl_coef is not None else {})}
    columns = {k: v for k, v in columns.items() if v is not None}
    flat, n = fetch_rows([r for rows in columns.values() for r in rows]), len(inputs.response_lengths)
    fetched = {k: flat[j * n:(j + 1) * n] for j, k in enumerate(columns)}
    adv, returns, metrics = advantages_with_metrics(inputs, adv_fn, adv_opts, kl_coef, **fetched)
    sizes = inputs.response_lengths
    return {"advantages_T": put_rows(torch.cat(adv), sizes), "returns_T": put_rows(torch.cat(returns), sizes),
            "metrics": metrics}


def split_tokens(values_T: torch.Tensor, cu_seqlens_N1: torch.Tensor) -> list[torch.Tensor]:
    return [values_T[int(a):int(b)] for a, b in zip(cu_seqlens_N1[:-1], cu_seqlens_N1[1:])]


def micro_batches_for(rollout: Rollout, plan, dp_rank: int, per_sample: dict[str, list[torch.Tensor]],
                      routing: list | None = None):
    """The engine's ``SequenceBatch`` list of one DP rank; ``per_sample`` values are [R_i] tensors,
    or a forward pass's outputs in the object store (:class:`megarl.data.store.Rows`: the micro-batch
    carries a :class:`~megarl.data.store.Column` the rank assembles); ``routing``: per sample
    ``[P + R, Lm, K]`` (``SequenceBatch.routing``), or None."""
    from megarl.data.store import Column, Rows, Stored
    from megarl.data.sequences import SequenceBatch

    out = []
    stored = rollout.stored_ids or [None] * len(rollout)
    for indices in plan.micro_batches[dp_rank]:
        # the engine's handle (the rank fetches the ids), or int32 on the wire (4 B a token through the controller,
        # not 8; vocabularies < 2**31): packed as int64
        ids = [stored[i] if stored[i] is not None else
               torch.tensor(rollout.prompt_ids[i] + rollout.response_ids[i], dtype=torch.int32) for i in indices]
        loss_mask = torch.cat([rollout.loss_mask_T(i) for i in indices])   # tool-result tokens: no loss
        extras = {}
        for k, v in per_sample.items():
            if any(isinstance(v[i], Rows) for i in indices):   # the rank assembles it (tensors pass as they are)
                extras[k] = Column([v[i] for i in indices], loss_mask if k == "mask_T" else None)
            else:
                extras[k] = torch.cat([v[i] for i in indices])
                if k == "mask_T":
                    extras[k] = extras[k] & loss_mask
        extras.setdefault("mask_T", loss_mask)
        # a Stored handle is fetched by the rank (megarl/data/store.py)
        mb_routing = [routing[i] if isinstance(routing[i], Stored) else torch.as_tensor(routing[i]) for i in indices] \
            if routing is not None else None
        out.append(SequenceBatch(ids, [len(rollout.prompt_ids[i]) for i in indices], extras, routing=mb_routing))
    return out


def scatter_back(rollout: Rollout, plan, outputs_per_rank: dict[int, list]) -> list[torch.Tensor]:
    """Per-micro-batch packed [R] outputs of every DP rank -> one [R_i] tensor per sample."""
    return scatter_sequences(rollout, plan, {
        dp_rank: [torch.split(packed_R, [rollout.response_length(i) for i in indices])
                  for indices, packed_R in zip(plan.micro_batches[dp_rank], outs)]
        for dp_rank, outs in outputs_per_rank.items()})


def scatter_sequences(rollout: Rollout, plan, outputs_per_rank: dict[int, list]) -> list:
    """Per-micro-batch lists of per-sequence outputs (one per sequence, any shape) of every DP
    rank -> one output per sample."""
    per_sample: list = [None] * len(rollout)
    for dp_rank, outs in outputs_per_rank.items():
        for indices, seqs in zip(plan.micro_batches[dp_rank], outs):
            for i, x in zip(indices, seqs):
                per_sample[i] = x
    missing = [i for i, v in enumerate(per_sample) if v is None]
    assert not missing, f"samples {missing[:5]} got no output"
    return per_sample


def version_runs(versions: list[int]) -> list[list[int]]:
    """``[[version, count], ...]``: the run-length form of a sample's per-token versions."""
    return TokenVersions.of(versions).runs
