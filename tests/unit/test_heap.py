"""megarl.compat.heap.trim: freed heap memory goes back to the OS (measured on this process's PSS)."""
import subprocess
import sys

CODE = """
import gc
from megarl.compat import heap

def pss():
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("Pss:"):
            return int(line.split()[1]) >> 10

blocks = [bytearray(b"x" * 100_000) for _ in range(3000)]   # ~300 MiB of small (heap) blocks
keep = blocks[-1:]                                          # the last one pins the heap's top
del blocks
gc.collect()
before = pss()
print(heap.trim(), before, pss())
"""


def test_trim_returns_freed_heap_pages():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True).stdout.split()
    released, before, after = out[0] == "True", int(out[1]), int(out[2])
    assert released and before - after > 200, (before, after)   # MiB
