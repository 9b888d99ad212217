"""A local run's Ray admits only its own run (issue: Ray token authentication, proven).

Ray 2.60's daemons listen on every interface (measured: GCS, raylet, object manager and workers
on ``*``; Ray has no option to bind them to loopback), so :func:`megarl.actors.placement.init_ray`
turns token authentication on with a fresh token per local run. Asserted on a real local cluster
started the way ``megarl train`` starts it: a client without the token (and without
``~/.ray/auth_token``) and one with a wrong token are refused by the GCS with Ray's
"Unauthenticated" error; a client with the run's token connects and runs a task; the cluster
still serves the run afterwards. The two-node Slurm version is in test_slurm_e2e.py.
"""
import json
import subprocess
import sys

import pytest
from e2e_common import HERE

pytestmark = [pytest.mark.slow]


def test_local_ray_refuses_clients_without_the_runs_token():
    proc = subprocess.run([sys.executable, str(HERE / "ray_auth_probe.py"), "local"], capture_output=True,
                          text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(lines[-1])
    assert out["mode"] == "token", out
    for case in ("no_token", "wrong_token"):
        assert not out[case]["connected"], out[case]
        assert "Unauthenticated" in out[case]["stderr"] and "InvalidAuthToken" in out[case]["stderr"], out[case]
    assert out["token"]["connected"] and out["token"]["task"] == 42 and out["token"]["nodes"] == 1, out["token"]
    assert out["still_up"]
