"""The controller's handle on the rollout fleet: ``rollout.dp`` vLLM engines, each an
:class:`megarl.rollout.engine.EngineActor`.

A call's prompt groups are dealt to the engines by predicted work
(:class:`megarl.rollout.dispatch.LengthDispatcher`; a prompt's ``rollout.n`` samples stay on one
engine, for its prefix cache) and stream back as they finish, so the caller scores them while the
engines go on. Seeds come with the prompts, so what is sampled does not depend on the number of
engines. :meth:`Fleet.generate_requests` serves one-sample requests that a pause can stop (the
partial rollouts of ``trainer.mode: async``). Each message's object-store handles are claimed
from its engine as it arrives, before anyone sees the samples; the objects belong to the
engine's keeper, so a restarted engine's delivered samples keep them. A dead or silent engine is
restarted and given its unfinished prompts again with the same seeds, up to
``rollout.engine_restarts`` times a call; then the error, naming the engine, fails the step.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

from megarl.calls import WorkerDied, death_reason, wait_all
from megarl.data.batch import response_length

log = logging.getLogger("megarl")

HEARTBEAT_S = 2.0
"""How often a busy engine reports at least (its progress message may be empty)."""
PAUSE_POLL_S = 0.5
"""How often :meth:`Fleet.generate_requests` looks at its pause event at least."""
FEED_POLL_S = 0.02
"""How often :meth:`Fleet.generate_requests` asks its feed for new requests."""


class EngineHung(RuntimeError):
    """An engine reported no progress for ``rollout.engine_timeout_s`` seconds during generation."""


def samples_in(item: dict) -> list:
    """The sample dicts of an engine's stream message: ``done`` as ``[(prompt index, [samples])]``
    (:meth:`EngineActor.generate_stream`) or ``[(request id, sample)]``, and ``partial``."""
    out = []
    for _, x in list(item.get("done", ())) + list(item.get("partial", ())):
        out.extend(x if isinstance(x, list) else [x])
    return out


class Fleet:
    """The engines of a run, from the controller: :meth:`generate` (prompt groups, run to the
    end), :meth:`generate_requests` (one-sample requests a pause can stop), :meth:`call_all`.
    A message's samples carry keys of what their engine put (:class:`megarl.data.store.Pending`:
    routing, and the ``stored_ids`` and ``stored_logprobs`` the ranks read), claimed as handles
    with :func:`megarl.data.store.claim`; the objects belong to the engine's keeper
    (:class:`megarl.data.keeper.Keeper`), so a restarted engine's delivered samples keep them."""

    def __init__(self, cfg, engines: list, infos: list[dict], restart: Optional[Callable] = None):
        """``engines``: the EngineActor handles; ``infos``: their :meth:`EngineActor.info`;
        ``restart(k)``: replaces engine k, returns (new handle, its info); None: no restarts."""
        from megarl.rollout.dispatch import LengthDispatcher

        self.cfg, self.engines, self.infos, self.restart = cfg, engines, infos, restart
        r = cfg.rollout
        self.dispatcher = LengthDispatcher(len(engines), default_response_tokens=r.max_response_tokens / 2, n=r.n)
        self.metrics: dict = {}

    def name(self, k: int) -> str:
        """``rollout engine K (pid P on NODE, vLLM TP ranks on training devices a..b)``."""
        tp, info = self.cfg.rollout.tp, self.infos[k] if k < len(self.infos) else {}
        where = "its own devices" if self.cfg.rollout.placement == "split" else \
            f"training device{'s' if tp > 1 else ''} {k * tp}" + (f"..{(k + 1) * tp - 1}" if tp > 1 else "")
        pid = f"pid {info['pid']} on {info['node']}, " if info else ""
        return f"rollout engine {k} ({pid}vLLM TP ranks on {where})"

    def generate(self, prompt_ids: list[list[int]], seeds: list[int], greedy: bool = False,
                 on_done: Optional[Callable[[list], None]] = None, drafts: Optional[list] = None) -> list:
        """Per prompt, its samples (:func:`megarl.rollout.engine.samples_of`), in prompt order.
        ``on_done(pairs)`` is called with ``[(prompt index, samples), ...]`` as they finish.
        ``drafts`` (``rollout.speculative``): per prompt, its drafts or None; they travel with
        their prompt to its engine (:meth:`EngineActor.generate_stream`)."""
        keys = [tuple(p) for p in prompt_ids]
        local = {k: part for k, part in enumerate(self.dispatcher.assign([len(p) for p in prompt_ids], keys)) if part}
        out: list = [None] * len(prompt_ids)
        spec_s: dict = {}   # engine -> its verification seconds

        def launch(k: int):
            local[k] = [i for i in local[k] if out[i] is None]
            if not local[k]:
                return None
            return self.engines[k].generate_stream.options(num_returns="streaming").remote(
                [prompt_ids[i] for i in local[k]], [seeds[i] for i in local[k]], greedy, heartbeat_s=HEARTBEAT_S,
                drafts=None if drafts is None else [drafts[i] for i in local[k]])

        def receive(k: int, item: dict) -> None:
            if item.get("spec_s"):
                spec_s[k] = item["spec_s"]
            pairs = [(local[k][j], samples) for j, samples in item["done"]]
            for i, samples in pairs:
                out[i] = samples
                if not greedy:
                    self.dispatcher.observe(keys[i], [response_length(s) for s in samples])
            if pairs and on_done is not None:
                on_done(pairs)

        stats, restarts, _ = self._stream(list(local), launch, receive,
                                          unfinished=lambda k: f"{sum(out[i] is None for i in local[k])} unfinished "
                                                               "prompt(s)")
        missing = [i for i, o in enumerate(out) if o is None]
        if missing:
            raise RuntimeError(f"the rollout fleet returned no samples for {len(missing)} prompt(s), e.g. prompt "
                               f"{missing[0]} (engine {next(k for k, p in local.items() if missing[0] in p)})")
        self.metrics = dict(fleet_metrics(stats), **{"rollout/engine_restarts": restarts})
        for name in ("verify_s", "residual_s"):   # the engines verify at once: the slowest one's
            if spec_s:
                self.metrics[f"spec/{name}"] = max(s[name] for s in spec_s.values())
        return out

    def generate_requests(self, requests: list[dict], pause: Optional[threading.Event] = None,
                          on_done: Optional[Callable[[list], None]] = None,
                          feed: Optional[Callable[[], tuple[list, bool]]] = None) -> tuple[dict, dict]:
        """One sample per request (:meth:`megarl.rollout.engine.EngineActor.generate_requests`:
        ``{"id", "prompt_ids", "seed", "max_tokens", "greedy"}``, ids unique; an optional
        ``"group"``, default the prompt, keeps requests together on one engine). Returns
        ``(done, partial)``: ``{id: sample}`` of the requests that finished, and of those that a
        pause stopped (their tokens and log-probs so far). ``on_done(pairs)`` gets ``[(id, sample),
        ...]`` as requests finish. ``pause``: once it is set (looked at every 0.5 s at least),
        every engine is paused (:meth:`EngineActor.pause`), the call collects their partials and
        returns; the engines stay paused until :meth:`resume_all`. Without a pause every request
        ends in ``done``. Faults as :meth:`generate` (a restarted engine's unfinished requests
        start again from their prompt); metrics (:attr:`metrics`) as :meth:`generate`.

        ``feed`` (open streams, the agent loop's turns): called every few tens of milliseconds
        while the call runs, it returns ``(new requests, more)``; each new request joins the
        running stream of the engine that holds its group (:meth:`EngineActor.submit`: a
        trajectory's turns stay on the engine whose prefix cache holds it), a new group the engine
        with the least work given; ``more`` false: nothing else will come, and the call ends once
        every request has. ``done`` then holds the new requests too."""
        from megarl.rollout.dispatch import lpt

        requests = list(requests)
        ids = [q["id"] for q in requests]
        if len(set(ids)) != len(ids):
            twice = next(i for i in ids if ids.count(i) > 1)
            raise ValueError(f"Fleet.generate_requests: request id {twice!r} appears {ids.count(twice)} times; "
                             "expected unique ids")
        # groups dealt by predicted work (LPT): the prompt once, each request's expected length within its budget
        groups: dict = {}
        for i, q in enumerate(requests):
            groups.setdefault(q.get("group", tuple(q["prompt_ids"])), []).append(i)
        keys = list(groups)
        costs = [len(requests[groups[g][0]]["prompt_ids"]) +
                 sum(min(requests[i]["max_tokens"], self.dispatcher.expected_response_len(g)) for i in groups[g])
                 for g in keys]
        local = {k: sorted(i for g in part for i in groups[keys[g]])
                 for k, part in enumerate(lpt(costs, len(self.engines))) if part}
        done, partial = {}, {}
        owner = {g: k for k, part in local.items() for g in {requests[i].get("group", tuple(requests[i]["prompt_ids"]))
                                                              for i in part}}
        work = {k: sum(len(requests[i]["prompt_ids"]) + requests[i]["max_tokens"] for i in local.get(k, []))
                for k in range(len(self.engines))}
        feeding = feed is not None
        sids: dict = {}   # engine -> its open stream's id

        def launch(k: int):
            local[k] = [i for i in local[k] if ids[i] not in done]
            if not local[k]:
                return None
            if feeding:
                sids[k] = f"{id(local):x}-{k}-{time.monotonic_ns()}"
            return self.engines[k].generate_requests.options(num_returns="streaming").remote(
                [requests[i] for i in local[k]], heartbeat_s=HEARTBEAT_S, stream_id=sids.get(k) if feeding else None)

        def tick(running: set) -> tuple[list, bool]:
            """The feed's new requests into the engines' open streams; the engines to start, and
            whether the feed may still give more."""
            nonlocal feeding
            if not feeding:
                return [], False
            new, more = feed()
            to_start: dict = {}
            for q in new:
                if q["id"] in ids:
                    raise ValueError(f"Fleet.generate_requests: the feed's request id {q['id']!r} was used before "
                                     "in this call; expected unique ids")
                g = q.get("group", tuple(q["prompt_ids"]))
                k = owner.setdefault(g, min(work, key=work.get))
                work[k] += len(q["prompt_ids"]) + q["max_tokens"]
                requests.append(q)
                ids.append(q["id"])
                local.setdefault(k, []).append(len(requests) - 1)
                if k in running:
                    to_start.setdefault(k, []).append(q)
                else:
                    to_start[k] = None   # started with everything it has left
            for k, qs in to_start.items():
                if qs is not None:
                    self.engines[k].submit.remote(sids[k], qs)
            if not more:
                feeding = False
                for k in running:
                    self.engines[k].close_stream.remote(sids[k])
            return [k for k, qs in to_start.items() if qs is None], feeding

        def receive(k: int, item: dict) -> None:
            for rid, sample in item["done"]:
                done[rid] = sample
            partial.update(item["partial"])
            if item["done"] and on_done is not None:
                on_done(item["done"])

        stats, restarts, paused = self._stream(list(local), launch, receive, pause=pause,
                                               unfinished=lambda k: f"{sum(ids[i] not in done for i in local[k])} "
                                                                    "unfinished request(s) (from their prompts)",
                                               tick=tick if feed is not None else None)
        missing = [i for i in ids if i not in done and i not in partial]
        if missing:
            raise RuntimeError(f"the rollout fleet returned nothing for {len(missing)} request(s), e.g. {missing[0]!r} "
                               f"(engine {next(k for k, p in local.items() if any(ids[i] == missing[0] for i in p))})")
        if partial and not paused:
            raise RuntimeError(f"the rollout fleet returned {len(partial)} unfinished request(s), e.g. "
                               f"{next(iter(partial))!r}, without a pause of this call: an engine was paused before "
                               "it (Fleet.resume_all was not called after the last pause)")
        for g in keys:   # a group that finished whole from its prompt tells the router its length
            full = [done[ids[i]] for i in groups[g] if ids[i] in done and
                    requests[i]["max_tokens"] == self.cfg.rollout.max_response_tokens and not requests[i]["greedy"]]
            if full and len(full) == len(groups[g]):
                self.dispatcher.observe(g, [response_length(s) for s in full])
        self.metrics = dict(fleet_metrics(stats), **{"rollout/engine_restarts": restarts})
        return done, partial

    def resume_all(self) -> None:
        """:meth:`EngineActor.resume` on every engine (after a paused :meth:`generate_requests`
        and the weight sync), waited for: a ``generate_requests`` sent after this returns is not
        mistaken for paused."""
        self.call_all("resume")

    def _stream(self, engines: list[int], launch: Callable, receive: Callable, unfinished: Callable,
                pause: Optional[threading.Event] = None,
                tick: Optional[Callable[[set], list]] = None) -> tuple[dict, int, bool]:
        """Run one call's engine streams to their ends: ``launch(k)`` starts engine k's stream on
        what it has left (None: nothing), ``receive(k, message)`` takes each message,
        ``unfinished(k)`` words what a restart reissues. ``pause`` set: every engine is paused once. Returns per engine
        busy seconds and tokens (those of its dead streams included), the restarts, and whether
        it paused the engines. ``tick(running engines)``, every loop until it says no more: the
        engines to start and whether more may come (see :meth:`generate_requests`' feed); the call
        runs while it has streams or more may come.

        Faults: an engine dies (its actor process, :class:`megarl.calls.WorkerDied`, or a vLLM
        worker process of it, :class:`megarl.rollout.vllm_engine.EngineDied`) or hangs (it
        reports at least every few seconds while busy; nothing for ``rollout.engine_timeout_s``
        seconds is :class:`EngineHung`). Up to ``rollout.engine_restarts`` times per call the
        engine is restarted (``restart(k)``: a new actor on the same devices, loaded with the
        current weights) and given its unfinished prompts again, with the same seeds: the call's
        samples are those it would have returned without the fault. Beyond that the error,
        naming the engine, fails the step; the run can resume from its last checkpoint."""
        import ray

        from megarl.data.store import claim
        from megarl.rollout.vllm_engine import EngineDied

        streams, heard, restarts, pausing = {}, {}, 0, False
        stats = {k: {"busy_s": 0.0, "tokens": 0} for k in range(len(self.engines))}
        carried = {k: dict(v) for k, v in stats.items()}   # what an engine's earlier (dead) streams reported

        def start(k: int) -> None:
            stream = launch(k)
            if stream is None:
                streams.pop(k, None)
            else:
                streams[k], heard[k] = stream, time.monotonic()

        def failed(k: int, err: Exception) -> None:
            nonlocal restarts
            limit = self.cfg.rollout.engine_restarts
            if self.restart is None or restarts >= limit:
                raise err
            restarts += 1
            log.warning(f"{err} - restarting it ({restarts} of rollout.engine_restarts={limit} this call) and "
                        f"reissuing its {unfinished(k)}")
            carried[k] = dict(stats[k])
            self.engines[k], self.infos[k] = self.restart(k)
            if pausing:   # it stops at once, its requests partial
                self.engines[k].pause.remote()
            start(k)

        def look_at_pause() -> None:
            nonlocal pausing
            if pause is not None and not pausing and pause.is_set():
                pausing = True
                for e in self.engines:   # not waited for: each stream's end is the answer
                    e.pause.remote()

        for k in engines:
            start(k)
        timeout = self.cfg.rollout.engine_timeout_s
        poll = min(FEED_POLL_S if tick is not None else 1.0 if pause is None else PAUSE_POLL_S, timeout)
        feeding = tick is not None
        while streams or feeding:
            look_at_pause()
            if feeding:
                to_start, feeding = tick(set(streams))
                for k in to_start:
                    start(k)
                if not streams:
                    if feeding:
                        time.sleep(FEED_POLL_S)
                    continue
            gens = list(streams.items())
            ready, _ = ray.wait([g for _, g in gens], num_returns=1, timeout=poll)
            for k, g in gens:
                if not any(r is g for r in ready) or streams.get(k) is not g:
                    continue
                try:
                    item = ray.get(next(g))
                    claim(self.engines[k], samples_in(item))   # the object-store handles of its arrays
                except StopIteration:
                    del streams[k]
                    carried[k] = dict(stats[k])   # a later stream of this engine (a feed's) counts on
                    continue
                except ray.exceptions.RayActorError as err:
                    failed(k, WorkerDied(f"{self.name(k)} died during generate: {death_reason(err)}"))
                    continue
                except EngineDied as err:
                    failed(k, err)
                    continue
                heard[k] = time.monotonic()
                stats[k] = {"busy_s": carried[k]["busy_s"] + item["busy_s"],
                            "tokens": carried[k]["tokens"] + item["tokens"]}
                receive(k, item)
                look_at_pause()   # also between messages: receive runs the caller's on_done
            now = time.monotonic()
            for k in [k for k in streams if now - heard[k] > timeout]:
                # a message already waiting: the controller was the one not listening (e.g. it was
                # restarting another engine, which can take longer than the timeout), not the engine
                if ray.wait([streams[k]], num_returns=1, timeout=0)[0]:
                    continue
                failed(k, EngineHung(f"{self.name(k)} reported no progress for {now - heard[k]:.0f} s during "
                                     f"generate (rollout.engine_timeout_s={timeout:g}): it is hung"))
        return stats, restarts, pausing

    def call_all(self, method: str, *args) -> list:
        """``method(*args)`` on every engine, waited for with deaths named."""
        refs = [getattr(e, method).remote(*args) for e in self.engines]
        return wait_all(refs, [self.name(k) for k in range(len(self.engines))], method)


def fleet_metrics(stats: dict) -> dict:
    """Per engine generated tokens and busy seconds, ``rollout/busy_ratio`` (max over mean
    busy seconds; 1.0: no engine waits for another; an idle engine counts)."""
    from megarl.rollout.dispatch import busy_ratio

    m = {}
    for k, s in stats.items():
        m[f"rollout/engine{k}_tokens"] = s["tokens"]
        m[f"rollout/engine{k}_busy_s"] = s["busy_s"]
    m["rollout/busy_ratio"] = busy_ratio([s["busy_s"] for s in stats.values()])
    return m
