"""MoE routing replay and routing agreement: which experts the trainer's MoE layers use.

The rollout engine (vLLM) and the trainer route a share of the tokens to different experts (other
kernels, precision, or an older policy), so the trainer's log-probs belong to another sub-network
than the one that sampled. Replaying a recorded routing removes that part of the mismatch
(``algorithm.router_replay``): ``r3`` replays vLLM's routing of every token
(``rollout.return_routing``) in the old log-prob, reference and training passes; ``r2`` records
the trainer's own routing in the old log-prob pass and replays it in the training passes, so the
routing stays fixed while the weights move within a step. Probabilities stay the trainer's.

Token layout: a layer's router sees this CP rank's packed row (``SequenceBatch.routing`` is packed
like the tokens by :func:`megarl.policy.logprobs.pack_micro_batch`), cut into TP slices under SP,
before the EP dispatch. Rows of -1 (padding) keep the layer's own routing. Measured every call
(:meth:`RouterReplayer.report`): ``routing_agree`` per layer and overall, per-token disagreements
(:meth:`~RouterReplayer.token_misses`), and ``routing_replay_mismatch`` (0 unless replay is broken).
Shape legend: T packed tokens on this CP rank, Ts router tokens (T or T/tp under SP), Lm MoE
layers, K experts per token, E experts.
"""
from __future__ import annotations

from collections import deque
from typing import Optional

import torch
import torch.distributed as dist

ACTIONS = ("compare", "replay")


def moe_layer_numbers(config) -> list[int]:
    """1-based numbers of the model's MoE layers, in order (megatron's ``moe_layer_freq``)."""
    freq = config.moe_layer_freq
    pattern = freq if isinstance(freq, list) else [1 if i % freq == 0 else 0 for i in range(config.num_layers)]
    return [i + 1 for i, is_moe in enumerate(pattern) if is_moe]


class _LayerReplay:
    """The ``router_replay`` object of one megatron ``TopKRouter``.

    megatron-core 0.16's ``topk_routing_with_score_function`` asks it for the top-k
    (``get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)``); megatron's
    own ``RouterReplay`` keeps one global list of targets per layer, this one is driven per
    micro-batch. The replayed experts' scores are gathered from the router's own scores, so
    gradients still reach the router; only the choice is fixed. The fused TE router bypasses the
    call: replay refuses ``moe_router_fusion``."""

    def __init__(self, owner: "RouterReplayer", row: int):
        self.owner, self.row = owner, row

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        return self.owner._topk(self.row, scores, topk, num_groups, group_topk, default_compute_topk)


class RouterReplayer:
    """Routing replay / comparison / recording for every MoE layer on this rank."""

    def __init__(self, modules: list, config, groups):
        from megatron.core.transformer.moe.router import TopKRouter

        self.groups = groups
        self.sp = bool(config.sequence_parallel) and groups.topology.tp > 1
        self.moe_layers = moe_layer_numbers(config) if config.num_moe_experts else []
        self.top_k = config.moe_router_topk
        self.fused = bool(getattr(config, "moe_router_fusion", False))
        self.action: Optional[str] = None
        self._reset_call(None, None, False)
        for module in modules:
            for sub in module.modules():
                if isinstance(sub, TopKRouter):
                    row = self.moe_layers.index(sub.layer_number)
                    sub.router_replay = _LayerReplay(self, row)
                    sub.register_forward_hook(self._check_routing_map)

    # ------------------------------------------------------------------ one engine call
    def _reset_call(self, action, phase, record: bool) -> None:
        self.action, self.phase, self.record = action, phase, record
        n = len(self.moe_layers)
        self.agree_L = torch.zeros(n, dtype=torch.float64)
        self.valid_L = torch.zeros(n, dtype=torch.float64)
        self.replay_counts = torch.zeros(2, dtype=torch.float64)   # replayed, mismatched token-layers
        self.miss: dict[int, torch.Tensor] = {}
        self.own: dict[int, torch.Tensor] = {}
        self.fifo = {row: deque() for row in range(n)}
        self.mb: Optional[int] = None
        self.targets: Optional[torch.Tensor] = None
        self.last: dict[int, tuple] = {}

    def start(self, action: Optional[str], phase: str, record: bool = False) -> None:
        """Before an engine call: ``action`` is None (the layers route themselves), ``compare``
        (measure agreement with the micro-batches' routing) or ``replay`` (compare, then use it);
        ``record``: keep the layers' own routing (:meth:`recorded`; forward-only calls);
        ``phase``: ``logprob`` (forward only) or ``train``."""
        if action is not None and action not in ACTIONS:
            raise ValueError(f"RouterReplayer.start: action={action!r}, expected None or one of {ACTIONS}")
        if action == "replay" and self.fused:
            raise ValueError("routing replay needs megatron's unfused router (moe_router_fusion=False): the fused "
                             "TE router never asks for replayed experts")
        if record and phase != "logprob":
            raise ValueError("RouterReplayer.start: record=True is for forward-only (logprob) calls")
        self._reset_call(action if self.moe_layers else None, phase, record and bool(self.moe_layers))

    def begin(self, mb) -> None:
        """Around one micro-batch's model forward (``mb``: a PackedMicroBatch), also per model
        chunk under VPP. In the training pass, a forward inside ``begin`` / ``end`` with gradients
        off is the first pass of a checkpointed region: it queues its targets per layer and the
        recompute pops them in order (megatron runs a chunk's backward passes in the order of its
        forward passes)."""
        self.mb = mb.index
        if self.action is None and not self.record:
            return
        T = mb.num_packed_tokens
        topo = self.groups.topology
        self.mb, self.slice = mb.index, (slice(self.groups.tp_rank * T // topo.tp, (self.groups.tp_rank + 1) * T // topo.tp)
                                         if self.sp else slice(0, T))
        if self.record:
            self.own.setdefault(mb.index, torch.full((T, len(self.moe_layers), self.top_k), -1, dtype=torch.int64))
        self.targets = None
        if self.action is None:
            return
        if mb.routing_T is None:
            raise ValueError(f"routing {self.action}: micro-batch {mb.index} has no routing (SequenceBatch.routing)")
        if mb.routing_T.shape[1:] != (len(self.moe_layers), self.top_k):
            raise ValueError(f"routing of shape [tokens, {mb.routing_T.shape[1]}, {mb.routing_T.shape[2]}] for a model "
                             f"with {len(self.moe_layers)} MoE layers and top-{self.top_k} routing")
        self.targets = mb.routing_T[self.slice]
        self.miss.setdefault(mb.index, torch.zeros(T, dtype=torch.int64))

    def end(self) -> None:
        self.mb, self.targets = None, None

    def in_recompute(self) -> bool:
        """Whether a router runs outside any micro-batch's forward: an activation recompute in
        the backward pass (:class:`megarl.policy.moe_stats.MoEStats` then counts nothing twice)."""
        return self.mb is None

    # ------------------------------------------------------------------ inside the router
    def _topk(self, row, scores, topk, num_groups, group_topk, default):
        probs, idx = default(scores, topk, num_groups=num_groups, group_topk=group_topk)
        self.last.pop(row, None)
        if self.record and self.mb is not None:
            self.own[self.mb][self.slice, row] = idx.detach().to(torch.int64)
        if self.action is None:
            return probs, idx
        if self.mb is not None:
            target = self.targets[:, row]
            if self.action == "replay" and self.phase == "train" and not torch.is_grad_enabled():
                self.fifo[row].append(target)   # a checkpointed region's first pass: its recompute pops it
        elif self.fifo[row]:
            target = self.fifo[row].popleft()
        else:
            return probs, idx
        target = target.to(idx.device)
        valid = (target >= 0).all(dim=-1)
        if self.mb is not None and self.phase == "logprob":   # agreement, once per token-layer
            same = (idx.sort(dim=-1).values == target.sort(dim=-1).values).all(dim=-1)
            self.agree_L[row] += float((same & valid).sum())
            self.valid_L[row] += float(valid.sum())
            self.miss[self.mb][self.slice] += (valid & ~same).to(torch.int64).cpu()
        if self.action != "replay":
            return probs, idx
        idx = torch.where(valid[:, None], target, idx)
        self.last[row] = (target, valid, self.mb is not None)
        return scores.gather(1, idx), idx

    def _check_routing_map(self, module, args, output) -> None:
        """The routing map the dispatcher gets must hold exactly the replayed experts."""
        row = module.router_replay.row if isinstance(module.router_replay, _LayerReplay) else None
        entry = self.last.pop(row, None) if row is not None else None
        if entry is None:
            return
        target, valid, counted = entry
        if not counted:   # a recompute in the backward pass: its forward was checked already
            return
        routing_map = output[1].detach()
        expected = torch.zeros_like(routing_map).scatter_(1, target.clamp(min=0), True)
        wrong = (routing_map != expected).any(dim=-1) & valid
        self.replay_counts += torch.tensor([float(valid.sum()), float(wrong.sum())], dtype=torch.float64)

    def check_drained(self) -> None:
        """After a training pass: every queued target was popped by its recompute."""
        left = {self.moe_layers[row]: len(q) for row, q in self.fifo.items() if q}
        if left:
            raise RuntimeError(f"routing replay: activation recomputes left targets unused (layer: count) {left}; "
                               "the backward passes did not run in the order of the forward passes")

    # ------------------------------------------------------------------ after the call (collective)
    def report(self) -> dict:
        """Collective over the whole layout: agreement per MoE layer and overall (NaN without
        routing to compare), replayed and mismatched token-layers."""
        if not self.moe_layers:
            return {}
        pgs, stats = self.groups.pgs, torch.cat([self.agree_L, self.valid_L, self.replay_counts])
        if self.sp:
            dist.all_reduce(stats, group=pgs.tp)
        dist.all_reduce(stats, group=pgs.dp_cp)
        dist.all_reduce(stats, group=pgs.pp)
        n = len(self.moe_layers)
        agree, valid = stats[:n], stats[n:2 * n]
        per_layer = [float(a / v) if v > 0 else float("nan") for a, v in zip(agree, valid)]
        return {"routing_agree": float(agree.sum() / valid.sum()) if valid.sum() > 0 else float("nan"),
                "routing_agree_per_layer": per_layer, "routing_compared": int(valid.sum()),
                "routing_replayed": int(stats[2 * n]), "routing_replay_mismatch": int(stats[2 * n + 1])}

    def token_misses(self, packed: list) -> list:
        """Collective over TP, PP and CP: per micro-batch of ``packed``, the number of MoE layers
        whose own routing differed from the given one, per response token ``[R]`` (None for a
        micro-batch without routing to compare)."""
        from megarl.policy.logprobs import gather_cp, select_response

        out = []
        for mb in packed:
            miss = self.miss.get(mb.index)
            if miss is None:
                out.append(None)
                continue
            if self.sp:
                dist.all_reduce(miss, group=self.groups.pgs.tp)
            if self.groups.topology.pp > 1:
                dist.all_reduce(miss, group=self.groups.pgs.pp)
            out.append(select_response(gather_cp(miss, mb, self.groups.pgs.cp), mb).to(torch.int16))
        return out

    def recorded(self, packed: list) -> list:
        """Collective over TP, PP and CP (after a call with ``record``): per micro-batch, per sequence,
        the routing the layers chose, ``[L, Lm, K]`` int16 (the format of ``SequenceBatch.routing``)."""
        from megarl.data.packing import gather_cp_shares, unpack_sequences

        out = []
        for mb in packed:
            own = self.own[mb.index]
            if self.groups.topology.tp > 1:     # SP slices, or identical copies: MAX keeps the chosen ids
                dist.all_reduce(own, op=dist.ReduceOp.MAX, group=self.groups.pgs.tp)
            if self.groups.topology.pp > 1:     # each stage filled its own layers
                dist.all_reduce(own, op=dist.ReduceOp.MAX, group=self.groups.pgs.pp)
            cp = self.groups.topology.cp
            if cp > 1:
                parts = [torch.empty_like(own) for _ in range(cp)]
                dist.all_gather(parts, own.contiguous(), group=self.groups.pgs.cp)
                own = gather_cp_shares(parts, mb.cu_seqlens_padded_N1)
            out.append([x.to(torch.int16).clone() for x in unpack_sequences(own, mb.cu_seqlens_N1,
                                                                             mb.cu_seqlens_padded_N1)])
        return out
