"""HybridWorker: one Ray actor per device (a gloo rank on CPU), owning that device's Megatron
shards and its end of the weight bridge.

It holds the policy shard (with its optimizer), the frozen reference when a KL term is used, the
critic (PPO), the frozen reward model of a ``model:`` reward term, its end of the weight bridge and
its shards of a checkpoint: one role object each (:mod:`megarl.actors.roles`). The actor sets the
process up (signals, log file, ``torch.distributed``, process groups), builds the roles and keeps
the methods the controller calls through Ray, each handing the call to a role; calls with several
values take and return the dataclasses of :mod:`megarl.actors.messages`. Every method is
collective: the controller calls it on all workers at once.

vLLM is not here: every engine is an :class:`megarl.rollout.engine.EngineActor` of its own.
Colocated, engine k's TP ranks share the devices of training ranks k*tp .. k*tp+tp-1, whose bridge
writes the new weights into buffers there; rank k*tp drives the engine's loads. On GPU, colocated,
vLLM sleeps while Megatron trains (``rollout.sleep_level``). ``trainer.offload_train_state`` moves
the Megatron state (params, grads, optimizer) to host memory while vLLM generates; on CPU the host
is the device, so it frees and restores the same memory (the path is exercised, nothing is gained).
"""
from __future__ import annotations

import dataclasses
import os
import signal

from megarl import faults
from megarl.compat import heap
from megarl.actors.messages import PassRequest, PassResult, UpdateRequest, UpdateResult, WorkerInfo


def receive(micro_batches: list) -> None:
    """What a rank does first with the micro-batches the controller sent (in place): the extras'
    wire encoding undone (:func:`megarl.data.wire.decode_batches`), and what they carry by
    reference fetched from Ray's object store, in one ``ray.get``: the token ids the engines put,
    the samples' routing (replayed or compared in the MoE layers), vLLM's log-probs the engines put
    and the outputs of an earlier pass (old / reference log-probs, correction weights, values,
    advantages; :func:`megarl.data.store.fetch_batches`)."""
    from megarl.data.store import fetch_batches
    from megarl.data.wire import decode_batches

    decode_batches(micro_batches)
    fetch_batches(micro_batches)


class HybridWorker:
    def __init__(self, cfg, rank: int, world_size: int, master_addr: str, master_port: int,
                 log_file: str | None = None, stage: str = "rl"):
        """``log_file``: where this process's output goes; None leaves
        it on Ray's worker log, which reaches the driver's terminal (``--verbose``). ``stage``:
        ``rl`` (policy, reference, critic, reward model as the config needs them), ``sft`` (the
        policy alone) or ``rm`` (the policy's architecture with a score head, trained as a
        Bradley-Terry reward model; :mod:`megarl.posttrain`)."""
        # Ctrl-C is the driver's to handle (megarl/driver/interrupt.py: stop at a safe point). Ray starts
        # workers in their own process group with SIGINT blocked; ignoring it keeps a phase alive without that.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # a write past a file-size limit (RLIMIT_FSIZE, like a full disk) then fails with OSError (EFBIG),
        # which the checkpoint save reports, instead of killing the process
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        if log_file is not None:   # first, so that the imports' warnings land in the file too
            from megarl.observability.console import redirect_process_output

            redirect_process_output(log_file, cfg.logging.level)
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
        import torch
        import torch.distributed as dist

        from megarl.compat import setup_cpu
        from megarl.policy import ModelOptions, OptimOptions, PolicyModel, reference_model
        from megarl.policy.lora import LoraOptions
        from megarl.models.fixtures import resolve_model_path
        from megarl.parallel.groups import build_process_groups
        from megarl.actors.algorithm import needs_critic
        from megarl.actors.roles import (BridgeEnd, CriticRole, PolicyRole, RankContext, ReferenceRole,
                                          RewardModelRole, ShardCheckpoint)

        cpu = setup_cpu()
        if cpu:   # CPU: threads per rank (1 thread per process measured 10-20x faster than 2 on 2 cores)
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
            heap.keep()   # reuse freed memory instead of page-faulting it back every micro-batch (megarl/compat/heap.py)
        else:     # Ray gives each worker one GPU (CUDA_VISIBLE_DEVICES): it is device 0 here
            os.environ["LOCAL_RANK"] = "0"
            torch.cuda.set_device(0)
        dist.init_process_group("gloo" if cpu else "nccl", rank=rank, world_size=world_size)
        loss_hook = faults.train_loss_hook(rank, cfg.topology.world_size)   # test-only fault injection
        topology = cfg.topology.to_topology()
        groups = build_process_groups(topology, seed=cfg.trainer.seed)
        self.ctx = RankContext(cfg, rank, topology, groups, resolve_model_path(cfg.model.path))
        self.stage = stage
        opts = ModelOptions(path=self.ctx.model_path, dtype=cfg.model.dtype, recompute=cfg.model.recompute,
                            moe_aux_loss_coeff=cfg.model.moe_aux_loss_coeff,
                            moe_z_loss_coeff=cfg.model.moe_z_loss_coeff, moe_dispatcher=cfg.model.moe_dispatcher)
        lora = cfg.model.lora
        lora_opts = LoraOptions(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, targets=tuple(lora.targets),
                                seed=cfg.trainer.seed) if lora.rank else None
        tr = cfg.trainer
        optim = OptimOptions(optimizer=tr.optimizer, lr=tr.lr, min_lr=tr.min_lr, warmup_steps=tr.warmup_steps,
                             decay_steps=max(1, tr.steps * cfg.algorithm.ppo_epochs * cfg.algorithm.mini_batches),
                             decay_style="cosine" if tr.min_lr < tr.lr else "constant",
                             weight_decay=tr.weight_decay, grad_clip=tr.grad_clip,
                             adam_beta1=tr.adam_beta1, adam_beta2=tr.adam_beta2, cpu_offload=tr.optimizer_offload)
        self.reference, self.critic = None, None
        self.reward_model = RewardModelRole(self.ctx, opts)
        # every rank builds them in this order (policy, reference, reward model, critic): building a model may
        # draw on the RNG
        if stage != "rl":   # megarl sft / rm / dpo: one trainable engine (dpo: and its reference), no rollout
            policy_opts = dataclasses.replace(opts, score_head=stage == "rm", lora=lora_opts)
            self.policy = PolicyRole(self.ctx, PolicyModel(policy_opts, groups, optim), stage, loss_hook)
            if stage == "dpo":   # LoRA: the policy's own weights with the adapters off
                self.reference = ReferenceRole(self.ctx, self.policy.engine if lora_opts else
                                               reference_model(opts, groups))
        else:
            policy = PolicyModel(dataclasses.replace(opts, lora=lora_opts), groups, optim)
            self.policy = PolicyRole(self.ctx, policy, stage, loss_hook)
            if cfg.algorithm.kl_coef > 0:   # LoRA: the policy's own weights with the adapters off
                self.reference = ReferenceRole(self.ctx, policy if lora_opts else reference_model(opts, groups))
            self.reward_model.configure(cfg)
            if needs_critic(cfg.algorithm):   # PPO: same architecture and checkpoint, scalar value head
                critic_optim = dataclasses.replace(optim, lr=cfg.algorithm.critic_lr or tr.lr,
                                                   min_lr=min(tr.min_lr, cfg.algorithm.critic_lr or tr.lr))
                self.critic = CriticRole(self.ctx, PolicyModel(dataclasses.replace(opts, value_head=True), groups,
                                                                critic_optim))
        self.bridge = BridgeEnd(self.ctx, self.policy.engine)
        self.checkpoint = ShardCheckpoint(self.ctx, self.policy.engine,
                                          self.critic.engine if self.critic is not None else None)

    def set_config(self, cfg) -> None:
        """Run ``cfg`` from now on (:meth:`megarl.actors.group.WorkerGroup.reuse_for` checked that
        the model, layout and fleet are the ones these engines were built for); a reward model the
        new config names is built here."""
        self.ctx.cfg = cfg
        self.reward_model.configure(cfg)

    # ------------------------------------------------------------------ queries
    def info(self) -> WorkerInfo:
        """Rank, DP rank, whether this rank returns its DP group's outputs, and where it runs."""
        from megarl.parallel.nodes import where

        g = self.ctx.groups
        return WorkerInfo(rank=self.ctx.rank, dp_rank=g.dp_rank, dp_leader=self.ctx.dp_leader, pid=os.getpid(),
                          **where())

    def precision(self) -> dict:
        """:meth:`megarl.actors.roles.PolicyRole.precision`."""
        return self.policy.precision()

    def gpu_ids(self) -> list:
        """The GPU ids Ray gave this worker (colocated engines are handed them)."""
        import ray

        return ray.get_gpu_ids()

    def object_refs(self) -> int:
        """The object references this process holds or owns (Ray's reference table): what it put
        into the object store for the controller (a forward pass's log-probs, recorded routing)
        and has not seen released yet."""
        from megarl.data.store import reference_count

        return reference_count()

    # ------------------------------------------------------------------ memory (collective)
    def _engines(self) -> list:
        """Every Megatron engine this worker holds, once: policy, reference (the policy itself under
        LoRA), critic, reward model."""
        roles = (self.policy, self.reference, self.critic, self.reward_model)
        engines = [r.engine for r in roles if r is not None and r.engine is not None]
        return [e for i, e in enumerate(engines) if all(e is not f for f in engines[:i])]

    def offload(self) -> int:
        """Move every engine's params, grads and optimizer state to host memory; the bytes moved."""
        engines = self._engines()
        for e in engines:
            e.offload()
        return sum(e.offloader.offloaded_bytes for e in engines)

    def onload(self) -> None:
        for e in self._engines():
            e.onload()

    # ------------------------------------------------------------------ passes and updates (collective)
    def logprobs(self, micro_batches, request: PassRequest) -> PassResult | None:
        """A forward pass before the update, of the policy (old log-probs) or the reference
        (:class:`megarl.actors.roles.PolicyRole` / :class:`megarl.actors.roles.ReferenceRole`):
        the DP leaders' :class:`PassResult`, else None. The per-token outputs stay on this rank
        and in the object store."""
        receive(micro_batches)
        role = self.reference if request.reference else self.policy
        return role.logprobs(micro_batches, request)

    def values(self, micro_batches) -> list | None:
        """:meth:`megarl.actors.roles.CriticRole.values`."""
        receive(micro_batches)
        return self.critic.values(micro_batches)

    def reward_scores(self, micro_batches) -> list | None:
        """The reward model's score of each sequence, per micro-batch ``[N]`` (DP leaders; else
        None): the frozen reward model of an RL run, or the one an ``rm`` stage trains."""
        engine = self.reward_model.engine if self.stage == "rl" else self.policy.engine
        outs = engine.forward_scores(micro_batches)
        return outs if self.ctx.dp_leader else None

    def advantages(self, inputs, adv_fn, adv_opts: dict, kl_coef: float | None, old_lp, ref_lp, values) -> dict:
        """The step's advantages from the per-token inputs in the object store
        (:func:`megarl.data.batch.stored_advantages`), on this rank."""
        from megarl.data.batch import stored_advantages

        return stored_advantages(inputs, adv_fn, adv_opts, kl_coef, old_lp, ref_lp, values)

    def train_critic(self, micro_batches) -> UpdateResult:
        receive(micro_batches)
        return self.critic.train(micro_batches)

    def train(self, micro_batches, request: UpdateRequest) -> UpdateResult:
        """One policy update (:meth:`megarl.actors.roles.PolicyRole.train`)."""
        receive(micro_batches)
        return self.policy.train(micro_batches, request)

    def posttrain_step(self, micro_batches, options: dict) -> dict:
        """One optimizer step of an ``sft``, ``rm`` or ``dpo`` stage
        (:mod:`megarl.algorithms.posttrain`); dpo: the reference's log-probs first."""
        if self.reference is not None:
            self.reference.attach_logprobs(micro_batches)
        return self.policy.posttrain_step(micro_batches, options)

    def posttrain_eval(self, micro_batches, options: dict) -> dict:
        """The held-out loss and metrics of ``micro_batches`` (forward only; the same numbers a
        train step reports, without the update). Every rank returns them."""
        if self.reference is not None:
            self.reference.attach_logprobs(micro_batches)
        return self.policy.posttrain_eval(micro_batches, options)

    def reference_logps(self, micro_batches) -> list | None:
        """:meth:`megarl.actors.roles.ReferenceRole.sequence_logps` (``megarl dpo``, precomputed)."""
        return self.reference.sequence_logps(micro_batches)

    def release_reference(self) -> None:
        """Drop a separate reference model once its log-probs are precomputed (under LoRA the
        reference is the policy itself: kept)."""
        import gc

        if self.reference is not None and self.reference.engine is not self.policy.engine:
            self.reference = None
            gc.collect()

    def export_hf(self, folder: str) -> None:
        """:meth:`megarl.actors.roles.PolicyRole.export_hf`."""
        self.policy.export_hf(folder)

    # ------------------------------------------------------------------ weight bridge (collective)
    def attach_engines(self, engines: list) -> None:
        """Build the weight bridge to the fleet's ``engines`` (:class:`megarl.actors.roles.BridgeEnd`)."""
        self.bridge.attach(engines)

    def replace_engine(self, k: int, actor) -> dict:
        """Engine ``k`` was restarted as ``actor``: it gets the current weights."""
        return self.bridge.replace_engine(k, actor)

    def sync_weights(self) -> dict:
        """Push the weights into every engine; this rank's stats."""
        return self.bridge.sync()

    # ------------------------------------------------------------------ checkpoints (collective)
    def save_checkpoint(self, folder: str) -> None:
        """Model + optimizer (megatron dist checkpoint) and this rank's RNG states into ``folder``."""
        self.checkpoint.save(folder)

    def load_checkpoint(self, folder: str) -> None:
        self.checkpoint.load(folder)

    def hash_checkpoint_files(self, folder: str, relpaths: list[str], sync: bool) -> dict:
        """This worker's slice of a checkpoint's manifest (:func:`megarl.checkpoint_files.hash_files`)."""
        from megarl.checkpoint_files import hash_files

        return hash_files(folder, relpaths, sync)

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def shutdown(self) -> None:
        """Nothing of its own to stop (the engines are actors of their own): a no-op kept so that
        :meth:`megarl.actors.placement.Placement.close` treats every actor alike."""
