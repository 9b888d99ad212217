"""Point-to-point transports over a torch.distributed group: gloo (CPU tensors) and NCCL (CUDA).

Transfers run in the plan's global order; each is one ``send``/``recv`` of a contiguous slice
(a non-contiguous source box is copied once; a destination box that is not contiguous, or not on
the transport's device, is received into a temporary and copied). Peak extra memory: one slice.

The group must have the transport's backend: when the bridge's group has another one (gloo
sends on a GPU run, whose default group is NCCL), a group of the transport's backend over the
same ranks is created once, when the bridge is built (collective: every rank builds it).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.bridge.mapping import box_shape, slices


class P2PTransport:
    name = "p2p"
    backend = "gloo"
    device = "cpu"
    storage = "shm"
    """Where the destination buffers live (:data:`megarl.bridge.buffer.STORAGES`)."""

    def __init__(self, rank: int, group=None, nodes=None):
        self.rank, self.group = rank, group
        if dist.is_initialized() and dist.get_backend(group) != self.backend:
            ranks = None if group is None else dist.get_process_group_ranks(group)
            self.group = dist.new_group(ranks, backend=self.backend)

    def path(self, tr) -> str:
        return "local" if tr.local else self.backend

    def run(self, transfers, source, buffers: dict, open_remote) -> tuple[int, int]:
        """Move every transfer this rank sends or receives. Returns (largest temporary slice in
        bytes, messages sent or received by this rank)."""
        largest = messages = 0
        for tr in transfers:
            if tr.local:
                if tr.src_rank == self.rank:
                    source.copy_box(tr.tensor, tr.src_box, buffers[tr.dst_rank].view(tr.dst_name)[slices(tr.dst_box)])
                continue
            if tr.src_rank == self.rank:
                out = source.read_box(tr.tensor, tr.src_box).contiguous()
                largest = max(largest, out.numel() * out.element_size())
                dist.send(out.to(self.device), dst=tr.dst_rank, group=self.group)
                messages += 1
            elif tr.dst_rank == self.rank:
                dst = buffers[tr.dst_rank].view(tr.dst_name)[slices(tr.dst_box)]
                direct = dst.is_contiguous() and dst.device.type == self.device
                tmp = dst if direct else torch.empty(box_shape(tr.dst_box), dtype=dst.dtype, device=self.device)
                if not direct:
                    largest = max(largest, tmp.numel() * tmp.element_size())
                dist.recv(tmp, src=tr.src_rank, group=self.group)
                messages += 1
                if not direct:
                    dst.copy_(tmp)
        return largest, messages


class GlooTransport(P2PTransport):
    name = "gloo"


class NcclTransport(P2PTransport):
    """Slices travel as CUDA tensors; the destination buffers stay in host shared memory."""

    name, backend, device = "nccl", "nccl", "cuda"
