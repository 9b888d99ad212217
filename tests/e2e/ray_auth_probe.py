"""Clients of a running Ray cluster with and without its token (tests/e2e/test_ray_auth.py and the
Slurm test use it).

``python ray_auth_probe.py client ADDRESS``: connect to ADDRESS with the environment as given
(MEGARL_PROBE_NODE_IP: the cluster node to attach to) and submit one task that asks for no CPU; prints one JSON line {"connected": bool, "nodes": n, "task": value, "error": ...}.
The GCS retries a refused client once a second for RAY_gcs_server_port_wait_time_s attempts: the
callers set it low so that a refusal takes seconds, not Ray's default 20.

``python ray_auth_probe.py local``: start a local cluster the way ``megarl train`` does
(:func:`megarl.actors.placement.init_ray`), then run three clients against it: without the token
(no RAY_AUTH_* variables, HOME without ~/.ray), with a wrong token, and with the run's token;
prints one JSON line with the mode and the three results, and stops Ray.
"""
import json
import os
import subprocess
import sys
import tempfile


def client(address: str) -> dict:
    import ray

    try:
        node_ip = os.environ.get("MEGARL_PROBE_NODE_IP")   # a node of the cluster (two "nodes" share a host)
        ray.init(address=address, logging_level="ERROR", log_to_driver=False, configure_logging=False,
                 **({"_node_ip_address": node_ip} if node_ip else {}))
    except Exception as err:   # ConnectionError: Ray's own message says "Failed to connect"
        return {"connected": False, "error": f"{type(err).__name__}: {err}"}
    try:
        nodes = sum(1 for n in ray.nodes() if n["Alive"])
        # no CPU asked: the run's placement group may hold every CPU of the cluster
        value = ray.get(ray.remote(num_cpus=0)(lambda: 6 * 7).remote(), timeout=60)
        return {"connected": True, "nodes": nodes, "task": value}
    finally:
        ray.shutdown()


def run_client(address: str, env: dict) -> dict:
    env = {**env, "RAY_gcs_server_port_wait_time_s": "3"}
    proc = subprocess.run([sys.executable, __file__, "client", address], env=env, capture_output=True, text=True,
                          timeout=120)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    out = json.loads(lines[-1]) if lines else {"connected": False, "error": f"exit {proc.returncode}"}
    out["stderr"] = proc.stderr[-3000:]
    return out


def without_auth(env: dict, home: str) -> dict:
    return {**{k: v for k, v in env.items() if not k.startswith("RAY_AUTH_")}, "HOME": home}


def local() -> dict:
    import ray

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from megarl.actors.placement import init_ray, ray_auth_mode

    for var in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS"):
        os.environ.pop(var, None)
    init_ray(1, False)
    try:
        address = ray.get_runtime_context().gcs_address
        env = dict(os.environ)
        with tempfile.TemporaryDirectory() as home:
            results = {"mode": ray_auth_mode(), "address": address,
                       "no_token": run_client(address, without_auth(env, home)),
                       "wrong_token": run_client(address, {**without_auth(env, home), "RAY_AUTH_MODE": "token",
                                                           "RAY_AUTH_TOKEN": "0" * 64}),
                       "token": run_client(address, env)}
        results["still_up"] = ray.get(ray.remote(lambda: 1).remote(), timeout=60) == 1
        return results
    finally:
        ray.shutdown()


if __name__ == "__main__":
    out = client(sys.argv[2]) if sys.argv[1] == "client" else local()
    print(json.dumps(out), flush=True)
