"""vLLM worker extension for the weight bridge (``LLM(worker_extension_cls=WORKER_EXTENSION)``).

Methods are called by name through ``llm.collective_rpc`` (no pickled callables). A bucket
arrives as a manifest of a shared-memory file per vLLM rank (raw tensors in RPC arguments would
turn into lists on vLLM's msgpack hop); tensors are mapped without a copy and loaded through
vLLM's own path:

* ``hf_full`` (CPU): ``Worker.reload_weights(weights_iterator=..., is_checkpoint_format=True)``:
  vLLM's layer-wise reload restores checkpoint-format parameters, runs each module's weight
  loader (which slices its TP shard out of the full HF tensor) and re-runs
  ``process_weights_after_loading`` (CPU GEMM pre-packing). vLLM 0.32.0 bug: the CPU MoE experts
  are not re-packed on reload (``UnquantizedFusedMoEMethod._setup_kernel`` only packs on the
  first load), so :func:`repack_cpu_moe` re-applies ``cpu_prepack_moe_weight`` to the MoE
  modules of the layers just loaded (never twice: other layers are already packed).
* ``vllm_shard`` (GPU path, untested here): tensors are vLLM's own TP shards, copied into the
  parameters in place; valid for unquantized models whose parameters keep checkpoint layout.

The weight version of the last completed sync is kept per worker (``megarl_weight_version``).
"""
from __future__ import annotations

import re
import time

WORKER_EXTENSION = "megarl.rollout.worker_ext.BridgeWorkerExtension"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.")


def repack_cpu_moe(model, layers: set) -> int:
    """Re-apply vLLM's CPU expert pre-packing to the MoE modules of ``layers`` (vLLM 0.32 bug)."""
    try:
        from vllm import _custom_ops as ops
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:   # GPU builds: nothing to re-pack
        return 0
    count = 0
    for name, mod in model.named_modules():
        m = re.match(r"^model\.layers\.(\d+)\.", name + ".")
        if m is None or int(m.group(1)) not in layers:
            continue
        fused = getattr(getattr(getattr(mod, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if isinstance(fused, CPUUnquantizedExperts) and not getattr(fused, "_use_zentorch", False):
            for pname in ("w13_weight", "w2_weight"):
                p = getattr(mod, pname)
                p.data.copy_(ops.cpu_prepack_moe_weight(p.data.contiguous(), fused.isa))
            count += 1
    return count


def refresh_tied_lm_head(model) -> bool:
    """Tied embeddings (SmolLM2): the checkpoint has no lm_head, so vLLM's reload never re-runs
    the lm_head's post-load processing, and on CPU the lm_head GEMM keeps computing from the
    weights pre-packed at start-up although the shared tensor was updated. Re-pack it."""
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if lm_head is None or embed is None or getattr(lm_head, "weight", None) is not getattr(embed, "weight", None):
        return False
    method = getattr(lm_head, "quant_method", None)
    if method is None:
        return False
    method.process_weights_after_loading(lm_head)
    return True


class BridgeWorkerExtension:
    """Mixed into vLLM's Worker: ``self`` has ``model_runner``, ``rank``, ``reload_weights``."""

    _megarl_weight_version = 0

    def megarl_load_bucket(self, manifests: dict, version: int, fmt: str = "hf_full") -> dict:
        from megarl.bridge.mapping import unstack_hf
        from megarl.bridge.transport.shm import open_manifest

        t = time.perf_counter()
        manifest = manifests.get(str(self.rank))
        if manifest is None:
            return {"rank": self.rank, "loaded": 0}
        named = open_manifest(manifest)
        model = self.model_runner.model
        if fmt == "hf_full":
            weights = [pair for name, tensor in named for pair in unstack_hf(name, tensor)]
            self.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
            layers = {int(m.group(1)) for n, _ in weights if (m := _LAYER.match(n))}
            repacked = repack_cpu_moe(model, layers) if layers else 0
            if any(n.endswith("embed_tokens.weight") for n, _ in weights):
                refresh_tied_lm_head(model)
        else:
            import torch

            params = dict(model.named_parameters(remove_duplicate=False))
            with torch.no_grad():
                for name, tensor in named:
                    params[name].data.copy_(tensor)
            repacked = 0
        self._megarl_weight_version = version
        return {"rank": self.rank, "loaded": len(named), "repacked_moe": repacked, "secs": time.perf_counter() - t}

    def megarl_reload_bytes(self, blob: bytes) -> dict:
        """Baseline path (benchmarks): a safetensors blob of full HF tensors through reload_weights."""
        from safetensors.torch import load

        t = time.perf_counter()
        named = list(load(bytes(blob)).items())
        self.reload_weights(weights_iterator=iter(named), is_checkpoint_format=True)
        layers = {int(m.group(1)) for n, _ in named if (m := _LAYER.match(n))}
        repack_cpu_moe(self.model_runner.model, layers)
        if any(n.endswith("embed_tokens.weight") for n, _ in named):
            refresh_tied_lm_head(self.model_runner.model)
        return {"rank": self.rank, "secs": time.perf_counter() - t}

    def megarl_weight_version(self) -> int:
        return self._megarl_weight_version

    def megarl_checksums(self, names: list) -> dict:
        """Weighted checksums (:mod:`megarl.bridge.verify`) of the named parameters of this rank."""
        from megarl.bridge.verify import weighted_checksum

        model = self.model_runner.model
        params = dict(model.named_parameters(remove_duplicate=False))
        params.update({k: v for k, v in model.named_buffers(remove_duplicate=False) if k not in params})
        out = {}
        for n in names:
            p = params.get(n)
            if p is not None and p.numel() > 0:
                out[n] = weighted_checksum(p.detach().cpu(), tuple(p.shape))
        return {"rank": self.rank, "checksums": out}
