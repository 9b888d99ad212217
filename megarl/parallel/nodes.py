"""Which node a process runs on, as the launcher names it.

Several "nodes" of a test cluster can share one host (launch/slurm/local/start_cluster.sh), so a
node is not a host name: it is the Ray node the process belongs to (its id decides what is local
to what, e.g. the weight bridge's shared memory vs network paths), named for people by Slurm's
node name. Ray's processes on a Slurm node inherit ``SLURMD_NODENAME`` from the job step that
started that node's Ray (launch/slurm/megarl.sbatch), so a training worker or an engine knows it
without asking Slurm; outside Slurm the name is the host name.
"""
from __future__ import annotations

import os
import socket


def node_name() -> str:
    """Slurm's name of this process's node (``SLURMD_NODENAME``), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def where() -> dict:
    """This Ray process's node: ``node_id`` (Ray's node id), ``ip`` (the address Ray binds on it),
    ``node_name`` and ``node``, the label used in logs and errors (``n2 (127.0.0.12)``)."""
    import ray

    ip = ray.util.get_node_ip_address()
    name = node_name()
    return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ip, "node_name": name,
            "node": f"{name} ({ip})" if name != ip else ip}
