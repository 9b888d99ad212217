"""Transports: they only move bytes of one plan bucket into destination buffers.

A destination buffer (:class:`~megarl.bridge.transport.shm.DestBuffer`) holds the destination
tensors of one bucket on one device; every transport fills boxes of it from source shards:

* ``inproc``: source and destination are the same process (a ``copy_`` into the buffer);
* ``shm``: same host; every source maps the destination's shared-memory file and writes its
  boxes directly (no message, one barrier per bucket) -- the CPU default;
* ``gloo`` / ``nccl``: point-to-point ``send``/``recv`` of one contiguous slice at a time, in the
  plan's global order (which cannot deadlock: the first unfinished transfer always has both ends
  waiting on it), so a rank holds at most one slice in flight;
* ``cuda_ipc`` (:mod:`.cuda_ipc`): hands a device buffer to the colocated vLLM worker process.

Transfers with ``src_rank == dst_rank`` always use ``inproc``.
"""
from megarl.bridge.transport.p2p import P2PTransport
from megarl.bridge.transport.shm import DestBuffer, ShmTransport

TRANSPORTS = {"shm": ShmTransport, "gloo": P2PTransport, "nccl": P2PTransport}


def get_transport(name: str):
    if name not in TRANSPORTS:
        raise ValueError(f"unknown transport {name!r}; known: {', '.join(sorted(TRANSPORTS))}")
    return TRANSPORTS[name]


__all__ = ["TRANSPORTS", "DestBuffer", "P2PTransport", "ShmTransport", "get_transport"]
