"""Ray bootstrap and placement of one run's actors, and their release.

One Ray actor per device (per GPU; on CPU ``topology.world_size`` gloo ranks), placed with a
placement group (one bundle per worker, packed on as few nodes as possible), and the rollout
fleet: ``rollout.dp`` :class:`megarl.rollout.engine.EngineActor` s. Ranks are numbered node by
node, the controller's node first (:func:`_rank_order`). Colocated, engine k shares
the bundles of training devices k*tp .. k*tp+tp-1 (the actor sits in bundle k*tp and takes no
resources of its own; on GPU it is given those bundles' GPUs); with ``rollout.placement=split``
each engine gets one more bundle of ``rollout.tp`` devices. Ray is joined at ``RAY_ADDRESS`` when
set (multi-node, e.g. launch/slurm/megarl.sbatch), else started on this node.

:class:`Placement` owns everything it starts: :meth:`Placement.close` stops the vLLM engines
(their processes), kills the actors, removes the placement group and stops Ray when it started
it. It is safe after a partial start and after failed actors, so a run that raises leaves no
process behind.
"""
from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

log = logging.getLogger("megarl")


def _free_port(host: str = "", rng=None) -> int:
    """A port that ``host`` can listen on now, below the kernel's ephemeral range when that range
    leaves room (20000 up to it). A port from ``bind(("", 0))`` is an ephemeral one, and between
    this check and rank 0's listen, any outgoing connection on the node (gloo's, Ray's gRPC) may
    be given it: EADDRINUSE at process-group creation, seen in CI. Ports below the range are
    handed out only to those who ask for them by number (Ray's workers use 10002-19999)."""
    import random

    rng = rng or random.Random()
    low = _ephemeral_low()
    for port in rng.sample(range(20000, low), min(64, max(0, low - 20000))):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:   # no room below the range, or all taken: any free port
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _rendezvous_address() -> tuple[str, int]:
    """(IP, free port) of the node this runs on: torch.distributed's master for rank 0."""
    import ray

    ip = ray.util.get_node_ip_address()
    return ip, _free_port(ip)


_AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def ray_auth_mode() -> str:
    """'token' or 'disabled': the authentication of the Ray cluster this process is connected to."""
    from ray._raylet import AuthenticationMode, get_authentication_mode

    return "token" if get_authentication_mode() == AuthenticationMode.TOKEN else "disabled"


def init_ray(num_devices: int, verbose: bool) -> bool:
    """Join the cluster named by RAY_ADDRESS, or start a local one-node Ray with ``num_devices``
    CPUs; True when this call connected (so the run disconnects or stops it at the end).
    Workers' output reaches this terminal (``(pid=...)`` prefixed) only when ``verbose``.

    Authentication: Ray 2.60's daemons listen on every interface (GCS, raylet, object manager,
    workers: no option binds them to loopback), so what keeps other hosts out is Ray's token
    authentication. A local cluster gets a fresh random token for this run, in the environment of
    the driver and so of every Ray process it starts (Ray's own default is a token file,
    ``~/.ray/auth_token``, that it writes world-readable and keeps across runs), unless the user
    set RAY_AUTH_MODE, RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH. Joining a cluster, the run says
    whether the cluster authenticated it (launch/slurm/megarl.sbatch makes a token per job)."""
    import ray

    if ray.is_initialized():
        return False
    opts = dict(log_to_driver=verbose, configure_logging=False)
    if os.environ.get("RAY_ADDRESS"):
        if os.environ.get("MEGARL_NODE_IP"):   # this node's address as the launcher knows it (Slurm's NodeAddr)
            opts["_node_ip_address"] = os.environ["MEGARL_NODE_IP"]
        ray.init(address=os.environ["RAY_ADDRESS"], **opts)
        token = ray_auth_mode() == "token"
        auth = ("token authentication on" if token else
                "NO authentication: whoever reaches this address can run code in the cluster; start Ray with "
                "RAY_AUTH_MODE=token and a RAY_AUTH_TOKEN shared by every node")
        log.info(f"joined the Ray cluster at {os.environ['RAY_ADDRESS']} ({auth}; "
                 f"{len(ray.nodes())} node(s), {ray.cluster_resources()})")
        if not token:
            log.warning(f"the Ray cluster at {os.environ['RAY_ADDRESS']} has no authentication")
    else:
        if not any(os.environ.get(var) for var in _AUTH_VARS):
            import secrets

            from ray._raylet import AuthenticationTokenLoader, Config

            os.environ["RAY_AUTH_MODE"] = "token"
            os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
            # Ray read its settings when it was imported: re-read them, as ray.init does when it
            # turns token authentication on itself, and forget any token it cached
            Config.initialize("")
            AuthenticationTokenLoader.instance().reset_cache()
        # Ray's daemons on one node (Ray 2.60, measured PSS on CPU): gcs_server 40 MB, raylet 24,
        # dashboard agent 68, runtime-env agent 51, autoscaler monitor 51, log monitor 47 and the
        # dashboard's API server 72 (with include_dashboard=False it still starts, loading only
        # the usage-stats module; without ray[default]'s packages it is the same minimal process
        # either way): ~355 MB. No ray.init or _system_config option removes one of them:
        # prestart_worker_first_driver=False changes nothing (no idle worker is started: our
        # actors carry a runtime_env), enable_metrics_collection=False neither PSS nor idle CPU
        # (3.5% of a core). The log monitor (useless without log_to_driver) and the autoscaler
        # monitor could only go through Ray's private RayParams (-98 MB): not done.
        ray.init(num_cpus=max(num_devices, 1), include_dashboard=False, **opts)
        if ray_auth_mode() != "token":
            log.warning("Ray token authentication is off (RAY_AUTH_MODE): any host that reaches this machine's Ray "
                        "ports can run code as this user")
    return True


class Placement:
    """Ray, the placement group, the HybridWorkers (``workers``, rank order) and the rollout
    engines (``engines``, engine order) of one run."""

    def __init__(self, cfg, log_dir: Path | None = None, verbose: bool = False, stage: str = "rl"):
        """``stage``: ``rl``, or ``sft`` / ``rm`` (:mod:`megarl.posttrain`: the workers alone, no
        rollout engine)."""
        self.pg, self.workers, self.engines, self.keepers, self.started_ray = None, [], [], [], False
        self.stage = stage
        try:
            self._start(cfg, log_dir, verbose)
        except BaseException:
            self.close()
            raise

    def _start(self, cfg, log_dir: Path | None, verbose: bool) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from megarl import faults
        from megarl.data.keeper import keeper_actor_class
        from megarl.rollout.engine import engine_actor_class
        from megarl.actors.worker import HybridWorker

        world, r = cfg.topology.world_size, cfg.rollout
        num_engines = r.dp if self.stage == "rl" else 0
        split = r.placement == "split" and num_engines > 0
        rollout_devices = num_engines * r.tp if split else 0
        self.started_ray = init_ray(world + rollout_devices, verbose)
        # "GPU" when the cluster has GPUs, else "CPU"
        kind = "GPU" if ray.cluster_resources().get("GPU", 0) > 0 else "CPU"
        # one bundle per training device, then (split) one per engine holding its rollout devices;
        # on GPU clusters a bundle is a GPU (+1 CPU), packed on as few nodes as possible
        bundle = (lambda n: {"GPU": n, "CPU": n}) if kind == "GPU" else (lambda n: {"CPU": n})
        self.pg = placement_group([bundle(1)] * world + ([bundle(r.tp)] * num_engines if split else []),
                                  strategy="PACK")
        ray.get(self.pg.ready())
        # training rank i sits in bundle order[i]: ranks contiguous per node (TP groups within a
        # node), rank 0 (torch.distributed's rendezvous) on the controller's node
        order = _rank_order(self.pg, world)
        on = lambda i: PlacementGroupSchedulingStrategy(self.pg, i)   # noqa: E731
        cores = os.cpu_count() or 2
        threads = str(max(1, cores // (world + rollout_devices))) if kind == "CPU" else "4"
        env = {"env_vars": {"OMP_NUM_THREADS": threads}}
        if os.environ.get(faults.ENV):   # a test's fault injection (megarl/faults.py): checked here, before any start
            faults.planned()
            env["env_vars"][faults.ENV] = os.environ[faults.ENV]
        log_file = (lambda name: str(log_dir / f"{name}.log")) if log_dir is not None else (lambda name: None)
        # torch.distributed rendezvous on the node of rank 0 (bundle 0), not on the driver's
        master, port = ray.get(ray.remote(num_cpus=0)(_rendezvous_address).options(
            scheduling_strategy=on(order[0])).remote())
        actor = ray.remote(HybridWorker)
        per_worker = {"num_cpus": 1, **({"num_gpus": 1} if kind == "GPU" else {})}
        self.workers = [actor.options(scheduling_strategy=on(order[i]), runtime_env=env, **per_worker)
                        .remote(cfg, i, world, master, port, log_file(f"worker_{i}"), self.stage)
                        for i in range(world)]
        # colocated on GPU: an engine's actor takes no GPU of its own, it is handed those of the
        # training workers whose devices its TP ranks share (this waits for the workers to start)
        gpu_ids = ray.get([w.gpu_ids.remote() for w in self.workers]) if kind == "GPU" and not split else None
        # CPU: the host's cores split evenly over every vLLM TP rank of the fleet
        per_rank = max(1, cores // (r.dp * r.tp))
        engine_actor = engine_actor_class()   # pause/resume in a concurrency group of their own
        # engine k's objects are owned by keeper k, in the same bundle (so on its node): they outlive
        # the engine's restarts (megarl/data/keeper.py)
        keeper_actor = keeper_actor_class()
        bundle = (lambda k: world + k) if split else (lambda k: order[k * r.tp])

        def start_engine(k: int):
            if split:
                where = dict(scheduling_strategy=on(bundle(k)), num_cpus=r.tp,
                             **({"num_gpus": r.tp} if kind == "GPU" else {}))
            else:
                where = dict(scheduling_strategy=on(bundle(k)), num_cpus=0)
            devices = range(k * r.tp, (k + 1) * r.tp)
            return engine_actor.options(runtime_env={"env_vars": {"OMP_NUM_THREADS": str(per_rank)}},
                                        **where).remote(
                cfg, k, cores=((k * r.tp * per_rank) % cores, r.tp * per_rank) if kind == "CPU" else None,
                gpu_ids=[g for d in devices for g in gpu_ids[d]] if gpu_ids else None,
                log_file=log_file(f"engine_{k}"), keeper=self.keepers[k])

        self.keepers = [keeper_actor.options(scheduling_strategy=on(bundle(k))).remote() for k in range(num_engines)]
        self._start_engine = start_engine
        for k in range(num_engines):   # one by one: close() must find every started actor
            self.engines.append(start_engine(k))

    def restart_engine(self, k: int):
        """Kill engine ``k``'s actor (with its vLLM processes) and start a new one in its place;
        returns the new handle (also in ``engines``)."""
        import ray

        _quietly(f"kill of engine {k}", lambda: ray.kill(self.engines[k]))
        self.engines[k] = self._start_engine(k)
        return self.engines[k]

    def close(self, timeout_s: float = 120.0) -> None:
        """Release everything this placement started; never raises (failures are logged).

        The actors first stop their vLLM engines themselves (which also frees the engines' shared
        memory), for at most ``timeout_s`` seconds: an actor still busy in a phase (e.g. blocked in
        a collective whose peer died) cannot run its shutdown, and is killed with the rest. Ray
        kills a killed actor's child processes (its vLLM workers) too."""
        import ray

        if ray.is_initialized():
            actors = self.workers + self.engines
            pending = {a.shutdown.remote(): a for a in actors}
            done, busy = ray.wait(list(pending), num_returns=len(pending), timeout=timeout_s) if pending else ([], [])
            for ref in done:
                _quietly(f"shutdown of {pending[ref]}", lambda: ray.get(ref))
            if busy:
                log.warning(f"cleanup: {len(busy)} of {len(actors)} actor(s) did not stop within {timeout_s:.0f} s "
                            "(busy in a phase): killing them")
            for a in actors + self.keepers:
                _quietly(f"kill of {a}", lambda: ray.kill(a))
            if self.pg is not None:
                from ray.util.placement_group import remove_placement_group

                _quietly("removing the placement group", lambda: remove_placement_group(self.pg))
        self.workers, self.engines, self.keepers, self.pg = [], [], [], None
        if self.started_ray:
            _quietly("ray.shutdown", ray.shutdown)
            self.started_ray = False


def _rank_order(pg, world: int) -> list[int]:
    """The placement group's first ``world`` bundles (the training devices) in rank order
    (:func:`rank_order` of where Ray put them)."""
    import ray
    from ray.util.placement_group import placement_group_table

    return rank_order(placement_group_table(pg)["bundles_to_node_id"], world,
                      here=ray.get_runtime_context().get_node_id(),
                      ips={n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()})


def rank_order(node_of: dict, world: int, here: str, ips: dict) -> list[int]:
    """Bundles ``0..world-1`` in rank order, given ``node_of[bundle]`` (a node id), the
    controller's node ``here`` and each node's address: the controller's node first, then the
    other nodes by address; within a node, by bundle index. Ray's PACK strategy decides which node
    holds which bundle, in no order a rank layout needs: TP groups must stay within a node, and
    rank 0 (torch.distributed's rendezvous) goes with the controller."""

    def key(b):
        node = node_of[b]
        address = tuple(int(x) if x.isdigit() else 0 for x in ips.get(node, "").split("."))
        return node != here, address, node, b

    return sorted(range(world), key=key)


def _quietly(what: str, fn) -> None:
    import ray

    try:
        fn()
    except Exception as err:   # cleanup runs on error paths: report and go on
        # an actor that already died (the error being cleaned up after) is not news
        level = logging.DEBUG if isinstance(err, ray.exceptions.RayActorError) else logging.WARNING
        log.log(level, f"cleanup: {what} failed: {type(err).__name__}: {(str(err).splitlines() or [''])[0]}")
