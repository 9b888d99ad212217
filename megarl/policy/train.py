"""The train step of a trainable Megatron engine: its optimizer, loss scaling and LR schedule.

``loss_fn(logprobs_R, batch) -> (loss, metrics)`` returns one micro-batch's *share of the step
loss*: the step loss is the SUM of the returned losses over micro-batches and DP ranks (the
contract: :meth:`megarl.policy.model.PolicyModel.train_step`). With
``calculate_per_token_loss=False`` megatron's schedule multiplies the loss by
``cp / num_microbatches`` and DDP averages gradients over dp*cp ranks; every CP rank computes the
same micro-batch loss but back-propagates only its own tokens (see
:func:`megarl.policy.logprobs.gather_cp`). Handing megatron ``loss * num_microbatches * dp``
therefore yields the gradient of the summed loss, while MoE aux / z losses keep megatron's usual
mean over micro-batches and DP ranks. The LR schedule: :meth:`OptimOptions.lr_at`.

Shape legend: R packed response tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megarl.policy.build import BuiltModel
from megarl.policy.logprobs import LogprobOutput, PackedMicroBatch, SequenceBatch
from megarl.policy.moe_stats import MoEStats
from megarl.policy.offload import _torch_optimizers
from megarl.policy.replay import RouterReplayer
from megarl.policy.schedule import MicroBatchRunner
from megarl.parallel.groups import ParallelGroups

_OPTIMIZERS = ("adam", "sgd")
_DECAY_STYLES = ("constant", "linear", "cosine")


@dataclass
class OptimOptions:
    """Optimizer, clipping and LR schedule of a trainable engine."""

    optimizer: str = "adam"
    """adam (AdamW, decoupled weight decay; megatron's distributed optimizer, state sharded over
    DP) or sgd (with ``sgd_momentum``; megatron only shards Adam, so SGD is replicated)."""
    lr: float = 1e-6
    min_lr: float = 0.0
    warmup_steps: int = 0
    decay_steps: Optional[int] = None
    """Steps after warm-up over which the LR decays to ``min_lr`` (None: no decay)."""
    decay_style: str = "constant"
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    """Global grad-norm clip (0 disables)."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.0
    cpu_offload: bool = False
    """Keep the optimizer in host memory (``trainer.optimizer_offload``): megatron-core's
    HybridDeviceOptimizer holds the fp32 main parameters and Adam moments of this rank's shard
    on the host and steps them there; the gradients go down and the updated parameters come back
    each step (adam only: it rides the distributed optimizer's precision-aware path)."""

    def __post_init__(self):
        if self.optimizer not in _OPTIMIZERS:
            raise ValueError(f"OptimOptions.optimizer={self.optimizer!r}, expected one of {_OPTIMIZERS}")
        if self.decay_style not in _DECAY_STYLES:
            raise ValueError(f"OptimOptions.decay_style={self.decay_style!r}, expected one of {_DECAY_STYLES}")
        if self.lr < 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"OptimOptions.lr={self.lr!r}, min_lr={self.min_lr!r}: expected 0 <= min_lr <= lr")
        if self.warmup_steps < 0:
            raise ValueError(f"OptimOptions.warmup_steps={self.warmup_steps!r}, expected >= 0")
        if self.cpu_offload and self.optimizer != "adam":
            raise ValueError(f"OptimOptions.cpu_offload with optimizer={self.optimizer!r}: megatron-core offloads "
                             "the distributed optimizer, which wraps adam only")

    def lr_at(self, step: int) -> float:
        """Learning rate used by optimizer step ``step`` (0-based): ``lr * (s + 1) / warmup_steps``
        during warm-up, then constant, linear or cosine decay to ``min_lr`` over ``decay_steps``.
        Own schedule, not megatron's OptimizerParamScheduler, which spends step 0 at ``init_lr``."""
        if self.warmup_steps and step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.decay_style == "constant" or not self.decay_steps:
            return self.lr
        frac = min(1.0, (step - self.warmup_steps) / self.decay_steps)
        if self.decay_style == "linear":
            return self.lr - (self.lr - self.min_lr) * frac
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * frac))


def build_optimizer(optim: OptimOptions, model: BuiltModel, distributed: bool):
    """megatron-core's optimizer of ``optim`` over ``model``'s chunks (``distributed``: its
    distributed optimizer, which wraps Adam only), with the model config's gradient hooks set."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    o, config = optim, model.config
    # cpu_offload: megatron's HybridDeviceOptimizer reuses the precision-aware path of the
    # distributed optimizer (Megatron-LM requires the two flags together); every shard on the host
    offload = dict(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0, use_precision_aware_optimizer=True,
                   overlap_cpu_optimizer_d2h_h2d=True) if o.cpu_offload else {}
    cfg = OptimizerConfig(optimizer=o.optimizer, lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
                          adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
                          sgd_momentum=o.sgd_momentum, clip_grad=o.grad_clip, bf16=config.bf16,
                          params_dtype=config.params_dtype, use_distributed_optimizer=distributed, **offload)
    optimizer = get_megatron_optimizer(cfg, model.chunks)
    if not o.cpu_offload:
        fuse_cpu_adam(optimizer)
    chunks = model.chunks
    config.finalize_model_grads_func = finalize_model_grads
    no_sync = [c.no_sync for c in chunks]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    config.grad_scale_func = None
    return optimizer


def fuse_cpu_adam(optimizer) -> None:
    """On CPU, step AdamW with torch's fused CPU kernel (one multi-threaded pass per tensor)
    instead of its per-tensor loop of ~10 ops: 0.07 s a step instead of 0.57 s for SmolLM2-135M's
    fp32 main parameters on 2 cores, the same update up to rounding (2e-7 after 5 steps at lr
    1e-3). It is the kernel megatron-core uses for the host step of optimizer offload
    (``fused=True`` in its HybridDeviceOptimizer defaults), so plain and offloaded runs on CPU step
    alike. On GPU megatron-core picks TE's or apex's fused Adam itself."""
    if optimizer is None:
        return
    for opt in _torch_optimizers(optimizer):
        if type(opt) in (torch.optim.AdamW, torch.optim.Adam) and all(
                p.device.type == "cpu" for g in opt.param_groups for p in g["params"]):
            for g in opt.param_groups:
                g["foreach"], g["fused"] = False, True


class TrainStep:
    """The optimizer of a trainable engine and its steps (see the module docstring)."""

    def __init__(self, optim: OptimOptions, model: BuiltModel, groups: ParallelGroups, runner: MicroBatchRunner,
                 router: RouterReplayer, moe: MoEStats, extract: Callable, distributed: bool):
        """``extract``: the reduction of a micro-batch's model output (response log-probs,
        critic values or sequence scores); ``distributed``: megatron's distributed optimizer."""
        self.optim, self.model, self.groups, self.runner = optim, model, groups, runner
        self.router, self.moe, self.extract, self.distributed = router, moe, extract, distributed
        self.step_count = 0
        """Updates applied so far: the LR schedule's position."""
        self.optimizer = build_optimizer(optim, model, distributed)

    def step(self, micro_batches, loss_fn: Callable, with_entropy: bool, replay_routing: bool,
             return_logprobs: bool) -> dict:
        """:meth:`megarl.policy.model.PolicyModel.train_step`."""
        micro_batches = self.runner.check(micro_batches)
        g, topo = self.groups, self.groups.topology
        counts = torch.tensor([sum(_masked_counts(b)[0] for b in micro_batches),
                               sum(len(b.input_ids) for b in micro_batches),
                               sum(b.num_tokens for b in micro_batches),
                               sum(_masked_counts(b)[1] for b in micro_batches)], dtype=torch.float64)
        dist.all_reduce(counts, group=g.pgs.dp)
        for b in micro_batches:
            b.num_global_tokens, b.num_global_sequences = int(counts[0]), int(counts[3])
        scale = len(micro_batches) * topo.dp

        forward_outputs: dict[int, LogprobOutput] = {}

        def loss_func(mb: PackedMicroBatch, output):
            logprobs_R, entropy_R = self.extract(output, mb, g.pgs, with_entropy or return_logprobs)
            if with_entropy and entropy_R is not None:
                mb.batch.extras["entropy_T"] = entropy_R
            if return_logprobs:   # one call per micro-batch (activation recompute re-runs layers, not this)
                forward_outputs[mb.index] = LogprobOutput(logprobs_R.detach().clone(), entropy_R.detach().clone(),
                                                          mb.batch.cu_seqlens_N1)
            loss, metrics = loss_fn(logprobs_R, mb.batch)
            report = {"loss": loss.detach().clone()}
            report.update({k: torch.as_tensor(v).detach().float() for k, v in (metrics or {}).items()})
            return loss * scale, report

        for c in self.model.chunks:
            c.train()
            c.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.moe.reset()
        self.router.start("replay" if replay_routing else None, "train")
        outs = self.runner.run(micro_batches, loss_func, forward_only=False)
        result = self._reduce_reports(outs, len(micro_batches))
        if self.router.action is not None:
            self.router.check_drained()
            report = self.router.report()
            result.update(routing_replayed=report["routing_replayed"],
                          routing_replay_mismatch=report["routing_replay_mismatch"])
        self.router.start(None, "train")
        lr = self.optim.lr_at(self.step_count)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
        update_successful, grad_norm = False, None
        if self.all_finite(result["loss"]):
            update_successful, grad_norm, _ = self.optimizer.step()
        else:   # see all_finite: no rank steps; the LR schedule stays where it is, as megatron's loop does
            for c in self.model.chunks:
                c.zero_grad_buffer()
            self.optimizer.zero_grad()
        self.step_count += bool(update_successful)
        result.update(lr=lr, grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
                      update_successful=bool(update_successful), num_response_tokens=int(counts[0]),
                      num_sequences=int(counts[1]), num_tokens=int(counts[2]), step=self.step_count)
        result.update(self.moe.report(len(micro_batches)))
        if return_logprobs and g.is_last_stage:
            result["outputs"] = [forward_outputs[i] for i in range(len(micro_batches))]
        return result

    def all_finite(self, loss: float) -> bool:
        """Whether the step's loss and every gradient are finite on every rank (collective).

        A NaN or inf loss (a bad batch, an overflow) makes NaN gradients, and megatron-core's
        optimizer steps with them unless a grad scaler (fp16 only) checks them: one such step
        turns every weight into NaN for good. So the step skips the update (the caller counts it
        and stops after too many in a row: ``trainer.max_skipped_updates``). Ranks must agree: a
        rank that stepped alone would leave the replicas apart, hence one all-reduce of a flag over
        all ranks. The gradient test sums each grad buffer in fp32 (NaN and inf survive a sum)
        rather than ``isfinite`` over it: no buffer-sized temporary."""
        bad = not math.isfinite(loss)
        for chunk in self.model.chunks:
            for buffer in getattr(chunk, "buffers", []) + getattr(chunk, "expert_parallel_buffers", []):
                bad = bad or not torch.isfinite(buffer.grad_data.sum(dtype=torch.float32)).item()
        flag = torch.tensor([float(bad)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return not flag.item()

    def ensure_state(self) -> None:
        """:meth:`megarl.policy.model.PolicyModel.ensure_optimizer_state`: an update at lr 0 with
        zero gradients creates Adam's state without changing a weight (AdamW's decay is
        ``1 - lr * weight_decay``); the step counts are then reset, so the next update computes
        what it would have without this."""
        if not self.distributed:   # SGD: megatron saves its (possibly empty) state as it is
            return
        for opt in _torch_optimizers(self.optimizer):
            if opt.state:
                continue
            lrs = [group["lr"] for group in opt.param_groups]
            for group in opt.param_groups:
                group["lr"] = 0.0
                for param in group["params"]:
                    param.grad = torch.zeros_like(param)
            opt.step()
            opt.zero_grad()
            for group, lr in zip(opt.param_groups, lrs):
                group["lr"] = lr
            for state in opt.state.values():
                state["step"].zero_()

    def _reduce_reports(self, outs: list, num_micro_batches: int) -> dict:
        g = self.groups
        keys = self.runner.from_last_stage(sorted(outs[0]) if outs else None)
        if g.is_last_stage:
            vals = torch.stack([torch.stack([o[k].float().reshape(()) for o in outs]).sum() for k in keys])
        else:
            vals = torch.zeros(len(keys))
        if g.topology.pp > 1:
            dist.broadcast(vals, src=dist.get_global_rank(g.pgs.pp, g.topology.pp - 1), group=g.pgs.pp)
        dist.all_reduce(vals, group=g.pgs.dp)
        denom = num_micro_batches * g.topology.dp
        return {k: float(v) if k == "loss" else float(v) / denom for k, v in zip(keys, vals)}


def _masked_counts(batch: SequenceBatch) -> tuple[int, int]:
    """(response tokens, sequences with at least one response token) inside ``extras['mask_T']``."""
    mask = batch.extras.get("mask_T")
    if mask is None:
        return batch.num_response_tokens, len(batch.input_ids)
    per_seq = [int(m.sum()) for m in torch.split(mask.bool(), batch.response_lengths)]
    return sum(per_seq), sum(n > 0 for n in per_seq)
