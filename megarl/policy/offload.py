"""Offload / onload of params, grads and optimizer state to host memory.

Algorithm: every tensor to move is reduced to its *storage* (megatron-core DDP keeps params and
grads as views of a few contiguous buffers, and the distributed optimizer's fp32 shards are
views of those buffers too). For each distinct storage we keep a host copy of its bytes and
``resize_(0)`` the device storage, which frees it while every view (``param.data``,
``param.main_grad``, optimizer shard views) stays valid. Onload resizes the storage back and
copies the bytes in; the views see the original values again.

On a CPU-only machine the "device" is the host: the same calls run, really free and restore the
storages, and are tested for exact state preservation (``tests/distributed/test_engine_train.py``).
Host copies are pinned when CUDA is present.
"""
from __future__ import annotations

import torch


def _storage_bytes(storage) -> torch.Tensor:
    """A uint8 tensor aliasing the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


class Offloader:
    def __init__(self, engine):
        self.engine = engine
        self.saved: dict[int, tuple] = {}   # storage data_ptr -> (storage, host bytes, nbytes)

    def _tensors(self, params: bool, grads: bool, optimizer: bool) -> list[torch.Tensor]:
        out = []
        for chunk in self.engine.model.chunks:
            buffers = getattr(chunk, "buffers", None)   # DDP: a list attribute shadowing Module.buffers()
            if isinstance(buffers, list):
                buffers = buffers + list(getattr(chunk, "expert_parallel_buffers", None) or [])
                for buf in buffers:
                    if params and getattr(buf, "param_data", None) is not None:
                        out.append(buf.param_data)
                    if grads and getattr(buf, "grad_data", None) is not None:
                        out.append(buf.grad_data)
            elif params:
                out.extend(p.data for p in chunk.parameters())
        # an optimizer already on the host (OptimOptions.cpu_offload) stays where it is
        if optimizer and self.engine.optimizer is not None and not self.engine.optim.cpu_offload:
            for opt in _torch_optimizers(self.engine.optimizer):
                for state in opt.state.values():
                    out.extend(v for v in state.values() if torch.is_tensor(v) and v.numel() > 0)
        return out

    def offload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> None:
        pin = torch.cuda.is_available()
        for t in self._tensors(params, grads, optimizer):
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self.saved or storage.nbytes() == 0:
                continue
            host = _storage_bytes(storage).to("cpu", copy=True)
            if pin:
                host = host.pin_memory()
            self.saved[key] = (storage, host, storage.nbytes())
            storage.resize_(0)

    def onload(self) -> None:
        for storage, host, nbytes in self.saved.values():
            storage.resize_(nbytes)
            _storage_bytes(storage).copy_(host)
        self.saved = {}

    @property
    def offloaded_bytes(self) -> int:
        return sum(n for _, _, n in self.saved.values())


def _torch_optimizers(optimizer) -> list:
    """The torch optimizers inside a megatron (Chained/Distributed) optimizer."""
    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [getattr(o, "optimizer", o) for o in inner]
