"""The vLLM worker methods the bridge calls, by name: ``llm.collective_rpc(NAME, args=...)``.

vLLM's worker processes are reached through ``collective_rpc``, which calls a method of the
worker extension (``LLM(worker_extension_cls=...)``) by its name. Both sides take the names from
here: :mod:`megarl.bridge.sync` calls them and :class:`megarl.rollout.worker_ext.BridgeWorkerExtension`
defines a method under each (tests/unit/test_bridge_buffer.py checks that it defines all of them).

================  ================================================  ===================================
name              arguments                                         each worker returns
================  ================================================  ===================================
LOAD_BUCKET       manifests ``{str(vllm rank): DestBuffer manifest}``  ``{"rank", "loaded", ...}``
                  (:mod:`megarl.bridge.buffer`), weight version,
                  format (hf_full / vllm_shard)
WEIGHT_VERSION    none                                              version of its last loaded bucket
CHECKSUMS         vLLM parameter names                              ``{"rank", "checksums": {name:
                                                                    weighted checksum}}``
                                                                    (:mod:`megarl.bridge.verify`)
RELOAD_BYTES      safetensors bytes of full HF tensors (benchmark   ``{"rank", "secs"}``
                  baseline: perf/bench_weight_sync.py)
================  ================================================  ===================================
"""
LOAD_BUCKET = "megarl_load_bucket"
WEIGHT_VERSION = "megarl_weight_version"
CHECKSUMS = "megarl_checksums"
RELOAD_BYTES = "megarl_reload_bytes"

RPC_METHODS = (LOAD_BUCKET, WEIGHT_VERSION, CHECKSUMS, RELOAD_BYTES)
