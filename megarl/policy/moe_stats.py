"""MoE load-balance metrics: tokens routed to each expert per MoE layer, and aux / z losses.

Token counts come from a forward hook on every megatron ``TopKRouter`` (its ``routing_map``),
summed over micro-batches, DP and CP ranks (different tokens; TP ranks share tokens unless
sequence-parallel) and pipeline stages (different layers). Router calls of an activation
recompute are told apart by ``in_recompute`` (:meth:`megarl.policy.replay.RouterReplayer.in_recompute`)
and not counted again.

Aux / z losses come from megatron's layer-wise tracker, reduced as megatron's
``reduce_aux_losses_tracker_across_ranks`` does (load-balancing shares summed over TP x CP then
averaged over DP, z-loss averaged over both; both averaged over micro-batches and MoE layers),
but with fixed names and shapes on every rank: megatron's reduction assumes every pipeline stage
has MoE layers and hangs otherwise (e.g. DeepSeek's dense first layer alone on stage 0).

Shape legend: Lm MoE layers of the whole model, E experts.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.policy.replay import moe_layer_numbers

_TRACKED = ("load_balancing_loss", "z_loss")


class MoEStats:
    def __init__(self, modules: list, config, groups, in_recompute=None):
        from megatron.core.transformer.moe.router import TopKRouter

        self.groups, self.in_recompute = groups, in_recompute
        self.num_experts = config.num_moe_experts or 0
        self.num_layers = config.num_layers
        self.sp = bool(config.sequence_parallel)
        self.counts: dict[int, torch.Tensor] = {}
        if not self.num_experts:
            return
        self.moe_layers = moe_layer_numbers(config)
        for module in modules:
            for sub in module.modules():
                if isinstance(sub, TopKRouter):
                    sub.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, output):
        if self.in_recompute is not None and self.in_recompute():
            return
        routing_map = output[1].detach()
        # the dispatcher routes alignment padding too; count real tokens only
        padding = args[1] if len(args) > 1 else kwargs.get("padding_mask")
        if padding is not None:
            routing_map = routing_map & ~padding.reshape(-1, 1).bool()
        layer = module.layer_number
        counts = routing_map.sum(dim=0).to(torch.float64)
        self.counts[layer] = self.counts.get(layer, 0) + counts

    def reset(self) -> None:
        self.counts = {}
        if self.num_experts:
            from megatron.core.transformer.moe.moe_utils import (clear_aux_losses_tracker,
                                                                 get_moe_layer_wise_logging_tracker)

            tracker = get_moe_layer_wise_logging_tracker()
            for name in [n for n, entry in tracker.items() if entry["values"].numel() != self.num_layers]:
                del tracker[name]   # sized for another model built earlier in this process (deeper or not)
            clear_aux_losses_tracker()

    def report(self, num_micro_batches: int) -> dict:
        """Collective: ``moe_tokens_per_expert`` [Lm][E], ``moe_load_imbalance`` (max/mean over
        experts, worst layer), ``moe_aux_loss`` and ``moe_z_loss`` (0.0 when not enabled)."""
        if not self.num_experts:
            return {}
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        pgs = self.groups.pgs
        counts_LE = torch.zeros(len(self.moe_layers), self.num_experts, dtype=torch.float64)
        for row, layer in enumerate(self.moe_layers):
            if layer in self.counts:
                counts_LE[row] = self.counts[layer]
        if self.sp and self.groups.topology.tp > 1:
            dist.all_reduce(counts_LE, group=pgs.tp)
        dist.all_reduce(counts_LE, group=pgs.dp_cp)
        dist.all_reduce(counts_LE, group=pgs.pp)
        tracker = get_moe_layer_wise_logging_tracker()
        losses = torch.zeros(len(_TRACKED), self.num_layers, dtype=torch.float64)
        for i, name in enumerate(_TRACKED):
            if name in tracker:
                losses[i] = tracker[name]["values"].detach().to(torch.float64)[: self.num_layers]
        dist.all_reduce(losses, group=pgs.pp)
        dist.all_reduce(losses, group=pgs.tp_cp)
        dist.all_reduce(losses, group=pgs.dp)
        losses[1] /= dist.get_world_size(pgs.tp_cp)                       # z-loss: a mean over the group
        losses /= dist.get_world_size(pgs.dp) * max(num_micro_batches, 1)
        moe_rows = [layer - 1 for layer in self.moe_layers]
        per_layer = losses[:, moe_rows].mean(dim=1)
        mean_E = counts_LE.mean(dim=1, keepdim=True).clamp(min=1e-9)
        return {
            "moe_tokens_per_expert": counts_LE.to(torch.int64).tolist(),
            "moe_load_imbalance": float((counts_LE / mean_E).max()),
            "moe_aux_loss": float(per_layer[0]),
            "moe_z_loss": float(per_layer[1]),
        }
