"""Destination buffers and their manifests: what the bridge and the vLLM workers share.

A :class:`DestBuffer` holds one plan bucket's destination tensors on one device at 64-byte aligned
offsets (:func:`buffer_layout`). The bridge creates and fills it; its :meth:`~DestBuffer.manifest`
(plain values, since it crosses vLLM's msgpack RPC hop) lets a vLLM worker map it without a copy
(:func:`open_manifest`). Storages:

* ``shm``: a file in ``/dev/shm`` mapped with ``torch.from_file``, not
  ``multiprocessing.shared_memory``, whose resource tracker unlinks segments opened by
  non-creators when they exit; the creating rank unlinks. Other ranks of the host open it by name.
* ``cuda``: device memory, handed to the vLLM worker on the same GPU as a CUDA IPC handle; the
  creator keeps it alive until the load RPC returns. Untested here (no GPU in CI).

Names are the plan's destination names; a stacked HF expert tensor (``*`` in the name,
:func:`megarl.bridge.mapping.unstack_hf`) is read back as per-expert checkpoint tensors.
"""
from __future__ import annotations

import logging
import math
import os
import pickle
import re

import torch

from megarl.bridge.mapping import unstack_hf

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
STORAGES = ("shm", "cuda")
_ALIGN = 64
SHM_PREFIX = "megarl-ws-"
_CREATOR = re.compile(re.escape(SHM_PREFIX) + r"p(\d+)-")
logger = logging.getLogger(__name__)


def shm_name(creator_pid: int, rest: str) -> str:
    """The ``shm`` file name of a buffer its creator (``creator_pid``) unlinks: the pid lets
    :func:`sweep_stale_buffers` tell the files of a run that was killed mid-sync."""
    return f"{SHM_PREFIX}p{creator_pid}-{rest}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # another user's process
        return True
    return True


def sweep_stale_buffers(shm_dir: str = SHM_DIR) -> tuple[int, int]:
    """Remove the ``shm`` buffers whose creating process is gone (a run killed between a
    bucket's create and its close leaves them, up to a bucket per device). Returns the count
    and bytes removed. Files of a live process, of another user, or not named by
    :func:`shm_name` are left alone."""
    removed = nbytes = 0
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return 0, 0
    for name in names:
        match = _CREATOR.match(name)
        if match is None or _alive(int(match.group(1))):
            continue
        path = os.path.join(shm_dir, name)
        try:
            size = os.stat(path).st_size
            os.unlink(path)
        except OSError:   # another rank swept it first, or not ours to remove
            continue
        removed, nbytes = removed + 1, nbytes + size
    if removed:
        logger.warning("removed %d weight-sync buffers (%.2f GB) left in %s by processes that are gone",
                       removed, nbytes / 1e9, shm_dir)
    return removed, nbytes


def buffer_layout(shapes: dict, dtype: torch.dtype) -> tuple[dict, int]:
    """``name -> (byte offset, shape)`` of the tensors of ``shapes`` in one buffer; total bytes."""
    item = torch.empty((), dtype=dtype).element_size()
    out, off = {}, 0
    for name, shape in shapes.items():
        out[name] = (off, tuple(shape))
        off += -(-math.prod(shape) * item // _ALIGN) * _ALIGN
    return out, max(off, _ALIGN)


def _views(raw: torch.Tensor, dtype: torch.dtype, layout: dict) -> dict:
    item = torch.empty((), dtype=dtype).element_size()
    return {name: raw[off:off + math.prod(shape) * item].view(dtype).view(shape)
            for name, (off, shape) in layout.items()}


class DestBuffer:
    """One device's destination tensors of one bucket (see the module docstring).

    :meth:`create` on the destination device, :meth:`open` by another rank of the host (``shm``
    only), :meth:`view` to write a tensor, :meth:`manifest` for the vLLM worker, :meth:`close`
    when the worker has loaded it (the creator frees the storage)."""

    def __init__(self, name: str, shapes: dict, dtype: torch.dtype, storage: str, raw: torch.Tensor,
                 owner: bool):
        self.name, self.dtype, self.storage, self.raw, self.owner = name, dtype, storage, raw, owner
        self.layout, self.nbytes = buffer_layout(shapes, dtype)
        self.tensors = _views(raw, dtype, self.layout)

    @staticmethod
    def path(name: str) -> str:
        """The shared-memory file of an ``shm`` buffer."""
        return os.path.join(SHM_DIR, name)

    @classmethod
    def create(cls, name: str, shapes: dict, dtype: torch.dtype, storage: str = "shm") -> "DestBuffer":
        if storage not in STORAGES:
            raise ValueError(f"DestBuffer storage={storage!r}; known: {', '.join(STORAGES)}")
        nbytes = buffer_layout(shapes, dtype)[1]
        if storage == "cuda":
            raw = torch.empty(nbytes, dtype=torch.uint8, device=torch.cuda.current_device())
        else:
            with open(cls.path(name), "wb") as f:
                f.truncate(nbytes)
            raw = torch.from_file(cls.path(name), shared=True, size=nbytes, dtype=torch.uint8)
        return cls(name, shapes, dtype, storage, raw, owner=True)

    @classmethod
    def open(cls, name: str, shapes: dict, dtype: torch.dtype) -> "DestBuffer":
        """Map the ``shm`` buffer another rank of this host created (to write boxes into it)."""
        nbytes = buffer_layout(shapes, dtype)[1]
        raw = torch.from_file(cls.path(name), shared=True, size=nbytes, dtype=torch.uint8)
        return cls(name, shapes, dtype, "shm", raw, owner=False)

    def view(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def manifest(self) -> dict:
        """What a reader in another process needs to map the tensors (plain, msgpack-able values)."""
        out = {"nbytes": self.nbytes, "dtype": str(self.dtype).replace("torch.", ""),
               "tensors": [(n, off, list(shape)) for n, (off, shape) in self.layout.items()]}
        if self.storage == "cuda":
            from torch.multiprocessing.reductions import reduce_tensor

            out["cuda_ipc"] = pickle.dumps(reduce_tensor(self.raw))
        else:
            out["path"] = self.path(self.name)
        return out

    def close(self) -> None:
        self.raw, self.tensors = None, {}
        if self.owner and self.storage == "shm" and os.path.exists(self.path(self.name)):
            os.unlink(self.path(self.name))


def open_manifest(manifest: dict) -> list[tuple[str, torch.Tensor]]:
    """Reader side (vLLM worker): zero-copy ``(checkpoint name, tensor)`` pairs of a
    :meth:`DestBuffer.manifest` (stacked expert tensors split per expert)."""
    dtype = getattr(torch, manifest["dtype"])
    if "cuda_ipc" in manifest:
        rebuild, args = pickle.loads(manifest["cuda_ipc"])
        # argument 6 of torch's rebuild_cuda_tensor is the producer's device index; the same GPU
        # can have another index in this process (its own CUDA_VISIBLE_DEVICES)
        args = list(args)
        args[6] = torch.cuda.current_device()
        raw = rebuild(*args)
    else:
        raw = torch.from_file(manifest["path"], shared=True, size=manifest["nbytes"], dtype=torch.uint8)
    layout = {name: (off, tuple(shape)) for name, off, shape in manifest["tensors"]}
    return [pair for name, tensor in _views(raw, dtype, layout).items() for pair in unstack_hf(name, tensor)]
