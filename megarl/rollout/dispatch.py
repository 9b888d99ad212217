"""Length-aware dispatch: deal prompt groups to rollout engines so their predicted work is even.

A prompt goes with its ``n`` samples to one engine, so vLLM's prefix cache computes its KV blocks
once. Cost in tokens, ``prompt_len + n * expected_response_len(key)``: prompts are known exactly
and responses, usually the larger term in RL, are a guess, so one unit without per-engine
hardware constants is enough; engine time is taken as linear in tokens, true at large batches (at
small batches an engine's time is its longest response, which no assignment of whole groups
changes). The expected response length is the mean of the prompt's latest observed group (the
policy drifts, so the newest observation predicts best), else the running mean over all
responses, else ``default_response_tokens``.

Assignment: LPT greedy (largest predicted cost first, each to the least loaded engine; ties by
prompt then engine index, so every caller agrees), within 4/3 of the optimal makespan in
O(P log P + P log E). The DP balancer (:mod:`megarl.data.balance`) is tighter, but its gains are
below the error of the length prediction. Pure Python: no torch, Ray or vLLM imports.
"""
from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence


class LengthDispatcher:
    """Routes prompt groups to ``num_engines`` engines by predicted work and learns response lengths
    from finished groups (:meth:`observe`). See the module docstring for the cost model."""

    def __init__(self, num_engines: int, default_response_tokens: float, n: int = 1):
        """``num_engines``: engines to deal to. ``default_response_tokens``: the response length
        assumed before anything was observed (e.g. half of rollout.max_response_tokens). ``n``:
        samples per prompt (rollout.n)."""
        if not isinstance(num_engines, int) or num_engines < 1:
            raise ValueError(f"LengthDispatcher: num_engines must be an integer >= 1, got {num_engines!r}")
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"LengthDispatcher: n (samples per prompt) must be an integer >= 1, got {n!r}")
        if not default_response_tokens >= 0:
            raise ValueError(f"LengthDispatcher: default_response_tokens must be >= 0, got {default_response_tokens!r}")
        self.num_engines = num_engines
        self.default_response_tokens = float(default_response_tokens)
        self.n = n
        self._key_mean: dict = {}          # key -> mean response length of its latest observed group
        self._observed_tokens = 0          # over every observed response: the dataset's running mean
        self._observed_responses = 0

    def expected_response_len(self, key) -> float:
        """Expected length of one response of prompt ``key``: its latest group's mean, else the
        dataset's running mean, else ``default_response_tokens``."""
        if key in self._key_mean:
            return self._key_mean[key]
        if self._observed_responses:
            return self._observed_tokens / self._observed_responses
        return self.default_response_tokens

    def predicted_cost(self, prompt_len: int, key) -> float:
        """Predicted work (tokens) of one prompt's group: the prompt once, ``n`` responses."""
        return prompt_len + self.n * self.expected_response_len(key)

    def assign(self, prompt_lens: list[int], keys: list) -> list[list[int]]:
        """Prompt indices per engine (``num_engines`` lists, each ascending), by LPT on
        :meth:`predicted_cost`; every index in ``range(len(prompt_lens))`` appears exactly once."""
        if len(keys) != len(prompt_lens):
            raise ValueError(f"LengthDispatcher.assign: keys has {len(keys)} entries but prompt_lens has "
                             f"{len(prompt_lens)}; expected one key per prompt")
        for i, length in enumerate(prompt_lens):
            if not isinstance(length, int) or length < 0:
                raise ValueError(f"LengthDispatcher.assign: prompt_lens[{i}] must be an integer >= 0, got {length!r}")
        for i, key in enumerate(keys):
            if not isinstance(key, Hashable):
                raise TypeError(f"LengthDispatcher.assign: keys[{i}] must be hashable (e.g. the prompt's dataset "
                                f"index), got {type(key).__name__}")
        costs = [self.predicted_cost(length, key) for length, key in zip(prompt_lens, keys)]
        return lpt(costs, self.num_engines)

    def observe(self, key, response_lens: list[int]) -> None:
        """Record the finished group of prompt ``key``: the lengths (tokens) of its responses."""
        if not response_lens:
            raise ValueError(f"LengthDispatcher.observe: response_lens of key {key!r} is empty; expected the "
                             "lengths of the prompt's finished samples")
        if any(not isinstance(x, int) or x < 0 for x in response_lens):
            raise ValueError(f"LengthDispatcher.observe: response_lens of key {key!r} must be integers >= 0, "
                             f"got {response_lens!r}")
        total = sum(response_lens)
        self._key_mean[key] = total / len(response_lens)
        self._observed_tokens += total
        self._observed_responses += len(response_lens)

    def state_dict(self) -> dict:
        """Plain values (ints, floats, the keys as given) that :meth:`load_state_dict` restores."""
        return {"num_engines": self.num_engines, "default_response_tokens": self.default_response_tokens,
                "n": self.n, "key_mean": dict(self._key_mean), "observed_tokens": self._observed_tokens,
                "observed_responses": self._observed_responses}

    def load_state_dict(self, d: dict) -> None:
        """Restore what :meth:`state_dict` returned. The learned lengths are kept even when
        ``num_engines`` changed (a resumed run with another rollout.dp): they do not depend on it."""
        missing = [k for k in ("key_mean", "observed_tokens", "observed_responses") if k not in d]
        if missing:
            raise ValueError(f"LengthDispatcher.load_state_dict: missing entries {missing}; expected the dict of "
                             "LengthDispatcher.state_dict()")
        if d.get("n", self.n) != self.n:
            raise ValueError(f"LengthDispatcher.load_state_dict: the state was saved with n={d['n']} samples per "
                             f"prompt but this router has n={self.n}")
        self._key_mean = dict(d["key_mean"])
        self._observed_tokens = d["observed_tokens"]
        self._observed_responses = d["observed_responses"]


def lpt(costs: Sequence[float], num_engines: int) -> list[list[int]]:
    """LPT greedy: items by cost descending (ties: lower index first), each to the least-loaded
    engine (ties: lower engine index). Returns ascending index lists, one per engine."""
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    heap = [(0.0, e) for e in range(num_engines)]   # (load, engine): the heap pops the lowest of both
    parts: list[list[int]] = [[] for _ in range(num_engines)]
    for i in order:
        load, e = heapq.heappop(heap)
        parts[e].append(i)
        heapq.heappush(heap, (load + costs[i], e))
    return [sorted(p) for p in parts]


def round_robin(num_prompts: int, num_engines: int) -> list[list[int]]:
    """Prompt ``i`` to engine ``i % num_engines`` (the baseline the router is measured against)."""
    if not isinstance(num_engines, int) or num_engines < 1:
        raise ValueError(f"round_robin: num_engines must be an integer >= 1, got {num_engines!r}")
    if not isinstance(num_prompts, int) or num_prompts < 0:
        raise ValueError(f"round_robin: num_prompts must be an integer >= 0, got {num_prompts!r}")
    return [list(range(e, num_prompts, num_engines)) for e in range(num_engines)]


def busy_ratio(loads: list[float]) -> float:
    """``max / mean`` of per-engine loads (busy seconds or tokens): 1.0 is perfect balance, and
    the step waits ``ratio - 1`` of the mean on the slowest engine. All loads 0 gives 1.0."""
    if not loads:
        raise ValueError("busy_ratio: loads is empty; expected one value per engine")
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0
