"""Peak host memory of the HF -> Megatron conversion: 1 process vs 3 processes at tp=3 (SmolLM2, fp32).

Runs ``conversion/hf_to_megatron.py`` twice on the SmolLM2 fixture (135M params, 538 MB fp32):
once as a single process (tp=1) and once under torchrun with 3 processes at tp=3 (SmolLM2 has 9
attention heads and 3 KV heads, so megatron cannot split it over tp=2); each run prints
every rank's peak RSS (``resource.getrusage(RUSAGE_SELF).ru_maxrss``, which includes ~350 MB of
torch + megatron imports). Prints the ratio (max over ranks at tp=3 / single process) and, with
``--write``, records the numbers in ``perf/results/conversion_cpu_<date>.md``.

Usage: python perf/bench_conversion.py [--write]
"""
from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_PEAK = re.compile(r"peak RSS per rank \(MiB\): ([\d, ]+) \(max (\d+)\)")
_READ = re.compile(r"read \[([\d., ]+)\] MiB per rank")


def _convert(nproc: int, tp: int, out: str) -> tuple[list[float], list[float], str]:
    from megarl.models.fixtures import ensure_fixture

    src = str(ensure_fixture("smollm2"))
    script = str(REPO / "conversion" / "hf_to_megatron.py")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), GLOO_SOCKET_IFNAME="lo")
    if nproc == 1:
        cmd = [sys.executable, script, src, out]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
               "127.0.0.1", "--master-port", "0", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
               script, src, out, "--tp", str(tp)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    text = proc.stdout + proc.stderr
    m, r = _PEAK.search(text), _READ.search(text)
    if proc.returncode != 0 or not m:
        raise RuntimeError(f"conversion failed (rc={proc.returncode}):\n{text[-5000:]}")
    return ([float(x) for x in m.group(1).split(",")], [float(x) for x in r.group(1).split(",")],
            [line for line in text.splitlines() if line.startswith("[convert]")])


def measure() -> tuple[float, float]:
    """(single-process peak MiB, max per-rank peak MiB at tp=3)."""
    global LAST
    with tempfile.TemporaryDirectory() as tmp:
        single, read1, log1 = _convert(1, 1, os.path.join(tmp, "tp1"))
        tp2, read2, log2 = _convert(3, 3, os.path.join(tmp, "tp3"))
    LAST = {"single": single, "tp2": tp2, "read1": read1, "read2": read2, "log": log1 + log2}
    return max(single), max(tp2)


LAST: dict = {}


def main() -> None:
    import megatron.core
    import torch
    import transformers

    single, tp2 = measure()
    ratio = tp2 / single
    lines = [f"single process (tp=1): peak RSS {single:.0f} MiB, read {LAST['read1']} MiB",
             f"3 processes (tp=3): peak RSS per rank {LAST['tp2']} MiB (max {tp2:.0f}), read {LAST['read2']} MiB per rank",
             f"ratio tp3 max / single = {ratio:.2f} (target < 0.70)"]
    print("\n".join(lines))
    if "--write" in sys.argv:
        date = datetime.date.today().isoformat()
        path = REPO / "perf" / "results" / f"conversion_cpu_{date}.md"
        path.write_text(
            f"# HF -> Megatron conversion memory, CPU ({date})\n\n"
            "Model: SmolLM2-135M fixture (fp32, 538 MB safetensors, tied embeddings). Command: "
            "`python perf/bench_conversion.py --write` (runs `conversion/hf_to_megatron.py` as 1 process at tp=1, "
            "then under torchrun with 3 gloo processes at tp=3; SmolLM2's 9 heads / 3 KV heads rule out tp=2). Peak RSS = `getrusage(RUSAGE_SELF).ru_maxrss` "
            "per rank, which includes ~350 MB of torch + megatron-core imports.\n\n"
            + "\n".join(f"- {line}" for line in lines)
            + "\n\nConverter log:\n\n```\n" + "\n".join(LAST["log"]) + "\n```\n\n"
            f"Versions: torch {torch.__version__}, megatron-core {megatron.core.__version__}, transformers "
            f"{transformers.__version__}, python {sys.version.split()[0]}; {os.cpu_count()} CPU cores, "
            "OMP_NUM_THREADS=1.\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
