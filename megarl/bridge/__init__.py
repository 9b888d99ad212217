"""Weight bridge: Megatron shards -> vLLM's tensor-parallel layout, loaded in place.

Three layers (DESIGN.md s3): :mod:`megarl.bridge.mapping` (pure per-family layout functions),
:mod:`megarl.bridge.plan` (deterministic transfer plan from shapes only), and
:mod:`megarl.bridge.transport` + :mod:`megarl.bridge.sync` (moving bytes, vLLM hand-off).
"""
from megarl.bridge.mapping import MAPPINGS, get_mapping
from megarl.bridge.plan import MegatronLayout, Planner, Transfer, VllmLayout, build_plan

__all__ = ["MAPPINGS", "MegatronLayout", "Planner", "SyncOptions", "Transfer", "VllmLayout", "WeightBridge",
           "WeightSyncError", "build_plan", "get_mapping"]


def __getattr__(name):   # torch.distributed-dependent parts load lazily
    if name in ("SyncOptions", "WeightBridge", "WeightSyncError"):
        from megarl.bridge import sync

        return getattr(sync, name)
    raise AttributeError(name)
