"""Transports: they only move bytes of one plan bucket into destination buffers.

Every transport fills boxes of a :class:`megarl.bridge.buffer.DestBuffer` from source shards;
transfers with ``src_rank == dst_rank`` are an in-process ``copy_``. The others:

* ``auto`` (default): per transfer from the two ranks' nodes: ``shm`` within a node, point to
  point between nodes (NCCL when the bridge's group is NCCL, else gloo);
* ``shm``: same node only; sources map the destination's file and write directly (one barrier);
* ``gloo`` / ``nccl``: ``send``/``recv`` of one contiguous slice at a time in the plan's global
  order (deadlock-free: the first unfinished transfer has both ends waiting on it);
* ``cuda_ipc``: NCCL into device-memory buffers handed to the colocated vLLM worker (CUDA only).

A transport is built once per bridge as ``cls(rank, group, nodes)`` (collective); ``storage``
says where buffers live, ``path(transfer)`` names the way a transfer goes (the keys of
``bytes_by_path``), ``run(transfers, source, buffers, open_remote)`` returns (largest temporary
slice in bytes, messages sent or received).
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
