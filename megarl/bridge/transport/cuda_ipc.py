"""GPU hand-off to a colocated vLLM worker: CUDA IPC handles of a device buffer.

Untested here (no GPU). The producer shares a CUDA tensor with ``torch.multiprocessing``'s
reduction (an IPC handle + offsets, picklable); the vLLM worker on the same device rebuilds it
without a copy. The producer must keep the tensor alive until the worker has loaded it."""
from __future__ import annotations


def share(tensor):
    """Picklable handle of a CUDA tensor for another process on the same device."""
    from torch.multiprocessing.reductions import reduce_tensor

    func, args = reduce_tensor(tensor)
    return func, args


def rebuild(handle):
    """The shared CUDA tensor in the receiving process (zero copy)."""
    func, args = handle
    return func(*args)
