"""GPU hand-off to the colocated vLLM worker: destination buffers in device memory.

Each destination device allocates its bucket buffer on its GPU (:class:`megarl.bridge.buffer.DestBuffer`
with ``storage="cuda"``); slices from other ranks arrive by NCCL ``send``/``recv`` straight into
it (:class:`~megarl.bridge.transport.p2p.NcclTransport`), and the buffer's manifest carries a CUDA
IPC handle, so the vLLM worker on the same GPU maps it without a copy and without a trip through
host memory. Untested here (no GPU in CI); ``bridge.transport=cuda_ipc`` is refused at config
load on a machine without CUDA.
"""
from __future__ import annotations

from megarl.bridge.transport.p2p import NcclTransport


class CudaIpcTransport(NcclTransport):
    name = "cuda_ipc"
    storage = "cuda"
