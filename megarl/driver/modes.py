"""Where a step's samples come from in each ``trainer.mode``, and when new weights reach the engines.

Policy versions: version v is the policy after v optimizer steps of the run (the weights a
checkpoint of step v holds). Step k trains the policy of version k - 1 into version k; a sample's
*version gap* at step k is (k - 1) minus the oldest version that generated one of its tokens.

This module owns one sample source per mode (:func:`make_source`), the samples' ids and versions,
and ``<run_dir>/samples.jsonl`` (:class:`SampleLog`):

- ``on_policy`` (:class:`OnPolicy`): generate with version k - 1, train, sync: every gap is 0.
- ``one_step_off`` (:class:`OneStepOff`): step k+1's generation overlaps step k's training: gap 1.
- ``async`` (:class:`AsyncSource`): a producer thread keeps the fleet generating into a bounded
  buffer; each sync pauses the engines and the producer resumes the unfinished samples (partial
  rollouts), so a sample may hold tokens of several versions, within ``trainer.max_staleness``.

Choices: a checkpoint of step k holds version k, and a resume redoes the steps after it, so that
no sample is trained twice and no step is skipped.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

from megarl.data.batch import Rollout, TokenVersions, response_length

log = logging.getLogger("megarl")

POLL_S = 0.2
"""How often a waiting controller or producer looks at errors and stop requests."""


def version_gaps(rollout: Rollout, step: int) -> list[int]:
    """Per sample, (step - 1) minus the oldest version among its tokens (0 for an empty response)."""
    return [step - 1 - v.min() if v else 0 for v in rollout.token_versions]


def offpolicy_metrics(rollout: Rollout, step: int) -> dict:
    gaps = version_gaps(rollout, step)
    return {"offpolicy/version_gap_max": max(gaps), "offpolicy/version_gap_mean": sum(gaps) / len(gaps),
            "offpolicy/partial_samples": sum(len(v.distinct()) > 1 for v in rollout.token_versions)}


class SampleLog:
    """``<run_dir>/samples.jsonl``: per step, every trained sample's id, version gap and version
    runs, and the mean |vLLM - trainer| log-prob of its tokens per version run (the tokens of the
    trained version must match, older ones need not). On resume, lines of steps >= the resumed
    step are dropped (the file never holds a step twice).

    Sample ids (:attr:`Rollout.sample_ids`) name a sample by where its prompt came from:
    ``s<step>.g<group>.<j>`` (sample j of group g of step k's prompts) in the synchronous modes,
    ``c<chunk>.g<i>.<j>`` in async (prompt i of the chunk ``PromptSource.batch(chunk)``: async
    draws prompts chunk after chunk, independently of steps)."""

    def __init__(self, run_dir: Path, resume_step: int):
        from megarl.observability.jsonl import keep_steps_before, read_jsonl

        self.path = Path(run_dir) / "samples.jsonl"
        if self.path.exists():
            keep_steps_before(self.path, read_jsonl(self.path), resume_step)

    def write(self, step: int, rollout: Rollout, readouts: list[dict]) -> None:
        """``readouts``: the samples' read-outs of the policy's log-probs before the update
        (:func:`megarl.data.readout.sample_readout`). Agent trajectories (``rollout.loss_masks``)
        also get ``sampled`` (their model-sampled tokens), ``tool_tokens`` (the inserted ones, no
        vLLM log-prob, no loss) and ``logprob_diff_max`` over the sampled tokens; a run's mean diff
        is over its sampled tokens."""
        samples = []
        for i, (sid, versions, readout) in enumerate(zip(rollout.sample_ids, rollout.token_versions, readouts)):
            sample = {"id": sid, "gap": step - 1 - versions.min() if versions else 0, "runs": versions.runs,
                      "run_logprob_diff": readout["runs"]}
            if rollout.loss_masks:
                sample.update(sampled=readout["sampled"], tool_tokens=int((~rollout.loss_mask_T(i)).sum()),
                              logprob_diff_max=readout["sampled_max"])
            samples.append(sample)
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, "samples": samples}) + "\n")


def make_source(cfg, rollouts, group, rewards, timeline, start: int, state: dict | None):
    """The sample source of ``trainer.mode``; ``start``: the last completed step (the version the
    engines hold); ``state``: what a checkpoint's metadata kept of it (:meth:`state`).

    A checkpoint of step k holds version k; steps after k of the killed run are redone, so across
    the run's history (steps <= k of the first launch, the rest of the resumed one) no sample is
    trained twice and no step is skipped."""
    kind = {"on_policy": OnPolicy, "one_step_off": OneStepOff, "async": AsyncSource}[cfg.trainer.mode]
    return kind(cfg, rollouts, group, rewards, timeline, start, state or {})


class OnPolicy:
    """Generate with the current weights, train, then sync: step k generates with version k - 1
    and every version gap is 0."""

    def __init__(self, cfg, rollouts, group, rewards, timeline, start: int, state: dict):
        self.cfg, self.rollouts, self.group, self.rewards, self.timeline = cfg, rollouts, group, rewards, timeline
        self.version = start

    def _collect(self, step: int) -> tuple[Rollout, dict]:
        """``rollouts.collect`` with the engines' current version; ids and versions filled in."""
        version, t0 = self.version, time.monotonic()
        rollout, m = self.rollouts.collect(step, self.rewards)
        m.update(self.group.end_rollout())
        self._engine_spans(t0, m)
        seen: dict = {}
        for g in rollout.group_ids:
            seen[g] = seen.get(g, -1) + 1
            rollout.sample_ids.append(f"s{step}.g{g}.{seen[g]}")
        rollout.token_versions = [TokenVersions([(version, n)]) for n in rollout.response_lengths()]
        return rollout, m

    def _engine_spans(self, t0: float, m: dict) -> None:
        """Engine k was busy from the call's start for its ``rollout/engine<k>_busy_s``."""
        for key, busy in m.items():
            if key.startswith("rollout/engine") and key.endswith("_busy_s") and busy:
                self.timeline.record(key[len("rollout/"):-len("_busy_s")], "generate", t0, t0 + busy)

    def batch(self, step: int, check_stop: Callable[[], None]) -> tuple[Rollout, dict]:
        return self._collect(step)

    def after_update(self, step: int, sync: Callable[[], dict]) -> dict:
        """Run ``sync`` (the weight sync and what must follow it while the engines are idle);
        from here on the engines hold version ``step``."""
        m = sync()
        self.version = step
        return m

    def state(self) -> dict:
        return {}

    def close(self) -> None:
        pass


class OneStepOff(OnPolicy):
    """Step k+1's generation overlaps step k's training: when step k has its samples, step k+1's
    generation starts in a thread of the driver (with version k - 1, the weights the engines hold)
    while step k computes log-probs and trains; after the update the controller waits for that
    generation to end, then syncs version k. Every gap is 1 (0 at the run's first step and at the
    first step after a resume, generated synchronously: a resume from step k regenerates step k+1's
    samples with version k). The engines are busy during training instead of idle; on shared
    devices (colocated) both compete for them."""

    def __init__(self, *args):
        super().__init__(*args)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="megarl-one-step-off")
        self.pending = None   # (step, future) of the generation running ahead

    def batch(self, step: int, check_stop: Callable[[], None]) -> tuple[Rollout, dict]:
        if self.pending is not None and self.pending[0] == step:
            future = self.pending[1]
            while not future.done():
                check_stop()
                time.sleep(POLL_S)
            rollout, m = future.result()
        else:
            rollout, m = self._collect(step)
        self.pending = None
        if step < self.cfg.trainer.steps:
            self.pending = (step + 1, self.pool.submit(self._collect, step + 1))
        return rollout, m

    def after_update(self, step: int, sync: Callable[[], dict]) -> dict:
        if self.pending is not None:
            self.pending[1].exception()   # generation ends before the weights change; its error surfaces in batch()
        return super().after_update(step, sync)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class _Group:
    """A prompt group of the async producer: prompt ``index`` of ``chunk`` (its id
    ``c<chunk>.g<index>``), and its samples' progress."""

    def __init__(self, chunk: int, index: int, record, prompt_ids: list[int], n: int):
        self.chunk, self.index, self.gid = chunk, index, f"c{chunk}.g{index}"
        self.record, self.prompt_ids = record, prompt_ids
        self.samples = [{"token_ids": [], "logprobs": [], "versions": TokenVersions(), "done": False, "clipped": False}
                        for _ in range(n)]
        self.rewards: list[float] = []

    def oldest(self) -> int:
        return min((s["versions"].min() for s in self.samples if s["versions"]), default=1 << 30)


class AsyncSource(OnPolicy):
    """A producer thread generates continuously into a bounded buffer.

    The producer keeps the fleet generating, one request per sample
    (:meth:`megarl.rollout.fleet.Fleet.generate_requests`), with at most ``trainer.buffer_groups``
    prompt groups generated or in flight ahead of training. A group is scored when its
    ``rollout.n`` samples are done and waits in the buffer; step k takes the first
    ``data.prompts_per_step`` finished groups, dropping (and counting) the ones whose gap would
    exceed ``trainer.max_staleness``. After the update, the controller pauses the engines: each
    aborts its unfinished requests and returns their tokens and vLLM log-probs so far (partial
    rollouts); it syncs the new weights, and the producer resumes every unfinished sample with its
    generated prefix appended to the prompt and the remaining token budget. Each token records the
    version that generated it (:attr:`megarl.data.batch.Rollout.token_versions`).

    The engine that finishes a sample puts its ids (the whole sample: the request's prompt holds
    its earlier tokens) and, for a sample generated in one call, its log-probs for the ranks, as in
    the synchronous modes (owned by the engine's keeper: a restart of the engine loses none of
    them); a sample generated in one call then reaches the controller as metadata only (length,
    text, digest), a resumed one with its ids and log-probs (the controller built its request from
    its earlier tokens; ``"inline"``). A checkpoint keeps :meth:`state`."""

    def __init__(self, cfg, rollouts, group, rewards, timeline, start: int, state: dict):
        super().__init__(cfg, rollouts, group, rewards, timeline, start, state)
        t, per_step = cfg.trainer, cfg.data.prompts_per_step
        self.capacity = t.buffer_groups or per_step * (t.max_staleness + 1)
        if self.capacity < per_step:
            from megarl.config.errors import invalid_value

            raise invalid_value("trainer.buffer_groups", t.buffer_groups,
                                f"at least data.prompts_per_step={per_step} (a step's groups)")
        self.cursor = list(state.get("cursor", [1, 0]))   # next prompt: (chunk, index in chunk)
        self.requeue = deque(state.get("requeue", []))    # group ids to generate again first
        if self.requeue:
            log.info(f"async: generating again the {len(self.requeue)} group(s) that the checkpoint's run had "
                     "generated or in flight but not trained")
        self.groups: dict[str, _Group] = {}               # generating
        self.ready: deque[_Group] = deque()               # scored, waiting for a step
        self.lock = threading.Condition()
        self.engines_busy = threading.Lock()              # held by the producer during a fleet call
        self.pause = threading.Event()
        self.closed, self.error = False, None
        self.counts = {"dropped_stale": 0, "dropped_uninformative": 0, "score_errors": 0, "score_timeouts": 0}
        self._chunk = (0, None)
        self.thread = threading.Thread(target=self._produce, name="megarl-async-rollout", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ producer thread
    def _records(self, chunk: int):
        if self._chunk[0] != chunk:
            self._chunk = (chunk, self.rollouts.prompts.batch(chunk, self.cfg.data.prompts_per_step))
        return self._chunk[1]

    def _top_up(self) -> None:
        """New groups until the buffer and the groups in flight reach ``capacity``."""
        per_step = self.cfg.data.prompts_per_step
        while len(self.groups) + len(self.ready) < self.capacity:
            if self.requeue:
                chunk, i = (int(x) for x in self.requeue.popleft()[1:].split(".g"))   # c<chunk>.g<i>
            else:
                chunk, i = self.cursor
                self.cursor = [chunk + 1, 0] if i + 1 == per_step else [chunk, i + 1]
            record = self._records(chunk)[i]
            g = _Group(chunk, i, record, self.rollouts.encode([record])[0], self.cfg.rollout.n)
            self.groups[g.gid] = g

    def _requests(self) -> list[dict]:
        r, out = self.cfg.rollout, []
        for gid, g in self.groups.items():
            for j, s in enumerate(g.samples):
                if not s["done"]:
                    have = len(s["token_ids"])
                    seed = ((self.cfg.trainer.seed * 1_000_003 + g.chunk * 1009 + g.index) * 64 + j) * 4099 + have
                    # a resumed sample keeps its ids and log-probs here (the next request's prompt holds them)
                    out.append({"id": (gid, j), "group": gid, "prompt_ids": g.prompt_ids + s["token_ids"],
                                "max_tokens": r.max_response_tokens - have, "greedy": False, "seed": seed,
                                "store": True, "inline": have > 0})
        return out

    def _extend(self, rid, sample: dict, done: bool) -> None:
        s = self.groups[rid[0]].samples[rid[1]]
        if sample.get("stored_ids") is not None:
            # the engine put prompt + every token (the request's prompt held the earlier ones) and the
            # log-probs of this call's tokens: those are the whole sample's only if it had none before
            s["stored_ids"] = sample["stored_ids"]
            s["stored_logprobs"] = sample["stored_logprobs"] if not s["token_ids"] else None
        if sample["token_ids"] is None:   # generated in one call: the engine sent its metadata, not its arrays
            s.update({k: sample[k] for k in ("token_ids", "logprobs", "response_length", "text", "digest")})
        else:
            s["token_ids"] += sample["token_ids"]
            s["logprobs"] += sample["logprobs"]
        s["versions"].extend(self.version, response_length(sample))
        s["done"], s["clipped"] = done, sample["clipped"]
        if "routed_experts" in sample:
            # the request's prompt was the group's prompt + the sample's earlier tokens: its routing
            # covers the whole sample ([len(prompt) + len(all tokens), ...]) and replaces the earlier
            s["routed_experts"] = sample["routed_experts"]

    def _on_done(self, pairs: list) -> None:
        finished = []
        for rid, sample in pairs:
            self._extend(rid, sample, done=True)
            g = self.groups[rid[0]]
            if all(s["done"] for s in g.samples):
                finished.append(g)
        if finished:
            self._score(finished)

    def _score(self, finished: list[_Group]) -> None:
        from megarl.algorithms.dapo import informative_group_mask

        samples = [(g, s) for g in finished for s in g.samples]
        texts = self.rollouts.response_texts([s["token_ids"] for _, s in samples],
                                             [s.get("text") for _, s in samples])
        extras = [{"data_source": g.record.data_source, **g.record.extra} for g, _ in samples]
        result = self.rewards.score(self.cfg.data.reward, texts, [g.record.answer for g, _ in samples], extras=extras)
        self.counts["score_errors"] += result.n_errors
        self.counts["score_timeouts"] += result.n_timeouts
        rewards = list(result.rewards)
        with self.lock:
            for g in finished:
                g.rewards, rewards = rewards[:len(g.samples)], rewards[len(g.samples):]
                del self.groups[g.gid]
                if self.cfg.algorithm.dynamic_sampling and not bool(
                        informative_group_mask(torch.tensor(g.rewards), torch.zeros(len(g.rewards), dtype=torch.long))[0]):
                    self.counts["dropped_uninformative"] += 1
                    continue
                self.ready.append(g)
            self.lock.notify_all()

    def _produce(self) -> None:
        try:
            while not self.closed:
                if self.pause.is_set():
                    time.sleep(POLL_S / 4)
                    continue
                with self.lock:
                    self._top_up()
                    requests = self._requests()
                    if not requests:   # the buffer is full: wait for a step to take groups
                        self.lock.wait(POLL_S)
                        continue
                with self.engines_busy:
                    if self.pause.is_set() or self.closed:
                        continue
                    t0 = time.monotonic()
                    partial = self.group.fleet.generate_requests(requests, pause=self.pause, on_done=self._on_done)[1]
                    self._engine_spans(t0, self.group.fleet.metrics)
                    with self.lock:
                        for rid, sample in partial.items():
                            self._extend(rid, sample, done=False)
                    # held while the producer waits, these would keep trained groups' stored routing alive
                    del partial, requests
        except BaseException as err:   # noqa: BLE001 - handed to the controller's thread
            with self.lock:
                self.error = err
                self.lock.notify_all()

    # ------------------------------------------------------------------ controller thread
    def _raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def batch(self, step: int, check_stop: Callable[[], None]) -> tuple[Rollout, dict]:
        per_step, bound = self.cfg.data.prompts_per_step, self.cfg.trainer.max_staleness
        taken: list[_Group] = []
        dropped, t0 = 0, time.perf_counter()
        while len(taken) < per_step:
            with self.lock:
                self.lock.wait_for(lambda: self.ready or self.error is not None, timeout=POLL_S)
                self._raise_error()
                g = self.ready.popleft() if self.ready else None
                buffered = len(self.ready)
                self.lock.notify_all()
            if g is None:   # nothing finished yet: a stop request is honoured while waiting
                check_stop()
                continue
            if step - 1 - g.oldest() > bound:
                dropped += 1
                continue
            taken.append(g)
        self.counts["dropped_stale"] += dropped
        rollout = Rollout.from_generations([g.prompt_ids for g in taken], [g.record.answer for g in taken],
                                           [g.samples for g in taken],
                                           [{"data_source": g.record.data_source, **g.record.extra} for g in taken])
        rollout.rewards = [r for g in taken for r in g.rewards]
        rollout.sample_ids = [f"{g.gid}.{j}" for g in taken for j in range(len(g.samples))]
        rollout.token_versions = [s["versions"].copy() for g in taken for s in g.samples]
        from megarl.driver.rollouts import _sample_metrics

        m = self.rollouts.score(rollout, self.rewards)   # scored already: overlong shaping and metrics
        m.update(_sample_metrics(rollout), **{"reward/errors": self.counts["score_errors"],
                                              "reward/timeouts": self.counts["score_timeouts"]})
        m.update({"time/generate_s": time.perf_counter() - t0, "rollout/num_samples": len(rollout),
                  "async/dropped_stale": dropped, "async/dropped_stale_total": self.counts["dropped_stale"],
                  "async/dropped_uninformative_total": self.counts["dropped_uninformative"],
                  "async/buffered_groups": buffered, "async/generating_groups": len(self.groups)})
        m.update(self.group.fleet.metrics)
        return rollout, m

    def after_update(self, step: int, sync: Callable[[], dict]) -> dict:
        """Pause the engines (their requests come back as partials), sync, resume."""
        t0 = time.monotonic()
        self.pause.set()
        try:
            with self.engines_busy:
                self._raise_error()
                self.timeline.record("driver", "pause", t0, time.monotonic())
                m = sync()
                self.group.fleet.resume_all()
                with self.lock:
                    self.version = step
        finally:
            self.pause.clear()
        return m

    def state(self) -> dict:
        """The prompt cursor and the groups generated or in flight but not trained, for a
        checkpoint's metadata: the resumed producer generates those groups again first (from
        scratch, with the checkpoint's version), then goes on from the cursor."""
        with self.lock:
            return {"cursor": list(self.cursor),
                    "requeue": list(self.requeue) + [g.gid for g in self.ready] + list(self.groups)}

    def close(self) -> None:
        self.closed = True
        self.pause.set()
        self.thread.join(timeout=10)
