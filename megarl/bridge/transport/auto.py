"""The default transport: each transfer takes the path its two ranks' nodes allow.

``nodes[r]`` names the node group rank ``r`` runs on (gathered by the bridge: the Ray node id in a
run, the host name otherwise; None: every rank on one node). A transfer whose two ranks share a
node is written through shared memory like :class:`~megarl.bridge.transport.shm.ShmTransport` (an
in-process copy when they are the same rank); one between nodes goes point to point like
:class:`~megarl.bridge.transport.p2p.P2PTransport`, over NCCL when the bridge's group is an NCCL
group (a GPU run: the shards are CUDA tensors), else over gloo.

Order: the cross-node transfers run in the plan's global order (every rank filters the same plan
with the same node table, so both ends of each message agree on it); the shared-memory writes
never wait for another rank, so they all go first.
"""
from __future__ import annotations

import torch.distributed as dist

from megarl.bridge.transport.p2p import GlooTransport, NcclTransport
from megarl.bridge.transport.shm import ShmTransport


class AutoTransport:
    name = "auto"
    storage = "shm"

    def __init__(self, rank: int, group=None, nodes=None):
        self.nodes = nodes
        self.shm = ShmTransport(rank, group, nodes)
        network = NcclTransport if dist.is_initialized() and dist.get_backend(group) == "nccl" else GlooTransport
        self.backend = network.backend
        # built only when some ranks are on other nodes (the same answer on every rank: the group
        # creation P2PTransport may do is collective)
        self.p2p = network(rank, group, nodes) if nodes and len(set(nodes)) > 1 else None

    def path(self, tr) -> str:
        if tr.local:
            return "local"
        if self.nodes is None or self.nodes[tr.src_rank] == self.nodes[tr.dst_rank]:
            return "shm"
        return self.backend

    def run(self, transfers, source, buffers: dict, open_remote) -> tuple[int, int]:
        """Shared-memory writes of this rank, then the cross-node messages in plan order. Returns
        (largest temporary slice in bytes, messages sent or received by this rank)."""
        same, cross = [], []
        for tr in transfers:
            (same if self.path(tr) in ("local", "shm") else cross).append(tr)
        self.shm.run(same, source, buffers, open_remote)
        return self.p2p.run(cross, source, buffers, open_remote) if cross else (0, 0)
