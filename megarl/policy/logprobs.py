"""Per-token log-probs (and entropy) of response tokens from packed THD micro-batches.

1. Pack (:func:`pack_micro_batch`): a micro-batch's sequences (prompt + response) go into one THD
   row (:func:`megarl.data.packing.pack_sequences`: TP / 2*cp*tp alignment, zig-zag CP split).
   The labels (next token within the sequence) are packed the same way, so a CP rank holding a
   chunk also holds its tokens' labels when the next token sits on another rank.
2. Vocab-parallel log-softmax, fused and chunked (:func:`vocab_parallel_logprobs`): the logits
   stay split over TP ``[T, V/tp]`` and are read a chunk at a time (:data:`CHUNK_BYTES`); nothing
   logits-sized is allocated but the gradient. No temperature is applied (the rollout's default 1.0,
   ``RolloutConfig.temperature``).
3. Gather CP shares (:func:`gather_cp`) back into sequence order; backward keeps this rank's share
   (every CP rank computes the same loss from the gathered tensor and DDP sums the shares), so
   the loss function sees whole sequences.
4. Select response tokens: token j's log-prob is read at position j - 1.

Shape legend: T packed tokens on this rank, Tf the full packed row, V vocabulary (V/tp local),
N sequences, N1 = N + 1, R packed response tokens (sum of response lengths).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from megarl.data.packing import (gather_cp_shares, pack_sequences, packed_seq_params_kwargs, padded_length,
                                 unpack_sequences)
from megarl.data.sequences import SequenceBatch


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
    response_positions_R: Optional[torch.Tensor] = None
    """When set (:class:`megarl.policy.schedule.MicroBatchRunner` at cp = 1 and no sequence-parallel
    output layer): the positions of the packed row whose next-token logits are read, the output
    layer computes only these, and :func:`response_logprobs` gets logits ``[1, R, V/tp]``."""

    @property
    def num_packed_tokens(self) -> int:
        return self.tokens_1T.shape[1]


@dataclass
class LogprobOutput:
    """Response-token log-probs of one micro-batch (layout of ``batch.cu_seqlens_N1``)."""

    logprobs_R: torch.Tensor
    entropy_R: Optional[torch.Tensor]
    cu_seqlens_N1: torch.Tensor
    routing_miss_R: Optional[torch.Tensor] = None
    """routing ``compare`` / ``replay``: per response token, the MoE layers whose own routing
    differed from the given one (:meth:`megarl.policy.replay.RouterReplayer.token_misses`)."""
    routing: Optional[list] = None
    """routing ``record``: per sequence, the routing the layers chose ``[L, Lm, K]``."""


def _align_tp(tp: int, cp: int, sp: bool) -> int:
    """The TP factor of the per-sequence alignment: without SP and CP no alignment is needed
    (pad only for what the layout requires)."""
    return tp if (sp or cp > 1) else 1


def packed_length(batch: SequenceBatch, tp: int, cp: int, sp: bool = False) -> int:
    """Tokens of the full packed row (before the CP split) :func:`pack_micro_batch` builds."""
    return sum(padded_length(ids.numel(), _align_tp(tp, cp, sp), cp) for ids in batch.input_ids)


def pack_micro_batch(batch: SequenceBatch, tp: int, cp: int, cp_rank: int, sp: bool = False,
                     pad_to: Optional[int] = None) -> PackedMicroBatch:
    """THD-pack a micro-batch for this CP rank (tokens, labels, positions, PackedSeqParams);
    ``pad_to``: the full row's length (see :func:`megarl.data.packing.pack_sequences`)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    kw = dict(tp=_align_tp(tp, cp, sp), cp=cp, cp_rank=cp_rank, pad_to=pad_to)
    seqs = [ids.to(torch.int64) for ids in batch.input_ids]
    labels = [torch.cat([ids[1:], ids.new_zeros(1)]) for ids in seqs]
    tok = pack_sequences(seqs, **kw)
    lab = pack_sequences(labels, **kw)
    valid = pack_sequences([torch.ones(ids.numel(), dtype=torch.bool) for ids in seqs], pad_value=False, **kw)
    params = PackedSeqParams(**packed_seq_params_kwargs(tok))
    routing = None
    if batch.routing is not None:
        routing = pack_sequences([r.to(torch.int64) for r in batch.routing], pad_value=-1, **kw).tokens_T
    return PackedMicroBatch(batch=batch, tokens_1T=tok.tokens_T[None], position_ids_1T=tok.position_ids_T[None],
                            labels_T=lab.tokens_T, packed_seq_params=params, cu_seqlens_N1=tok.cu_seqlens_N1,
                            cu_seqlens_padded_N1=tok.cu_seqlens_padded_N1, padding_mask_1T=~valid.tokens_T[None],
                            routing_T=routing)


CHUNK_BYTES = {"cpu": 2 * 2 ** 20, "cuda": 256 * 2 ** 20}
"""Per device type, the size of each of the <= 2 fp32 working buffers ``[C, V/tp]`` of
:func:`vocab_parallel_logprobs`: C = bytes / (4 V/tp) tokens per chunk. CPU: small enough to stay
in cache (10 tokens at V = 49152; measured on the 2-core EPYC, 1 thread, 2048 x 49152: 0.5-2 MiB
0.30 s per log-prob pass, 8-32 MiB 0.48 s); the Python loop costs little next to each chunk's
~0.5M elements. GPU: large chunks (kernel launches)."""


def _chunk_tokens(v_local: int, chunk_tokens: Optional[int], device: torch.device) -> int:
    if chunk_tokens is not None:
        if chunk_tokens < 1:
            raise ValueError(f"vocab_parallel_logprobs: chunk_tokens={chunk_tokens}; expected >= 1")
        return chunk_tokens
    budget = CHUNK_BYTES.get(device.type, CHUNK_BYTES["cuda"])
    return max(1, budget // (4 * max(1, v_local)))


class _FusedVocabParallelLogprobs(torch.autograd.Function):
    """log p(label) and entropy from TP-split logits, a chunk of tokens at a time.

    Forward reads ``[chunk, V/tp]`` of the logits at a time into fp32 buffers and keeps per token
    and shard the max m, sum exp(x - m), sum exp(x - m)(x - m) (for the entropy) and the label's
    logit; two all-reduces combine the shards (the max, then the sums rescaled by
    exp(m_rank - m)). Nothing of the logits' size is allocated. It saves the logits themselves
    (the model output, which exists anyway), the labels' local indices and three ``[T]`` vectors
    (max, sum of exp, entropy); backward recomputes exp(x - m) chunk by chunk and writes
    ``grad = [v = y] g_lp - p (g_lp + g_H (log p + H))`` straight into the one ``[T, V/tp]`` tensor
    it allocates, with no communication (every TP rank computes the same loss). Within 1e-6 of
    fp64 (2 ulps for |values| > 8) at tp1 and tp2 (tests/unit/test_fused_logprobs.py)."""

    @staticmethod
    def forward(ctx, logits_TV, labels_T, tp_group, with_entropy, chunk_tokens):
        T, v_local = logits_TV.shape
        tp = dist.get_world_size(tp_group) if tp_group is not None else 1
        start = (dist.get_rank(tp_group) if tp > 1 else 0) * v_local
        local_label_T = labels_T - start
        owned_T = (local_label_T >= 0) & (local_label_T < v_local)
        index_T1 = local_label_T.clamp(0, v_local - 1)[:, None]
        C = _chunk_tokens(v_local, chunk_tokens, logits_TV.device)
        # per token, on this shard: max m, sum exp(x - m), sum exp(x - m) * (x - m), the label's logit
        max_T = torch.empty(T, dtype=torch.float32, device=logits_TV.device)
        sum_exp_T, sum_es_T, target_T = torch.empty_like(max_T), torch.zeros_like(max_T), torch.empty_like(max_T)
        shift_CV = logits_TV.new_empty((min(C, T), v_local), dtype=torch.float32)
        exp_CV = torch.empty_like(shift_CV) if with_entropy else shift_CV
        for t0 in range(0, T, C):
            t1 = min(t0 + C, T)
            x_CV, s_CV, e_CV = logits_TV[t0:t1], shift_CV[:t1 - t0], exp_CV[:t1 - t0]
            max_T[t0:t1] = x_CV.amax(dim=-1)
            target_T[t0:t1] = x_CV.gather(1, index_T1[t0:t1])[:, 0]
            torch.sub(x_CV, max_T[t0:t1, None], out=s_CV)   # fp32 also for bf16 logits
            torch.exp(s_CV, out=e_CV)
            torch.sum(e_CV, dim=-1, out=sum_exp_T[t0:t1])
            if with_entropy:
                torch.sum(s_CV.mul_(e_CV), dim=-1, out=sum_es_T[t0:t1])
        target_T = target_T * owned_T
        if tp > 1:
            # rescale each shard's sums from its own max to the global max, then add the shards
            global_max_T = max_T.clone()
            dist.all_reduce(global_max_T, op=dist.ReduceOp.MAX, group=tp_group)
            delta_T = max_T - global_max_T
            scale_T = delta_T.exp()
            sums_3T = torch.stack([sum_exp_T * scale_T, (sum_es_T + delta_T * sum_exp_T) * scale_T, target_T])
            dist.all_reduce(sums_3T, group=tp_group)
            sum_exp_T, sum_es_T, target_T = sums_3T.unbind(0)
            max_T = global_max_T
        log_z_T = sum_exp_T.log()
        logprobs_T = (target_T - max_T) - log_z_T
        entropy_T = log_z_T - sum_es_T / sum_exp_T if with_entropy else None
        ctx.save_for_backward(logits_TV, index_T1, owned_T, max_T, sum_exp_T, entropy_T)
        ctx.chunk = C
        ctx.set_materialize_grads(False)
        return logprobs_T if entropy_T is None else (logprobs_T, entropy_T)

    @staticmethod
    def backward(ctx, grad_logprobs_T, grad_entropy_T=None):
        # With s = x - m (m the max, as in forward: exact for the entries that matter), S the sum
        # of exp(s), p = exp(s) / S and log p = s - log S:
        #   d logp(y)/dx_v = [v == y] - p_v,   dH/dx_v = -p_v (log p_v + H),
        # so grad_v = exp(s_v) * (a s_v + d) + [v == y] g_lp with, per token,
        #   a = -g_H / S,   d = a (H - log S) - g_lp / S.
        # Every TP rank holds the same upstream grads (each computes the same loss), so each
        # shard's gradient is local: no communication.
        logits_TV, index_T1, owned_T, max_T, sum_exp_T, entropy_T = ctx.saved_tensors
        if grad_logprobs_T is None and grad_entropy_T is None:
            return None, None, None, None, None
        T, v_local = logits_TV.shape
        C = ctx.chunk
        g_lp_T = grad_logprobs_T.float() if grad_logprobs_T is not None else torch.zeros_like(sum_exp_T)
        d_T = -g_lp_T / sum_exp_T
        a_T = None
        if grad_entropy_T is not None:
            a_T = -grad_entropy_T.float() / sum_exp_T
            d_T = d_T + a_T * (entropy_T - sum_exp_T.log())
        grad_TV = torch.empty_like(logits_TV)
        direct = grad_TV.dtype == torch.float32
        shift_CV = logits_TV.new_empty((min(C, T), v_local), dtype=torch.float32)
        exp_CV = torch.empty_like(shift_CV)
        for t0 in range(0, T, C):
            t1 = min(t0 + C, T)
            s_CV, e_CV = shift_CV[:t1 - t0], exp_CV[:t1 - t0]
            torch.sub(logits_TV[t0:t1], max_T[t0:t1, None], out=s_CV)
            torch.exp(s_CV, out=e_CV)
            if a_T is not None:
                coef_CV = torch.addcmul(d_T[t0:t1, None], s_CV, a_T[t0:t1, None], out=s_CV)
            else:
                coef_CV = d_T[t0:t1, None]
            out_CV = grad_TV[t0:t1] if direct else s_CV
            torch.mul(e_CV, coef_CV, out=out_CV)
            if grad_logprobs_T is not None:
                out_CV.scatter_add_(1, index_T1[t0:t1], (g_lp_T[t0:t1] * owned_T[t0:t1])[:, None])
            if not direct:
                grad_TV[t0:t1].copy_(out_CV)
        return grad_TV, None, None, None, None


def vocab_parallel_logprobs(logits_TV: torch.Tensor, labels_T: torch.Tensor, tp_group,
                            with_entropy: bool = False,
                            chunk_tokens: Optional[int] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """log p(label) and optionally the entropy per token from TP-split logits ``[T, V/tp]``.

    The vocabulary shard of TP rank r is ``[r * V/tp, (r + 1) * V/tp)`` (megatron's
    VocabParallelEmbedding / output layer). Computed in fp32 (bf16 logits are read a chunk at a
    time), ``chunk_tokens`` tokens per chunk (default: from :data:`CHUNK_BYTES`). Differentiable
    w.r.t. ``logits_TV``; two all-reduces over ``tp_group`` in forward, none in backward.
    """
    if logits_TV.dim() != 2 or labels_T.shape != logits_TV.shape[:1]:
        raise ValueError(f"vocab_parallel_logprobs: logits of shape {tuple(logits_TV.shape)} and labels of shape "
                         f"{tuple(labels_T.shape)}; expected [T, V/tp] and [T]")
    out = _FusedVocabParallelLogprobs.apply(logits_TV, labels_T, tp_group, with_entropy, chunk_tokens)
    return (out[0], out[1]) if with_entropy else (out, None)


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


def response_positions(packed: PackedMicroBatch) -> torch.Tensor:
    """The positions of the full packed row that predict the response tokens ``[R]``: for a
    sequence starting at s (padded layout) with P prompt tokens and L tokens, s+P-1 .. s+L-2
    (what :func:`select_response` reads)."""
    starts = packed.cu_seqlens_padded_N1[:-1].tolist()
    return torch.cat([torch.arange(s + p - 1, s + ids.numel() - 1)
                      for s, p, ids in zip(starts, packed.batch.prompt_lengths, packed.batch.input_ids)])


def select_response(full_Tf: torch.Tensor, packed: PackedMicroBatch) -> torch.Tensor:
    """Per-position values of the full row -> the values of the response tokens ``[R]``."""
    per_seq = unpack_sequences(full_Tf, packed.cu_seqlens_N1, packed.cu_seqlens_padded_N1)
    out = [x[p - 1:x.shape[0] - 1] for x, p in zip(per_seq, packed.batch.prompt_lengths)]
    return torch.cat(out)


def response_logprobs(logits_1TV: torch.Tensor, packed: PackedMicroBatch, pgs,
                      with_entropy: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Model output of one micro-batch -> (log-probs ``[R]``, entropy ``[R]`` or None). The
    output holds every position of the packed row, or only the response positions when
    ``packed.response_positions_R`` is set (then already in the order of the response tokens)."""
    if packed.response_positions_R is not None:
        return vocab_parallel_logprobs(logits_1TV[0], packed.labels_T[packed.response_positions_R], pgs.tp,
                                       with_entropy)
    logprobs_T, entropy_T = vocab_parallel_logprobs(logits_1TV[0], packed.labels_T, pgs.tp, with_entropy)
    logprobs_R = select_response(gather_cp(logprobs_T, packed, pgs.cp), packed)
    entropy_R = select_response(gather_cp(entropy_T, packed, pgs.cp), packed) if with_entropy else None
    return logprobs_R, entropy_R
