"""Same-host transport: every source maps the destination's shared-memory buffer
(:meth:`megarl.bridge.buffer.DestBuffer.open`) and writes its boxes straight into it (no message;
the bridge gathers every rank's manifests after its writes, which orders them before vLLM reads)."""
from __future__ import annotations

from megarl.bridge.mapping import slices


class ShmTransport:
    name = "shm"
    storage = "shm"

    def __init__(self, rank: int, group=None, nodes=None):
        self.rank, self.group = rank, group

    def path(self, tr) -> str:
        return "local" if tr.local else "shm"

    def run(self, transfers, source, buffers: dict, open_remote) -> tuple[int, int]:
        """Write every transfer whose source is this rank. Returns (largest temporary slice in
        bytes, point-to-point messages): (0, 0)."""
        for tr in transfers:
            if tr.src_rank != self.rank:
                continue
            buf = buffers.get(tr.dst_rank) or open_remote(tr.dst_rank)
            source.copy_box(tr.tensor, tr.src_box, buf.view(tr.dst_name)[slices(tr.dst_box)])
        return 0, 0
