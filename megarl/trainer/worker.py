"""HybridWorker: one per device (a gloo rank on CPU), owning its Megatron shard and the weight
bridge's end on that device.

Each worker holds the policy shard (with its optimizer), the frozen reference shard when a KL
term is used, and the weight bridge. Every method is collective: the controller calls it on all
workers at once.

vLLM is not here: every engine of the rollout fleet is an
:class:`megarl.rollout.engine.EngineActor` of its own (see there why). Colocated, engine k's TP
ranks share the devices of training ranks k*tp .. k*tp+tp-1; the bridge on those ranks writes the
new weights into buffers on their devices, and rank k*tp drives the engine's loads
(:meth:`attach_engines`). On GPU, colocated, vLLM sleeps while Megatron trains
(``rollout.sleep_level``; the controller's fleet does it). ``trainer.offload_train_state`` moves
the Megatron state (policy, reference, critic: params, grads, optimizer) to host memory while
vLLM generates; on CPU the host is the device, so it frees and restores the same memory (the path
is exercised, nothing is gained).
"""
from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path

from megarl import faults
from megarl.compat import heap


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
        # Ctrl-C is the driver's to handle (megarl/trainer/interrupt.py: stop at a safe point). Ray starts
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
        from megarl.engine import ModelOptions, OptimOptions, PolicyEngine, reference_engine
        from megarl.models.fixtures import resolve_model_path
        from megarl.parallel.groups import build_process_groups

        cpu = setup_cpu()
        if cpu:   # CPU: threads per rank (1 thread per process measured 10-20x faster than 2 on 2 cores)
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
            heap.keep()   # reuse freed memory instead of page-faulting it back every micro-batch (megarl/compat/heap.py)
        else:     # Ray gives each worker one GPU (CUDA_VISIBLE_DEVICES): it is device 0 here
            os.environ["LOCAL_RANK"] = "0"
            torch.cuda.set_device(0)
        dist.init_process_group("gloo" if cpu else "nccl", rank=rank, world_size=world_size)
        self.cfg, self.rank, self.cpu = cfg, rank, cpu
        self.faults, self.num_train_calls = faults.planned(), 0   # test-only fault injection (megarl/faults.py)
        self.topology = cfg.topology.to_topology()
        self.groups = build_process_groups(self.topology, seed=cfg.trainer.seed)
        self.model_path = resolve_model_path(cfg.model.path)
        opts = ModelOptions(path=self.model_path, dtype=cfg.model.dtype, recompute=cfg.model.recompute,
                            moe_aux_loss_coeff=cfg.model.moe_aux_loss_coeff,
                            moe_z_loss_coeff=cfg.model.moe_z_loss_coeff, moe_dispatcher=cfg.model.moe_dispatcher)
        tr = cfg.trainer
        optim = OptimOptions(optimizer=tr.optimizer, lr=tr.lr, min_lr=tr.min_lr, warmup_steps=tr.warmup_steps,
                             decay_steps=max(1, tr.steps * cfg.algorithm.ppo_epochs * cfg.algorithm.mini_batches),
                             decay_style="cosine" if tr.min_lr < tr.lr else "constant",
                             weight_decay=tr.weight_decay, grad_clip=tr.grad_clip,
                             adam_beta1=tr.adam_beta1, adam_beta2=tr.adam_beta2, cpu_offload=tr.optimizer_offload)
        self.stage, self.opts = stage, opts
        self.ref = self.critic = self.reward_model = None
        self.reward_model_path = None
        self.bridge, self.engine_index = None, None
        if stage != "rl":   # megarl sft / rm: one trainable engine, no rollout
            self.policy = PolicyEngine(dataclasses.replace(opts, score_head=stage == "rm"), self.groups, optim)
            return
        self.policy = PolicyEngine(opts, self.groups, optim)
        self.ref = reference_engine(opts, self.groups) if cfg.algorithm.kl_coef > 0 else None
        self._build_reward_model(cfg)
        from megarl.trainer.algorithm import needs_critic

        if needs_critic(cfg.algorithm):   # PPO: same architecture and checkpoint, scalar value head
            critic_optim = dataclasses.replace(optim, lr=cfg.algorithm.critic_lr or tr.lr,
                                               min_lr=min(tr.min_lr, cfg.algorithm.critic_lr or tr.lr))
            self.critic = PolicyEngine(dataclasses.replace(opts, value_head=True), self.groups, critic_optim)

    def _build_reward_model(self, cfg) -> None:
        """The frozen reward model of ``data.reward``'s ``model:PATH`` term (none without one),
        in the policy's layout and dtype; kept while the path stays the same."""
        from megarl.engine import PolicyEngine
        from megarl.rewards.spec import model_term, parse_reward

        term = model_term(parse_reward(cfg.data.reward))
        path = term.path if term is not None else None
        if path == self.reward_model_path:
            return
        self.reward_model, self.reward_model_path = None, path
        if path is not None:
            self.reward_model = PolicyEngine(dataclasses.replace(self.opts, path=path, score_head=True,
                                                                 recompute="none"),
                                             self.groups, trainable=False)

    def set_config(self, cfg) -> None:
        """Run ``cfg`` from now on (:meth:`megarl.trainer.workers.WorkerGroup.reuse_for` checked that
        the model, layout and fleet are the ones these engines were built for); a reward model the
        new config names is built here."""
        self.cfg = cfg
        self._build_reward_model(cfg)

    def attach_engines(self, engines: list) -> None:
        """Build the weight bridge to the fleet's ``engines`` (EngineActor handles, engine order;
        collective). vLLM TP rank r of engine k is written by training rank k*tp + r, and rank
        k*tp drives engine k's loads."""
        from megarl.bridge import WeightBridge
        from megarl.parallel.nodes import where
        from megarl.rollout.engine import RemoteEngine

        tp = self.cfg.rollout.tp
        drives = self.rank % tp == 0 and self.rank // tp < len(engines)
        self.engine_index = self.rank // tp if drives else None
        self.bridge = WeightBridge(self.policy.local_shards, self.policy.model.hf_config, self.topology,
                                   vllm_tp=tp, llm=RemoteEngine(engines[self.engine_index]) if drives else None,
                                   options=self.cfg.bridge.sync_options(dtype=self.cfg.model.dtype),
                                   vllm_devices=tuple(range(len(engines) * tp)), node=where()["node_id"])

    # ------------------------------------------------------------------ queries
    def info(self) -> dict:
        """Rank, DP rank, whether this rank returns its DP group's outputs, and where it runs
        (pid and :func:`megarl.parallel.nodes.where`: for the placement log and error messages)."""
        from megarl.parallel.nodes import where

        g = self.groups
        leader = g.tp_rank == 0 and g.cp_rank == 0 and g.is_last_stage
        return {"rank": self.rank, "dp_rank": g.dp_rank, "dp_leader": leader, "pid": os.getpid(), **where()}

    def precision(self) -> dict:
        """The policy's dtypes on this rank (:meth:`megarl.engine.policy.PolicyEngine.precision`)
        and the dtype the bridge sends to vLLM."""
        return {**self.policy.precision(), "sent_to_vllm": self.cfg.model.dtype}

    def replace_engine(self, k: int, actor) -> dict:
        """Engine ``k`` was restarted as ``actor``: its driver rank points its bridge there, and
        every rank sends it the current weights (collective; the other engines are left alone)."""
        from megarl.rollout.engine import RemoteEngine

        if self.engine_index == k:
            self.bridge.llm = RemoteEngine(actor)
        return self.bridge.sync(engine=k)

    def gpu_ids(self) -> list:
        """The GPU ids Ray gave this worker (colocated engines are handed them)."""
        import ray

        return ray.get_gpu_ids()

    def _models(self) -> list:
        """Every engine this worker holds: policy, reference, critic, reward model."""
        return [e for e in (self.policy, self.ref, self.critic, self.reward_model) if e is not None]

    def offload(self) -> dict:
        """Move every engine's params, grads and optimizer state to host memory (collective)."""
        engines = self._models()
        for e in engines:
            e.offload()
        return {"offloaded_bytes": sum(e.offloader.offloaded_bytes for e in engines)}

    def onload(self) -> None:
        for e in self._models():
            e.onload()

    # ------------------------------------------------------------------ training (collective)
    def logprobs(self, micro_batches, reference: bool, routing: str | None = None, record_routing: bool = False,
                 version: int | None = None, with_kl: bool = False):
        """A forward pass before the update; DP leaders: ``([(outputs, recorded routing)] per
        micro-batch, the routing report)``, else None. The per-token outputs stay on this rank and
        in the object store: ``outputs`` is, for the policy's old-log-prob pass,
        :func:`megarl.trainer.readout.old_pass_outputs` (``version``: the policy version whose
        alarm it reads), for the reference pass :func:`megarl.trainer.readout.reference_pass_outputs`
        (``with_kl``: the micro-batches carry the old pass's log-probs). The recorded routing
        (``record_routing``) is put into the object store, owned here."""
        from megarl.data.store import put_all
        from megarl.trainer.readout import old_pass_outputs, reference_pass_outputs

        engine = self.ref if reference else self.policy
        receive(micro_batches)
        outs = engine.forward_logprobs(micro_batches, with_entropy=not reference, routing=routing,
                                       record_routing=record_routing)
        if not self.info()["dp_leader"]:
            return None
        kept = [reference_pass_outputs(o.logprobs_R, b, with_kl) if reference
                else old_pass_outputs(o.logprobs_R, o.entropy_R, b, version, self.cfg.algorithm, o.routing_miss_R)
                for o, b in zip(outs, micro_batches)]   # the routing misses: in the old pass's sums
        return ([(k, put_all(o.routing) if o.routing is not None else None) for k, o in zip(kept, outs)],
                engine.routing_report)

    def reward_scores(self, micro_batches):
        """The reward model's score of each sequence, per micro-batch ``[N]`` (DP leaders; else
        None): the frozen reward model of an RL run, or the one an ``rm`` stage trains."""
        engine = self.reward_model if self.stage == "rl" else self.policy
        outs = engine.forward_scores(micro_batches)
        return outs if self.info()["dp_leader"] else None

    def posttrain_step(self, micro_batches, options: dict) -> dict:
        """One optimizer step of an ``sft`` or ``rm`` stage (:mod:`megarl.algorithms.posttrain`)."""
        from megarl.algorithms.posttrain import make_loss_fn

        return self.policy.train_step(micro_batches, make_loss_fn(self.stage, **options))

    def posttrain_eval(self, micro_batches, options: dict) -> dict:
        """The held-out loss and metrics of ``micro_batches`` (forward only; the same numbers a
        train step reports, without the update). Every rank returns them."""
        import torch
        import torch.distributed as dist

        from megarl.algorithms.posttrain import eval_sums

        sums = eval_sums(self.stage, self.policy, micro_batches, **options)
        names = sorted(sums)
        vals = torch.tensor([float(sums[k]) for k in names], dtype=torch.float64)
        dist.all_reduce(vals, group=self.groups.pgs.dp)
        return dict(zip(names, vals.tolist()))

    def values(self, micro_batches):
        """The critic's values of the response tokens, put into the object store by the DP leaders
        (one object per micro-batch, a :class:`megarl.data.store.Rows` per sample:
        :func:`megarl.data.store.put_rows`); None on the other ranks."""
        from megarl.data.store import put_rows

        receive(micro_batches)
        outs = self.critic.forward_values(micro_batches)
        if not self.info()["dp_leader"]:
            return None
        return [put_rows(o, b.response_lengths) for o, b in zip(outs, micro_batches)]

    def advantages(self, inputs, adv_fn, adv_opts: dict, kl_coef: float | None, old_lp, ref_lp, values) -> dict:
        """The step's advantages from the per-token inputs in the object store
        (:func:`megarl.trainer.batch.stored_advantages`), on this rank."""
        from megarl.trainer.batch import stored_advantages

        return stored_advantages(inputs, adv_fn, adv_opts, kl_coef, old_lp, ref_lp, values)

    def train_critic(self, micro_batches) -> dict:
        from megarl.trainer.algorithm import make_value_loss_fn

        receive(micro_batches)
        out = self.critic.train_step(micro_batches, make_value_loss_fn(self.cfg.algorithm,
                                                                       self.cfg.rollout.max_response_tokens))
        return out

    def train(self, micro_batches, kl_coef: float, replay_routing: bool = False,
              own_old_logprobs: bool = False, version: int | None = None) -> dict:
        """One policy update. ``own_old_logprobs``: the micro-batches carry no ``old_logprobs_T``;
        the loss takes the training forward's own (:func:`megarl.config.passes.needs_old_logprob_pass`)
        and the DP leaders return what the controller reads of that forward's log-probs and
        entropy in ``outputs``: per micro-batch, its samples' read-outs
        (:func:`megarl.trainer.readout.micro_batch_readouts`; ``version``: the policy version
        being trained, the alarm's), not the tokens."""
        from megarl.config.passes import correction_in_forward
        from megarl.trainer.algorithm import forward_tis_weights, make_loss_fn
        from megarl.trainer.readout import micro_batch_readouts

        receive(micro_batches)
        loss_fn = make_loss_fn(self.cfg.algorithm, self.cfg.rollout.max_response_tokens, kl_coef,
                               own_old_logprobs=own_old_logprobs)
        self.num_train_calls += 1
        if self.num_train_calls in self.faults.get("nan_loss", ()) and self.rank == self.cfg.topology.world_size - 1:
            loss_fn = faults.nan_loss(loss_fn)
        out = self.policy.train_step(micro_batches, loss_fn, with_entropy=self.cfg.algorithm.entropy_coef > 0,
                                     replay_routing=replay_routing, return_logprobs=own_old_logprobs)
        outputs = out.pop("outputs", None)
        if own_old_logprobs and self.info()["dp_leader"]:
            tis = correction_in_forward(self.cfg.algorithm)
            out["outputs"] = [micro_batch_readouts(o.logprobs_R, o.entropy_R, b, version,
                                                   forward_tis_weights(self.cfg.algorithm, o.logprobs_R, b) if tis
                                                   else None)
                              for o, b in zip(outputs, micro_batches)]
        out["weight_checksum"] = self._weight_checksum()
        return out

    def _weight_checksum(self) -> float:
        """Sum of every parameter of the model (all ranks): changes whenever an update lands."""
        import torch
        import torch.distributed as dist

        local = torch.zeros((), dtype=torch.float64)
        for chunk in self.policy.model.modules:
            for p in chunk.parameters():
                local += p.detach().double().sum()
        dist.all_reduce(local)   # replicas count several times: fine for a change detector
        return float(local)

    def sync_weights(self) -> dict:
        """Push the weights into every engine (collective); the stats of this rank (with its
        engine's load time and bytes when it drives one)."""
        import ray

        t0 = time.perf_counter()
        try:
            stats = self.bridge.sync()
        except ray.exceptions.RayActorError as err:
            from megarl.rollout.vllm_engine import EngineDied

            raise EngineDied(f"rollout engine {self.engine_index} died during the weight sync (driven by training "
                             f"rank {self.rank}): {type(err).__name__}") from err
        stats["seconds"] = time.perf_counter() - t0
        return stats

    def export_hf(self, folder: str) -> None:
        """The policy as an HF folder (collective; rank 0 writes ``model.safetensors`` and copies
        the model folder's config and tokenizer files): what a fresh vLLM engine would load. An
        ``rm`` stage writes a ``*ForSequenceClassification`` folder with one label
        (:func:`megarl.models.seqcls.reward_model_config`). Written into a temporary sibling
        folder and renamed: ``folder`` is either the last complete export or absent."""
        import shutil

        from safetensors.torch import save_file

        tensors = {name: t.detach().contiguous().clone() for name, t in self.policy.export_hf()}
        if self.rank != 0:
            return
        final, partial = Path(folder), Path(f"{folder}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        for f in Path(self.model_path).iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
                shutil.copy2(f, partial / f.name)
        if self.policy.is_reward_model:
            from megarl.models.seqcls import reward_model_config

            (partial / "config.json").write_text(reward_model_config(self.model_path))
            tensors.pop("lm_head.weight", None)
        save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)

    # ------------------------------------------------------------------ checkpoints (collective)
    def _engines(self) -> dict:
        """The trainable engines by checkpoint prefix ("" policy, "critic." critic)."""
        return {"": self.policy, **({"critic.": self.critic} if self.critic is not None else {})}

    def _sharded_state(self, is_loading: bool) -> dict:
        state = {}
        for prefix, engine in self._engines().items():
            if not is_loading:   # a checkpoint before the first applied update (all skipped so far)
                engine.ensure_optimizer_state()
            model_sd = {f"{prefix}model{i}": chunk.sharded_state_dict(prefix=prefix)
                        for i, chunk in enumerate(engine.model.modules)}
            state.update(model_sd)
            state[f"{prefix}optimizer"] = engine.optimizer.sharded_state_dict(
                model_sd, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "fully_reshardable"})
        return state

    def save_checkpoint(self, folder: str) -> None:
        """Model + optimizer (megatron dist checkpoint) and this rank's RNG states into ``folder``."""
        import torch
        from megatron.core import dist_checkpointing, tensor_parallel

        dist_checkpointing.save(self._sharded_state(is_loading=False), folder)
        torch.save({"torch": torch.get_rng_state(),
                    "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
                    "engine_step": self.policy.step_count,
                    "critic_step": self.critic.step_count if self.critic is not None else 0},
                   Path(folder) / f"rng_rank{self.rank:05d}.pt")

    def load_checkpoint(self, folder: str) -> None:
        import torch
        from megatron.core import dist_checkpointing, tensor_parallel

        from megarl.compat.megatron_fixes import find_unsafe, optimizer_classes
        from megarl.trainer.checkpoint import CheckpointError, UnsafeCheckpointError, describe_error, load_plain

        try:
            # common.pt is read with torch.load(weights_only=True): optimizer classes by name only
            # (trainer.optimizer_offload's HybridDeviceOptimizer keeps them in its parameter groups)
            with torch.serialization.safe_globals(optimizer_classes()):
                state = dist_checkpointing.load(self._sharded_state(is_loading=True), folder)
        except Exception as err:   # M2 refused a pickle of the folder: name it, do not treat it as damage
            if (unsafe := find_unsafe(err)) is not None:
                raise UnsafeCheckpointError(f"{folder}: refused to load the distributed checkpoint: {unsafe}; "
                                            "only resume from checkpoints you trust") from err
            raise
        for prefix, engine in self._engines().items():
            for i, chunk in enumerate(engine.model.modules):
                chunk.load_state_dict(_strip(state[f"{prefix}model{i}"], prefix))
            engine.optimizer.load_state_dict(state[f"{prefix}optimizer"])
        rng_file = Path(folder) / f"rng_rank{self.rank:05d}.pt"
        if rng_file.exists():
            try:
                rng = load_plain(rng_file)   # weights_only: a pickle that would run code is refused
            except UnsafeCheckpointError:
                raise
            except Exception as err:   # e.g. EOFError of a truncated file, which does not name it
                raise CheckpointError(f"{rng_file}: {describe_error(err)}") from err
            torch.set_rng_state(rng["torch"])
            tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])
            self.policy.step_count = rng["engine_step"]
            if self.critic is not None:
                self.critic.step_count = rng.get("critic_step", 0)

    def hash_checkpoint_files(self, folder: str, relpaths: list[str], sync: bool) -> dict:
        """This worker's slice of a checkpoint's manifest (:func:`megarl.trainer.checkpoint.hash_files`)."""
        from megarl.trainer.checkpoint import hash_files

        return hash_files(folder, relpaths, sync)

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def object_refs(self) -> int:
        """The object references this process holds or owns (Ray's reference table): what it put
        into the object store for the controller (a forward pass's log-probs, recorded routing)
        and has not seen released yet."""
        from megarl.data.store import reference_count

        return reference_count()

    def shutdown(self) -> None:
        """Nothing of its own to stop (the engines are actors of their own): a no-op kept so that
        :meth:`megarl.trainer.placement.Placement.close` treats every actor alike."""


def _strip(state: dict, prefix: str) -> dict:
    """A loaded model state dict with the checkpoint prefix taken off its keys."""
    return {k[len(prefix):] if prefix and k.startswith(prefix) else k: v for k, v in state.items()}
