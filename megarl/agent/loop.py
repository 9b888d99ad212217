"""The multi-turn agent loop on the rollout fleet (``rollout.agent: tools``).

A trajectory (:class:`Trajectory`) is a prompt and a response that grows turn by turn: the model's
sampled tokens (exactly the ids vLLM sampled, with vLLM's log-probs) and, after a turn that calls
tools, the token ids of the tool results. ``loss_mask`` is true on sampled tokens only; the
inserted tokens carry no loss and no vLLM log-prob (NaN). :class:`AgentLoop` owns the
trajectories of one call, their stored arrays (:func:`stored_trajectory`) and their metrics.

Choices: the model's own tokens are never decoded and encoded again (:meth:`_Call.next_turn`),
so the trainer sees exactly what the engine sampled. Every trajectory's next turn is a request of
its own in the running stream of its engine (:class:`_Call`), so a trajectory waiting for a tool
blocks no other. ``rollout.max_response_tokens`` bounds the whole response, model and tool tokens
(:meth:`_Call.request`), and a turn's seed depends on its trajectory alone (:data:`TURN_SEED_STRIDE`).
"""
from __future__ import annotations

import math
import queue
import statistics
from dataclasses import dataclass, field
from typing import Callable, Optional

TURN_SEED_STRIDE = 1_000_003
"""Seed offset between consecutive turns of one trajectory: turn t of sample j of prompt i samples
with ``seed_i + j + t * TURN_SEED_STRIDE``, so a trajectory does not depend on the engine it runs on
or on the other trajectories."""


@dataclass
class Trajectory:
    prompt_index: int
    sample_index: int
    seed: int
    prompt_ids: list[int]
    greedy: bool
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    turns: int = 0
    calls: dict = field(default_factory=dict)       # tool name -> calls
    calls_ok: int = 0
    calls_bad: int = 0                              # malformed calls (parse errors, unknown tools)
    tool_errors: int = 0
    tool_timeouts: int = 0
    clipped: bool = False
    finished: bool = False
    final_text: str = ""
    waiting: int = 0                                # tool calls of the current turn still running
    results: list = field(default_factory=list)     # (name, content) of the current turn, in call order
    last_turn_ended: bool = True

    @property
    def tid(self) -> str:
        return f"{self.prompt_index}/{self.sample_index}"

    def sample(self) -> dict:
        """As :func:`megarl.rollout.sampling.samples_of`, plus the mask and what the reward gets."""
        return {"token_ids": list(self.ids), "logprobs": list(self.logprobs), "clipped": self.clipped,
                "loss_mask": list(self.mask), "reward_text": self.final_text,
                "reward_extra": {"tool_calls_ok": self.calls_ok, "tool_calls_bad": self.calls_bad},
                "agent": {"turns": self.turns, "calls": dict(self.calls), "tool_errors": self.tool_errors,
                          "tool_timeouts": self.tool_timeouts, "calls_bad": self.calls_bad}}


class AgentLoop:
    """``sample_fn`` of :class:`megarl.driver.rollouts.Rollouts` for ``rollout.agent: tools``.

    ``fleet``: a callable giving the current :class:`megarl.rollout.fleet.Fleet` (its engines
    may be replaced between steps); ``formatter``: a :class:`megarl.agent.parse.TurnFormatter`
    of the policy's tokenizer; ``runner``: a :class:`megarl.agent.tools.ToolRunner`.
    :attr:`metrics`: :func:`agent_metrics` of the last call."""

    def __init__(self, cfg, tokenizer, formatter, runner, fleet: Callable, store: bool = True):
        self.cfg, self.tokenizer, self.formatter, self.runner, self.fleet = cfg, tokenizer, formatter, runner, fleet
        self.store = store
        """Put each finished trajectory's ids and log-probs into Ray's object store for the ranks
        (:meth:`_Call.finish`; this process owns them, having joined the turns); False only for a
        loop without Ray (unit tests), whose samples carry the arrays alone."""
        self.format = formatter.call_format   # what the prompt taught: the template's tags or Hermes
        self.end_ids = set(formatter.end_of_turn_ids)
        self.metrics: dict = {}

    def __call__(self, prompt_ids: list[list[int]], seeds: list[int], greedy: bool = False,
                 on_done: Optional[Callable[[list], None]] = None) -> list:
        """Per prompt, its trajectories as samples (:meth:`Trajectory.sample`), in prompt order;
        ``on_done([(prompt index, samples)])`` as each prompt's trajectories all finish."""
        call = _Call(self, prompt_ids, seeds, greedy, on_done)
        fleet = self.fleet()
        fleet.generate_requests([call.request(t) for t in call.trajs.values()], on_done=call.on_turn,
                                feed=call.feed)
        missing = [t.tid for t in call.trajs.values() if not t.finished]
        if missing:
            raise RuntimeError(f"the agent loop ended with {len(missing)} unfinished trajectories, e.g. {missing[0]}")
        self.metrics = agent_metrics(list(call.trajs.values()))
        return call.out


class _Call:
    """One :meth:`AgentLoop.__call__`: its trajectories and the fleet's callbacks. ``on_turn``
    and ``feed`` run in the controller's thread (the fleet calls both from its loop); the tool
    pool's threads only put results into :attr:`tool_done`.

    Scheduling: every trajectory's next turn is a request of its own, sent into the running stream
    of the engine that generated its earlier turns (:meth:`megarl.rollout.fleet.Fleet.generate_requests`
    with a feed, :meth:`megarl.rollout.engine.EngineActor.submit`), so turns of different
    trajectories interleave on the engines, a trajectory waiting for a tool blocks no other, and
    the engine's prefix cache holds the trajectory so far. Tool calls run in a bounded pool
    (:class:`megarl.agent.tools.ToolRunner`) while the engines generate; their results come back
    through a queue that the feed drains, so the trajectories' state and the caller's ``on_done``
    are only touched from the controller's thread."""

    def __init__(self, loop: AgentLoop, prompt_ids, seeds, greedy, on_done):
        self.loop, self.cfg, self.on_done = loop, loop.cfg.rollout, on_done
        self.n = 1 if greedy else self.cfg.n
        self.trajs = {}
        for i, (prompt, seed) in enumerate(zip(prompt_ids, seeds)):
            for j in range(self.n):   # vLLM gives sample j of a request seed + j: the same here
                t = Trajectory(i, j, seed + j, list(prompt), greedy)
                self.trajs[t.tid] = t
        self.left = {i: self.n for i in range(len(prompt_ids))}   # prompt -> trajectories not finished
        self.out: list = [None] * len(prompt_ids)
        self.tool_done: "queue.Queue" = queue.Queue()             # (tid, call index, name, ToolResult)
        self.new_requests: list = []
        self.finished_prompts: list = []

    def request(self, t: Trajectory) -> dict:
        """The trajectory's next turn: everything so far is its prompt, what is left its budget
        (``rollout.max_response_tokens`` bounds the whole response, model and tool tokens;
        ``rollout.max_turns`` bounds the model turns, the last one's tool calls are not run)."""
        return {"id": (t.tid, t.turns), "prompt_ids": t.prompt_ids + t.ids, "group": t.prompt_index,
                "seed": t.seed + t.turns * TURN_SEED_STRIDE, "max_tokens": self.cfg.max_response_tokens - len(t.ids),
                "greedy": t.greedy, "stop_token_ids": sorted(self.loop.end_ids)}

    def finish(self, t: Trajectory) -> None:
        t.finished = True
        self.left[t.prompt_index] -= 1
        if self.left[t.prompt_index] == 0:
            i = t.prompt_index
            self.out[i] = [self.trajs[f"{i}/{j}"].sample() for j in range(self.n)]
            if self.loop.store:   # what the ranks read: handles, as an engine's samples (megarl/data/store.py)
                for j, s in enumerate(self.out[i]):
                    s.update(stored_trajectory(self.trajs[f"{i}/{j}"]))
            self.finished_prompts.append((i, self.out[i]))

    def deliver(self) -> None:
        done, self.finished_prompts = self.finished_prompts, []
        if done and self.on_done is not None:
            self.on_done(done)

    def on_turn(self, pairs: list) -> None:
        """The fleet's ``on_done``: model turns that finished."""
        for (tid, _turn), s in pairs:
            self.take_turn(self.trajs[tid], s)
        self.deliver()

    def feed(self) -> tuple[list, bool]:
        """The fleet's feed: tool results that came back -> the next turns."""
        while True:
            try:
                tid, k, name, result = self.tool_done.get_nowait()
            except queue.Empty:
                break
            t = self.trajs[tid]
            t.tool_errors += int(result.error and not result.timeout)
            t.tool_timeouts += int(result.timeout)
            t.results[k] = (name, result.content)
            t.waiting -= 1
            if t.waiting == 0:
                self.next_turn(t)
        self.deliver()
        batch, self.new_requests = self.new_requests, []
        return batch, any(not t.finished for t in self.trajs.values())

    def take_turn(self, t: Trajectory, s: dict) -> None:
        """A model turn came back: append it; finish the trajectory or start its tool calls."""
        from megarl.agent.parse import parse_tool_calls

        loop = self.loop
        t.turns += 1
        t.ids += s["token_ids"]
        t.logprobs += s["logprobs"]
        t.mask += [True] * len(s["token_ids"])
        t.last_turn_ended = bool(s["token_ids"]) and s["token_ids"][-1] in loop.end_ids
        text = loop.tokenizer.decode([x for x in s["token_ids"] if x not in loop.end_ids], skip_special_tokens=False)
        parsed = parse_tool_calls(text, loop.format)
        t.final_text = parsed.final_text
        known = set(loop.runner.registry.names())
        calls = [(c.name, c.arguments) for c in parsed.calls]
        t.calls_bad += len(parsed.errors) + sum(name not in known for name, _ in calls)
        t.calls_ok += sum(name in known for name, _ in calls)
        for name, _ in calls:
            t.calls[name] = t.calls.get(name, 0) + 1
        if s["clipped"]:
            t.clipped = True
        if s["clipped"] or not (calls or parsed.errors) or t.turns >= self.cfg.max_turns:
            self.finish(t)   # a final answer, the budget spent, or the last turn (its calls are not run)
            return
        # malformed calls get their parse error back as the tool message, in call order
        t.results = [("error", f"error: {err}") for err in parsed.errors] + [None] * len(calls)
        t.waiting = len(calls)
        for k, (name, args) in enumerate(calls, start=len(parsed.errors)):
            fut = loop.runner.submit(name, args)
            fut.add_done_callback(lambda f, tid=t.tid, k=k, name=name: self.tool_done.put((tid, k, name, f.result())))
        if not calls:
            self.next_turn(t)

    def next_turn(self, t: Trajectory) -> None:
        """Every tool result of the turn is in: append their tokens and queue the next turn. The
        results are rendered as the chat template does (:class:`megarl.agent.parse.TurnFormatter`),
        tokenized alone and appended, so the model's own tokens are never decoded and encoded
        again; a result that does not fit the budget ends the trajectory (clipped)."""
        limit = self.cfg.tool_output_chars
        results = [(name, _truncate(content, limit)) for name, content in t.results]
        t.results = []
        inserted = self.loop.formatter.tool_turn_ids(results, turn_ended=t.last_turn_ended)
        if len(t.ids) + len(inserted) >= self.cfg.max_response_tokens:
            t.clipped = True   # no room for the results and a next turn
            self.finish(t)
            return
        t.ids += inserted
        t.logprobs += [math.nan] * len(inserted)
        t.mask += [False] * len(inserted)
        self.new_requests.append(self.request(t))


def stored_trajectory(t: Trajectory) -> dict:
    """A finished trajectory's ``stored_ids`` (prompt + response: the model's tokens and the tool
    results', int32) and ``stored_logprobs`` (float64, NaN on the tool results) in Ray's object
    store, put by this process (the controller: the trajectory is joined here), as
    :meth:`megarl.rollout.stash.Stash.put_pairs` puts an engine's samples."""
    import numpy as np

    from megarl.data.store import Stored

    return {"stored_ids": Stored.put(np.asarray(t.prompt_ids + t.ids, dtype=np.int32)),
            "stored_logprobs": Stored.put(np.asarray(t.logprobs, dtype=np.float64))}


def _truncate(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n...[truncated {len(text) - limit} characters]"


def agent_metrics(trajs: list[Trajectory]) -> dict:
    """Turns, tool calls by tool, tool error / timeout rates, the share of masked (tool) tokens and
    the trajectory length distribution of one call."""
    if not trajs:
        return {}
    n = len(trajs)
    lengths = sorted(len(t.ids) for t in trajs)
    calls = sum(sum(t.calls.values()) for t in trajs)
    tokens = sum(len(t.mask) for t in trajs)
    m = {"agent/turns_mean": sum(t.turns for t in trajs) / n, "agent/turns_max": max(t.turns for t in trajs),
         "agent/tool_calls_per_traj": calls / n,
         "agent/tool_call_rate": sum(1 for t in trajs if t.calls) / n,
         "agent/malformed_calls_per_traj": sum(t.calls_bad for t in trajs) / n,
         "agent/tool_error_rate": sum(t.tool_errors for t in trajs) / calls if calls else 0.0,
         "agent/tool_timeout_rate": sum(t.tool_timeouts for t in trajs) / calls if calls else 0.0,
         "agent/masked_token_share": sum(not x for t in trajs for x in t.mask) / tokens if tokens else 0.0,
         "agent/length_mean": sum(lengths) / n, "agent/length_p50": statistics.median(lengths),
         "agent/length_p90": lengths[min(n - 1, int(0.9 * n))], "agent/length_max": lengths[-1]}
    for name in sorted({k for t in trajs for k in t.calls}):
        m[f"agent/calls_{name}_per_traj"] = sum(t.calls.get(name, 0) for t in trajs) / n
    return m
