"""The weight sync of a LoRA policy in adapter mode (``bridge.lora_sync: adapter``).

The engines keep the frozen base weights they loaded at start (the same HF folder the policy's
base came from; it never changes), so a sync moves only the adapters: every training rank
gathers the model's adapter tensors under their PEFT names (over TP and PP; a few MB; the A that
q/k/v and gate/up share travels once), and the rank that drives each engine hands them to it
(:func:`megarl.rollout.lora.load_adapter`, through Ray), where vLLM replaces its LoRA adapter in
place. The interface is the weight bridge's
(``sync(engine=None)``, ``llm``, ``version``), so restarts and resumes work the same way.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist


def wire_form(tensors: dict) -> tuple[dict, dict]:
    """What travels: each tensor object once (``tensors`` names the fused layers' shared A under
    every HF module's name: q/k/v, gate/up), on the CPU, plus ``{name: name it repeats}``."""
    first, out, aliases = {}, {}, {}
    for name, t in tensors.items():
        if id(t) in first:
            aliases[name] = first[id(t)]
        else:
            first[id(t)], out[name] = name, t.cpu()
    return out, aliases


class AdapterSync:
    """Megatron LoRA adapters -> every engine's vLLM LoRA slot, for one training rank.

    ``llm``: on the rank that drives engine ``engine_index``, that engine (``vllm.LLM`` or a
    :class:`megarl.rollout.engine.RemoteEngine`); None elsewhere. Collective to build and to sync
    (every rank of the default group)."""

    def __init__(self, engine, base_model: str, llm=None, engine_index=None):
        from megarl.bridge import rpc
        from megarl.policy.lora import peft_config

        self.engine, self.llm, self.engine_index = engine, llm, engine_index
        self.config = peft_config(engine.model.adapters[0].options, base_model)
        # continue the engines' weight version (a new bridge must not go back in time)
        version = torch.tensor([max(llm.collective_rpc(rpc.WEIGHT_VERSION)) if llm is not None else 0])
        if dist.is_initialized():
            dist.all_reduce(version, op=dist.ReduceOp.MAX)
        self.version = int(version)

    def sync(self, engine=None) -> dict:
        """Load the current adapters into every engine (``engine``: only into that one, at the
        current version: a restarted engine catching up). Returns this rank's stats: the
        adapter's bytes, and on an engine's driver its load time and the bytes it received."""
        from megarl.policy.lora import peft_state
        from megarl.rollout.lora import load_adapter

        t0 = time.perf_counter()
        if engine is None:
            self.version += 1
        model = self.engine.model
        tensors, aliases = wire_form(peft_state(model.adapters, model.mapping, self.engine.groups))
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        stats = {"version": self.version, "adapter_bytes": nbytes, "adapter_tensors": len(tensors) + len(aliases)}
        drives = self.llm is not None and engine in (None, self.engine_index)
        if drives:
            loaded = load_adapter(self.llm, tensors, self.config, self.version, aliases)
            stats.update(engine_index=self.engine_index, engine_load_seconds=loaded["seconds"],
                         engine_bytes=loaded["bytes"], bytes_by_path={"ray": nbytes})
        if dist.is_initialized():
            dist.barrier()
        stats.update(seconds=time.perf_counter() - t0, bytes_sent_by_rank=nbytes if drives else 0)
        return stats
