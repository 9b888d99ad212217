"""launch/slurm/megarl.sbatch on one node, without Slurm: ``srun`` and ``scontrol`` are shims.

There is no Slurm on this machine (nor on CI), so ``scontrol show hostnames`` answers
``localhost`` and ``srun [options] CMD`` runs CMD here. Everything else is real: the script
starts a Ray head with ``ray start``, waits for the node, and ``megarl train`` joins that
cluster through RAY_ADDRESS (not a Ray of its own), places its worker with a placement group
and rendezvouses torch.distributed on the address of rank 0's node; the run trains 2 steps
with vLLM sampling from the synced weights; the exit trap stops Ray.
"""
import os
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from e2e_common import HERE, metrics, recipe, tied_tiny_llama

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
REPO = HERE.parents[1]
SCONTROL = """#!/usr/bin/env bash
[[ "$1 $2" == "show hostnames" ]] && echo localhost
"""
SRUN = """#!/usr/bin/env bash
# drop srun's options (-w takes a value), run the command here
while [[ $# -gt 0 && "$1" == -* ]]; do
    if [[ "$1" == "-w" ]]; then shift 2; else shift; fi
done
exec "$@"
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def test_sbatch_script_on_one_node(tmp_path):
    shims = tmp_path / "bin"
    shims.mkdir()
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN)):
        (shims / name).write_text(text)
        (shims / name).chmod(0o755)
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(recipe("  name: grpo", steps=2).format(model=tied_tiny_llama(tmp_path / "tied-llama"),
                                                                 run_dir=tmp_path / "run"))
    env = dict(os.environ, PATH=f"{shims}:{os.environ['PATH']}", SLURM_JOB_NODELIST="localhost",
               SLURM_JOB_ID=str(os.getpid()), SLURM_CPUS_ON_NODE="2", MEGARL_VENV=sys.prefix,
               MEGARL_RAY_PORT=str(free_port()), MEGARL_RAY_TMPDIR=tempfile.mkdtemp(prefix="rs-", dir="/tmp"),
               PYTHONPATH=f"{HERE}:{os.environ.get('PYTHONPATH', '')}")
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(["bash", str(REPO / "launch/slurm/megarl.sbatch"), str(recipe_file)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=1200)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    assert "megarl: 1 node(s), head localhost" in log and "megarl: 1 Ray node(s) up" in log, log[-3000:]
    assert re.search(rf"megarl: joined the Ray cluster at \S+:{env['MEGARL_RAY_PORT']} \(1 node", log), log[-3000:]
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in rows)
    assert rows[0]["actor/weight_checksum"] != rows[1]["actor/weight_checksum"]
    # the exit trap stopped Ray: nothing listens on the head's port any more
    with socket.socket() as s:
        assert s.connect_ex((re.search(r"head localhost \((\S+):", log).group(1), int(env["MEGARL_RAY_PORT"]))) != 0
