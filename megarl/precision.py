"""``model.dtype: auto``: bfloat16 where it is the fast precision, float32 elsewhere.

The rule (:func:`choose_dtype`): on a GPU, bfloat16. On a CPU, bfloat16 only when the CPU has
native bf16 instructions (avx512_bf16 or AMX: /proc/cpuinfo's flags) and a sub-second probe
measures bf16 matmuls at least :data:`BF16_MIN_SPEEDUP` times as fast as fp32 on this machine's
threads; otherwise float32 (an AVX2-only EPYC runs bf16 matmuls at 0.3-1 GFLOP/s against ~50-100 in
fp32). The decision is made once, on the controller,
when the config is loaded (:func:`resolve_auto`), so every process gets the same concrete dtype,
and the run's precision line says why (:func:`auto_reason`). Whatever is chosen, the fp32 main
parameters and Adam state, the alarm bound per dtype and the KV-cache sizing follow as for an
explicit dtype.
"""
from __future__ import annotations

import platform
import time
from pathlib import Path

__all__ = ["BF16_MIN_SPEEDUP", "CPU_FLAGS", "auto_reason", "choose_dtype", "cpu_flags", "cpu_line", "matmul_gflops",
           "resolve_auto"]

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
NATIVE_BF16 = ("avx512_bf16", "amx_bf16")
BF16_MIN_SPEEDUP = 1.2
_REASON: list[str] = []


def read_cpuinfo(cpuinfo: str = "/proc/cpuinfo") -> tuple[str, set[str] | None]:
    """(model name, every flag of the first CPU); flags None where ``cpuinfo`` cannot be read
    (not Linux) or lists none (not x86)."""
    model, flags = platform.processor() or "unknown", None
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            if line.startswith("model name") and model in ("unknown", "", platform.machine()):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return model, flags


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> tuple[str, set[str]]:
    """(model name, the flags of :data:`CPU_FLAGS` this CPU has)."""
    model, flags = read_cpuinfo(cpuinfo)
    return model, (flags or set()) & set(CPU_FLAGS)


def cpu_line() -> str:
    """The machine as the benchmarks print it beside their numbers: model name, cores and the
    flags of :data:`CPU_FLAGS` it has (which precision is fast here)."""
    import os

    model, flags = cpu_flags()
    shown = [f for f in CPU_FLAGS if f in flags]
    return f"{model}, {os.cpu_count()} cores, flags: {' '.join(shown) or 'none of ' + '/'.join(CPU_FLAGS)}"


def matmul_gflops(dtype_name: str, size: int = 512, budget_s: float = 0.2) -> float:
    """GFLOP/s of size^3 matmuls in ``dtype_name`` on this CPU, over about ``budget_s`` seconds."""
    import torch

    dtype = getattr(torch, dtype_name)
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    torch.mm(a, b)   # warm-up (oneDNN picks its kernel)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < budget_s or n == 0:
        torch.mm(a, b)
        n += 1
    return 2 * size**3 * n / (time.perf_counter() - t0) / 1e9


def choose_dtype(gpu: bool, flags: set[str], probe=None) -> tuple[str, str]:
    """(dtype, reason). ``probe()`` -> (fp32 GFLOP/s, bf16 GFLOP/s), called only when the flags
    allow bf16 (an AVX2-only CPU is not probed: its bf16 path is emulated)."""
    if gpu:
        return "bfloat16", "GPU"
    native = sorted(flags & set(NATIVE_BF16))
    if not native:
        return "float32", "CPU without native bf16 (no avx512_bf16 or amx_bf16)"
    fp32, bf16 = probe()
    if bf16 >= BF16_MIN_SPEEDUP * fp32:
        return "bfloat16", f"CPU with {', '.join(native)}: bf16 {bf16:.0f} vs fp32 {fp32:.0f} GFLOP/s"
    return "float32", (f"CPU with {', '.join(native)} but bf16 {bf16:.0f} vs fp32 {fp32:.0f} GFLOP/s "
                       f"(< {BF16_MIN_SPEEDUP}x)")


def resolve_auto() -> str:
    """The dtype ``auto`` means on this machine (remembered for :func:`auto_reason`)."""
    import torch

    dtype, reason = choose_dtype(torch.cuda.is_available(), cpu_flags()[1],
                                 lambda: (matmul_gflops("float32"), matmul_gflops("bfloat16")))
    _REASON[:] = [f"model.dtype auto -> {dtype} ({reason})"]
    return dtype


def auto_reason() -> str | None:
    """Why ``auto`` chose what it chose in this process, or None when no config said auto."""
    return _REASON[0] if _REASON else None
