"""Process groups from a :class:`~megarl.parallel.topology.Topology`.

``build_process_groups(topology)`` initialises megatron-core's ``parallel_state`` once (tp, pp,
vpp, ep, etp, cp; dp derived) and returns a :class:`ParallelGroups`: the ``ProcessGroupCollection``
plus this rank's coordinates. Callers pass that object to the code that needs groups (the
engine, the weight bridge); nothing in megarl reads megatron's globals except through it.

Megatron keeps the groups in module globals; calling :func:`build_process_groups` again
destroys the previous layout first (tests switch layouts inside one process), torch's groups
included: megatron's ``destroy_model_parallel`` only forgets them, and every group left alive
makes the next ``new_group`` slower (measured with gloo, 2 ranks: 0.04 s per layout at first,
10 s per layout after 45 layouts; the layout tests and conversion build dozens). Layout errors are
raised by :class:`Topology` before any group exists; this module only checks that the topology's
``world_size`` is the size of the running job.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megarl.parallel.topology import Topology, TopologyError

__all__ = ["ParallelGroups", "build_process_groups", "destroy_process_groups"]


@dataclass(frozen=True)
class ParallelGroups:
    """The process groups of one layout and this rank's coordinates in it."""

    topology: Topology
    pgs: Any
    """megatron-core ``ProcessGroupCollection`` (tp, pp, cp, ep, expt_tp, dp, dp_cp, expt_dp, ...)."""
    tp_rank: int
    pp_rank: int
    cp_rank: int
    dp_rank: int
    ep_rank: int
    etp_rank: int

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.topology.pp - 1


_OWN_GROUPS: list = []
"""torch process groups created by the last :func:`build_process_groups` (destroyed by the next)."""


def _live_groups() -> set:
    import torch.distributed.distributed_c10d as c10d

    return {pg for pg in c10d._world.pg_map if pg is not c10d._world.default_pg}


def destroy_process_groups() -> None:
    """Destroy megatron's current parallel layout and the torch process groups it created (the
    default process group stays). Nothing built on that layout may be used afterwards."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    while _OWN_GROUPS:
        group = _OWN_GROUPS.pop()
        if group in _live_groups():
            dist.destroy_process_group(group)


def build_process_groups(topology: Topology, seed: int = 1234) -> ParallelGroups:
    """Initialise megatron-core parallel state for ``topology`` and seed its RNG tracker.

    ``torch.distributed`` must be initialised with ``topology.world_size`` ranks. ``seed`` seeds
    megatron's model-parallel RNG tracker (dropout, and random init before HF weights load).
    """
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection

    if not dist.is_initialized():
        raise RuntimeError("build_process_groups: torch.distributed is not initialised "
                           "(call torch.distributed.init_process_group first)")
    if dist.get_world_size() != topology.world_size:
        raise TopologyError("world_size", topology.world_size,
                            f"the number of running processes ({dist.get_world_size()})")
    destroy_process_groups()
    before = _live_groups()
    ps.initialize_model_parallel(**topology.megatron_sizes())
    _OWN_GROUPS.extend(_live_groups() - before)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return ParallelGroups(
        topology=topology,
        pgs=ProcessGroupCollection.use_mpu_process_groups(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        cp_rank=ps.get_context_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
    )
