"""The Megatron policy model: this rank's policy, reference, critic or reward model.

:class:`PolicyModel` owns this rank's model chunks (and, when trainable, megatron-core DDP and
the distributed optimizer). Every method is collective over all ranks of the layout; every
rank of a model-parallel group (tp, pp, cp, ep) must pass the same micro-batches, DP ranks
pass their own. The engine holds its roles as parts: a :class:`MicroBatchRunner` (packing and
megatron's pipeline schedule, :mod:`megarl.policy.schedule`), for a trainable engine a
:class:`TrainStep` (optimizer, loss scaling, LR schedule, :mod:`megarl.policy.train`), and an
:class:`Offloader` (:mod:`megarl.policy.offload`); the forward-only passes, the export of its
weights and the precision report are its own.

Shape legend: R packed response tokens of a micro-batch, E experts, Lm MoE layers.
"""
from __future__ import annotations

from typing import Callable, Iterator, Optional

import torch

from megarl.policy.build import BuiltModel, ModelOptions, build_model, check_layout, read_hf_config
from megarl.policy.export import export_hf_weights, local_shards
from megarl.policy.logprobs import LogprobOutput, PackedMicroBatch, response_logprobs
from megarl.policy.moe_stats import MoEStats
from megarl.policy.offload import Offloader
from megarl.policy.replay import RouterReplayer
from megarl.policy.schedule import MicroBatchRunner
from megarl.policy.train import OptimOptions, TrainStep
from megarl.policy.value import head_weight, response_values, sequence_scores
from megarl.models.dims import check_model_layout
from megarl.parallel.groups import ParallelGroups
from megarl.parallel.topology import Topology


class PolicyModel:
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
        self.runner = MicroBatchRunner(self.model, groups, self.router,
                                       select_logits=self._extract is response_logprobs)
        self.training: Optional[TrainStep] = None
        """A trainable engine's optimizer and train step."""
        if trainable:
            self.training = TrainStep(self.optim, self.model, groups, self.runner, self.router, self.moe,
                                      self._extract, self.distributed_optimizer)
        else:
            for chunk in self.model.chunks:
                chunk.requires_grad_(False)
                for m in chunk.modules():   # CPU: the frozen model's attention may use the fused kernel (te_cpu)
                    if hasattr(m, "fused_without_grad"):
                        m.fused_without_grad = True
        self.optimizer = self.training.optimizer if trainable else None
        """megatron-core's optimizer (None when frozen)."""
        self.offloader = Offloader(self)

    @property
    def step_count(self) -> int:
        """Updates applied so far, the LR schedule's position (0 when frozen); a checkpoint saves
        it and sets it back on resume."""
        return self.training.step_count if self.training is not None else 0

    @step_count.setter
    def step_count(self, value: int) -> None:
        self.training.step_count = value

    def precision(self) -> dict:
        """The dtypes this rank trains with: ``params`` (the model's, what the forward computes
        in and the bridge reads), ``main_params`` (what the optimizer updates: fp32 shards of the
        distributed optimizer under bf16), ``optimizer_state`` (Adam's moments; None before the
        first step creates them) and ``grads`` (megatron's gradient buffers)."""

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

    @torch.no_grad()
    def forward_logprobs(self, micro_batches, with_entropy: bool = False,
                         routing: Optional[str] = None, record_routing: bool = False) -> list[LogprobOutput]:
        """Response-token log-probs (and entropy) of each micro-batch, on every rank (a critic:
        its values, in ``logprobs_R``; see :meth:`forward_values`).

        MoE models (:mod:`megarl.policy.replay`): ``routing`` ``compare`` the layers' own routing
        with the micro-batches' ``routing`` or ``replay`` it (compared first; :attr:`routing_report`
        then holds the agreement); ``record_routing``: return the layers' own routing
        (:attr:`LogprobOutput.routing`); ``routing="record"`` is short for that alone."""
        if routing == "record":
            routing, record_routing = None, True
        micro_batches = self.runner.check(micro_batches)
        for c in self.model.chunks:
            c.eval()

        def loss_func(mb: PackedMicroBatch, output):
            logprobs_R, entropy_R = self._extract(output, mb, self.groups.pgs, with_entropy)
            return torch.zeros(()), {"logprobs": logprobs_R, "entropy": entropy_R}

        self.moe.reset()
        self.router.start(routing, "logprob", record=record_routing)
        outs = self.runner.run(micro_batches, loss_func, forward_only=True)
        outs = self.runner.from_last_stage([(o["logprobs"], o["entropy"]) for o in outs] if outs else None)
        result = [LogprobOutput(lp, ent, b.cu_seqlens_N1) for (lp, ent), b in zip(outs, micro_batches)]
        self.routing_report = {}
        if self.router.action in ("compare", "replay"):
            for out, miss in zip(result, self.router.token_misses(self.runner.packed)):
                out.routing_miss_R = miss
        if self.router.record:
            for out, own in zip(result, self.router.recorded(self.runner.packed)):
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
        """One optimizer step over ``micro_batches`` (gradient accumulation).

        ``loss_fn(logprobs_R, batch) -> (loss, metrics)`` gets the log-probs of one micro-batch's
        response tokens (whole sequences, also under CP) and returns that micro-batch's *share of
        the step loss*: the step loss is the SUM of the returned losses over micro-batches and DP
        ranks. To normalise, ``batch.num_global_tokens`` / ``batch.num_global_sequences`` hold the
        step's response-token count and sequence count over all micro-batches and DP ranks, both
        under ``extras['mask_T']`` when present: the masked-in tokens, and the sequences with at
        least one (e.g. pass them as ``num_tokens`` / ``num_seqs`` to
        :func:`megarl.algorithms.losses.aggregate_loss`, whose own sequence means skip fully
        masked sequences too; a rollout correction that drops whole sequences,
        :mod:`megarl.algorithms.offpolicy`, must not leave them in the denominator). How that maps
        onto megatron's loss scaling, and the LR schedule: :mod:`megarl.policy.train`.
        For a critic, ``loss_fn`` gets the values ``[R]`` in place of the log-probs.
        ``replay_routing`` (MoE): the MoE layers use the micro-batches' ``routing``
        (:mod:`megarl.policy.replay`; also in activation recomputes); the result then has
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
        :meth:`megarl.policy.train.TrainStep.all_finite`): ``update_successful`` is False,
        ``grad_norm`` NaN, the weights and optimizer state stay as they were, the gradients are
        zeroed, and ``step`` (the LR schedule's position: the number of updates applied) does not
        advance.
        """
        if not self.trainable:
            raise RuntimeError("train_step on a frozen (reference) engine; build it with trainable=True")
        return self.training.step(micro_batches, loss_fn, with_entropy, replay_routing, return_logprobs)

    def ensure_optimizer_state(self) -> None:
        """Give Adam the state its first update creates (zero moments, step 0) when no update has
        been applied yet (all skipped, see :meth:`train_step`), so that a checkpoint can be saved:
        torch's AdamW creates its state lazily, and megatron-core's distributed optimizer asserts
        that it has one ``step`` when it saves. An update at lr 0 with zero gradients creates it
        without changing a weight (:meth:`megarl.policy.train.TrainStep.ensure_state`)."""
        self.training.ensure_state()

    def export_hf(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors (collective; every rank gets every tensor)."""
        if self.is_critic:
            raise RuntimeError("export_hf on a critic: its value head has no HF counterpart")
        yield from export_hf_weights(self.model)
        if self.is_reward_model:   # HF *ForSequenceClassification's head, from the last pipeline stage
            head = head_weight(self.model.modules)
            yield "score.weight", self.runner.from_last_stage(head.detach().clone() if head is not None else None)

    def local_shards(self):
        """This rank's parameter shards with their TP/EP partition metadata (no communication)."""
        return local_shards(self.model)

    def offload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> None:
        """Move params / grads / optimizer state to host memory and free the device copies."""
        self.offloader.offload(params=params, grads=grads, optimizer=optimizer)

    def onload(self) -> None:
        """Bring back everything :meth:`offload` moved."""
        self.offloader.onload()


def reference_model(model: ModelOptions, groups: ParallelGroups) -> PolicyModel:
    """A frozen copy (forward only, no DDP, no optimizer) for KL against the reference policy."""
    return PolicyModel(model, groups, trainable=False)


def check_train_layout(path: str, topology: Topology) -> None:
    """:func:`megarl.policy.build.check_layout` plus the rules of training (no process needed):
    megatron-core's MoE layer refuses to train with tp > 1 unless sequence parallelism is on."""
    check_model_layout(read_hf_config(path), topology, train=True)


