"""The policy's LoRA adapter inside a vLLM engine (``bridge.lora_sync: adapter``).

An engine built with :func:`engine_options` holds the frozen base weights it loaded at start and
one LoRA slot. Each weight sync hands it the adapter tensors (:func:`load_adapter`): every vLLM
worker replaces the adapter in place (``rpc.LOAD_ADAPTER``, vLLM's ``load_inplace``), the prefix
cache is dropped (its blocks were computed with the old adapter), and from then on every request
of the engine carries :func:`adapter_request`. Before the first load the engine runs the bare base,
which is the policy itself while B is still zero.
"""
from __future__ import annotations

import weakref

from megarl.bridge import rpc
from megarl.config.loader import VLLM_LORA_RANKS

ADAPTER_NAME = "megarl-policy"
ADAPTER_ID = 1
ADAPTER_PATH = "megarl:in-memory-adapter"
"""The path requests name: never read (the adapter is already loaded when they arrive)."""
_ACTIVE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def engine_options(rank: int) -> dict:
    """``vllm.LLM`` keywords of an engine that takes the policy's adapter of ``rank``."""
    max_rank = next(r for r in VLLM_LORA_RANKS if r >= rank)
    return {"enable_lora": True, "max_lora_rank": max_rank, "max_loras": 1, "max_cpu_loras": 1}


def load_adapter(llm, tensors: dict, config: dict, version: int, aliases: dict | None = None) -> dict:
    """Load the adapter (PEFT names -> full tensors, its ``adapter_config.json``; ``aliases``:
    ``{name: name in tensors}`` of the tensors that repeat another) into every worker of ``llm``
    and make every later request use it. Returns ``{"bytes", "seconds"}`` (bytes one worker
    received; seconds of the slowest). An engine in another process
    (:class:`megarl.rollout.engine.RemoteEngine`) loads it there."""
    aliases = aliases or {}
    if hasattr(llm, "load_adapter"):
        return llm.load_adapter(tensors, config, version, aliases)
    replies = llm.collective_rpc(rpc.LOAD_ADAPTER, args=(tensors, config, version, aliases))
    llm.reset_prefix_cache()
    _ACTIVE[llm] = True
    return {"bytes": replies[0]["bytes"], "seconds": max(r["secs"] for r in replies)}


def adapter_request(llm):
    """The ``lora_request`` of ``llm``'s requests: the policy's adapter once one is loaded, else None."""
    if llm not in _ACTIVE:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(ADAPTER_NAME, ADAPTER_ID, ADAPTER_PATH)
