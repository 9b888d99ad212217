"""The controller's handle on the rollout fleet: ``rollout.dp`` vLLM engines, each an
:class:`megarl.rollout.engine.EngineActor`.

Generation: the prompts of a call are dealt to the engines by
:class:`megarl.rollout.router.LengthRouter` (predicted work per engine even; the ``rollout.n``
samples of a prompt stay on one engine, for its prefix cache), every engine streams its finished
prompts back as they finish, and ``on_done`` sees them at once (the caller scores them while the
engines go on). Sampling seeds come with the prompts (functions of seed, step and prompt), so
what is sampled does not depend on the number of engines or on the routing.

Faults: an engine dies (its actor process, :class:`megarl.trainer.workers.WorkerDied`, or a vLLM
worker process of it, :class:`megarl.rollout.vllm_engine.EngineDied`) or hangs (it reports at
least every few seconds while busy; nothing for ``rollout.engine_timeout_s`` seconds is
:class:`EngineHung`). Up to ``rollout.engine_restarts`` times per call, the engine is restarted
(``restart(k)``: a new actor on the same devices, loaded with the current weights) and given its
unfinished prompts again, with the same seeds: the call's samples are those it would have
returned without the fault. Beyond that the error, naming the engine, fails the step, and the run
can resume from its last checkpoint (``megarl train --resume``).

Metrics of the last call (:attr:`Fleet.metrics`): per engine generated tokens and busy seconds,
``rollout/busy_ratio``, the max/mean busy seconds across engines (1.0: no engine waits for
another; the long tail shows as > 1; an engine given no prompt counts as idle), and
``rollout/engine_restarts``.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Optional

log = logging.getLogger("megarl")

HEARTBEAT_S = 2.0
"""How often a busy engine reports at least (its progress message may be empty)."""


class EngineHung(RuntimeError):
    """An engine reported no progress for ``rollout.engine_timeout_s`` seconds during generation."""


class Fleet:
    def __init__(self, cfg, engines: list, infos: list[dict], restart: Optional[Callable] = None):
        """``engines``: the EngineActor handles; ``infos``: their :meth:`EngineActor.info`;
        ``restart(k)``: replaces engine k, returns (new handle, its info); None: no restarts."""
        from megarl.rollout.router import LengthRouter

        self.cfg, self.engines, self.infos, self.restart = cfg, engines, infos, restart
        r = cfg.rollout
        self.router = LengthRouter(len(engines), default_response_tokens=r.max_response_tokens / 2, n=r.n)
        self.metrics: dict = {}

    def name(self, k: int) -> str:
        """``rollout engine K (pid P on NODE, vLLM TP ranks on training devices a..b)``."""
        tp, info = self.cfg.rollout.tp, self.infos[k] if k < len(self.infos) else {}
        where = "its own devices" if self.cfg.rollout.placement == "split" else \
            f"training device{'s' if tp > 1 else ''} {k * tp}" + (f"..{(k + 1) * tp - 1}" if tp > 1 else "")
        pid = f"pid {info['pid']} on {info['node']}, " if info else ""
        return f"rollout engine {k} ({pid}vLLM TP ranks on {where})"

    def generate(self, prompt_ids: list[list[int]], seeds: list[int], greedy: bool = False,
                 on_done: Optional[Callable[[list], None]] = None) -> list:
        """Per prompt, its samples (:func:`megarl.rollout.engine.samples_of`), in prompt order.
        ``on_done(pairs)`` is called with ``[(prompt index, samples), ...]`` as they finish."""
        import ray

        from megarl.rollout.vllm_engine import EngineDied
        from megarl.trainer.workers import WorkerDied, _reason

        keys = [tuple(p) for p in prompt_ids]
        local = {k: part for k, part in enumerate(self.router.assign([len(p) for p in prompt_ids], keys)) if part}
        out: list = [None] * len(prompt_ids)
        streams, heard, restarts = {}, {}, 0
        stats = {k: {"busy_s": 0.0, "tokens": 0} for k in range(len(self.engines))}
        carried = {k: dict(v) for k, v in stats.items()}   # what an engine's earlier (dead) streams reported

        def launch(k: int) -> None:
            todo = [i for i in local[k] if out[i] is None]
            local[k] = todo
            if todo:
                streams[k] = self.engines[k].generate_stream.options(num_returns="streaming").remote(
                    [prompt_ids[i] for i in todo], [seeds[i] for i in todo], greedy, heartbeat_s=HEARTBEAT_S)
                heard[k] = time.monotonic()
            else:
                streams.pop(k, None)

        def failed(k: int, err: Exception) -> None:
            nonlocal restarts
            limit = self.cfg.rollout.engine_restarts
            if self.restart is None or restarts >= limit:
                raise err
            restarts += 1
            unfinished = sum(out[i] is None for i in local[k])
            log.warning(f"{err} - restarting it ({restarts} of rollout.engine_restarts={limit} this call) and "
                        f"reissuing its {unfinished} unfinished prompt(s)")
            carried[k] = dict(stats[k])
            self.engines[k], self.infos[k] = self.restart(k)
            launch(k)

        for k in local:
            launch(k)
        timeout = self.cfg.rollout.engine_timeout_s
        while streams:
            gens = list(streams.items())
            ready, _ = ray.wait([g for _, g in gens], num_returns=1, timeout=min(1.0, timeout))
            for k, g in gens:
                if not any(r is g for r in ready) or streams.get(k) is not g:
                    continue
                try:
                    item = ray.get(next(g))
                except StopIteration:
                    del streams[k]
                    continue
                except ray.exceptions.RayActorError as err:
                    failed(k, WorkerDied(f"{self.name(k)} died during generate: {_reason(err)}"))
                    continue
                except EngineDied as err:
                    failed(k, err)
                    continue
                heard[k] = time.monotonic()
                stats[k] = {"busy_s": carried[k]["busy_s"] + item["busy_s"],
                            "tokens": carried[k]["tokens"] + item["tokens"]}
                pairs = [(local[k][j], samples) for j, samples in item["done"]]
                for i, samples in pairs:
                    out[i] = samples
                    if not greedy:
                        self.router.observe(keys[i], [len(s["token_ids"]) for s in samples])
                if pairs and on_done is not None:
                    on_done(pairs)
            now = time.monotonic()
            for k in [k for k in streams if now - heard[k] > timeout]:
                failed(k, EngineHung(f"{self.name(k)} reported no progress for {now - heard[k]:.0f} s during "
                                     f"generate (rollout.engine_timeout_s={timeout:g}): it is hung"))
        missing = [i for i, o in enumerate(out) if o is None]
        if missing:
            raise RuntimeError(f"the rollout fleet returned no samples for {len(missing)} prompt(s), e.g. prompt "
                               f"{missing[0]} (engine {next(k for k, p in local.items() if missing[0] in p)})")
        self.metrics = dict(self._metrics(stats), **{"rollout/engine_restarts": restarts})
        return out

    def _metrics(self, stats: dict) -> dict:
        from megarl.rollout.router import busy_ratio

        m = {}
        for k, s in stats.items():
            m[f"rollout/engine{k}_tokens"] = s["tokens"]
            m[f"rollout/engine{k}_busy_s"] = s["busy_s"]
        m["rollout/busy_ratio"] = busy_ratio([s["busy_s"] for s in stats.values()])
        return m

    def call_all(self, method: str, *args) -> list:
        """``method(*args)`` on every engine, waited for with deaths named."""
        from megarl.trainer.workers import wait_all

        refs = [getattr(e, method).remote(*args) for e in self.engines]
        return wait_all(refs, [self.name(k) for k in range(len(self.engines))], method)
