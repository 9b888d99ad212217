"""Transports: they only move bytes of one plan bucket into destination buffers.

A destination buffer (:class:`megarl.bridge.buffer.DestBuffer`) holds the destination tensors of
one bucket on one device; every transport fills boxes of it from source shards. Transfers with
``src_rank == dst_rank`` are a ``copy_`` into the buffer in process. The others:

* ``auto`` (the default): chosen per transfer from the nodes the two ranks run on (the bridge
  gathers them, never guessed from the config): shared memory as ``shm`` between processes of
  one node, point to point between nodes (NCCL when the bridge's group is NCCL, i.e. on GPU,
  else gloo);
* ``shm``: same node only (the bridge refuses a plan with a transfer between nodes); every
  source maps the destination's shared-memory file and writes its boxes directly (no message,
  one barrier per bucket);
* ``gloo`` / ``nccl``: point-to-point ``send``/``recv`` of one contiguous slice at a time, in the
  plan's global order (which cannot deadlock: the first unfinished transfer always has both ends
  waiting on it), so a rank holds at most one slice in flight; NCCL needs CUDA;
* ``cuda_ipc``: NCCL into buffers in device memory, handed to the colocated vLLM worker as CUDA
  IPC handles (needs CUDA).

A transport class is built once per bridge as ``cls(rank, group, nodes)`` (collective: it may
create a process group; ``nodes[r]``: the node of group rank r); its ``storage`` says where
destination buffers live; ``path(transfer)`` names the way a transfer goes (``local``, ``shm``,
``gloo`` or ``nccl``: the keys of the bridge's ``bytes_by_path``); ``run(transfers, source,
buffers, open_remote)`` returns (largest temporary slice in bytes, messages sent or received).
"""
from megarl.bridge.transport.auto import AutoTransport
from megarl.bridge.transport.cuda_ipc import CudaIpcTransport
from megarl.bridge.transport.p2p import GlooTransport, NcclTransport, P2PTransport
from megarl.bridge.transport.shm import ShmTransport

TRANSPORTS = {"shm": ShmTransport, "gloo": GlooTransport, "nccl": NcclTransport, "cuda_ipc": CudaIpcTransport,
              "auto": AutoTransport}


def get_transport(name: str):
    if name not in TRANSPORTS:
        raise ValueError(f"unknown transport {name!r}; known: {', '.join(TRANSPORTS)}")
    return TRANSPORTS[name]


__all__ = ["TRANSPORTS", "AutoTransport", "CudaIpcTransport", "GlooTransport", "NcclTransport", "P2PTransport",
           "ShmTransport", "get_transport"]
