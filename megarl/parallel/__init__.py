"""Parallel layout: :class:`Topology` (validated sizes) and process-group construction."""
from megarl.parallel.topology import ModelDims, Topology, TopologyError

__all__ = ["ModelDims", "Topology", "TopologyError"]
