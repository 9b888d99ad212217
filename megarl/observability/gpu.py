"""GPU utilisation and memory through nvidia-ml-py (empty on machines without an NVIDIA GPU)."""
from __future__ import annotations


def gpu_stats() -> dict[str, float]:
    """``gpu/<i>/util_pct`` and ``gpu/<i>/mem_used_gib`` per visible GPU; {} when NVML is absent."""
    try:
        import pynvml
    except ImportError:
        return {}
    try:
        pynvml.nvmlInit()
    except Exception:          # no driver: a CPU machine
        return {}
    out = {}
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            out[f"gpu/{i}/util_pct"] = float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            out[f"gpu/{i}/mem_used_gib"] = pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**30
    finally:
        pynvml.nvmlShutdown()
    return out
