"""A private two-node Slurm cluster for tests (launch/slurm/local/start_cluster.sh).

Real munged, slurmctld and two slurmd daemons (n1 at 127.0.0.11, n2 at 127.0.0.12) under a short
temporary directory; nothing is installed here. Without the packages (or without root) the tests
that use it are skipped with the install command, unless ``MEGARL_REQUIRE_SLURM=1`` (CI sets it):
then they fail. Every daemon is stopped by PID at the end (stop_cluster.sh).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "launch" / "slurm" / "local"
INSTALL = "apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge"
NEEDED = ["/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged", "/usr/bin/sinfo", "/usr/bin/srun",
          "/usr/bin/sbatch", "/usr/bin/scontrol", "/usr/bin/squeue"]


def why_unavailable() -> str | None:
    missing = [p for p in NEEDED if not os.access(p, os.X_OK)]
    if missing:
        return f"Slurm is not installed (missing {', '.join(missing)}): {INSTALL}"
    if os.geteuid() != 0:
        return "the local Slurm cluster needs root (slurmd and slurmstepd)"
    return None


def live_processes(**env) -> list[psutil.Process]:
    """Running processes (not zombies: this sandbox's PID 1 reaps late) whose environment holds
    every ``env`` item."""
    out = []
    for p in psutil.process_iter(["environ", "status"]):
        have = p.info["environ"] or {}
        if p.info["status"] != psutil.STATUS_ZOMBIE and all(have.get(k) == v for k, v in env.items()):
            out.append(p)
    return out


def job_processes(job_id: str, node: str | None = None) -> list[int]:
    """Live processes of a Slurm job (its tasks and what they started: Ray's daemons and workers,
    vLLM), found by the job id in their environment; only those on ``node`` when given."""
    where = {"SLURMD_NODENAME": node} if node is not None else {}
    return [p.pid for p in live_processes(SLURM_JOB_ID=job_id, **where)]


class SlurmCluster:
    def __init__(self, root: Path, env: dict):
        self.root, self.env = root, env

    def run(self, *cmd, timeout: float = 60) -> str:
        return subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout,
                              check=True).stdout

    def submit(self, *args, env: dict | None = None, cwd: Path) -> str:
        out = subprocess.run(["sbatch", "--parsable", *args], env={**self.env, **(env or {})}, cwd=cwd,
                             capture_output=True, text=True, timeout=60, check=True).stdout
        return out.strip().split(";")[0]

    def job(self, job_id: str) -> dict:
        """``scontrol show job`` as a dict (JobState, ExitCode, NodeList, ...)."""
        out = self.run("scontrol", "show", "job", "-o", job_id)
        return dict(f.split("=", 1) for f in out.split() if "=" in f)

    def wait_ended(self, job_id: str, timeout: float) -> dict:
        """Poll until the batch script has ended (the job may still be completing on a dead node)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            info = self.job(job_id)
            if info["JobState"] not in ("PENDING", "RUNNING", "CONFIGURING"):
                return info
            time.sleep(1)
        raise TimeoutError(f"job {job_id} still {info['JobState']} after {timeout:.0f} s")

    def kill_node(self, node: str, job_id: str) -> list[int]:
        """The node dies: its slurmd, the job's processes on it (with everything they started) and
        their slurmstepd, SIGKILLed. Returns the pids killed."""
        slurmd = psutil.Process(int((self.root / "run" / f"slurmd-{node}.pid").read_text()))
        tasks = live_processes(SLURM_JOB_ID=job_id, SLURMD_NODENAME=node)
        stepds = {t.parent() for t in tasks if t.parent() is not None and t.parent().name() == "slurmstepd"}
        # and everything the tasks started (Ray's workers, vLLM's processes)
        below = {c for t in tasks for c in t.children(recursive=True)} - set(tasks)
        victims = [slurmd, *stepds, *tasks, *sorted(below, key=lambda p: p.pid)]
        for p in victims:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        return [p.pid for p in victims]

    def start_node(self, node: str) -> None:
        subprocess.run([str(SCRIPTS / "start_cluster.sh"), str(self.root), "--node", node], env=self.env,
                       capture_output=True, text=True, timeout=120, check=True)


@pytest.fixture(scope="module")
def slurm_cluster():
    """A two-node Slurm cluster for the module; the env dict to run Slurm commands with."""
    why = why_unavailable()
    if why:
        if os.environ.get("MEGARL_REQUIRE_SLURM") == "1":
            pytest.fail(f"MEGARL_REQUIRE_SLURM=1: {why}")
        pytest.skip(why)
    root = Path(tempfile.mkdtemp(prefix="slurm-", dir="/tmp"))   # short: Unix socket paths < 108 bytes
    r = subprocess.run([str(SCRIPTS / "start_cluster.sh"), str(root)], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        pytest.fail(f"start_cluster.sh failed:\n{r.stderr[-4000:]}")
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.update(line.removeprefix("export ").split("=", 1) for line in r.stdout.splitlines())
    try:
        yield SlurmCluster(root, env)
    finally:
        s = subprocess.run([str(SCRIPTS / "stop_cluster.sh"), str(root)], capture_output=True, text=True,
                           timeout=180)
        assert s.returncode == 0, f"stop_cluster.sh left processes running:\n{s.stderr[-3000:]}"
        left = [p.pid for p in live_processes(_SLURM_LOCAL_DAEMON_OF=str(root))]
        assert not left, f"processes of the test Slurm cluster still running: {left}"
        shutil.rmtree(root, ignore_errors=True)
