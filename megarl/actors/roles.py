"""The roles a :class:`megarl.actors.worker.HybridWorker` plays on its device, one object each:
the policy (:class:`PolicyRole`), the frozen reference (:class:`ReferenceRole`), the critic
(:class:`CriticRole`), the frozen reward model (:class:`RewardModelRole`), this rank's end of the
weight bridge (:class:`BridgeEnd`) and its shards of a checkpoint (:class:`ShardCheckpoint`).

Each role owns its Megatron engine (:class:`megarl.policy.model.PolicyModel`) or bridge and
reads the run through one shared :class:`RankContext`; the actor builds the roles, receives the
micro-batches (:func:`megarl.actors.worker.receive`) and hands each call to its role. Every
method is collective over the training ranks, as the actor's methods are.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from megarl.actors.messages import MicroBatchPass, PassRequest, PassResult, UpdateRequest, UpdateResult

LORA_FILE = "lora.json"
"""In a LoRA policy's checkpoint: the adapters' layout (:func:`megarl.policy.lora.lora_layout`)."""


@dataclass
class RankContext:
    """What every role of a training rank reads: the run's config (replaced by
    :meth:`HybridWorker.set_config`), the rank, its layout and process groups, the model folder."""

    cfg: object
    rank: int
    topology: object
    groups: object
    """The rank's :class:`megarl.parallel.groups.ProcessGroups`."""
    model_path: str

    @property
    def dp_leader(self) -> bool:
        """Whether this rank returns its DP group's outputs: TP rank 0, CP rank 0, last stage."""
        g = self.groups
        return g.tp_rank == 0 and g.cp_rank == 0 and g.is_last_stage


def _pass_result(engine, outs: list, kept: list) -> PassResult:
    """A DP leader's reply to a forward pass: per micro-batch what it keeps (``kept``) and the
    routing it recorded, put into the object store (owned here)."""
    from megarl.data.store import put_all

    return PassResult([MicroBatchPass(k, put_all(o.routing) if o.routing is not None else None)
                       for k, o in zip(kept, outs)], engine.routing_report)


class PolicyRole:
    """The trainable policy shard: its old-log-prob pass, its update (with the weights' checksum),
    its HF export, and the steps of an ``sft`` / ``rm`` stage (``stage``)."""

    def __init__(self, ctx: RankContext, engine, stage: str, loss_hook: Callable):
        """``loss_hook``: applied to each update's loss function (:func:`megarl.faults.train_loss_hook`)."""
        self.ctx, self.engine, self.stage, self.loss_hook = ctx, engine, stage, loss_hook

    def logprobs(self, micro_batches, request: PassRequest) -> Optional[PassResult]:
        """The old-log-prob pass; DP leaders: per micro-batch its
        :func:`megarl.data.readout.old_pass_outputs` (the routing misses in its sums), else None."""
        from megarl.data.readout import old_pass_outputs

        outs = self.engine.forward_logprobs(micro_batches, with_entropy=True, routing=request.routing,
                                            record_routing=request.record_routing)
        if not self.ctx.dp_leader:
            return None
        kept = [old_pass_outputs(o.logprobs_R, o.entropy_R, b, request.version, self.ctx.cfg.algorithm,
                                 o.routing_miss_R) for o, b in zip(outs, micro_batches)]
        return _pass_result(self.engine, outs, kept)

    def train(self, micro_batches, request: UpdateRequest) -> UpdateResult:
        """One policy update; with ``own_old_logprobs`` the DP leaders return, per micro-batch,
        its samples' read-outs of the training forward (:func:`megarl.data.readout.micro_batch_readouts`),
        not the tokens."""
        from megarl.config.passes import correction_in_forward
        from megarl.actors.algorithm import forward_tis_weights, make_loss_fn
        from megarl.data.readout import micro_batch_readouts

        a = self.ctx.cfg.algorithm
        loss_fn = self.loss_hook(make_loss_fn(a, self.ctx.cfg.rollout.max_response_tokens, request.kl_coef,
                                              own_old_logprobs=request.own_old_logprobs))
        out = self.engine.train_step(micro_batches, loss_fn, with_entropy=a.entropy_coef > 0,
                                     replay_routing=request.replay_routing, return_logprobs=request.own_old_logprobs)
        outputs, readouts = out.pop("outputs", None), None
        if request.own_old_logprobs and self.ctx.dp_leader:
            tis = correction_in_forward(a)
            readouts = [micro_batch_readouts(o.logprobs_R, o.entropy_R, b, request.version,
                                             forward_tis_weights(a, o.logprobs_R, b) if tis else None)
                        for o, b in zip(outputs, micro_batches)]
        out["weight_checksum"] = self.weight_checksum()
        return UpdateResult(out, readouts)

    def weight_checksum(self) -> float:
        """Sum of every parameter of the model (all ranks): changes whenever an update lands."""
        import torch
        import torch.distributed as dist

        local = torch.zeros((), dtype=torch.float64)
        for chunk in self.engine.model.modules:
            for p in chunk.parameters():
                local += p.detach().double().sum()
        dist.all_reduce(local)   # replicas count several times: fine for a change detector
        return float(local)

    def precision(self) -> dict:
        """The policy's dtypes on this rank (:meth:`megarl.policy.model.PolicyModel.precision`)
        and the dtype the bridge sends to vLLM."""
        return {**self.engine.precision(), "sent_to_vllm": self.ctx.cfg.model.dtype}

    def posttrain_step(self, micro_batches, options: dict) -> dict:
        """One optimizer step of an ``sft`` or ``rm`` stage (:mod:`megarl.algorithms.posttrain`)."""
        from megarl.algorithms.posttrain import make_loss_fn

        return self.engine.train_step(micro_batches, make_loss_fn(self.stage, **options))

    def posttrain_eval(self, micro_batches, options: dict) -> dict:
        """The held-out sums of ``micro_batches`` over the DP group (forward only)."""
        import torch
        import torch.distributed as dist

        from megarl.algorithms.posttrain import eval_sums

        sums = eval_sums(self.stage, self.engine, micro_batches, **options)
        names = sorted(sums)
        vals = torch.tensor([float(sums[k]) for k in names], dtype=torch.float64)
        dist.all_reduce(vals, group=self.ctx.groups.pgs.dp)
        return dict(zip(names, vals.tolist()))

    def export_hf(self, folder: str) -> None:
        """The policy as an HF folder (collective; rank 0 writes ``model.safetensors`` and copies
        the model folder's config and tokenizer files): what a fresh vLLM engine would load. An
        ``rm`` stage writes a ``*ForSequenceClassification`` folder with one label
        (:func:`megarl.models.seqcls.reward_model_config`). A LoRA policy's weights are the merged
        W + alpha/r B A, and its adapters go beside them as a PEFT folder, ``folder/adapter``
        (``adapter_config.json``, ``adapter_model.safetensors``; ``PeftModel.from_pretrained`` on
        the base model). Written into a temporary sibling folder and renamed: ``folder`` is either
        the last complete export or absent."""
        import shutil

        from safetensors.torch import save_file

        from megarl.policy.lora import peft_state, write_peft_folder

        tensors = {name: t.detach().contiguous().clone() for name, t in self.engine.export_hf()}
        adapters = self.engine.model.adapters
        peft = peft_state(adapters, self.engine.model.mapping, self.engine.groups) if adapters else None
        if self.ctx.rank != 0:
            return
        model_path = self.ctx.model_path
        final, partial = Path(folder), Path(f"{folder}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        for f in Path(model_path).iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
                shutil.copy2(f, partial / f.name)
        if self.engine.is_reward_model:
            from megarl.models.seqcls import reward_model_config

            (partial / "config.json").write_text(reward_model_config(model_path))
            tensors.pop("lm_head.weight", None)
        save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
        if peft is not None:
            write_peft_folder(partial / "adapter", peft, adapters[0].options, str(model_path))
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)


class ReferenceRole:
    """The frozen reference shard (a KL term): its log-prob pass, with the engine's LoRA adapters
    disabled: under LoRA ``engine`` is the policy itself (its frozen base weights: no second model);
    a separate reference model has none."""

    def __init__(self, ctx: RankContext, engine):
        self.ctx, self.engine = ctx, engine

    def logprobs(self, micro_batches, request: PassRequest) -> Optional[PassResult]:
        """DP leaders: per micro-batch its :func:`megarl.data.readout.reference_pass_outputs`
        (``with_kl``: the micro-batches carry the old pass's log-probs), else None."""
        from megarl.data.readout import reference_pass_outputs

        from megarl.policy.lora import adapters_disabled

        with adapters_disabled(self.engine.model.adapters):
            outs = self.engine.forward_logprobs(micro_batches, with_entropy=False, routing=request.routing,
                                                record_routing=request.record_routing)
        if not self.ctx.dp_leader:
            return None
        kept = [reference_pass_outputs(o.logprobs_R, b, request.with_kl) for o, b in zip(outs, micro_batches)]
        return _pass_result(self.engine, outs, kept)

    def _forward(self, micro_batches) -> list:
        from megarl.policy.lora import adapters_disabled

        with adapters_disabled(self.engine.model.adapters):
            return self.engine.forward_logprobs(micro_batches, with_entropy=False)

    def attach_logprobs(self, micro_batches) -> None:
        """Put the reference's response log-probs into each micro-batch's ``extras['ref_logprobs_R']``
        (``megarl dpo``: they stay on this rank, where the policy's loss reads them), unless every
        micro-batch carries its precomputed sums (``extras['ref_logps_N']``)."""
        if all("ref_logps_N" in b.extras for b in micro_batches):
            return
        for o, b in zip(self._forward(micro_batches), micro_batches):
            if o.logprobs_R is not None:
                b.extras["ref_logprobs_R"] = o.logprobs_R.detach()

    def sequence_logps(self, micro_batches) -> Optional[list]:
        """DP leaders: per micro-batch, each sequence's response log-prob ``[N]`` (float64 of the
        fp32 sum the loss would take; ``megarl dpo`` precomputing its reference), else None."""
        from megarl.algorithms.posttrain import sequence_logps

        outs = self._forward(micro_batches)
        if not self.ctx.dp_leader:
            return None
        return [sequence_logps(o.logprobs_R.float(), b).double() for o, b in zip(outs, micro_batches)]


class CriticRole:
    """The critic shard (PPO): the policy's architecture and checkpoint with a scalar value head."""

    def __init__(self, ctx: RankContext, engine):
        self.ctx, self.engine = ctx, engine

    def values(self, micro_batches) -> Optional[list]:
        """The values of the response tokens, put into the object store by the DP leaders (one
        object per micro-batch, a :class:`megarl.data.store.Rows` per sample:
        :func:`megarl.data.store.put_rows`); None on the other ranks."""
        from megarl.data.store import put_rows

        outs = self.engine.forward_values(micro_batches)
        if not self.ctx.dp_leader:
            return None
        return [put_rows(o, b.response_lengths) for o, b in zip(outs, micro_batches)]

    def train(self, micro_batches) -> UpdateResult:
        from megarl.actors.algorithm import make_value_loss_fn

        cfg = self.ctx.cfg
        return UpdateResult(self.engine.train_step(
            micro_batches, make_value_loss_fn(cfg.algorithm, cfg.rollout.max_response_tokens)))


class RewardModelRole:
    """The frozen reward model of ``data.reward``'s ``model:PATH`` term (``engine`` None without
    one), in the policy's layout and dtype (``opts``); kept while the path stays the same."""

    def __init__(self, ctx: RankContext, opts):
        self.ctx, self.opts = ctx, opts
        self.engine, self.path = None, None

    def configure(self, cfg) -> None:
        """Build the reward model ``cfg`` names, unless it is the one held."""
        from megarl.policy import PolicyModel
        from megarl.rewards.spec import model_term, parse_reward

        term = model_term(parse_reward(cfg.data.reward))
        path = term.path if term is not None else None
        if path == self.path:
            return
        self.engine, self.path = None, path
        if path is not None:
            self.engine = PolicyModel(dataclasses.replace(self.opts, path=path, score_head=True, recompute="none"),
                                       self.ctx.groups, trainable=False)


class BridgeEnd:
    """This rank's end of the weight bridge (:class:`megarl.bridge.WeightBridge`) from the
    policy's shards to the fleet's engines. vLLM TP rank r of engine k is written by training rank
    k*tp + r, and rank k*tp drives engine k's loads (``engine_index``). A LoRA policy in adapter
    mode syncs its adapters instead (:class:`megarl.actors.adapter_sync.AdapterSync`)."""

    def __init__(self, ctx: RankContext, policy_engine):
        self.ctx, self.policy = ctx, policy_engine
        self.bridge, self.engine_index = None, None

    def attach(self, engines: list) -> None:
        """Build the bridge to ``engines`` (EngineActor handles, engine order)."""
        from megarl.bridge import WeightBridge
        from megarl.parallel.nodes import where
        from megarl.rollout.build import takes_adapter
        from megarl.rollout.engine import RemoteEngine

        cfg, rank = self.ctx.cfg, self.ctx.rank
        tp = cfg.rollout.tp
        drives = rank % tp == 0 and rank // tp < len(engines)
        self.engine_index = rank // tp if drives else None
        if takes_adapter(cfg):
            from megarl.actors.adapter_sync import AdapterSync

            self.bridge = AdapterSync(self.policy, str(self.ctx.model_path),
                                      llm=RemoteEngine(engines[self.engine_index]) if drives else None,
                                      engine_index=self.engine_index)
            return
        self.bridge = WeightBridge(self.policy.local_shards, self.policy.model.hf_config, self.ctx.topology,
                                   vllm_tp=tp, llm=RemoteEngine(engines[self.engine_index]) if drives else None,
                                   options=cfg.bridge.sync_options(dtype=cfg.model.dtype),
                                   vllm_devices=tuple(range(len(engines) * tp)), node=where()["node_id"])

    def replace_engine(self, k: int, actor) -> dict:
        """Engine ``k`` was restarted as ``actor``: its driver rank points the bridge there, and
        every rank sends it the current weights (the other engines are left alone)."""
        from megarl.rollout.engine import RemoteEngine

        if self.engine_index == k:
            self.bridge.llm = RemoteEngine(actor)
        return self.bridge.sync(engine=k)

    def sync(self) -> dict:
        """Push the weights into every engine; the stats of this rank (with its engine's load time
        and bytes when it drives one)."""
        import time

        import ray

        t0 = time.perf_counter()
        try:
            stats = self.bridge.sync()
        except ray.exceptions.RayActorError as err:
            from megarl.rollout.vllm_engine import EngineDied

            raise EngineDied(f"rollout engine {self.engine_index} died during the weight sync (driven by training "
                             f"rank {self.ctx.rank}): {type(err).__name__}") from err
        stats["seconds"] = time.perf_counter() - t0
        return stats


class ShardCheckpoint:
    """This rank's part of a checkpoint: the trainable engines' model and optimizer shards
    (megatron dist checkpoint; prefix "" the policy, "critic." the critic) and its RNG states."""

    def __init__(self, ctx: RankContext, policy, critic=None):
        """``policy``, ``critic``: the engines (the critic None without one)."""
        self.ctx, self.policy, self.critic = ctx, policy, critic

    def _engines(self) -> dict:
        """The trainable engines by checkpoint prefix."""
        return {"": self.policy, **({"critic.": self.critic} if self.critic is not None else {})}

    def _sharded_state(self, is_loading: bool) -> dict:
        state = {}
        for prefix, engine in self._engines().items():
            if not is_loading:   # a checkpoint before the first applied update (all skipped so far)
                engine.ensure_optimizer_state()
            if engine.model.adapters:   # LoRA: the adapters; the frozen base is the model folder's
                from megarl.policy.lora import adapter_sharded_state_dict

                model_sd = {f"{prefix}lora": adapter_sharded_state_dict(engine.model.adapters, prefix)}
            else:
                model_sd = {f"{prefix}model{i}": chunk.sharded_state_dict(prefix=prefix)
                            for i, chunk in enumerate(engine.model.modules)}
            state.update(model_sd)
            state[f"{prefix}optimizer"] = engine.optimizer.sharded_state_dict(
                model_sd, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "fully_reshardable"})
        return state

    def _lora_layout(self) -> dict | None:
        """:func:`megarl.policy.lora.lora_layout` of the policy's adapters (None without LoRA)."""
        from megarl.policy.lora import lora_layout

        adapters = self.policy.model.adapters
        return lora_layout(adapters[0].options, self.ctx.topology.tp) if adapters else None

    def _check_lora(self, folder: str) -> None:
        """A LoRA checkpoint loads into a LoRA policy of the same adapters and TP size, and a full
        one into a policy without adapters; else a CheckpointError naming what differs."""
        from megarl.checkpoint_files import CheckpointError

        path = Path(folder) / LORA_FILE
        saved = json.loads(path.read_text()) if path.exists() else None
        mine = self._lora_layout()
        if saved == mine:
            return
        if saved is None or mine is None:
            has, wants = ("full weights", "LoRA adapters") if saved is None else ("LoRA adapters", "full weights")
            raise CheckpointError(f"{folder}: the checkpoint holds {has} but this run trains {wants} (model.lora.rank "
                                  f"{mine['rank'] if mine else 0}); resume with the model.lora it was saved with")
        diff = ", ".join(f"{'topology.tp' if k == 'tp' else 'model.lora.' + k}={mine[k]!r} (saved: {saved[k]!r})"
                         for k in saved if saved[k] != mine.get(k))
        raise CheckpointError(f"{folder}: LoRA checkpoint saved with other settings: {diff}; resume with the "
                              "ones it was saved with")

    def _rng_file(self, folder: str) -> Path:
        return Path(folder) / f"rng_rank{self.ctx.rank:05d}.pt"

    def save(self, folder: str) -> None:
        """Model + optimizer and this rank's RNG states into ``folder``."""
        import torch
        from megatron.core import dist_checkpointing, tensor_parallel

        dist_checkpointing.save(self._sharded_state(is_loading=False), folder)
        if self.ctx.rank == 0 and (layout := self._lora_layout()) is not None:
            (Path(folder) / LORA_FILE).write_text(json.dumps(layout))
        torch.save({"torch": torch.get_rng_state(),
                    "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
                    "engine_step": self.policy.step_count,
                    "critic_step": self.critic.step_count if self.critic is not None else 0},
                   self._rng_file(folder))

    def load(self, folder: str) -> None:
        """What :meth:`save` wrote; a pickle that would run code is refused
        (:class:`megarl.checkpoint_files.UnsafeCheckpointError`), a damaged RNG file named."""
        import torch
        from megatron.core import dist_checkpointing, tensor_parallel

        from megarl.compat.megatron_fixes import find_unsafe, optimizer_classes
        from megarl.checkpoint_files import CheckpointError, UnsafeCheckpointError, describe_error, load_plain

        self._check_lora(folder)
        try:
            # common.pt is read with torch.load(weights_only=True): optimizer classes by name only
            # (trainer.optimizer_offload's HybridDeviceOptimizer keeps them in its parameter groups)
            with torch.serialization.safe_globals(optimizer_classes()):
                state = dist_checkpointing.load(self._sharded_state(is_loading=True), folder)
        except Exception as err:   # megatron_fixes M2 refused a pickle: name it, do not treat it as damage
            if (unsafe := find_unsafe(err)) is not None:
                raise UnsafeCheckpointError(f"{folder}: refused to load the distributed checkpoint: {unsafe}; "
                                            "only resume from checkpoints you trust") from err
            raise
        for prefix, engine in self._engines().items():
            if engine.model.adapters:
                from megarl.policy.lora import load_adapter_state

                load_adapter_state(engine.model.adapters, state[f"{prefix}lora"], prefix)
            for i, chunk in enumerate(engine.model.modules if not engine.model.adapters else ()):
                chunk.load_state_dict(_strip(state[f"{prefix}model{i}"], prefix))
            engine.optimizer.load_state_dict(state[f"{prefix}optimizer"])
        rng_file = self._rng_file(folder)
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


def _strip(state: dict, prefix: str) -> dict:
    """A loaded model state dict with the checkpoint prefix taken off its keys."""
    return {k[len(prefix):] if prefix and k.startswith(prefix) else k: v for k, v in state.items()}
