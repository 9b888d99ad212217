"""The requests of one ``generate_requests`` call of an engine, as vLLM runs them.

Each request is one sample with its own token budget (:func:`megarl.rollout.sampling.request_params`).
vLLM hands out only the tokens new since a request's previous output (``RequestOutputKind.DELTA``);
the stream accumulates every request's tokens and log-probs so far, which is what a pause returns
of a request it aborts. Requests are added to vLLM under ids of their own (``megarl-<n>``), which
outputs and ``abort_request(internal=False)`` use; vLLM's internal ids (``add_request``'s answer,
with a random suffix) are the routing's keys (:mod:`megarl.rollout.moe_routing`).
"""
from __future__ import annotations

import queue
import threading
import time

from megarl.rollout.moe_routing import routing_reader
from megarl.rollout.sampling import request_params
from megarl.rollout.stash import Stash


class RequestStream:
    """One call's requests: those vLLM still runs (:attr:`pending`), what each generated so far,
    and the messages the call yields (``{"done", "partial", "busy_s", "tokens"}``; ``busy_s`` and
    ``tokens`` cumulative, ``busy_s`` without the time an open stream waited for submissions).

    A request with ``"store": True`` in an engine actor (:attr:`Stash.enabled`) has its finished
    sample put (:meth:`Stash.put_sample`: its prompt, which holds the sample's earlier tokens, +
    what it generated here) and, unless it says ``"inline": True`` or the stash keeps arrays
    (:attr:`Stash.inline`), its arrays replaced by its metadata; a partial one carries neither."""

    def __init__(self, llm, rollout_cfg, stash: Stash, paused: threading.Event, index: int):
        """``paused``: set, requests added are not started (they come back as empty partials);
        ``index``: the engine's number, for errors."""
        self.rollout_cfg, self.stash, self.paused, self.index = rollout_cfg, stash, paused, index
        self.delay = rollout_cfg.delay_per_token_s
        self.reader = routing_reader(llm)
        self.num_prompt: dict = {}
        self.to_store: dict = {}   # vLLM request id -> its prompt, for a request whose finished sample is put
        self.compact: set = set()  # of those, the ones whose sample then leaves its arrays for its metadata
        self.internal: dict = {}   # external id -> vLLM's internal id (add_request's answer), the routing's key
        self.t0 = time.perf_counter()
        self.tokens, self.done, self.last, self.idle_s = 0, [], self.t0, 0.0   # idle: waiting for submissions
        self.pending: dict = {}
        """vLLM request id -> the request's id and its sample so far."""
        self.inbox: queue.Queue | None = None
        self.is_open = False
        """Whether more requests may come through :attr:`inbox` (:meth:`open`)."""
        self.llm, self.engine = llm, llm.llm_engine

    def open(self, inbox: queue.Queue) -> None:
        """Take requests from ``inbox`` too (lists of requests; None: no more) until it closes."""
        self.inbox, self.is_open = inbox, True

    def add(self, new: list[dict]) -> None:
        """Start ``new`` requests in vLLM (only record them while paused)."""
        if not new:
            return
        rids = [f"megarl-{len(self.num_prompt) + j}" for j in range(len(new))]
        for rid, q in zip(rids, new):
            self.num_prompt[rid] = len(q["prompt_ids"])
            if q.get("store") and self.stash.enabled:
                self.to_store[rid] = q["prompt_ids"]
                if not (self.stash.inline or q.get("inline")):
                    self.compact.add(rid)
            self.pending[rid] = (q["id"], {"token_ids": [], "logprobs": [], "clipped": False})
        if self.paused.is_set():
            return   # returned as partials (nothing generated)
        from vllm import TokensPrompt

        from megarl.rollout.lora import adapter_request

        lora = adapter_request(self.llm)
        inputs = self.engine.renderer.render_cmpl([TokensPrompt(prompt_token_ids=q["prompt_ids"]) for q in new])
        for rid, prompt, params in zip(rids, inputs, request_params(self.rollout_cfg, new)):
            self.internal[rid] = self.engine.add_request(rid, prompt, params, lora_request=lora)

    def take_inbox(self, wait_s: float) -> None:
        """:meth:`add` what the inbox holds, waiting up to ``wait_s`` for the first item."""
        while self.is_open:
            try:
                item = self.inbox.get(timeout=wait_s) if wait_s else self.inbox.get_nowait()
            except queue.Empty:
                return
            wait_s = 0.0
            if item is None:
                self.is_open = False
            else:
                self.add(item)

    def wait(self, wait_s: float) -> float:
        """:meth:`take_inbox` with nothing to run (the time counts as idle); returns the time after."""
        t_wait = time.perf_counter()
        self.take_inbox(wait_s)
        now = time.perf_counter()
        self.idle_s += now - t_wait
        return now

    def step(self) -> float:
        """One engine step: each output's new tokens and log-probs added to its sample, finished
        samples moved to the next message (put, and their routing attached); then
        ``rollout.delay_per_token_s``. Returns the time after."""
        routed = []
        for out in self.engine.step():
            if out.request_id not in self.pending:
                continue
            o = out.outputs[0]
            sample = self.pending[out.request_id][1]
            sample["token_ids"] += o.token_ids
            sample["logprobs"] += [o.logprobs[i][t].logprob for i, t in enumerate(o.token_ids)]
            self.tokens += len(o.token_ids)
            if out.finished:
                sample["clipped"] = o.finish_reason == "length"
                self.done.append(self.pending.pop(out.request_id))
                if out.request_id in self.to_store:
                    self.stash.put_sample(self.to_store.pop(out.request_id), sample)
                    if out.request_id in self.compact:
                        self.stash.to_metadata([sample])
                routed.append((self.internal[out.request_id], sample, self.num_prompt[out.request_id], o))
        if self.reader is not None:
            self.reader.attach(routed)
        if self.delay:
            time.sleep(self.delay)
        if self.pending and not self.engine.has_unfinished_requests():
            raise RuntimeError(f"rollout engine {self.index}: vLLM has no unfinished request left but "
                               f"{len(self.pending)} of this call's requests never finished")
        return time.perf_counter()

    def due(self, now: float, flush_s: float, heartbeat_s: float) -> bool:
        """Whether a message is due: something finished and ``flush_s`` passed since the last one,
        or ``heartbeat_s`` passed."""
        return (self.done and now - self.last >= flush_s) or now - self.last >= heartbeat_s

    def message(self, now: float) -> dict:
        """The message of what finished since the last one."""
        msg = {"done": self.done, "partial": [], "busy_s": now - self.t0 - self.idle_s, "tokens": self.tokens}
        self.done, self.last = [], now
        return msg

    def last_message(self) -> dict:
        """The call's last message: with the unfinished requests as partials."""
        return {"done": self.done, "partial": list(self.pending.values()),
                "busy_s": time.perf_counter() - self.t0 - self.idle_s, "tokens": self.tokens}

    def abort(self) -> None:
        """Abort the unfinished requests in vLLM (paused); they keep the routing computed so far."""
        if self.pending:
            self.engine.abort_request([rid for rid in self.pending if rid in self.internal], internal=False)
            if self.reader is not None:   # what was computed before the abort
                self.reader.attach([(self.internal.get(rid), sample, self.num_prompt[rid], None)
                                    for rid, (_, sample) in self.pending.items()])

    def cancel(self) -> None:
        """Abort the unfinished requests in vLLM and drop their routing (nobody reads them)."""
        if self.pending:
            self.engine.abort_request([rid for rid in self.pending if rid in self.internal], internal=False)
            if self.reader is not None:
                self.reader.forget([self.internal.get(rid) for rid in self.pending])
