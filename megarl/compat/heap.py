"""Give freed heap memory back to the OS (glibc ``malloc_trim``).

Tensors below glibc's mmap threshold (up to 32 MiB once large blocks have been freed) live on
the malloc heap; when they are freed the pages stay in the process (resident, counted in its
RSS and PSS) until a trim returns the free ones. A vLLM engine on CPU ends its start-up and
every weight load with such freed memory (the checkpoint's tensors, the loader's copies), so the
rollout engine trims after start-up (:class:`megarl.rollout.engine.EngineActor`) and each vLLM
worker after every bucket it loads (``megarl_load_bucket`` in :mod:`megarl.rollout.worker_ext`:
at rollout.tp > 1 the workers are processes of their own).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

_LIBC = None


def trim() -> bool:
    """``malloc_trim(0)``: True when glibc released memory; False elsewhere (not glibc, not Linux)."""
    global _LIBC
    if not sys.platform.startswith("linux"):
        return False
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim.argtypes, _LIBC.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        except (OSError, AttributeError):
            _LIBC = False
    return bool(_LIBC and _LIBC.malloc_trim(0))
