"""Point-to-point transport over a torch.distributed group (gloo on CPU, NCCL on GPU).

Transfers run in the plan's global order; each is one ``send``/``recv`` of a contiguous slice
(a non-contiguous source box is copied once; a non-contiguous destination box is received into
a temporary and copied). Peak extra memory: one slice."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.bridge.mapping import box_shape, slices


class P2PTransport:
    name = "p2p"

    def __init__(self, rank: int, group=None, device: str = "cpu"):
        self.rank, self.group, self.device = rank, group, device

    def run(self, transfers, source, buffers: dict, open_remote) -> int:
        largest = 0
        for tr in transfers:
            if tr.local:
                if tr.src_rank == self.rank:
                    source.copy_box(tr.tensor, tr.src_box, buffers[tr.dst_rank].view(tr.dst_name)[slices(tr.dst_box)])
                continue
            if tr.src_rank == self.rank:
                out = source.read_box(tr.tensor, tr.src_box).contiguous()
                largest = max(largest, out.numel() * out.element_size())
                dist.send(out.to(self.device), dst=tr.dst_rank, group=self.group)
            elif tr.dst_rank == self.rank:
                dst = buffers[tr.dst_rank].view(tr.dst_name)[slices(tr.dst_box)]
                tmp = dst if dst.is_contiguous() and self.device == "cpu" else torch.empty(
                    box_shape(tr.dst_box), dtype=dst.dtype, device=self.device)
                if tmp is not dst:
                    largest = max(largest, tmp.numel() * tmp.element_size())
                dist.recv(tmp, src=tr.src_rank, group=self.group)
                if tmp is not dst:
                    dst.copy_(tmp)
        return largest
