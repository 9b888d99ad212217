"""Run a worker script under torchrun (gloo) and collect what rank 0 reports.

Each worker prints one line ``RESULT <json>`` on rank 0; :func:`run_workers` returns it parsed.
torchrun launches cost 15-30 s of imports on 2 cores, so workers put many checks in one launch.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

WORKERS = Path(__file__).parent / "workers"
REPO = Path(__file__).resolve().parents[2]


def run_workers(script: str, nproc: int, *args: str, timeout: int = 600, env: dict | None = None) -> dict:
    full_env = dict(os.environ)
    full_env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}:{full_env.get('PYTHONPATH', '')}",
                     "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": full_env.get("GLOO_SOCKET_IFNAME", "lo")})
    full_env.update(env or {})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", "0", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "127.0.0.1:0", str(WORKERS / script), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
    results = [line[len("RESULT "):] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not results:
        raise AssertionError(f"{script} failed (rc={proc.returncode}):\n--- stdout\n{proc.stdout[-6000:]}"
                             f"\n--- stderr\n{proc.stderr[-8000:]}")
    return json.loads(results[-1])
