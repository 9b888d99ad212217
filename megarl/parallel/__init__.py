"""Parallel layout: :class:`Topology` (validated sizes) and process-group construction."""
from megarl.parallel.groups import ParallelGroups, build_process_groups, destroy_process_groups
from megarl.parallel.topology import Topology, TopologyError

__all__ = ["ParallelGroups", "Topology", "TopologyError", "build_process_groups",
           "destroy_process_groups"]
