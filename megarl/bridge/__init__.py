"""Weight bridge: Megatron shards -> vLLM's tensor-parallel layout, loaded in place.

Three layers: :mod:`megarl.bridge.mapping` (pure per-family layout functions),
:mod:`megarl.bridge.transfers` (deterministic transfer plan from shapes only), and
:mod:`megarl.bridge.transport` + :mod:`megarl.bridge.sync` (moving bytes, vLLM hand-off; settings
from the ``bridge:`` config section).

The boundary with the vLLM worker processes (:mod:`megarl.rollout.worker_ext`) is three small
public modules, and the worker side uses nothing else of the bridge:
:mod:`megarl.bridge.buffer` (destination buffers, their manifests and the reader that maps them),
:mod:`megarl.bridge.rpc` (the names of the worker methods the bridge calls) and
:mod:`megarl.bridge.verify` (the checksum both sides compute in verification mode).
"""
from megarl.bridge.mapping import get_mapping
from megarl.bridge.transfers import MegatronLayout, Planner, Transfer, VllmLayout, build_plan

__all__ = ["MegatronLayout", "Planner", "SyncOptions", "Transfer", "VllmLayout", "WeightBridge",
           "WeightSyncError", "build_plan", "get_mapping"]


def __getattr__(name):   # torch.distributed-dependent parts load lazily
    if name in ("SyncOptions", "WeightBridge", "WeightSyncError"):
        from megarl.bridge import sync

        return getattr(sync, name)
    raise AttributeError(name)
