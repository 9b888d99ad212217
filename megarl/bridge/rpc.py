"""The vLLM worker methods the bridge calls, by name: ``llm.collective_rpc(NAME, args=...)``, on
the worker extension :class:`megarl.rollout.worker_ext.BridgeWorkerExtension`, which defines each
(tests/unit/test_bridge_buffer.py).

================  ================================================  ===================================
name              arguments                                         each worker returns
================  ================================================  ===================================
LOAD_BUCKET       manifests ``{str(vllm rank): DestBuffer manifest}``  ``{"rank", "loaded", ...}``
                  (:mod:`megarl.bridge.buffer`), weight version,
                  format (hf_full / vllm_shard)
WEIGHT_VERSION    none                                              version of its last loaded bucket
CHECKSUMS         vLLM parameter names                              ``{"rank", "checksums": {name:
                                                                    weighted checksum}}``
RELOAD_BYTES      safetensors bytes of full HF tensors (a           ``{"rank", "secs"}``
                  baseline for measuring the sync)
LOAD_ADAPTER      PEFT adapter tensors ``{name: tensor}``, the        ``{"rank", "bytes", "secs"}``
                  ``adapter_config.json`` dict, weight version,
                  ``{name: name of the tensor it repeats}``
================  ================================================  ===================================
"""
LOAD_BUCKET = "megarl_load_bucket"
WEIGHT_VERSION = "megarl_weight_version"
CHECKSUMS = "megarl_checksums"
RELOAD_BYTES = "megarl_reload_bytes"
LOAD_ADAPTER = "megarl_load_adapter"

RPC_METHODS = (LOAD_BUCKET, WEIGHT_VERSION, CHECKSUMS, RELOAD_BYTES, LOAD_ADAPTER)
