"""launch/slurm/megarl.sbatch on a real two-node Slurm cluster (tests/e2e/slurm_cluster.py).

Two Ray nodes, one per Slurm node (n1 127.0.0.11, n2 127.0.0.12, 1 CPU each), each bound to its
own NodeAddr with its own ports and temp dir; the tiny recipe trains at tp2, so training rank 0
runs on n1 and rank 1 on n2 (one placement bundle per CPU), and its one TP1 rollout engine on n1:
the weight bridge writes rank 0's shards through shared memory and sends rank 1's over gloo,
across the nodes.

The algorithm rides along: REINFORCE++ (Dr.GRPO's aggregation, a KL term, so a reference model)
with ``trainer.offload_train_state`` (each rank moves its Megatron state to host memory while vLLM
generates).

1. Node failure: during step 2, n2 dies (its slurmd, its job step's slurmstepd and every process
   of the job on n2 SIGKILLed). The job must end non-zero within 120 s and its output must name
   n2; step 1's checkpoint stays intact.
2. The same command with ``--resume`` on a fresh allocation (n2's slurmd started again) continues
   from step 1 and trains steps 2 and 3: ranks on both nodes (by Slurm node name), rollout-vs-train
   log-prob gap below 1e-4 on every step, bytes moved by gloo between the nodes (and by shared
   memory within n1), exit code 0, and no Ray or vLLM process of either job left.
   Ray token authentication holds meanwhile: once both nodes are up, a client without the job's
   token and one with a wrong token are refused by the head's GCS ("Unauthenticated"), a client
   with the token attaches to n1 and sees both nodes, and the job goes on unaffected.

And a node whose Ray never joins is named by the job, which fails before megarl starts.
"""
import json
import os
import random
import re
import secrets
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import ray_auth_probe
from e2e_common import HERE, metrics, recipe, tied_tiny_llama
from slurm_cluster import REPO, job_processes, slurm_cluster  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.slurm]
# the algorithm under test rides along: REINFORCE++ with Dr.GRPO's constant-normalised aggregation,
# the Megatron state (policy, reference, grads, Adam) offloaded while vLLM generates
REINFORCE_PP = """  name: reinforce_pp
  gamma: 0.99
  kl_coef: 0.01
  loss_agg_mode: seq-mean-token-sum-norm"""
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


def sbatch(cluster, tmp_path: Path, recipe_file: Path, *extra: str, **env) -> str:
    env = {"MEGARL_VENV": sys.prefix, "MEGARL_RAY_PORT": str(ray_port()), "MEGARL_RAY_NODE_PORT_STRIDE": str(STRIDE),
           "MEGARL_RAY_TMPDIR": tempfile.mkdtemp(prefix="rs-", dir="/tmp"), "MEGARL_LOG_DIR": str(tmp_path),
           "PYTHONPATH": f"{HERE}:{os.environ.get('PYTHONPATH', '')}", **env}
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
        time.sleep(0.2)


def test_node_failure_then_resume_on_two_nodes(slurm_cluster, tmp_path):  # noqa: F811
    cluster = slurm_cluster
    run_dir = tmp_path / "run"
    text = "topology:\n  world_size: 2\n  tp: 2\n" + recipe(REINFORCE_PP, steps=3, save_every=1,
                                                            rollout_extra="  dp: 1\n  tp: 1",
                                                            trainer_extra="  offload_train_state: true")
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(text.format(model=tied_tiny_llama(tmp_path / "tied-llama"), run_dir=run_dir))

    # 1. n2 dies during step 2
    t = time.time()
    first = sbatch(cluster, tmp_path, recipe_file)
    step1 = run_dir / "checkpoints" / "step_00000001" / "COMPLETE"
    wait_for(step1.exists, 600, "step 1's checkpoint", lambda: job_log(tmp_path, first))
    assert cluster.job(first)["JobState"] == "RUNNING", job_log(tmp_path, first)
    assert job_processes(first, "n2"), "no process of the job on n2"
    killed_at = time.time()
    killed = cluster.kill_node("n2", first)
    info = cluster.wait_ended(first, 150)
    ended_s = time.time() - killed_at
    log = job_log(tmp_path, first)
    assert ended_s < 120, (ended_s, log[-4000:])
    print(f"n2 killed ({len(killed)} processes) {killed_at - t:.1f} s after the submission, "
          f"{killed_at - step1.stat().st_mtime:.1f} s after step 1's checkpoint; the job ended {ended_s:.1f} s later")
    assert info["ExitCode"] != "0:0" and info["JobState"] in ("FAILED", "COMPLETING"), (info, log[-4000:])
    error = [line for line in log.splitlines() if line.startswith("megarl: error:")]
    assert error and "n2 (127.0.0.12)" in error[0], log[-4000:]
    assert "megarl: job exit code 1" in log, log[-3000:]
    # step 2 did not finish (its partial row, written when a step raises, has no update)
    assert [r["step"] for r in metrics(run_dir) if "actor/weight_checksum" in r] == [1], log[-3000:]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000001"]

    # 2. a fresh allocation (n2 is back) resumes from step 1; its Ray admits only its own token
    cluster.start_node("n2")
    t = time.time()
    port, token = ray_port(), secrets.token_hex(32)
    second = sbatch(cluster, tmp_path, recipe_file, "--resume", MEGARL_RAY_PORT=str(port), RAY_AUTH_TOKEN=token)
    wait_for(lambda: "Ray node(s) up" in job_log(tmp_path, second), 300, "both nodes of the resumed job",
             lambda: job_log(tmp_path, second))
    address, env = f"127.0.0.11:{port}", {**os.environ, "MEGARL_PROBE_NODE_IP": "127.0.0.11"}
    home = tempfile.mkdtemp(prefix="home-")   # no ~/.ray/auth_token for the clients without a token
    with ThreadPoolExecutor(3) as pool:
        no_token, wrong, good = pool.map(lambda e: ray_auth_probe.run_client(address, e), [
            ray_auth_probe.without_auth(env, home),
            {**ray_auth_probe.without_auth(env, home), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64},
            {**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}])
    for refused in (no_token, wrong):
        assert not refused["connected"] and "Unauthenticated" in refused["stderr"], refused
    assert good["connected"] and good["nodes"] == 2 and good["task"] == 42, good
    print(f"Ray auth: a client without the token and one with a wrong token refused, the job's token admitted "
          f"{time.time() - t:.1f} s after the resubmission")
    info = cluster.wait_ended(second, 900)
    print(f"the resumed job ran {time.time() - t:.1f} s")
    log = job_log(tmp_path, second)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, log[-5000:])
    assert "megarl: job exit code 0" in log and "megarl: 2 Ray node(s) up" in log, log[-3000:]
    assert re.search(r"joined the Ray cluster at 127\.0\.0\.11:\d+ \(token authentication on", log), log[-3000:]
    assert re.search(r"resum\w+ from .*step_00000001", log), log[-3000:]
    placement = json.loads((run_dir / "logs" / "placement.json").read_text())
    assert [(r["rank"], r["node_name"], r["ip"]) for r in placement["ranks"]] == [(0, "n1", "127.0.0.11"),
                                                                                 (1, "n2", "127.0.0.12")]
    assert [e["node_name"] for e in placement["engines"]] == ["n1"]
    rows = [r for r in metrics(run_dir) if "actor/weight_checksum" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows[1:]:
        assert r["rollout/logprob_diff_max"] < 1e-4, r
        # rank 1's shards crossed from n2 to n1 by gloo; rank 0's reached the engine's buffer in process
        assert r["sync/bytes_gloo"] > 0 and r["sync/bytes_local"] > 0, r
        assert r["sync/p2p_messages"] > 0 and r["sync/verified_params"] > 0, r
    sums = [r["actor/weight_checksum"] for r in rows]
    assert abs(sums[0] - sums[1]) > 1e-6 and abs(sums[1] - sums[2]) > 1e-6, sums
    assert all(r["actor/grad_norm"] > 0 and r["actor/kl_coef"] == 0.01 for r in rows), rows
    # tiny llama has ~13.8M params (55 MB fp32), offloaded summed over both ranks: step 1 moves policy
    # params + grads + reference params (0.165 GB); after it (also after the resume, which loads
    # them) the Adam moments too (0.275 GB)
    gb = [r["memory/offloaded_gb"] for r in rows]
    assert gb[0] > 0.15 and gb[1] > gb[0] + 0.1 and gb[2] > gb[0] + 0.1, gb
    # nothing of either job is left: Ray's daemons and workers, the engine, the steps
    for job in (first, second):
        wait_for(lambda job=job: not job_processes(job), 30, f"the end of job {job}'s processes")


def test_a_node_that_does_not_join_is_named(slurm_cluster, tmp_path):  # noqa: F811
    """Both nodes' Ray on the same ports of one host: n2's raylet cannot bind them and never joins;
    the job ends within MEGARL_RAY_WAIT_S naming n2, before megarl starts, and leaves nothing."""
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text("model:\n  path: fixture:tiny-llama\n")   # never read: the job ends before
    t = time.time()
    job = sbatch(slurm_cluster, tmp_path, recipe_file, MEGARL_RAY_NODE_PORT_STRIDE="0", MEGARL_RAY_WAIT_S="10")
    info = slurm_cluster.wait_ended(job, 120)
    log = job_log(tmp_path, job)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "1:0", (info, log[-3000:])
    assert re.search(r"megarl: error: (node\(s\) n2 \(127\.0\.0\.12\) did not join the Ray cluster within 10 s|"
                     r"Ray did not start on node\(s\) n2 )", log), log[-3000:]
    assert "megarl: job exit code 1" in log and "joined the Ray cluster" not in log, log[-3000:]
    assert time.time() - t < 90, time.time() - t
    wait_for(lambda: not job_processes(job), 30, f"the end of job {job}'s processes")
