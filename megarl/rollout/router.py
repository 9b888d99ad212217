"""Length-aware request router: deal prompt groups to rollout engines so their predicted work is even.

Unit of routing: one prompt with its ``n`` samples. All samples of a prompt go to the same engine,
so the prompt's full KV blocks are computed once there and shared by the ``n`` sequences (vLLM's
prefix cache); splitting a group would prefill it on several engines.

Cost model (in tokens)
----------------------
``predicted_cost(prompt) = prompt_len + n * expected_response_len(key)``

* Decode dominates: every response token is one sequential model step for its sequence, while
  the prompt is processed in one parallel prefill. A response token therefore costs more than a
  prompt token; counting both as one token overstates prompts slightly, but prompts are known
  exactly while response lengths are a guess, and in RL responses are usually the larger term
  (reasoning traces of thousands of tokens). One unit (tokens) keeps the model free of
  hardware-specific constants that would need calibrating per engine.
* The prompt counts once per group (the prefix cache shares it), the response ``n`` times.
* Engine time is modelled as linear in tokens. That holds while engines run large batches (a
  decode step's time then grows with the batch). At small batches a decode step costs about the
  same whatever the batch (it reads all weights), so an engine's time is set by the step count
  of its longest response, which no assignment of whole groups changes (measured on CPU:
  perf/results/router_cpu_2026-12-01.md).
* The prompt is shared only where the prefix cache holds it: vLLM caches whole KV blocks (128
  tokens on CPU, 16 on GPU by default), so a prompt shorter than a block is prefilled once per
  sample. Responses still dominate the work RL generates, so the model stays as it is.

Expected response length, first that applies:

1. the prompt was seen before (same ``key``, e.g. its dataset index, in an earlier step): the mean
   response length of its **latest** observed group. The ``n`` samples already average the
   sampling noise, and the policy drifts between steps (RL tends to lengthen responses), so the
   newest observation predicts the next better than an average over older policies would;
2. else the mean over every response observed so far (the dataset's running mean);
3. else ``default_response_tokens`` (nothing observed yet, e.g. step 1 of a run).

Assignment: LPT (longest processing time first) greedy: prompts by predicted cost, largest first,
each to the engine with the least predicted load so far. Ties: lower prompt index first, then
lower engine index, so every caller computes the same assignment. LPT is within 4/3 of the
optimal makespan, runs in O(P log P + P log E), and works per step without search; the DP
balancer (:mod:`megarl.data.balance`, Karmarkar-Karp plus refinement) is tighter but its gains
are below the error of the response-length prediction this router works with.

Pure Python: no torch, Ray or vLLM imports.
"""
from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence


class LengthRouter:
    """Routes prompt groups to ``num_engines`` engines by predicted work and learns response lengths
    from finished groups (:meth:`observe`). See the module docstring for the cost model."""

    def __init__(self, num_engines: int, default_response_tokens: float, n: int = 1):
        """``num_engines``: engines to deal to. ``default_response_tokens``: the response length
        assumed before anything was observed (e.g. half of rollout.max_response_tokens). ``n``:
        samples per prompt (rollout.n)."""
        if not isinstance(num_engines, int) or num_engines < 1:
            raise ValueError(f"LengthRouter: num_engines must be an integer >= 1, got {num_engines!r}")
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"LengthRouter: n (samples per prompt) must be an integer >= 1, got {n!r}")
        if not default_response_tokens >= 0:
            raise ValueError(f"LengthRouter: default_response_tokens must be >= 0, got {default_response_tokens!r}")
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
            raise ValueError(f"LengthRouter.assign: keys has {len(keys)} entries but prompt_lens has "
                             f"{len(prompt_lens)}; expected one key per prompt")
        for i, length in enumerate(prompt_lens):
            if not isinstance(length, int) or length < 0:
                raise ValueError(f"LengthRouter.assign: prompt_lens[{i}] must be an integer >= 0, got {length!r}")
        for i, key in enumerate(keys):
            if not isinstance(key, Hashable):
                raise TypeError(f"LengthRouter.assign: keys[{i}] must be hashable (e.g. the prompt's dataset "
                                f"index), got {type(key).__name__}")
        costs = [self.predicted_cost(length, key) for length, key in zip(prompt_lens, keys)]
        return lpt(costs, self.num_engines)

    def observe(self, key, response_lens: list[int]) -> None:
        """Record the finished group of prompt ``key``: the lengths (tokens) of its responses."""
        if not response_lens:
            raise ValueError(f"LengthRouter.observe: response_lens of key {key!r} is empty; expected the "
                             "lengths of the prompt's finished samples")
        if any(not isinstance(x, int) or x < 0 for x in response_lens):
            raise ValueError(f"LengthRouter.observe: response_lens of key {key!r} must be integers >= 0, "
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
            raise ValueError(f"LengthRouter.load_state_dict: missing entries {missing}; expected the dict of "
                             "LengthRouter.state_dict()")
        if d.get("n", self.n) != self.n:
            raise ValueError(f"LengthRouter.load_state_dict: the state was saved with n={d['n']} samples per "
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
