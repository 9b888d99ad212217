"""Per-token log-probs (and entropy) of response tokens from packed THD micro-batches.

Algorithm
---------
1. **Pack** (:func:`pack_micro_batch`): the N sequences (prompt + response) of a micro-batch are
   packed into one THD row with :func:`megarl.data.packing.pack_sequences` (padding to the TP /
   2*cp*tp alignment; zig-zag CP split). The *labels* (next token of each position, within its
   sequence) are packed the same way, so a CP rank holding a chunk of a sequence also holds the
   labels of its tokens even when the next token sits on another rank.
2. **Vocab-parallel log-softmax** (:func:`vocab_parallel_logprobs`): logits stay split over the
   TP group ``[T, V/tp]``; the max, the sum of exp, the target logit and (for entropy) the sum of
   ``p * logit`` are all-reduced over TP. The full-vocabulary logits never exist on one rank.
   Reductions with autograd use megatron's ``reduce_from_tensor_model_parallel_region``
   (all-reduce forward, identity backward: every TP rank computes the same loss downstream).
3. **Gather CP shares** (:func:`gather_cp`): the per-token values of every CP rank are
   all-gathered and put back in sequence order. Backward keeps only this rank's share of the
   gradient (every CP rank computes the same loss from the gathered tensor, and DDP sums the
   shares), so the loss function sees whole sequences.
4. **Select response tokens**: the log-prob of token j is read at position j - 1; for a sequence
   with P prompt tokens and L tokens in all, positions P-1 .. L-2.

Shape legend: T packed tokens on this rank, Tf the full packed row, V vocabulary (V/tp local),
N sequences, N1 = N + 1, R packed response tokens (sum of response lengths).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from megarl.data.packing import gather_cp_shares, pack_sequences, packed_seq_params_kwargs, unpack_sequences


@dataclass
class SequenceBatch:
    """One micro-batch of sequences (prompt + response token ids) and per-response-token data.

    ``extras`` holds packed per-response-token tensors ``[R]`` (advantages, old log-probs, masks,
    ...) in the order of ``cu_seqlens_N1``; the engine does not read them, ``loss_fn`` does.
    ``num_global_tokens`` / ``num_global_sequences`` are filled by ``PolicyEngine.train_step``:
    the response-token and sequence counts of the whole step, summed over micro-batches and DP
    ranks; with ``extras['mask_T']``, the masked-in tokens and the sequences that have one.
    """

    input_ids: list
    """Per sequence, a 1-D int64 tensor of prompt + response token ids."""
    prompt_lengths: list
    """Per sequence, the number of prompt tokens (>= 1); the rest is the response."""
    extras: dict = field(default_factory=dict)
    num_global_tokens: Optional[int] = None
    num_global_sequences: Optional[int] = None
    routing: Optional[list] = None
    """MoE models: per sequence, an integer tensor ``[L, Lm, K]``: the experts each of its tokens
    was routed to in each MoE layer (the rollout engine's routing, or the trainer's own recorded
    one; -1 rows: unknown, the layer routes that token itself). :mod:`megarl.engine.replay`
    compares it with, or replays it in, the model's routing."""

    def __post_init__(self):
        if len(self.input_ids) != len(self.prompt_lengths) or not self.input_ids:
            raise ValueError(f"SequenceBatch: {len(self.input_ids)} sequences but "
                             f"{len(self.prompt_lengths)} prompt_lengths; expected equal and >= 1")
        for i, (ids, p) in enumerate(zip(self.input_ids, self.prompt_lengths)):
            if ids.dim() != 1 or not 1 <= p < ids.numel():
                raise ValueError(f"SequenceBatch: sequence {i} has {ids.numel()} tokens and prompt_length "
                                 f"{p}; expected 1 <= prompt_length < length (a non-empty response)")
        if self.routing is not None:
            if len(self.routing) != len(self.input_ids):
                raise ValueError(f"SequenceBatch: routing for {len(self.routing)} sequences, expected "
                                 f"{len(self.input_ids)}")
            for i, (ids, r) in enumerate(zip(self.input_ids, self.routing)):
                if r.dim() != 3 or r.shape[0] != ids.numel() or r.shape[1:] != self.routing[0].shape[1:]:
                    raise ValueError(f"SequenceBatch: sequence {i} has {ids.numel()} tokens and routing of shape "
                                     f"{tuple(r.shape)}; expected [{ids.numel()}, MoE layers, top-k], the same "
                                     "layers and top-k for every sequence")

    @property
    def response_lengths(self) -> list[int]:
        return [ids.numel() - p for ids, p in zip(self.input_ids, self.prompt_lengths)]

    @property
    def cu_seqlens_N1(self) -> torch.Tensor:
        """Cumulative response lengths (the layout of ``extras`` and of the returned log-probs)."""
        cu = torch.zeros(len(self.input_ids) + 1, dtype=torch.int64)
        cu[1:] = torch.tensor(self.response_lengths).cumsum(0)
        return cu

    @property
    def num_tokens(self) -> int:
        """All tokens (prompt + response) of the micro-batch."""
        return sum(ids.numel() for ids in self.input_ids)

    @property
    def num_response_tokens(self) -> int:
        return sum(self.response_lengths)


@dataclass
class PackedMicroBatch:
    """Model inputs for one micro-batch on this CP rank."""

    batch: SequenceBatch
    tokens_1T: torch.Tensor
    position_ids_1T: torch.Tensor
    labels_T: torch.Tensor
    packed_seq_params: Any
    cu_seqlens_N1: torch.Tensor
    cu_seqlens_padded_N1: torch.Tensor
    padding_mask_1T: torch.Tensor
    """True at alignment padding (kept out of MoE routing, aux and z losses)."""
    routing_T: Optional[torch.Tensor] = None
    """``batch.routing`` packed like the tokens, ``[T, Lm, K]`` int64 (-1 at padding)."""
    index: int = 0
    """Position of this micro-batch in the call (the replayer keeps per-micro-batch state)."""

    @property
    def num_packed_tokens(self) -> int:
        return self.tokens_1T.shape[1]


def pack_micro_batch(batch: SequenceBatch, tp: int, cp: int, cp_rank: int, sp: bool = False) -> PackedMicroBatch:
    """THD-pack a micro-batch for this CP rank (tokens, labels, positions, PackedSeqParams)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    # Without SP and CP, no alignment is needed (pad only for what the layout requires).
    align_tp = tp if (sp or cp > 1) else 1
    seqs = [ids.to(torch.int64) for ids in batch.input_ids]
    labels = [torch.cat([ids[1:], ids.new_zeros(1)]) for ids in seqs]
    tok = pack_sequences(seqs, tp=align_tp, cp=cp, cp_rank=cp_rank)
    lab = pack_sequences(labels, tp=align_tp, cp=cp, cp_rank=cp_rank)
    valid = pack_sequences([torch.ones(ids.numel(), dtype=torch.bool) for ids in seqs], tp=align_tp, cp=cp,
                           cp_rank=cp_rank, pad_value=False)
    params = PackedSeqParams(**packed_seq_params_kwargs(tok))
    routing = None
    if batch.routing is not None:
        routing = pack_sequences([r.to(torch.int64) for r in batch.routing], tp=align_tp, cp=cp, cp_rank=cp_rank,
                                 pad_value=-1).tokens_T
    return PackedMicroBatch(batch=batch, tokens_1T=tok.tokens_T[None], position_ids_1T=tok.position_ids_T[None],
                            labels_T=lab.tokens_T, packed_seq_params=params, cu_seqlens_N1=tok.cu_seqlens_N1,
                            cu_seqlens_padded_N1=tok.cu_seqlens_padded_N1, padding_mask_1T=~valid.tokens_T[None],
                            routing_T=routing)


def vocab_parallel_logprobs(logits_TV: torch.Tensor, labels_T: torch.Tensor, tp_group,
                            with_entropy: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """log p(label) and optionally the entropy per token from TP-split logits ``[T, V/tp]``.

    The vocabulary shard of TP rank r is ``[r * V/tp, (r + 1) * V/tp)`` (megatron's
    VocabParallelEmbedding / output layer). Computed in fp32.
    """
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    logits = logits_TV.float()
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    with torch.no_grad():
        max_T = logits.max(dim=-1).values
        if tp > 1:
            dist.all_reduce(max_T, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = logits - max_T[:, None]
    exp = shifted.exp()
    sum_exp_T = exp.sum(dim=-1)
    v_local = logits.shape[-1]
    start = (dist.get_rank(tp_group) if tp > 1 else 0) * v_local
    local_label = labels_T - start
    owned = (local_label >= 0) & (local_label < v_local)
    target_T = shifted.gather(1, local_label.clamp(0, v_local - 1)[:, None])[:, 0] * owned
    if with_entropy:
        p_logit_T = (exp * shifted).sum(dim=-1)
    if tp > 1:
        sum_exp_T = reduce_from_tensor_model_parallel_region(sum_exp_T, group=tp_group)
        target_T = reduce_from_tensor_model_parallel_region(target_T, group=tp_group)
        if with_entropy:
            p_logit_T = reduce_from_tensor_model_parallel_region(p_logit_T, group=tp_group)
    log_z_T = sum_exp_T.log()
    logprobs_T = target_T - log_z_T
    entropy_T = (log_z_T - p_logit_T / sum_exp_T) if with_entropy else None
    return logprobs_T, entropy_T


class _GatherCP(torch.autograd.Function):
    """All-gather equal-size shares over the CP group; backward returns this rank's slice."""

    @staticmethod
    def forward(ctx, x_T, group):
        ctx.group, ctx.rank, ctx.n = group, dist.get_rank(group), x_T.shape[0]
        parts = [torch.empty_like(x_T) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x_T.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n], None


def gather_cp(x_T: torch.Tensor, packed: PackedMicroBatch, cp_group) -> torch.Tensor:
    """This CP rank's per-token values ``[T]`` -> the full packed row ``[Tf]`` (sequence order)."""
    cp = dist.get_world_size(cp_group) if cp_group is not None else 1
    if cp == 1:
        return x_T
    flat = _GatherCP.apply(x_T, cp_group)
    shares = list(flat.split(x_T.shape[0]))
    return gather_cp_shares(shares, packed.cu_seqlens_padded_N1)


def select_response(full_Tf: torch.Tensor, packed: PackedMicroBatch) -> torch.Tensor:
    """Per-position values of the full row -> the values of the response tokens ``[R]``."""
    per_seq = unpack_sequences(full_Tf, packed.cu_seqlens_N1, packed.cu_seqlens_padded_N1)
    out = [x[p - 1:x.shape[0] - 1] for x, p in zip(per_seq, packed.batch.prompt_lengths)]
    return torch.cat(out)


def response_logprobs(logits_1TV: torch.Tensor, packed: PackedMicroBatch, pgs,
                      with_entropy: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Model output of one micro-batch -> (log-probs ``[R]``, entropy ``[R]`` or None)."""
    logprobs_T, entropy_T = vocab_parallel_logprobs(logits_1TV[0], packed.labels_T, pgs.tp, with_entropy)
    logprobs_R = select_response(gather_cp(logprobs_T, packed, pgs.cp), packed)
    entropy_R = select_response(gather_cp(entropy_T, packed, pgs.cp), packed) if with_entropy else None
    return logprobs_R, entropy_R
