"""Build each distinct rank's real megatron-core model on the meta device and count its parameters.

No GPU, no weights, no other process: for one representative rank of each kind, :func:`count_rank`
fakes the world in this process (``init_process_group("fake")`` on torch's ``FakeStore`` at the
full world size), runs megatron-core's ``initialize_model_parallel`` for the layout (no gloo
groups: they need a real rendezvous), builds the model through megarl's own path (the family's
mbridge bridge with :func:`megarl.policy.build._config_overrides`) under
``torch.device("meta")``, counts per parameter kind and tears everything down.

A rank's parameters depend only on its pipeline stage (its dense and MoE layers, and whether it
holds the embedding or the output layer), so stages alike in those are one kind. Counted per rank:
``dense`` (replicated over DP) and ``expert`` (routed experts, sharded over ep), with ``embedding``
and ``output`` apart; the MTP block is never built (mbridge_fixes F4). The model total multiplies
each kind's parameters by the ranks holding distinct shards: tp (etp for experts) for a
tensor-parallel parameter, ep for a routed expert.
"""
from __future__ import annotations

import contextlib
import io
import time
from dataclasses import dataclass, field

from megarl.parallel.topology import Topology


class RankBuildError(RuntimeError):
    """A rank's model could not be built; the message says which rank and why."""


@dataclass(frozen=True)
class StageKind:
    """Pipeline stages whose ranks hold the same parameter shapes."""

    stages: tuple[int, ...]
    """The pp stages of this kind."""
    dense_layers: int
    moe_layers: int
    first: bool
    last: bool

    @property
    def label(self) -> str:
        where = f"pp stage {self.stages[0]}" if len(self.stages) == 1 else \
            f"pp stages {self.stages[0]}..{self.stages[-1]} ({len(self.stages)})"
        parts = [f"{self.dense_layers} dense" if self.dense_layers else "", f"{self.moe_layers} MoE" if self.moe_layers
                 else "", "embedding" if self.first else "", "output layer" if self.last else ""]
        return f"{where}: " + " + ".join(p for p in parts if p)


@dataclass
class RankCount:
    """The parameters one rank of a :class:`StageKind` holds."""

    kind: StageKind
    rank: int
    """The global rank that was built."""
    dense: int = 0
    """Parameters replicated over data parallel (everything but routed experts)."""
    expert: int = 0
    """Routed-expert parameters (sharded over ep, replicated over expert data parallel)."""
    embedding: int = 0
    output: int = 0
    model_dense: int = 0
    """Distinct dense parameters of the stage across its tp shards (tp-sharded ones x tp)."""
    model_expert: int = 0
    """Distinct routed-expert parameters of the stage across ep (and etp) shards."""
    seconds: float = 0.0
    """Time taken to set up the groups and build this rank's model."""
    chunks: list = field(default_factory=list)
    """Parameters per virtual pipeline chunk."""

    @property
    def total(self) -> int:
        return self.dense + self.expert


def stage_kinds(topology: Topology, dims) -> list[StageKind]:
    """The distinct kinds of pipeline stage of ``topology`` for a model of ``dims``
    (:class:`~megarl.models.dims.ModelDims`), in stage order."""
    layers: dict[int, list[int]] = {s: [] for s in range(topology.pp)}
    for layer in range(dims.num_layers):
        layers[topology.stage_of_layer(layer, dims.num_layers)].append(layer)
    groups: dict[tuple, list[int]] = {}
    for stage, held in layers.items():
        moe = sum(dims.is_moe_layer(i) for i in held)
        key = (len(held) - moe, moe, stage == 0, stage == topology.pp - 1)
        groups.setdefault(key, []).append(stage)
    return [StageKind(tuple(stages), *key) for key, stages in groups.items()]


def first_rank_of_stage(topology: Topology, stage: int) -> int:
    """The global rank with tp = cp = dp = 0 on pipeline stage ``stage`` (megatron's rank order
    tp-cp-ep-dp-pp: the pipeline coordinate varies slowest)."""
    return stage * (topology.world_size // topology.pp)


def _init_fake_world(topology: Topology, rank: int) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=topology.world_size)
    ps.initialize_model_parallel(**topology.megatron_sizes(), create_gloo_process_groups=False)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)


def _teardown_fake_world() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _count(count: RankCount, chunks: list, topology: Topology) -> None:
    for chunk in chunks:
        in_chunk = 0
        for name, param in chunk.named_parameters():
            n = param.numel()
            in_chunk += n
            sharded = bool(getattr(param, "tensor_model_parallel", False))
            if ".mlp.experts." in name:
                count.expert += n
                count.model_expert += n * topology.ep * (topology.expert_tp if sharded else 1)
            else:
                count.dense += n
                count.model_dense += n * (topology.tp if sharded else 1)
            if "embedding" in name:
                count.embedding += n
            if "output_layer" in name:
                count.output += n
        count.chunks.append(in_chunk)


def count_rank(folder: str, hf_config, topology: Topology, kind: StageKind, options) -> RankCount:
    """Build rank :func:`first_rank_of_stage` of ``kind`` on the meta device under a fake world
    and count its parameters. ``options`` is the engine's
    :class:`~megarl.policy.build.ModelOptions` (dtype, recompute, router losses)."""
    import torch

    from megarl.policy.build import _DTYPES, _config_overrides, _restore_attention_env
    from megarl.models.registry import make_bridge

    rank = first_rank_of_stage(topology, kind.stages[0])
    count = RankCount(kind=kind, rank=rank)
    t0 = time.time()
    try:
        _init_fake_world(topology, rank)
    except Exception as err:
        _teardown_fake_world()
        raise RankBuildError(f"rank {rank} ({kind.label}): megatron could not set up the process groups of "
                             f"tp={topology.tp} pp={topology.pp} ep={topology.ep} cp={topology.cp} at "
                             f"world_size={topology.world_size}: {type(err).__name__}: {err}") from err
    try:
        dtype = _DTYPES[options.dtype]
        # perform_initialization stays on: megatron's CPU init is what marks tensor-parallel
        # weights (tensor_model_parallel); on meta tensors it computes nothing
        bridge = make_bridge(hf_config, dtype, _config_overrides(options, topology))
        _restore_attention_env()
        with torch.device("meta"), contextlib.redirect_stdout(io.StringIO()):
            chunks = bridge.get_model(wrap_with_ddp=False, bf16=dtype == torch.bfloat16, fp16=False,
                                      use_cpu_initialization=True, init_model_with_meta_device=True)
        _count(count, chunks, topology)
    except Exception as err:
        raise RankBuildError(f"rank {rank} ({kind.label}) of {folder}: megatron-core could not build the model: "
                             f"{type(err).__name__}: {err}") from err
    finally:
        _teardown_fake_world()
    count.seconds = time.time() - t0
    return count
