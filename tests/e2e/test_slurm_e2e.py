"""launch/slurm/megarl.sbatch on a real two-node Slurm cluster (tests/e2e/slurm_cluster.py).

Two Ray nodes, one per Slurm node (n1 127.0.0.11, n2 127.0.0.12, 1 CPU each), each bound to its
own NodeAddr with its own ports and temp dir; the tiny recipe trains at tp2, so training rank 0
runs on n1 and rank 1 on n2 (one placement bundle per CPU), and its one TP1 rollout engine on n1:
the weight bridge writes rank 0's shards through shared memory and sends rank 1's over gloo,
across the nodes.

1. Node failure: during step 2, n2 dies (its slurmd, its job step's slurmstepd and every process
   of the job on n2 SIGKILLed). The job must end non-zero within 120 s and its output must name
   n2; step 1's checkpoint stays intact.
2. The same command with ``--resume`` on a fresh allocation (n2's slurmd started again) continues
   from step 1 and trains steps 2 and 3: ranks on both nodes (by Slurm node name), rollout-vs-train
   log-prob gap below 1e-4 on every step, bytes moved by gloo between the nodes (and by shared
   memory within n1), exit code 0, and no Ray or vLLM process of either job left.
"""
import json
import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path

import pytest
from e2e_common import HERE, metrics, recipe, tied_tiny_llama
from slurm_cluster import REPO, job_processes, slurm_cluster  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.slurm]
STRIDE = 1000   # both "nodes" share this host: each node's Ray ports are shifted by this


def ray_port() -> int:
    """A base port below the ephemeral range whose node port ranges (base..base+STRIDE+600) are free."""
    busy = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            busy.add(int(line.split()[1].rsplit(":", 1)[1], 16))
    while True:
        base = random.randrange(21000, 30000, 10)
        if not busy & set(range(base, base + STRIDE + 600)):
            return base


def sbatch(cluster, tmp_path: Path, recipe_file: Path, *extra: str) -> str:
    env = {"MEGARL_VENV": sys.prefix, "MEGARL_RAY_PORT": str(ray_port()), "MEGARL_RAY_NODE_PORT_STRIDE": str(STRIDE),
           "MEGARL_RAY_TMPDIR": tempfile.mkdtemp(prefix="rs-", dir="/tmp"), "MEGARL_LOG_DIR": str(tmp_path),
           "PYTHONPATH": f"{HERE}:{os.environ.get('PYTHONPATH', '')}"}
    return cluster.submit("--nodes=2", f"--output={tmp_path}/job-%j.out", str(REPO / "launch/slurm/megarl.sbatch"),
                          str(recipe_file), *extra, env=env, cwd=tmp_path)


def job_log(tmp_path: Path, job_id: str) -> str:
    path = tmp_path / f"job-{job_id}.out"
    return path.read_text() if path.exists() else ""


def wait_for(predicate, timeout: float, what: str, log=lambda: ""):
    deadline = time.time() + timeout
    while not predicate():
        if time.time() > deadline:
            raise AssertionError(f"{what} not seen within {timeout:.0f} s\n{log()[-4000:]}")
        time.sleep(0.5)


def test_node_failure_then_resume_on_two_nodes(slurm_cluster, tmp_path):  # noqa: F811
    cluster = slurm_cluster
    run_dir = tmp_path / "run"
    text = "topology:\n  world_size: 2\n  tp: 2\n" + recipe("  name: grpo", steps=3, save_every=1,
                                                            rollout_extra="  dp: 1\n  tp: 1")
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(text.format(model=tied_tiny_llama(tmp_path / "tied-llama"), run_dir=run_dir))

    # 1. n2 dies during step 2
    first = sbatch(cluster, tmp_path, recipe_file)
    step1 = run_dir / "checkpoints" / "step_00000001" / "COMPLETE"
    wait_for(step1.exists, 600, "step 1's checkpoint", lambda: job_log(tmp_path, first))
    assert cluster.job(first)["JobState"] == "RUNNING", job_log(tmp_path, first)
    assert job_processes(first, "n2"), "no process of the job on n2"
    killed_at = time.time()
    cluster.kill_node("n2", first)
    info = cluster.wait_ended(first, 150)
    ended_s = time.time() - killed_at
    log = job_log(tmp_path, first)
    assert ended_s < 120, (ended_s, log[-4000:])
    assert info["ExitCode"] != "0:0" and info["JobState"] in ("FAILED", "COMPLETING"), (info, log[-4000:])
    error = [line for line in log.splitlines() if line.startswith("megarl: error:")]
    assert error and "n2 (127.0.0.12)" in error[0], log[-4000:]
    assert "megarl: job exit code 1" in log, log[-3000:]
    assert [r["step"] for r in metrics(run_dir)] == [1], log[-3000:]

    # 2. a fresh allocation (n2 is back) resumes from step 1
    cluster.start_node("n2")
    second = sbatch(cluster, tmp_path, recipe_file, "--resume")
    info = cluster.wait_ended(second, 900)
    log = job_log(tmp_path, second)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, log[-5000:])
    assert "megarl: job exit code 0" in log and "megarl: 2 Ray node(s) up" in log, log[-3000:]
    assert re.search(r"resum\w+ from .*step_00000001", log), log[-3000:]
    placement = json.loads((run_dir / "logs" / "placement.json").read_text())
    assert [(r["rank"], r["node_name"], r["ip"]) for r in placement["ranks"]] == [(0, "n1", "127.0.0.11"),
                                                                                 (1, "n2", "127.0.0.12")]
    assert [e["node_name"] for e in placement["engines"]] == ["n1"]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows[1:]:
        assert r["rollout/logprob_diff_max"] < 1e-4, r
        # rank 1's shards crossed from n2 to n1 by gloo; rank 0's reached the engine's buffer in process
        assert r["sync/bytes_gloo"] > 0 and r["sync/bytes_local"] > 0, r
        assert r["sync/p2p_messages"] > 0 and r["sync/verified_params"] > 0, r
    assert rows[1]["actor/weight_checksum"] != rows[2]["actor/weight_checksum"]
    # nothing of either job is left: Ray's daemons and workers, the engine, the steps
    for job in (first, second):
        wait_for(lambda job=job: not job_processes(job), 30, f"the end of job {job}'s processes")
