"""Micro-batches through megatron-core's pipeline schedule, for the forward passes and the train
step of :class:`megarl.policy.model.PolicyModel`.

A call packs its micro-batches (:func:`megarl.policy.logprobs.pack_micro_batch`; to one length
when the pipeline exchanges fixed shapes), runs megatron's forward-backward function over this
rank's model chunks (forward only for the passes that compute no gradient) and hands each
micro-batch's model output to the caller's loss function. The router replayer
(:mod:`megarl.policy.replay`) brackets each micro-batch's forward; where it is possible the output
layer computes only the logits that are read (:meth:`MicroBatchRunner.install_logit_selection`).

Shape legend: T packed tokens, H hidden size, R response positions.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from megarl.policy.build import BuiltModel
from megarl.policy.logprobs import PackedMicroBatch, SequenceBatch, pack_micro_batch, packed_length, response_positions
from megarl.policy.replay import RouterReplayer
from megarl.parallel.groups import ParallelGroups


class MicroBatchRunner:
    """Runs micro-batches through this rank's model chunks (collective over the layout; every
    rank of a model-parallel group passes the same micro-batches)."""

    def __init__(self, model: BuiltModel, groups: ParallelGroups, router: RouterReplayer, select_logits: bool):
        """``select_logits``: compute only the logits of response positions where the layout
        allows it (:meth:`install_logit_selection`)."""
        self.model, self.groups, self.router = model, groups, router
        self.config = model.config
        self.packed: list[PackedMicroBatch] = []
        """The last call's packed micro-batches (the router replayer reads its results by them)."""
        self._logit_positions: Optional[torch.Tensor] = None
        self.select_logits = select_logits and self.install_logit_selection()
        """Whether the output layer computes the logits of the response positions only."""

    def install_logit_selection(self) -> bool:
        """Let the output layer compute only the logits that are read (response positions).

        Every position of a packed row goes through the decoder (a response attends to its
        prompt), but only the positions that predict a response token need the vocabulary
        projection and the log-softmax over it: in an RL batch the prompts are most of the
        tokens (the quickstart: ~65-token prompts, 12-60-token responses), and on CPU the
        projection, the logits' copies and the log-softmax over every position take ~a quarter of
        a bf16 training step. A forward pre-hook on the last stage's output layer keeps the rows
        of :attr:`PackedMicroBatch.response_positions_R` (set by :meth:`run` per micro-batch);
        the other rows get a zero gradient, which is what unread logits would give. Not with
        context parallelism (a rank holds chunks of sequences), a sequence-parallel output layer
        (its input is this rank's slice of the row) or multi-token prediction (its layers read the
        same hidden states): those read every position. True when installed."""
        topo = self.groups.topology
        if topo.cp > 1 or (topo.sp and topo.tp > 1) or getattr(self.config, "mtp_num_layers", None):
            return False

        def keep_read_rows(module, args, kwargs):
            if self._logit_positions is None:
                return None
            hidden_T1H = args[0].index_select(0, self._logit_positions)
            return (hidden_T1H,) + tuple(args[1:]), kwargs

        for chunk in self.model.chunks:
            gpt = chunk
            while not hasattr(gpt, "output_layer") and hasattr(gpt, "module"):
                gpt = gpt.module
            if getattr(gpt, "post_process", False) and getattr(gpt, "output_layer", None) is not None:
                gpt.output_layer.register_forward_pre_hook(keep_read_rows, with_kwargs=True)
        return True

    def check(self, micro_batches) -> list:
        """``micro_batches`` (one :class:`SequenceBatch` or several) as a list, checked against
        the layout."""
        if isinstance(micro_batches, SequenceBatch):
            micro_batches = [micro_batches]
        micro_batches = list(micro_batches)
        if not micro_batches:
            raise ValueError("micro_batches is empty; expected at least one SequenceBatch")
        topo = self.groups.topology
        if topo.vpp_size > 1 and len(micro_batches) % topo.pp:   # non-empty: a multiple is >= pp
            raise ValueError(f"{len(micro_batches)} micro-batches with pp={topo.pp} and vpp={topo.vpp}: the "
                             f"interleaved schedule needs a multiple of pp={topo.pp} micro-batches (megatron "
                             "runs them in groups of pp per virtual stage)")
        return micro_batches

    def run(self, micro_batches: Sequence[SequenceBatch], loss_func: Callable, forward_only: bool) -> list:
        """megatron's forward-backward function over the packed ``micro_batches``;
        ``loss_func(packed micro-batch, output) -> (loss, report)``. Returns the reports (last
        pipeline stage; empty elsewhere)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        g, topo = self.groups, self.groups.topology
        pad_to = None
        if not self.config.variable_seq_lengths:   # fixed-shape pipeline exchange (build.py): one length
            pad_to = max(packed_length(b, topo.tp, topo.cp, topo.sp) for b in micro_batches)
        packed = [pack_micro_batch(b, topo.tp, topo.cp, g.cp_rank, topo.sp, pad_to=pad_to) for b in micro_batches]
        for i, mb in enumerate(packed):
            mb.index = i
            if self.select_logits:
                mb.response_positions_R = response_positions(mb)
        self.packed = packed

        moe = bool(self.config.num_moe_experts)

        def forward_step(data_iterator: Iterator[PackedMicroBatch], model):
            mb = next(data_iterator)
            kwargs = {"padding_mask": self._padding_mask(mb, model)} if moe else {}
            self.router.begin(mb)
            self._logit_positions = mb.response_positions_R
            try:
                out = model(mb.tokens_1T, mb.position_ids_1T, None, packed_seq_params=mb.packed_seq_params, **kwargs)
            finally:
                self.router.end()
                self._logit_positions = None
            return out, partial(loss_func, mb)

        chunks = self.model.chunks
        iters = [iter(packed) for _ in chunks] if len(chunks) > 1 else iter(packed)
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iters, model=chunks,
            num_microbatches=len(packed), seq_length=max(p.num_packed_tokens for p in packed) * topo.cp,
            micro_batch_size=1, forward_only=forward_only)

    def _padding_mask(self, mb: PackedMicroBatch, model) -> torch.Tensor:
        """MoE padding mask ``[1, T]``. GPTModel splits it for sequence parallelism only on the
        first pipeline stage (megatron-core 0.16 passes it unsplit to later stages), so later
        stages get this rank's SP slice here."""
        mask = mb.padding_mask_1T
        topo = self.groups.topology
        first = getattr(model.module if hasattr(model, "module") else model, "pre_process", True)
        if topo.sp and topo.tp > 1 and not first:
            mask = mask.chunk(topo.tp, dim=1)[self.groups.tp_rank]
        return mask

    def from_last_stage(self, obj):
        """Broadcast a picklable object from the last pipeline stage to the whole PP group."""
        g = self.groups
        if g.topology.pp == 1:
            return obj
        box = [obj if g.is_last_stage else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(g.pgs.pp, g.topology.pp - 1), group=g.pgs.pp)
        return box[0]
