"""The generation loops of one rollout engine: prompts run to the end, or requests a pause stops.

:meth:`Generation.stream` runs prompts with ``rollout.n`` samples each to the end; with
``rollout.speculative`` their drafts are verified first and only what they leave is generated.
:meth:`Generation.requests` runs one sample per request, each with its own token budget, and can
be paused. Pausing is how partial rollouts (``trainer.mode: async``) meet weight syncs: a running
call stops at its next engine step, aborts its unfinished requests in vLLM
(``LLMEngine.abort_request``) and returns the tokens and log-probs each had so far; the caller
syncs the weights, resumes, and continues each request with its generated prefix appended to the
prompt and the remaining budget. The abort costs one prefill of the prefix. vLLM 0.32 could
instead freeze the requests in its scheduler (``EngineCore.pause_scheduler(mode="keep")``), but
their KV cache would then hold the old policy's keys and values for the prefix; after the abort the
continuation is exactly what the new policy computes for prompt + prefix (prefix + continuation
equal uninterrupted greedy generation, tokens and log-probs: tests/e2e/test_partial_rollouts.py),
and a request can continue on any engine, a restarted one too.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Callable

import numpy as np

from megarl.rollout.moe_routing import routing_reader
from megarl.rollout.request_stream import RequestStream
from megarl.rollout.sampling import child_id, sampling_params, samples_of
from megarl.rollout.stash import Stash


class Generation:
    """The generation of one engine (its actor, :class:`megarl.rollout.engine.EngineActor`,
    forwards its generation methods here). vLLM is called only from the thread that runs
    :meth:`stream` and :meth:`requests`; :meth:`submit`, :meth:`close_stream` and :attr:`paused`
    are what another thread (the actor's control group) touches while one of them runs."""

    def __init__(self, cfg, index: int, llm, stash: Stash, errors: Callable):
        """``index``: the engine's number; ``stash``: where finished samples are put; ``errors``:
        ``errors(phase)``, the context manager that names this engine when vLLM fails."""
        self.cfg, self.index, self.llm, self.stash, self.errors = cfg, index, llm, stash, errors
        self.paused = threading.Event()
        """Set (:meth:`pause`): a running :meth:`requests` stops at its next engine step, every later
        one at once."""
        self._inboxes: dict = {}   # open stream id -> queue of submitted request lists (None: closed)
        self._inbox_lock = threading.Lock()

    def stream(self, prompt_ids: list[list[int]], seeds: list[int], greedy: bool, flush_s: float,
               heartbeat_s: float, drafts: list | None):
        """:meth:`megarl.rollout.engine.EngineActor.generate_stream`."""
        from vllm import TokensPrompt

        from megarl.rollout.lora import adapter_request

        r = self.cfg.rollout
        topk = r.speculative_topk if r.speculative != "off" and not greedy else 0
        delay = r.delay_per_token_s
        reader = routing_reader(self.llm)
        t0 = time.perf_counter()
        with self.errors("generate"):
            if drafts is not None and any(drafts) and not greedy:
                units, finish, ready, spec_s = speculative_units(self.llm, r, prompt_ids, seeds, drafts, topk)
            else:
                params = sampling_params(r, seeds, greedy)
                units = [(p, q, i) for i, (p, q) in enumerate(zip(prompt_ids, params))]
                ready, spec_s = [], {}

                def finish(i, internal, out) -> tuple[list, list]:
                    samples = samples_of(out, topk)
                    return [(i, samples)], [(child_id(internal, o.index, params[i].n), s, len(prompt_ids[i]), o)
                                            for o, s in zip(out.outputs, samples)]
            ids = self.llm.enqueue([TokensPrompt(prompt_token_ids=p) for p, _, _ in units], [q for _, q, _ in units],
                                   use_tqdm=False, lora_request=adapter_request(self.llm)) if units else []
            # outputs carry the external id (LLM's counter, "7"); enqueue returns vLLM's internal
            # one, the external id with a random suffix ("7-1a2b3c4d"); the routing is filed under it
            index = {rid.split("-", 1)[0]: (key, rid) for (_, _, key), rid in zip(units, ids)}
            engine = self.llm.llm_engine
            tokens, done, last = 0, self.stash.put_pairs(list(ready), prompt_ids), t0
            while engine.has_unfinished_requests():
                routed = []
                for out in engine.step():
                    if out.finished:
                        tokens += sum(len(o.token_ids) for o in out.outputs)
                        pairs, rows = finish(*index[out.request_id.split("-", 1)[0]], out)
                        done += self.stash.put_pairs(pairs, prompt_ids)
                        routed += rows
                if reader is not None:
                    reader.attach(routed)
                if delay:
                    time.sleep(delay)
                now = time.perf_counter()
                if (done and now - last >= flush_s) or now - last >= heartbeat_s:
                    yield {"done": done, "busy_s": now - t0, "tokens": tokens, "spec_s": spec_s}
                    done, last = [], now
        yield {"done": done, "busy_s": time.perf_counter() - t0, "tokens": tokens, "spec_s": spec_s}

    def requests(self, requests: list[dict], flush_s: float, heartbeat_s: float, stream_id: str | None):
        """:meth:`megarl.rollout.engine.EngineActor.generate_requests`: a :class:`RequestStream`
        stepped until its requests have ended (and, with ``stream_id``, its stream is closed) or the
        engine is paused; then its unfinished requests are aborted and come back as partials."""
        run = RequestStream(self.llm, self.cfg.rollout, self.stash, self.paused, self.index)
        if stream_id is not None:
            run.open(self._inbox(stream_id))
        with self.errors("generate"):
            try:
                run.add(requests)
                run.take_inbox(0.0)
                while (run.pending or run.is_open) and not self.paused.is_set():
                    stepping = bool(run.pending)   # else: an open stream with nothing to run waits for submissions
                    now = run.step() if stepping else run.wait(0.02)
                    if run.due(now, flush_s, heartbeat_s):
                        yield run.message(now)
                    if stepping:
                        run.take_inbox(0.0)
                run.abort()
            except GeneratorExit:   # the consumer went away: leave no request running in vLLM
                run.cancel()
                raise
            finally:
                if stream_id is not None:
                    with self._inbox_lock:
                        self._inboxes.pop(stream_id, None)
        yield run.last_message()

    def _inbox(self, stream_id: str) -> "queue.Queue":
        with self._inbox_lock:
            return self._inboxes.setdefault(stream_id, queue.Queue())

    def submit(self, stream_id: str, requests: list[dict]) -> None:
        """Queue ``requests`` for the open stream ``stream_id`` (it may not have started yet)."""
        self._inbox(stream_id).put(list(requests))

    def close_stream(self, stream_id: str) -> None:
        """No more :meth:`submit` to ``stream_id``."""
        self._inbox(stream_id).put(None)


def speculative_units(llm, rollout_cfg, prompt_ids: list[list[int]], seeds: list[int], drafts: list, topk: int):
    """:meth:`Generation.stream`'s requests when prompts have drafts: sample j of prompt i with a
    draft is verified (:func:`megarl.rollout.speculative.verify_and_resample`, seed
    ``seeds[i] + j``, vLLM's seed of sample j of a plain request) and continued, when
    something is left, as a request of one sample from the prompt + its kept tokens with the
    remaining budget; a prompt without drafts is one plain request of ``rollout.n`` samples
    (as without speculation). Returns the requests ``(prompt, params, key)``, the function
    that takes a finished one (``finish(key, internal id, output) -> (done pairs, [])``), the
    prompts complete already (every sample fully accepted) and the verification's seconds."""
    from megarl.rollout.speculative import verify_and_resample

    r = rollout_cfg
    jobs = [((i, j), {"prompt_ids": prompt_ids[i], "seed": seeds[i] + j, "draft": d})
            for i, ds in enumerate(drafts) for j, d in enumerate((ds or [])[:r.n])]
    results, spec_s = verify_and_resample(llm, [d for _, d in jobs], r.speculative, r.speculative_lenience, topk,
                                          r.max_response_tokens)
    slots = {i: [None] * r.n for i, ds in enumerate(drafts) if ds}
    for ((i, j), _), res in zip(jobs, results):
        slots[i][j] = res
    units = []
    for i in range(len(prompt_ids)):
        if i not in slots:
            units.append((prompt_ids[i], sampling_params(r, [seeds[i]])[0], (i, None)))
            continue
        for j, res in enumerate(slots[i]):
            if res is None:   # fewer drafts than samples: generated from the prompt
                res = slots[i][j] = {"token_ids": [], "logprobs": [], "top_ids": np.zeros((0, topk), np.int32),
                                     "top_logprobs": np.zeros((0, topk), np.float32), "done": False,
                                     "clipped": False, "spec": None}
            if not res["done"]:
                budget = r.max_response_tokens - len(res["token_ids"])
                units.append((prompt_ids[i] + res["token_ids"],
                              sampling_params(r, [seeds[i] + j], n=1, max_tokens=[budget])[0], (i, j)))

    def complete(i: int) -> list:
        return [(i, [{k: v for k, v in res.items() if k != "done"} for res in slots[i]])] \
            if all(res["done"] for res in slots[i]) else []

    def finish(key, internal, out) -> tuple[list, list]:
        i, j = key
        if j is None:
            return [(i, samples_of(out, topk))], []
        res, (new,) = slots[i][j], samples_of(out, topk)
        res["token_ids"] += new["token_ids"]
        res["logprobs"] += new["logprobs"]
        res["top_ids"] = np.concatenate([res["top_ids"], new["top_ids"]])
        res["top_logprobs"] = np.concatenate([res["top_logprobs"], new["top_logprobs"]])
        res["clipped"], res["done"] = new["clipped"], True
        return complete(i), []

    ready = [pair for i in slots for pair in complete(i)]
    return units, finish, ready, spec_s
