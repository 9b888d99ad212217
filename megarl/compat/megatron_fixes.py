"""Fixes for megatron-core 0.16 bugs that hit megarl on every device (CPU and GPU alike).

Applied by :func:`apply` (idempotent) before any model is built (``megarl.policy.build``), each
replaced at its definition site, never by editing megatron-core:

M1  the expert-bias token count of ``TopKRouter`` broadcasts the padding mask along the expert
    axis (:func:`_apply_expert_bias`); tests/unit/test_megatron_fixes.py, and the whole loop in
    tests/e2e/test_deepseek_e2e.py.
M2  distributed checkpoints load no code: torch DCP (megatron's ``torch_dist`` format) unpickles
    ``.metadata`` with plain ``pickle.load`` and byte items (TE's ``_extra_state``) with
    ``torch.load(weights_only=False)``, so a checkpoint someone else wrote could run code on every
    rank at resume. ``.metadata`` goes through :func:`restricted_load` (DCP's own metadata types,
    ``torch.Size``, dtypes, layouts) and byte items load with ``weights_only=True``; anything else
    raises :class:`UnsafePickleError` before it is built. TE FP8 extra state that pickles a recipe
    object would be refused. tests/unit/test_safe_loads.py.
M3  a frozen linear's input gradient (LoRA's frozen output layer): upstream's matmul on a
    non-contiguous ``[T, 1, V]`` gradient expands the weight to ``[T, V, H]``; the rows are
    multiplied as one matrix instead (:func:`_frozen_weight_backward`; test_megatron_fixes.py).
"""
from __future__ import annotations

import pickle

_APPLIED = False
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
                "torch.distributed.checkpoint.filesystem")
_PLAIN_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}


class UnsafePickleError(pickle.UnpicklingError):
    """A checkpoint pickle references something other than plain data and DCP's metadata types."""


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        import dataclasses
        import enum
        import importlib

        import torch

        if (module, name) in _PLAIN_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        if module in _DCP_MODULES:
            obj = getattr(importlib.import_module(module), name, None)
            if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
                return obj
        raise UnsafePickleError(f"unsafe GLOBAL {module}.{name}: not a type of torch's checkpoint metadata")


def restricted_load(file):
    """``pickle.load`` that builds only DCP metadata types and plain data (M2)."""
    return _RestrictedUnpickler(file).load()


def load_weights_only(source, what: str, map_location=None):
    """``torch.load(source, weights_only=True)`` (tensors, numbers, strings, containers); anything
    else raises :class:`UnsafePickleError` naming ``what`` and the global torch's unpickler
    refused, before it is built."""
    import re

    import torch

    try:
        with torch.serialization.safe_globals(optimizer_classes()):
            return torch.load(source, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"(?:unsupported|unsafe) GLOBAL [^\s]+|Unsupported global: GLOBAL [^\s]+|"
                          r"Unsupported operand \d+", str(err))
        raise UnsafePickleError(f"{what}: refused to load: it holds a pickled object that would run code "
                                f"({found.group(0) if found else str(err).splitlines()[0]})") from err


def optimizer_classes() -> list:
    """Optimizer classes a checkpoint may name (not build): megatron-core's HybridDeviceOptimizer
    (``trainer.optimizer_offload``) keeps its host and device optimizer classes in its parameter
    groups, so its state names torch's Adam/AdamW/SGD (and Transformer Engine's fused ones on GPU).
    A class reference is resolved by name; nothing of it runs while loading."""
    import torch

    found = [torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD]
    try:
        from transformer_engine.pytorch import optimizers as te_optimizers
    except Exception:   # no TE (CPU), or a TE that fails to import: nothing of it to allow
        return found
    return found + [c for c in (getattr(te_optimizers, n, None) for n in ("FusedAdam", "FusedSGD")) if c is not None]


def _load_bytes(self, read_item, value) -> None:
    from torch.distributed.checkpoint._traverse import set_element

    obj = load_weights_only(value, f"byte item {read_item.dest_index.fqn}")
    if self.flatten_state_dict:
        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
    else:
        self.state_dict[read_item.dest_index.fqn] = obj


def find_unsafe(err: BaseException | None, depth: int = 0) -> UnsafePickleError | None:
    """The :class:`UnsafePickleError` behind ``err``: its causes, and the per-rank failures that
    torch DCP wraps into ``CheckpointException``."""
    if err is None or depth > 8:
        return None
    if isinstance(err, UnsafePickleError):
        return err
    inner = [err.__cause__, err.__context__]
    for failure in (getattr(err, "failures", None) or {}).values():
        inner.append(failure[0] if isinstance(failure, tuple) else failure)
    for e in inner:
        if isinstance(e, BaseException) and (found := find_unsafe(e, depth + 1)) is not None:
            return found
    return None


def _apply_expert_bias(self, routing_map, padding_mask=None):
    """M1: ``TopKRouter._apply_expert_bias`` with the padding mask applied per token. Upstream
    computes ``routing_map & ~padding_mask`` with the mask already flattened to ``[tokens]`` and
    ``routing_map`` ``[tokens, experts]``: the mask broadcasts along the expert axis, so a model
    with expert bias (DeepSeek-V3's ``noaux_tc``) fails every training forward, or silently counts
    the wrong tokens when the token count equals the expert count. The count only updates the
    expert bias between steps, never the forward values."""
    import torch

    if self.enable_expert_bias and torch.is_grad_enabled():
        with torch.no_grad():
            if padding_mask is not None:
                routing_map = routing_map & ~padding_mask.reshape(-1, 1)
            self.local_tokens_per_expert += routing_map.sum(dim=0)


def _frozen_weight_backward(ctx, grad_output):
    """M3: the input gradient of ``LinearWithFrozenWeight`` with the leading dims folded into one
    (the same sums per element as upstream's matmul), all-reduced over TP when upstream does."""
    import torch

    (weight,) = ctx.saved_tensors
    rows = grad_output.reshape(-1, grad_output.shape[-1])
    grad_input = rows.matmul(weight).view(*grad_output.shape[:-1], weight.shape[1])
    if ctx.allreduce_dgrad:
        torch.distributed.all_reduce(grad_input, group=ctx.tp_group)
    return grad_input, None, None, None, None


def apply() -> None:
    """Install M1, M2 and M3 (once per process)."""
    global _APPLIED
    if _APPLIED:
        return
    import types

    from megatron.core.transformer.moe.router import TopKRouter
    from torch.distributed.checkpoint import default_planner, filesystem

    TopKRouter._apply_expert_bias = _apply_expert_bias
    from megatron.core.tensor_parallel import layers

    layers.LinearWithFrozenWeight.backward = staticmethod(layers.custom_bwd(_frozen_weight_backward))
    # filesystem.py's only other use of pickle is pickle.dump when saving: a copy of the module
    # whose load is the restricted one
    safe_pickle = types.ModuleType("pickle")
    safe_pickle.__dict__.update({k: v for k, v in vars(pickle).items() if not k.startswith("__")})
    safe_pickle.load = restricted_load
    filesystem.pickle = safe_pickle
    default_planner.DefaultLoadPlanner.load_bytes = _load_bytes
    _APPLIED = True
