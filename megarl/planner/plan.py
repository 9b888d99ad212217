"""``megarl plan``: will a recipe fit, and how long will a step take, before any GPU is allocated.

:func:`make_plan` builds every distinct rank's real model on the meta device
(:mod:`megarl.planner.ranks`), turns the counts into memory per device and per node
(:mod:`megarl.planner.memory`) for each phase of a colocated step, and estimates the step time
(:mod:`megarl.planner.roofline`). :func:`format_plan` prints it with every assumption and the
source of every constant; ``plan.problems`` lists what does not fit, each naming the phase, the
rank or node, and the component that takes the most.

Choices: the parameter counts come from the built models, with the config.json arithmetic beside
them for comparison (:attr:`Plan.config_params`); a device must hold each phase of a step, train
and generation (:class:`KindMemory`), and a node's host memory what is offloaded or sleeping in
all of them at once (:attr:`Plan.host_peak`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from megarl.planner.memory import GIB, TrainState


class PlanError(RuntimeError):
    """The recipe cannot be planned (a rank that cannot be built, a layout the model refuses)."""


@dataclass
class KindMemory:
    """Memory of the ranks of one stage kind (peak over its stages), per phase on a device
    (colocated placement; with ``rollout.placement: split`` the engines have GPUs of their own,
    which hold vLLM's share only, and the training GPUs the training state only):

    * ``train_phase`` (and log-probs, which need less): parameters + fp32 grads + optimizer shard
      (in host memory instead with ``trainer.optimizer_offload``) + the frozen reference copy of
      the parameters when ``algorithm.kl_coef > 0`` + activations, plus vLLM's whole share
      (``gpu_memory_utilization`` x device) when ``rollout.sleep_level`` is 0 (vLLM never sleeps);
      at levels 1 and 2 vLLM's KV cache is freed and its weights are in host memory (1) or dropped (2).
    * ``generation_phase``: vLLM's share, plus the training state unless
      ``trainer.offload_train_state`` moved it to host memory."""

    count: object
    """:class:`megarl.planner.ranks.RankCount`."""
    state: TrainState
    activations: int
    micro_batches: int
    in_flight: float
    train_phase: int
    generation_phase: int


@dataclass
class Plan:
    recipe: str
    model: str
    gpu: object
    world: int
    total_params: int
    dense_params: int
    expert_params: int
    config_params: int
    """The config.json arithmetic (:meth:`ModelDims.num_parameters`), for comparison."""
    mtp_params: int
    """DeepSeek's MTP block by config arithmetic (never built; 0 for other models)."""
    kinds: list[KindMemory]
    vllm_weights: int
    vllm_share: int
    kv_bytes_token: int
    kv_capacity_tokens: float
    kv_full_need_tokens: int
    host_peak: int
    """Host memory of the fullest node: offloaded training state plus the weights of sleeping
    vLLM engines (level 1), both counted at once (megarl keeps its pinned host buffers between
    steps)."""
    host_budget: int
    host_node: int
    gpus_per_node: int
    bridge_recv_per_gpu: int
    bridge_send_max: int
    bridge_bucket: int
    estimate: object
    seconds_building: float
    data_plane: object = None
    """:class:`megarl.planner.memory.DataPlane` of the recipe as configured."""
    data_plane_replay: object = None
    """The same with routing replay (MoE models), for comparison."""
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def device_budget(self) -> int:
        return self.gpu.hbm_bytes


def _mtp_params(dims, hf: dict) -> int:
    """DeepSeek-V3's multi-token-prediction block by config arithmetic: per predicted token one
    MoE decoder layer, two RMSNorms and the 2h -> h projection (embedding and head shared)."""
    from megarl.planner.flops import attention_matmul_params, mlp_matmul_params

    n = int(hf.get("num_nextn_predict_layers") or 0)
    if not n:
        return 0
    h = dims.hidden_size
    layer = attention_matmul_params(dims) + mlp_matmul_params(dims, dims.num_layers, active=False) + 2 * h
    if dims.kv_lora_rank:
        layer += (dims.q_lora_rank if dims.q_lora_rank else 0) + dims.kv_lora_rank   # the latent norms
    return n * (layer + 2 * h * h + 3 * h)


def _gib(n: float) -> str:
    return f"{n / GIB:,.1f} GiB"


def _parts(parts: dict) -> str:
    """``parts`` (name -> bytes), largest first."""
    return ", ".join(f"{name} {_gib(value)}" for name, value in sorted(parts.items(), key=lambda kv: -kv[1]))


def make_plan(cfg, recipe: str = "") -> Plan:
    """The plan of a loaded config (:func:`megarl.config.load_config`)."""
    from megarl.compat import setup_cpu
    from megarl.policy.build import ModelOptions, read_hf_config
    from megarl.models.dims import ModelDims
    from megarl.models.fixtures import resolve_model_path
    from megarl.parallel.topology import TopologyError
    from megarl.planner import memory as mem
    from megarl.planner.hardware import get_gpu
    from megarl.planner.ranks import count_rank, stage_kinds
    from megarl.planner.roofline import StepInputs, estimate_step
    from megarl.config.passes import needs_old_logprob_pass as old_logprob_pass
    from transformers import AutoConfig

    hf = read_hf_config(cfg.model.path)
    dims = ModelDims.from_hf(hf)
    topology = cfg.topology.to_topology()
    try:
        topology.check_model(dims)
    except TopologyError as err:
        raise PlanError(f"model {cfg.model.path}: {err}") from None
    gpu = get_gpu(cfg.cluster.gpu)
    setup_cpu()
    folder = resolve_model_path(cfg.model.path)
    hf_config = AutoConfig.from_pretrained(folder)
    options = ModelOptions(path=cfg.model.path, dtype=cfg.model.dtype, recompute=cfg.model.recompute,
                           moe_aux_loss_coeff=cfg.model.moe_aux_loss_coeff, moe_z_loss_coeff=cfg.model.moe_z_loss_coeff)
    counts = [count_rank(folder, hf_config, topology, kind, options) for kind in stage_kinds(topology, dims)]
    dense = sum(c.model_dense * len(c.kind.stages) for c in counts)
    expert = sum(c.model_expert * len(c.kind.stages) for c in counts)

    r, t = cfg.rollout, cfg.trainer
    samples = cfg.data.prompts_per_step * r.n
    mean_prompt = cfg.plan.mean_prompt_tokens or r.max_prompt_tokens
    mean_response = cfg.plan.mean_response_tokens or r.max_response_tokens
    seq = mean_prompt + mean_response
    tokens_per_device = samples * seq / cfg.algorithm.mini_batches / topology.dp / topology.cp
    micro_batches = max(1, math.ceil(tokens_per_device / t.max_tokens_per_micro_batch))
    if topology.vpp_size > 1:
        micro_batches = math.ceil(micro_batches / topology.pp) * topology.pp

    vllm_weights = mem.vllm_weight_bytes(dense + expert, r.tp)
    vllm_share = int(r.gpu_memory_utilization * gpu.hbm_bytes)
    kv_token = mem.kv_bytes_per_token(dims, r.tp)
    kv_capacity = max(0, vllm_share - vllm_weights) / kv_token
    per_engine = math.ceil(samples / r.dp)
    max_seq = r.max_prompt_tokens + r.max_response_tokens

    split = r.placement == "split"
    kinds = []
    for c in counts:
        stage = c.kind.stages[0]
        layers = [i for i in range(dims.num_layers) if topology.stage_of_layer(i, dims.num_layers) == stage]
        lora = cfg.model.lora
        adapters = mem.lora_params(dims, layers, rank=lora.rank, targets=lora.targets, tp=topology.tp) \
            if lora.rank else 0
        state = mem.train_state(c.dense, c.expert, dtype=cfg.model.dtype, optimizer=t.optimizer,
                                dp_cp=topology.dp * topology.cp, expert_dp=topology.expert_dp, adapters=adapters)
        in_flight = mem.in_flight_micro_batches(stage, topology.pp, topology.vpp_size, micro_batches)
        act = mem.activation_bytes(dims, layers, tokens=t.max_tokens_per_micro_batch, tp=topology.tp,
                                   etp=topology.expert_tp, sp=topology.sp, recompute=cfg.model.recompute,
                                   in_flight=in_flight, last_stage=c.kind.last)
        # trainer.optimizer_offload: fp32 main params and Adam moments live in host memory;
        # algorithm.kl_coef > 0: a frozen reference copy of the parameters (no grads, no optimizer);
        # under LoRA the reference is the policy with its adapters off (no copy)
        reference = state.params if cfg.algorithm.kl_coef > 0 and not lora.rank else 0
        on_device = state.total - (state.optimizer if t.optimizer_offload else 0) + reference
        train_phase = on_device + act + (vllm_share if r.sleep_level == 0 and not split else 0)
        gen_phase = vllm_share if split else vllm_share + (0 if t.offload_train_state else on_device)
        kinds.append(KindMemory(c, state, act, micro_batches, in_flight, train_phase, gen_phase))

    gpn = cfg.cluster.gpus_per_node or gpu.gpus_per_node
    host_budget = int((cfg.cluster.host_memory_gib or gpu.host_gib) * GIB)
    per_stage = topology.world_size // topology.pp
    kind_of_stage = {s: k for k in kinds for s in k.count.kind.stages}
    host_peak, host_node = 0, 0
    for node in range(math.ceil(topology.world_size / gpn)):
        ranks = range(node * gpn, min(topology.world_size, (node + 1) * gpn))
        used = 0
        for rank in ranks:
            state = kind_of_stage[rank // per_stage].state
            host_optimizer = state.optimizer if t.optimizer_offload else 0
            reference = state.params if cfg.algorithm.kl_coef > 0 else 0
            used += (state.total + reference if t.offload_train_state else host_optimizer) \
                + (vllm_weights if r.sleep_level == 1 and rank < r.dp * r.tp and not split else 0)
        if used > host_peak:
            host_peak, host_node = used, node

    plan = Plan(recipe=recipe, model=cfg.model.path, gpu=gpu, world=topology.world_size,
                total_params=dense + expert, dense_params=dense, expert_params=expert,
                config_params=dims.num_parameters(), mtp_params=_mtp_params(dims, hf), kinds=kinds,
                vllm_weights=vllm_weights, vllm_share=vllm_share, kv_bytes_token=kv_token,
                kv_capacity_tokens=kv_capacity, kv_full_need_tokens=per_engine * max_seq,
                host_peak=host_peak, host_budget=host_budget, host_node=host_node, gpus_per_node=gpn,
                bridge_recv_per_gpu=vllm_weights, bridge_send_max=max(k.count.total for k in kinds) * 2,
                bridge_bucket=cfg.bridge.bucket_mb << 20, estimate=None,
                seconds_building=sum(c.seconds for c in counts))

    worst = max(kinds, key=lambda k: k.state.total)
    optimizer_steps = cfg.algorithm.ppo_epochs * cfg.algorithm.mini_batches
    moved = worst.state.total - (worst.state.optimizer if t.optimizer_offload else 0) \
        + (worst.state.params if cfg.algorithm.kl_coef > 0 else 0)
    plan.estimate = estimate_step(StepInputs(
        dims=dims, gpu=gpu, world=topology.world_size, pp=topology.pp, vpp=topology.vpp_size, dp=topology.dp,
        micro_batches=micro_batches, micro_batch_tokens=min(t.max_tokens_per_micro_batch, tokens_per_device),
        samples=samples, mean_prompt=mean_prompt, mean_response=mean_response, max_response=r.max_response_tokens,
        engines=r.dp, engine_tp=r.tp, dense_params=dense, expert_params=expert, kv_bytes_token=kv_token,
        kv_capacity_tokens=kv_capacity, recompute=cfg.model.recompute, epochs=cfg.algorithm.ppo_epochs,
        optimizer_steps=optimizer_steps, reference=cfg.algorithm.kl_coef > 0,
        offload_bytes_per_gpu=moved if t.offload_train_state else 0, vllm_weight_bytes_per_gpu=vllm_weights,
        sleep_level=r.sleep_level, gpus_per_node=gpn, rank_dense_params=worst.count.dense,
        rank_expert_params=worst.count.expert, expert_dp=topology.expert_dp, mode=t.mode,
        staleness=t.max_staleness, split=split,
        optimizer_offload=t.optimizer_offload, dispatcher=cfg.model.moe_dispatcher,
        optimizer_shard_params=worst.count.dense // (topology.dp * topology.cp)
        + worst.count.expert // max(1, topology.expert_dp)))
    if split:
        plan.world = topology.world_size + r.dp * r.tp
    moe_layers = sum(dims.is_moe_layer(i) for i in range(dims.num_layers))
    critic = cfg.algorithm.advantage == "gae"
    kl_reward = cfg.algorithm.kl_coef > 0 and cfg.algorithm.kl_mode == "reward"
    flow = dict(samples=samples, mean_prompt=mean_prompt, mean_response=mean_response, moe_layers=moe_layers,
                topk=dims.num_experts_per_tok, dp=topology.dp, ranks_per_node=min(gpn, topology.world_size),
                old_pass=old_logprob_pass(cfg),
                reference=cfg.algorithm.kl_coef > 0, correction=cfg.algorithm.rollout_correction != "none",
                token_advantages=critic or kl_reward, critic=critic, kl_reward=kl_reward,
                samples_copy=r.speculative != "off" or r.agent == "tools")
    replay = cfg.algorithm.router_replay == "r3" or r.return_routing
    plan.data_plane = mem.data_plane_bytes(routing=replay and moe_layers > 0, **flow)
    if moe_layers and not replay:
        plan.data_plane_replay = mem.data_plane_bytes(routing=True, **flow)
    _check_fit(plan, cfg)
    return plan


def _check_fit(plan: Plan, cfg) -> None:
    budget, name = plan.device_budget, f"{plan.gpu.name} ({_gib(plan.device_budget)})"
    r = cfg.rollout
    if plan.vllm_weights >= plan.vllm_share:
        plan.problems.append(f"rollout weights: vLLM's bf16 weights take {_gib(plan.vllm_weights)} per GPU at "
                             f"rollout.tp={r.tp}, more than its share rollout.gpu_memory_utilization="
                             f"{r.gpu_memory_utilization} "
                             f"x {name} = {_gib(plan.vllm_share)}: raise rollout.tp or the share")
    elif plan.kv_capacity_tokens < r.max_prompt_tokens + r.max_response_tokens:
        plan.problems.append(f"KV cache: {plan.kv_capacity_tokens:,.0f} tokens fit in vLLM's share after its weights, "
                             f"fewer than one sequence of rollout.max_prompt_tokens + max_response_tokens = "
                             f"{r.max_prompt_tokens + r.max_response_tokens}")
    for k in plan.kinds:
        c = k.count
        if k.train_phase > budget:
            parts = {"parameters": k.state.params, "gradients": k.state.grads, "activations": k.activations}
            if not cfg.trainer.optimizer_offload:
                parts["optimizer state"] = k.state.optimizer
            if cfg.algorithm.kl_coef > 0:
                parts["reference copy (algorithm.kl_coef > 0)"] = k.state.params
            if r.sleep_level == 0:
                parts["vLLM (rollout.sleep_level=0)"] = plan.vllm_share
            plan.problems.append(f"training on rank {c.rank} ({c.kind.label}): {_gib(k.train_phase)} > {name}: "
                                 f"{_parts(parts)}")
        if k.generation_phase > budget:
            kept = k.state.total - (k.state.optimizer if cfg.trainer.optimizer_offload else 0)
            parts = {"vLLM share": plan.vllm_share, "training state kept on the device (trainer.offload_train_state="
                     "false)": kept}
            if cfg.algorithm.kl_coef > 0:
                parts["reference copy (algorithm.kl_coef > 0)"] = k.state.params
            plan.problems.append(f"generation on rank {c.rank} ({c.kind.label}): {_gib(k.generation_phase)} > "
                                 f"{name}: {_parts(parts)}")
    if plan.host_peak > plan.host_budget:
        plan.problems.append(f"host memory of node {plan.host_node}: {_gib(plan.host_peak)} of offloaded training "
                             f"state and sleeping vLLM weights > {_gib(plan.host_budget)} (cluster.host_memory_gib)")


def _data_plane_lines(plan: Plan, cfg) -> list[str]:
    d = plan.data_plane
    def gb(n: float) -> str:
        return f"{n / 1e9:,.2f} GB" if n >= 1e9 else f"{n / 1e6:,.1f} MB"

    lines = [f"  data plane per step: the controller receives {gb(d.controller_in)} from the engines"
             + ("" if d.samples_copy else " (the samples' text and handles, not their ids and log-probs)")
             + (", the forward passes' read-outs from the ranks," if d.passes else "")
             + f" and sends {gb(d.controller_out)} to the training ranks (handles on the engines' ids and log-probs, "
             + "advantages, masks)"
             + (f"; routing replay {gb(d.routing)} (through Ray's object store, engines to ranks)" if d.routing else "")
             + (f"; forward passes (old/reference log-probs, correction weights, critic values and returns) "
                f"{gb(d.passes)} (through the object store, rank to rank)" if d.passes else "")
             + (f"; per-token advantages computed on rank 0 from the stored passes ({gb(d.advantages_rank0)} "
                "read and written there)" if d.advantages_rank0 else "")
             + f"; a training rank receives {gb(d.per_rank)}, a node {gb(d.per_node)}"]
    if plan.data_plane_replay is not None:
        e = plan.data_plane_replay
        lines.append(f"  with routing replay (algorithm.router_replay=r3): {gb(e.routing)} more of routing "
                     f"(through Ray's object store, engines to ranks), the controller {gb(e.controller)} in all, "
                     f"a node {gb(e.per_node)}")
    return lines


def format_plan(plan: Plan, cfg) -> str:
    """The report ``megarl plan`` prints."""
    from megarl.planner.memory import LOGIT_BYTES_PER_ELEMENT

    t, r, top = cfg.trainer, cfg.rollout, cfg.topology
    lines = [f"megarl plan {plan.recipe}: {plan.model} on {plan.world} x {plan.gpu.name}",
             f"layout: tp={top.tp} pp={top.pp} vpp={top.vpp} ep={top.ep} etp={top.etp} cp={top.cp} sp={top.sp} "
             f"first_stage_layers={top.first_stage_layers} last_stage_layers={top.last_stage_layers}; "
             f"recompute={cfg.model.recompute}; rollout {r.dp} engines x tp {r.tp}",
             "", "parameters (real megatron-core model per rank, meta device, fake process group):"]
    for k in plan.kinds:
        c = k.count
        lines.append(f"  rank {c.rank:>5} {c.kind.label}: {c.total:,} ({c.dense:,} dense, {c.expert:,} expert; "
                     f"embedding {c.embedding:,}, output {c.output:,}; chunks {c.chunks}; built in {c.seconds:.1f} s)")
    lines += [f"  total: {plan.total_params:,} = {plan.total_params / 1e9:.2f}B ({plan.dense_params / 1e9:.2f}B dense, "
              f"{plan.expert_params / 1e9:.2f}B routed experts); config.json arithmetic: "
              f"{plan.config_params / 1e9:.2f}B"]
    if plan.mtp_params:
        lines.append(f"  not built: the multi-token-prediction block (num_nextn_predict_layers), "
                     f"{plan.mtp_params / 1e9:.2f}B by config arithmetic; with it "
                     f"{(plan.total_params + plan.mtp_params) / 1e9:.2f}B (a checkpoint's count also holds the "
                     "MTP block's own copies of embedding and output layer)")
    lines += ["", f"memory per device (budget {_gib(plan.device_budget)}: {plan.gpu.hbm_source}):"]
    lines.append(f"  {'rank':>5} {'params':>10} {'grads':>10} {'optim':>10} {'activ':>10} {'train':>10} "
                 f"{'generate':>10}  M/in-flight")
    for k in plan.kinds:
        lines.append(f"  {k.count.rank:>5} {_gib(k.state.params):>10} {_gib(k.state.grads):>10} "
                     f"{_gib(k.state.optimizer):>10} {_gib(k.activations):>10} {_gib(k.train_phase):>10} "
                     f"{_gib(k.generation_phase):>10}  {k.micro_batches}/{k.in_flight:g}")
    lines += [
        f"  params: model.dtype={cfg.model.dtype}; grads: fp32 main grads; optimizer: {t.optimizer}, fp32 master + "
        f"moments, distributed over dp x cp = {top.to_topology().dp * top.cp} (dense) and expert-dp = "
        f"{top.to_topology().expert_dp} (experts)",
        f"  activations: trainer.max_tokens_per_micro_batch={t.max_tokens_per_micro_batch} tokens per micro-batch, "
        f"recompute={cfg.model.recompute}, x micro-batches in flight (1F1B), last stage + logits x "
        f"{LOGIT_BYTES_PER_ELEMENT} B (formula: megarl/planner/memory.py)",
        f"  vLLM per GPU: weights {_gib(plan.vllm_weights)} (bf16 / rollout.tp={r.tp}); share "
        f"{_gib(plan.vllm_share)} (rollout.gpu_memory_utilization={r.gpu_memory_utilization}); KV cache "
        f"{_gib(max(0, plan.vllm_share - plan.vllm_weights))} = {plan.kv_capacity_tokens:,.0f} tokens at "
        f"{plan.kv_bytes_token:,} B/token; all samples of an engine at full length need "
        f"{plan.kv_full_need_tokens:,} tokens",
        f"  host memory: node {plan.host_node} peaks at {_gib(plan.host_peak)} of {_gib(plan.host_budget)} "
        f"({plan.gpus_per_node} GPUs per node; offload_train_state={t.offload_train_state}, "
        f"rollout.sleep_level={r.sleep_level})",
        f"  weight bridge: each vLLM GPU receives {_gib(plan.bridge_recv_per_gpu)} per sync; a training rank sends at "
        f"most {_gib(plan.bridge_send_max)}; extra buffer per device up to bridge.bucket_mb = "
        f"{_gib(plan.bridge_bucket)}",
        *_data_plane_lines(plan, cfg),
        "", f"step-time estimate: {plan.estimate.seconds:.1f} s (published measurements, listed below)"]
    for p in plan.estimate.phases:
        lines.append(f"  {p.name:<11} {p.seconds:8.1f} s  {p.detail}")
    tokens_gpu_s = plan.estimate.tokens_per_step / plan.estimate.seconds / plan.world
    lines.append(f"  tokens/s/GPU {tokens_gpu_s:.1f} ({plan.estimate.tokens_per_step:,.0f} tokens per step)")
    lines.append("  assumptions:")
    lines += [f"  - {a}" for a in plan.estimate.assumptions]
    lines += [f"  - {n}" for n in plan.notes]
    lines.append("")
    if plan.problems:
        lines.append("DOES NOT FIT:")
        lines += [f"  - {p}" for p in plan.problems]
    else:
        lines.append(f"fits: every phase within {_gib(plan.device_budget)} per device and "
                     f"{_gib(plan.host_budget)} host memory per node")
    lines.append(f"(built {len(plan.kinds)} distinct ranks in {plan.seconds_building:.1f} s)")
    return "\n".join(lines)
