"""Megatron policy engine: packed log-probs, train step, reference copy, export, offload.

:class:`PolicyEngine` owns this rank's model chunks (and, when trainable, megatron-core DDP and
the distributed optimizer). Every method is collective over the layout's ranks; the ranks of a
model-parallel group (tp, pp, cp, ep) pass the same micro-batches, DP ranks their own.

Loss convention (``train_step``): ``loss_fn(logprobs_R, batch) -> (loss, metrics)`` gets one
micro-batch's response-token log-probs (whole sequences, also under CP) and returns its share of
the step loss, which is the SUM over micro-batches and DP ranks. To normalise,
``batch.num_global_tokens`` / ``num_global_sequences`` count the step's masked-in response tokens
and the sequences with at least one (pass them as ``num_tokens`` / ``num_seqs`` to
:func:`megarl.algorithms.losses.aggregate_loss`). Metrics are averaged over micro-batches and DP.
With ``calculate_per_token_loss=False`` megatron scales the loss by ``cp / num_microbatches`` and
DDP averages gradients over dp*cp ranks, each CP rank back-propagating only its own tokens
(:func:`megarl.engine.logprobs.gather_cp`); handing megatron ``loss * num_microbatches * dp``
yields the summed loss's gradient, while MoE aux / z losses keep megatron's mean.
Shape legend: R packed response tokens of a micro-batch, E experts, Lm MoE layers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from megarl.engine.build import BuiltModel, ModelOptions, build_model, check_layout, read_hf_config
from megarl.engine.export import export_hf_weights, local_shards
from megarl.engine.logprobs import (PackedMicroBatch, SequenceBatch, pack_micro_batch, packed_length,
                                   response_logprobs, response_positions)
from megarl.engine.moe_stats import MoEStats
from megarl.engine.offload import Offloader
from megarl.engine.replay import RouterReplayer
from megarl.engine.value import head_weight, response_values, sequence_scores
from megarl.models.dims import check_model_layout
from megarl.parallel.groups import ParallelGroups
from megarl.parallel.topology import Topology

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


@dataclass
class LogprobOutput:
    """Response-token log-probs of one micro-batch (layout of ``batch.cu_seqlens_N1``)."""

    logprobs_R: torch.Tensor
    entropy_R: Optional[torch.Tensor]
    cu_seqlens_N1: torch.Tensor
    routing_miss_R: Optional[torch.Tensor] = None
    """routing ``compare`` / ``replay``: per response token, the MoE layers whose own routing
    differed from the given one (:meth:`RouterReplayer.token_misses`)."""
    routing: Optional[list] = None
    """routing ``record``: per sequence, the routing the layers chose ``[L, Lm, K]``."""


class PolicyEngine:
    """Policy (trainable) or reference (frozen) Megatron model on this rank."""

    def __init__(self, model: ModelOptions, groups: ParallelGroups, optim: Optional[OptimOptions] = None,
                 trainable: bool = True):
        self.groups, self.trainable = groups, trainable
        self.is_critic = model.value_head
        self.is_reward_model = model.score_head
        # what a micro-batch's model output is reduced to: response log-probs, critic values, or
        # one reward-model score per sequence
        self._extract = sequence_scores if model.score_head else response_values if model.value_head \
            else response_logprobs
        self.optim = optim or OptimOptions()
        check_train_layout(model.path, groups.topology) if trainable else check_layout(model.path, groups.topology)
        # megatron's distributed optimizer only wraps Adam; SGD runs the plain (replicated) one.
        self.distributed_optimizer = self.optim.optimizer == "adam"
        self.model: BuiltModel = build_model(model, groups, ddp=trainable,
                                             distributed_optimizer=self.distributed_optimizer)
        self.config = self.model.config
        self.router = RouterReplayer(self.model.modules, self.config, groups)
        self.moe = MoEStats(self.model.modules, self.config, groups, in_recompute=self.router.in_recompute)
        self.routing_report: dict = {}
        """The last call's :meth:`RouterReplayer.report` (MoE models, with a routing action)."""
        self.step_count = 0
        self.optimizer = None
        if trainable:
            self._setup_optimizer()
        else:
            for chunk in self.model.chunks:
                chunk.requires_grad_(False)
                for m in chunk.modules():   # CPU: the frozen model's attention may use the fused kernel (te_cpu)
                    if hasattr(m, "fused_without_grad"):
                        m.fused_without_grad = True
        self.offloader = Offloader(self)
        self._logit_positions: Optional[torch.Tensor] = None
        self._select_logits = self._extract is response_logprobs and self._install_logit_selection()

    # ---------------------------------------------------------------- setup
    def _install_logit_selection(self) -> bool:
        """Let the output layer compute only the logits that are read (response positions).

        Every position of a packed row goes through the decoder (a response attends to its
        prompt), but only the positions that predict a response token need the vocabulary
        projection and the log-softmax over it: in an RL batch the prompts are most of the
        tokens (the quickstart: ~65-token prompts, 12-60-token responses), and on CPU the
        projection, the logits' copies and the log-softmax over every position take ~a quarter of
        a bf16 training step. A forward pre-hook on the last stage's output layer keeps the rows
        of :attr:`PackedMicroBatch.response_positions_R` (set by :meth:`_run` per micro-batch);
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

    def _setup_optimizer(self) -> None:
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        o = self.optim
        # cpu_offload: megatron's HybridDeviceOptimizer reuses the precision-aware path of the
        # distributed optimizer (Megatron-LM requires the two flags together); every shard on the host
        offload = dict(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0, use_precision_aware_optimizer=True,
                       overlap_cpu_optimizer_d2h_h2d=True) if o.cpu_offload else {}
        cfg = OptimizerConfig(optimizer=o.optimizer, lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
                              adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
                              sgd_momentum=o.sgd_momentum, clip_grad=o.grad_clip, bf16=self.config.bf16,
                              params_dtype=self.config.params_dtype,
                              use_distributed_optimizer=self.distributed_optimizer, **offload)
        self.optimizer = get_megatron_optimizer(cfg, self.model.chunks)
        if not o.cpu_offload:
            self._fuse_cpu_adam()
        chunks = self.model.chunks
        self.config.finalize_model_grads_func = finalize_model_grads
        no_sync = [c.no_sync for c in chunks]
        self.config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        self.config.grad_scale_func = None

    def _fuse_cpu_adam(self) -> None:
        """On CPU, step AdamW with torch's fused CPU kernel (one multi-threaded pass per tensor)
        instead of its per-tensor loop of ~10 ops: 0.07 s a step instead of 0.57 s for
        SmolLM2-135M's fp32 main parameters on 2 cores, the same update up to rounding (2e-7 after
        5 steps at lr 1e-3). It is the kernel megatron-core uses for the host step of optimizer
        offload (``fused=True`` in its HybridDeviceOptimizer defaults), so plain and offloaded runs
        on CPU step alike. On GPU megatron-core picks TE's or apex's fused Adam itself."""
        import torch

        from megarl.engine.offload import _torch_optimizers

        if self.optimizer is None:
            return
        for opt in _torch_optimizers(self.optimizer):
            if type(opt) in (torch.optim.AdamW, torch.optim.Adam) and all(
                    p.device.type == "cpu" for g in opt.param_groups for p in g["params"]):
                for g in opt.param_groups:
                    g["foreach"], g["fused"] = False, True

    def precision(self) -> dict:
        """The dtypes this rank trains with: ``params`` (the model's, what the forward computes
        in and the bridge reads), ``main_params`` (what the optimizer updates: fp32 shards of the
        distributed optimizer under bf16), ``optimizer_state`` (Adam's moments; None before the
        first step creates them) and ``grads`` (megatron's gradient buffers)."""
        import torch

        def names(tensors) -> list:
            return sorted({str(t.dtype).replace("torch.", "") for t in tensors})

        params = [p for chunk in self.model.modules for p in chunk.parameters()]
        out = {"params": names(params), "main_params": None, "optimizer_state": None,
               "grads": names(p.main_grad for p in params if getattr(p, "main_grad", None) is not None) or None}
        if self.optimizer is not None:
            inner = [o.optimizer for o in getattr(self.optimizer, "chained_optimizers", [self.optimizer])]
            main = [p for opt in inner for g in opt.param_groups for p in g["params"]]
            state = [v for opt in inner for st in opt.state.values() for v in st.values()
                     if isinstance(v, torch.Tensor) and v.dim() > 0]
            out["main_params"], out["optimizer_state"] = names(main), names(state) or None
        return out

    # ---------------------------------------------------------------- schedule
    def _run(self, micro_batches: Sequence[SequenceBatch], loss_func: Callable, forward_only: bool) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        g, topo = self.groups, self.groups.topology
        pad_to = None
        if not self.config.variable_seq_lengths:   # fixed-shape pipeline exchange (build.py): one length
            pad_to = max(packed_length(b, topo.tp, topo.cp, topo.sp) for b in micro_batches)
        packed = [pack_micro_batch(b, topo.tp, topo.cp, g.cp_rank, topo.sp, pad_to=pad_to) for b in micro_batches]
        for i, mb in enumerate(packed):
            mb.index = i
            if self._select_logits:
                mb.response_positions_R = response_positions(mb)
        self._packed = packed

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

    def _check_micro_batches(self, micro_batches) -> list:
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

    def _from_last_stage(self, obj):
        """Broadcast a picklable object from the last pipeline stage to the whole PP group."""
        g = self.groups
        if g.topology.pp == 1:
            return obj
        box = [obj if g.is_last_stage else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(g.pgs.pp, g.topology.pp - 1), group=g.pgs.pp)
        return box[0]

    # ---------------------------------------------------------------- public API
    @torch.no_grad()
    def forward_logprobs(self, micro_batches, with_entropy: bool = False,
                         routing: Optional[str] = None, record_routing: bool = False) -> list[LogprobOutput]:
        """Response-token log-probs (and entropy) of each micro-batch, on every rank (a critic:
        its values, in ``logprobs_R``; see :meth:`forward_values`).

        MoE models (:mod:`megarl.engine.replay`): ``routing`` ``compare`` the layers' own routing
        with the micro-batches' ``routing`` or ``replay`` it (compared first; :attr:`routing_report`
        then holds the agreement); ``record_routing``: return the layers' own routing
        (:attr:`LogprobOutput.routing`); ``routing="record"`` is short for that alone."""
        if routing == "record":
            routing, record_routing = None, True
        micro_batches = self._check_micro_batches(micro_batches)
        for c in self.model.chunks:
            c.eval()

        def loss_func(mb: PackedMicroBatch, output):
            logprobs_R, entropy_R = self._extract(output, mb, self.groups.pgs, with_entropy)
            return torch.zeros(()), {"logprobs": logprobs_R, "entropy": entropy_R}

        self.moe.reset()
        self.router.start(routing, "logprob", record=record_routing)
        outs = self._run(micro_batches, loss_func, forward_only=True)
        outs = self._from_last_stage([(o["logprobs"], o["entropy"]) for o in outs] if outs else None)
        result = [LogprobOutput(lp, ent, b.cu_seqlens_N1) for (lp, ent), b in zip(outs, micro_batches)]
        self.routing_report = {}
        if self.router.action in ("compare", "replay"):
            for out, miss in zip(result, self.router.token_misses(self._packed)):
                out.routing_miss_R = miss
        if self.router.record:
            for out, own in zip(result, self.router.recorded(self._packed)):
                out.routing = own
        if self.router.action is not None:
            self.routing_report = self.router.report()
        self.router.start(None, "logprob")
        return result

    @torch.no_grad()
    def forward_scores(self, micro_batches) -> list[torch.Tensor]:
        """A reward model's score of each sequence, per micro-batch ``[N]``."""
        if not self.is_reward_model:
            raise RuntimeError("forward_scores on an engine without a score head; build it with "
                               "ModelOptions(score_head=True)")
        return [o.logprobs_R for o in self.forward_logprobs(micro_batches)]

    @torch.no_grad()
    def forward_values(self, micro_batches) -> list[torch.Tensor]:
        """A critic's value of each response token (the state before it), per micro-batch ``[R]``."""
        if not self.is_critic:
            raise RuntimeError("forward_values on a policy engine; build it with ModelOptions(value_head=True)")
        return [o.logprobs_R for o in self.forward_logprobs(micro_batches)]

    def train_step(self, micro_batches, loss_fn: Callable, with_entropy: bool = False,
                   replay_routing: bool = False, return_logprobs: bool = False) -> dict:
        """One optimizer step over ``micro_batches`` (gradient accumulation); see the module doc.
        For a critic, ``loss_fn`` gets the values ``[R]`` in place of the log-probs.
        ``replay_routing`` (MoE): the MoE layers use the micro-batches' ``routing``
        (:mod:`megarl.engine.replay`; also in activation recomputes); the result then has
        ``routing_replayed`` and ``routing_replay_mismatch`` (token-layers; 0 expected).

        Returns ``loss`` (summed over micro-batches and DP), ``grad_norm`` (before clipping),
        ``lr``, ``update_successful``, token counts and the averaged ``loss_fn`` metrics, plus MoE
        aux/z losses and per-expert token counts for MoE models. ``return_logprobs``: also
        ``outputs``, on the last pipeline stage, a :class:`LogprobOutput` per micro-batch with the
        training forward's own log-probs and entropy (detached; before the update), what
        :meth:`forward_logprobs` with entropy returns for the same weights, so that a step that
        updates once needs no separate old-log-prob pass (the entropy is computed for that even
        when the loss has no entropy term; ``entropy_T`` is then not put in the extras).

        A non-finite loss or gradient on any rank skips the update on all ranks (see
        :meth:`_all_finite`): ``update_successful`` is False, ``grad_norm`` NaN, the weights and
        optimizer state stay as they were, the gradients are zeroed, and ``step`` (the LR
        schedule's position: the number of updates applied) does not advance.
        """
        if not self.trainable:
            raise RuntimeError("train_step on a frozen (reference) engine; build it with trainable=True")
        micro_batches = self._check_micro_batches(micro_batches)
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
            logprobs_R, entropy_R = self._extract(output, mb, g.pgs, with_entropy or return_logprobs)
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
        outs = self._run(micro_batches, loss_func, forward_only=False)
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
        if self._all_finite(result["loss"]):
            update_successful, grad_norm, _ = self.optimizer.step()
        else:   # see _all_finite: no rank steps; the LR schedule stays where it is, as megatron's loop does
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

    def _all_finite(self, loss: float) -> bool:
        """Whether the step's loss and every gradient are finite on every rank (collective).

        A NaN or inf loss (a bad batch, an overflow) makes NaN gradients, and megatron-core's
        optimizer steps with them unless a grad scaler (fp16 only) checks them: one such step
        turns every weight into NaN for good. So ``train_step`` skips the update (the caller
        counts it and stops after too many in a row: ``trainer.max_skipped_updates``). Ranks must
        agree: a rank that stepped alone would leave the replicas apart, hence one all-reduce of a
        flag over all ranks. The gradient test sums each grad buffer in fp32 (NaN and inf survive
        a sum) rather than ``isfinite`` over it: no buffer-sized temporary."""
        bad = not math.isfinite(loss)
        for chunk in self.model.chunks:
            for buffer in getattr(chunk, "buffers", []) + getattr(chunk, "expert_parallel_buffers", []):
                bad = bad or not torch.isfinite(buffer.grad_data.sum(dtype=torch.float32)).item()
        flag = torch.tensor([float(bad)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return not flag.item()

    def ensure_optimizer_state(self) -> None:
        """Give Adam the state its first update creates (zero moments, step 0) when no update has
        been applied yet (all skipped, see :meth:`_all_finite`), so that a checkpoint can be saved:
        torch's AdamW creates its state lazily, and megatron-core's distributed optimizer asserts
        that it has one ``step`` when it saves. An update at lr 0 with zero gradients creates it
        without changing a weight (AdamW's decay is ``1 - lr * weight_decay``); the step counts are
        then reset, so the next update computes what it would have without this."""
        from megarl.engine.offload import _torch_optimizers

        if not self.distributed_optimizer:   # SGD: megatron saves its (possibly empty) state as it is
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
        keys = self._from_last_stage(sorted(outs[0]) if outs else None)
        if g.is_last_stage:
            vals = torch.stack([torch.stack([o[k].float().reshape(()) for o in outs]).sum() for k in keys])
        else:
            vals = torch.zeros(len(keys))
        if g.topology.pp > 1:
            dist.broadcast(vals, src=dist.get_global_rank(g.pgs.pp, g.topology.pp - 1), group=g.pgs.pp)
        dist.all_reduce(vals, group=g.pgs.dp)
        denom = num_micro_batches * g.topology.dp
        return {k: float(v) if k == "loss" else float(v) / denom for k, v in zip(keys, vals)}

    # ---------------------------------------------------------------- weights
    def export_hf(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors (collective; every rank gets every tensor)."""
        if self.is_critic:
            raise RuntimeError("export_hf on a critic: its value head has no HF counterpart")
        yield from export_hf_weights(self.model)
        if self.is_reward_model:   # HF *ForSequenceClassification's head, from the last pipeline stage
            head = head_weight(self.model.modules)
            yield "score.weight", self._from_last_stage(head.detach().clone() if head is not None else None)

    def local_shards(self):
        """This rank's parameter shards with their TP/EP partition metadata (no communication)."""
        return local_shards(self.model)

    def offload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> None:
        """Move params / grads / optimizer state to host memory and free the device copies."""
        self.offloader.offload(params=params, grads=grads, optimizer=optimizer)

    def onload(self) -> None:
        """Bring back everything :meth:`offload` moved."""
        self.offloader.onload()


def reference_engine(model: ModelOptions, groups: ParallelGroups) -> PolicyEngine:
    """A frozen copy (forward only, no DDP, no optimizer) for KL against the reference policy."""
    return PolicyEngine(model, groups, trainable=False)


def check_train_layout(path: str, topology: Topology) -> None:
    """:func:`megarl.engine.build.check_layout` plus the rules of training (no process needed):
    megatron-core's MoE layer refuses to train with tp > 1 unless sequence parallelism is on."""
    check_model_layout(read_hf_config(path), topology, train=True)


def _masked_counts(batch: SequenceBatch) -> tuple[int, int]:
    """(response tokens, sequences with at least one response token) inside ``extras['mask_T']``."""
    mask = batch.extras.get("mask_T")
    if mask is None:
        return batch.num_response_tokens, len(batch.input_ids)
    per_seq = [int(m.sum()) for m in torch.split(mask.bool(), batch.response_lengths)]
    return sum(per_seq), sum(n > 0 for n in per_seq)
