"""Destination buffers in shared memory (``/dev/shm`` files mapped with ``torch.from_file``) and
the same-host transport that writes source boxes straight into them.

A file (not ``multiprocessing.shared_memory``) because Python's resource tracker unlinks
segments opened by non-creator processes when they exit; here the creating rank unlinks."""
from __future__ import annotations

import os

import torch

from megarl.bridge.mapping import slices

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None
_ALIGN = 64


def _layout(shapes: dict, dtype: torch.dtype):
    """name -> (byte offset, shape); total bytes."""
    item = torch.empty((), dtype=dtype).element_size()
    out, off = {}, 0
    for name, shape in shapes.items():
        n = 1
        for s in shape:
            n *= s
        out[name] = (off, tuple(shape))
        off += -(-n * item // _ALIGN) * _ALIGN
    return out, max(off, _ALIGN)


class DestBuffer:
    """One device's destination tensors of one bucket, in one shared-memory file."""

    def __init__(self, name: str, shapes: dict, dtype: torch.dtype, create: bool):
        self.name, self.dtype = name, dtype
        self.layout, self.nbytes = _layout(shapes, dtype)
        self.path = os.path.join(SHM_DIR or "/tmp", name)
        if create:
            with open(self.path, "wb") as f:
                f.truncate(self.nbytes)
        self.raw = torch.from_file(self.path, shared=True, size=self.nbytes, dtype=torch.uint8)
        self.owner = create

    def view(self, name: str) -> torch.Tensor:
        off, shape = self.layout[name]
        item = torch.empty((), dtype=self.dtype).element_size()
        n = 1
        for s in shape:
            n *= s
        return self.raw[off:off + n * item].view(self.dtype).view(shape)

    def manifest(self) -> dict:
        """What a reader in another process needs to map the tensors."""
        return {"path": self.path, "nbytes": self.nbytes, "dtype": str(self.dtype).replace("torch.", ""),
                "tensors": [(n, off, list(shape)) for n, (off, shape) in self.layout.items()]}

    def close(self):
        self.raw = None
        if self.owner and os.path.exists(self.path):
            os.unlink(self.path)


def open_manifest(manifest: dict) -> list[tuple[str, torch.Tensor]]:
    """Reader side (vLLM worker): zero-copy tensors of a :meth:`DestBuffer.manifest`."""
    dtype = getattr(torch, manifest["dtype"])
    raw = torch.from_file(manifest["path"], shared=True, size=manifest["nbytes"], dtype=torch.uint8)
    item = torch.empty((), dtype=dtype).element_size()
    out = []
    for name, off, shape in manifest["tensors"]:
        n = 1
        for s in shape:
            n *= s
        out.append((name, raw[off:off + n * item].view(dtype).view(shape)))
    return out


class ShmTransport:
    """Same-host: sources write their boxes into the destination's mapped buffer."""

    name = "shm"

    def __init__(self, rank: int, group=None):
        self.rank, self.group = rank, group

    def run(self, transfers, source, buffers: dict, open_remote) -> int:
        """Write every transfer whose source is this rank; returns the largest temporary slice (0)."""
        for tr in transfers:
            if tr.src_rank != self.rank:
                continue
            buf = buffers.get(tr.dst_rank) or open_remote(tr.dst_rank)
            source.copy_box(tr.tensor, tr.src_box, buf.view(tr.dst_name)[slices(tr.dst_box)])
        return 0
