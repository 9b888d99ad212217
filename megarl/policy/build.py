"""Build a Megatron GPTModel (TE layer spec; CPU TE modules on CPU) from an HF folder.

:func:`build_model` validates the layout against the model (``Topology.check_model``) before any
group or model exists; takes the family from :mod:`megarl.models.registry`, whose mbridge bridge
(with :mod:`megarl.models.mbridge_fixes`) gives the ``TransformerConfig`` and TE decoder-block
spec and whose weight mapping places every parameter; builds this rank's model chunks (one per
virtual pipeline stage) and fills them from the HF safetensors, each rank reading only its own
shards' boxes (:func:`megarl.policy.export.fill_from_hf`, no scatter); and optionally wraps each
chunk in megatron-core DDP.

Megatron settings chosen here (:func:`_config_overrides`): ``calculate_per_token_loss=False`` with
the loss scaling of :mod:`megarl.policy.train`; variable sequence lengths except under VPP on
CPU (fixed shapes there, see the comment); ``batch_p2p_comm=False`` on CPU; sequence parallelism
only when ``topology.sp``; uneven first/last pipeline stages only when the topology sets them;
the ``alltoall`` MoE dispatcher unless ``model.moe_dispatcher`` names a flex backend (GPU only).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from megarl.models.dims import check_model_layout
from megarl.parallel.groups import ParallelGroups
from megarl.parallel.topology import Topology

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# megatron's LanguageModule writes the attention backend into these env vars and asserts they
# agree with the next model's choice: building DeepSeek (mbridge picks "fused") after a "auto"
# model in one process fails. Each build starts from the values the process started with.
_NVTE_VARS = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
_NVTE_AT_START = {k: os.environ.get(k) for k in _NVTE_VARS}


def _restore_attention_env() -> None:
    for key, value in _NVTE_AT_START.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@dataclass
class ModelOptions:
    """What to build (besides the layout)."""

    path: str
    """HF folder (config.json + safetensors) or ``fixture:<name>``."""
    dtype: str = "float32"
    """Parameter dtype: float32 or bfloat16."""
    moe_aux_loss_coeff: float = 0.0
    """Load-balancing aux-loss coefficient (0 = off, the RL default)."""
    moe_z_loss_coeff: float = 0.0
    """Router z-loss coefficient (0 = off)."""
    recompute: str = "none"
    """Activation recompute: none, selective or full."""
    moe_dispatcher: str = "alltoall"
    """MoE token dispatcher: alltoall, or deepep / hybridep (megatron-core's flex dispatcher; GPU)."""
    lora: Optional[Any] = None
    """A :class:`megarl.policy.lora.LoraOptions`: freeze the model and train LoRA adapters on it."""
    config_overrides: dict = field(default_factory=dict)
    """Extra TransformerConfig fields (win over everything else)."""
    value_head: bool = False
    """Build a critic: the LM head replaced by a zero-initialised scalar value head
    (:mod:`megarl.policy.value`)."""
    score_head: bool = False
    """Build a reward model: the LM head replaced by a bias-free scalar head read at each
    sequence's last token (:func:`megarl.policy.value.sequence_scores`), loaded from the folder's
    ``score.weight`` (an HF ``*ForSequenceClassification`` folder) when it has one, else zero."""

    def __post_init__(self):
        if self.dtype not in _DTYPES:
            raise ValueError(f"ModelOptions.dtype={self.dtype!r}, expected one of {sorted(_DTYPES)}")
        if self.value_head and self.score_head:
            raise ValueError("ModelOptions: value_head and score_head are exclusive (a critic or a reward model)")
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"ModelOptions.recompute={self.recompute!r}, expected none, selective or full")
        for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            if getattr(self, name) < 0:
                raise ValueError(f"ModelOptions.{name}={getattr(self, name)!r}, expected >= 0")


@dataclass
class BuiltModel:
    """This rank's model chunks and what was used to build them."""

    chunks: list
    """One GPTModel per virtual pipeline stage (DDP-wrapped when built with ``ddp=True``)."""
    mapping: Any
    """The family's weight mapping (:class:`megarl.bridge.mapping.FamilyMapping`)."""
    config: Any
    """The megatron TransformerConfig shared by the chunks."""
    hf_config: Any
    groups: ParallelGroups
    path: str
    adapters: list = field(default_factory=list)
    """The LoRA adapters (:class:`megarl.policy.lora.LoraAdapter`), in module order; empty without LoRA."""

    @property
    def modules(self) -> list:
        """The chunks without their wrappers (DDP; bf16: megatron's Float16Module)."""
        return [_unwrap(c) for c in self.chunks]


def _unwrap(chunk):
    """The GPTModel inside ``chunk``: DDP and, in bf16, megatron's ``Float16Module`` come off (names
    under either start with ``module.``, which no weight mapping knows)."""
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.transformer.module import Float16Module

    while isinstance(chunk, (DDP, Float16Module)):
        chunk = chunk.module
    return chunk


def read_hf_config(path: str) -> dict:
    """The raw config.json of an HF folder (``fixture:<name>`` resolved)."""
    from megarl.models.fixtures import resolve_model_path

    folder = resolve_model_path(path)
    config_json = os.path.join(folder, "config.json")
    if not os.path.exists(config_json):
        raise ValueError(f"model path {path!r} has no config.json (expected an HF model folder)")
    with open(config_json) as f:
        return json.load(f)


def check_layout(path: str, topology: Topology) -> None:
    """Raise before any process group exists if ``topology`` cannot hold the model at ``path``:
    unknown ``model_type`` (ValueError listing the supported ones) or a TopologyError (the rules:
    :func:`megarl.models.dims.check_model_layout`, which preflight runs on the same config.json)."""
    check_model_layout(read_hf_config(path), topology)


def _config_overrides(options: ModelOptions, topology: Topology) -> dict:
    from megarl.compat import cpu_transformer_overrides, cuda_available

    extra = {} if cuda_available() else cpu_transformer_overrides()
    extra.update(
        sequence_parallel=topology.sp,
        # packed rows differ per micro-batch, so each pipeline exchange first sends the shape;
        # except under VPP on CPU: gloo's send waits for the matching receive, and the interleaved
        # schedule's separate blocking shape exchange deadlocks (pp2: stage 0 in its last warm-up
        # send, stage 1 in its first steady-state shape exchange). There every micro-batch of a
        # call is padded to one length (logprobs.pack_micro_batch's pad_to) and no shapes move.
        variable_seq_lengths=not (topology.vpp_size > 1 and not cuda_available()),
        calculate_per_token_loss=False,
        moe_aux_loss_coeff=options.moe_aux_loss_coeff,
        moe_z_loss_coeff=options.moe_z_loss_coeff or None,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    if options.moe_aux_loss_coeff > 0:
        extra["moe_router_load_balancing_type"] = "aux_loss"
    if options.moe_dispatcher != "alltoall":
        if not cuda_available():
            raise ValueError(f"model.moe_dispatcher={options.moe_dispatcher!r} needs a GPU and the deep_ep package "
                             "(megatron-core's flex dispatcher); use model.moe_dispatcher=alltoall on this machine")
        extra.update(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend=options.moe_dispatcher)
    if options.recompute != "none":
        extra["recompute_granularity"] = options.recompute
        if options.recompute == "full":
            extra.update(recompute_method="uniform", recompute_num_layers=1)
    if topology.vpp_size > 1:
        extra["overlap_p2p_comm"] = False   # simple, deterministic p2p; batch_p2p_comm stays False
    if topology.first_stage_layers is not None:
        extra["num_layers_in_first_pipeline_stage"] = topology.first_stage_layers
    if topology.last_stage_layers is not None:
        extra["num_layers_in_last_pipeline_stage"] = topology.last_stage_layers
    extra.update(options.config_overrides)
    return extra


def build_model(options: ModelOptions, groups: ParallelGroups, *, ddp: bool = False,
                distributed_optimizer: bool = True, load_weights: bool = True) -> BuiltModel:
    """Build this rank's chunks of the model at ``options.path`` for ``groups``' layout.

    ``ddp`` wraps the chunks in megatron-core DDP; ``distributed_optimizer`` picks its grad
    layout (reduce-scatter for the distributed optimizer, else all-reduce).
    """
    from megarl.bridge.mapping import get_mapping
    from megarl.compat import megatron_fixes, setup_cpu
    from megarl.policy.export import fill_from_hf
    from megarl.models.fixtures import resolve_model_path
    from megarl.models.registry import make_bridge
    from megarl.models.safetensors_io import HFCheckpoint
    from transformers import AutoConfig

    setup_cpu()
    megatron_fixes.apply()
    topology = groups.topology
    check_layout(options.path, topology)
    folder = resolve_model_path(options.path)
    hf_config = AutoConfig.from_pretrained(folder)
    dtype = _DTYPES[options.dtype]
    bridge = make_bridge(hf_config, dtype, _config_overrides(options, topology))
    _restore_attention_env()
    chunks = bridge.get_model(wrap_with_ddp=False, bf16=dtype == torch.bfloat16, fp16=False,
                              use_cpu_initialization=True)
    model = BuiltModel(chunks=chunks, mapping=get_mapping(hf_config), config=bridge.config, hf_config=hf_config,
                       groups=groups, path=folder)
    if options.value_head or options.score_head:   # first: weight loading skips the heads
        from megarl.policy.value import attach_value_heads

        attach_value_heads(model.chunks, model.config, groups.pgs.tp, bias=not options.score_head)
    if load_weights:
        reader = HFCheckpoint(folder)
        fill_from_hf(model, reader)
        if options.score_head and "score.weight" in reader:
            from megarl.policy.value import head_weight

            weight = head_weight(model.chunks)
            if weight is not None:
                score = reader.read("score.weight")
                if tuple(score.shape) != tuple(weight.shape):
                    raise ValueError(f"{folder}: score.weight has shape {tuple(score.shape)}, expected "
                                     f"{tuple(weight.shape)} (a sequence-classification model with one label)")
                with torch.no_grad():
                    weight.copy_(score.to(weight.dtype))
    if options.lora is not None:   # before DDP: it allocates gradient buffers for the adapters only
        from megarl.policy.lora import attach_lora

        model.adapters = attach_lora(model.modules, options.lora, groups, topology.sp)
    if ddp:
        model.chunks = wrap_ddp(model.chunks, model.config, distributed_optimizer)
    return model


def wrap_ddp(chunks: list, config, distributed_optimizer: bool = True) -> list:
    """megatron-core DDP per chunk (fp32 grad buffers)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=distributed_optimizer)
    return [DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                    disable_bucketing=i > 0)
            for i, chunk in enumerate(chunks)]
