"""The async sample source's bookkeeping (megarl/driver/modes.py) around a scripted fleet.

The fleet here is a stand-in that emits one token per request every few milliseconds and honours
the pause event like the real one (tests/e2e/test_modes_e2e.py runs the real fleet, engines
and trainer): it checks the controller logic only - per-token versions across a pause, the
staleness bound, the checkpoint state and its replay, errors crossing the thread, the samples'
object-store handles. Keys:
trainer.mode=async, trainer.max_staleness (the bound), trainer.buffer_groups (groups generated
ahead of training).
"""
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import AlternatingRewards, PrefixTokenizer

from megarl.config.schema import MegaRLConfig
from megarl.data.store import Stored, fetch
from megarl.observability.timeline import Timeline
from megarl.rollout.stash import to_metadata
from megarl.data.batch import Rollout, TokenVersions
from megarl.data.batch import version_runs
from megarl.driver.modes import AsyncSource, version_gaps
from megarl.driver.rollouts import Rollouts


class ScriptedFleet:
    """``generate_requests`` as the real fleet's: a token per request per tick, partials on pause.
    ``store``: a finished sample of a ``"store"`` request carries handles on its ids (the request's
    prompt + this call's tokens) and log-probs (this call's), as the object-store plane's engines
    and fleet give them (Ray's store: the ``store`` fixture); unless the request is ``"inline"``
    (a resumed sample) its ids and log-probs then leave it for its metadata (the engine's
    :func:`megarl.rollout.stash.to_metadata`)."""

    def __init__(self, tick_s=0.01, fail=False, store=False):
        self.tick_s, self.fail, self.active, self.calls, self.resumed = tick_s, fail, False, [], 0
        self.requests = []
        self.engines, self.metrics, self.store = [object()], {}, store

    def finished(self, request, tokens):
        sample = {"token_ids": tokens, "logprobs": [-0.5 - t / 100 for t in tokens], "clipped": True}
        if self.store and request.get("store"):
            sample["stored_ids"] = Stored.put(np.asarray(request["prompt_ids"] + tokens, np.int32))
            sample["stored_logprobs"] = Stored.put(np.asarray(sample["logprobs"], np.float64))
            if not request.get("inline"):
                to_metadata([sample], PrefixTokenizer())
        return sample

    def generate_requests(self, requests, pause=None, on_done=None):
        if self.fail:
            raise RuntimeError("rollout engine 0 died during generate")
        self.active = True
        self.calls.append([r["id"] for r in requests])
        self.requests.append(requests)
        have = {r["id"]: [] for r in requests}
        budget = {r["id"]: r["max_tokens"] for r in requests}
        by_id = {r["id"]: r for r in requests}
        try:
            while have:
                if pause is not None and pause.is_set():
                    return {}, {rid: {"token_ids": t, "logprobs": [-0.5 - x / 100 for x in t], "clipped": False}
                                for rid, t in have.items()}
                time.sleep(self.tick_s)
                for rid in list(have):
                    have[rid].append(7 + len(by_id[rid]["prompt_ids"]) + len(have[rid]))   # position-dependent
                    if len(have[rid]) == budget[rid]:
                        on_done([(rid, self.finished(by_id[rid], have.pop(rid)))])
            return {}, {}
        finally:
            self.active = False
            self.metrics = {"rollout/engine0_busy_s": 0.01}

    def resume_all(self):
        self.resumed += 1


def source(fleet, start=0, state=None, **trainer):
    cfg = MegaRLConfig()
    cfg.trainer.mode = "async"
    cfg.data.prompts_per_step, cfg.data.use_chat_template = 2, False
    cfg.rollout.n, cfg.rollout.max_response_tokens = 2, 20
    for k, v in trainer.items():
        setattr(cfg.trainer, k, v)
    rollouts = Rollouts(cfg, sample_fn=None, tokenizer=PrefixTokenizer())
    return AsyncSource(cfg, rollouts, SimpleNamespace(fleet=fleet), AlternatingRewards(), Timeline(None), start,
                       state or {})


def no_stop():
    pass


def test_a_sync_pauses_requests_and_their_tokens_carry_both_versions():
    fleet = ScriptedFleet()
    src = source(fleet, max_staleness=1, buffer_groups=2)   # one step's groups: generation runs one step ahead
    try:
        first, m = src.batch(1, no_stop)
        assert first.sample_ids == ["c1.g0.0", "c1.g0.1", "c1.g1.0", "c1.g1.1"]
        assert all(v == [0] * 20 for v in first.token_versions) and m["async/dropped_stale"] == 0
        time.sleep(0.05)                       # the next chunk is being generated
        assert fleet.active

        def sync():
            assert not fleet.active            # the weights change only while no request runs
            return {"sync/seconds": 0.0}

        assert src.after_update(1, sync) == {"sync/seconds": 0.0}
        assert fleet.resumed == 1
        second, _ = src.batch(2, no_stop)
        assert second.sample_ids == ["c2.g0.0", "c2.g0.1", "c2.g1.0", "c2.g1.1"]
        for versions, tokens in zip(second.token_versions, second.response_ids):
            assert len(versions) == len(tokens) == 20
            runs = version_runs(versions)
            assert [v for v, _ in runs] == [0, 1], runs   # paused mid-way: both versions, in order
        assert version_gaps(second, 2) == [1, 1, 1, 1]
        # the resumed requests were the paused ones, with their prefix and the remaining budget
        resumed = fleet.calls[2]
        assert sorted(resumed) == [("c2.g0", 0), ("c2.g0", 1), ("c2.g1", 0), ("c2.g1", 1)]
    finally:
        src.close()


def test_samples_older_than_the_staleness_bound_are_dropped_and_counted():
    fleet = ScriptedFleet()
    src = source(fleet, max_staleness=0, buffer_groups=4)       # chunks 1 and 2 are generated together
    try:
        src.batch(1, no_stop)
        deadline = time.time() + 10
        while len(src.ready) < 2 and time.time() < deadline:   # chunk 2 finished with version 0
            time.sleep(0.01)
        src.after_update(1, dict)
        second, m = src.batch(2, no_stop)
        assert m["async/dropped_stale"] >= 2                     # chunk 2 (and chunk 3 if begun with version 0)
        assert version_gaps(second, 2) == [0, 0, 0, 0]
        assert not {i.split(".g")[0] for i in second.sample_ids} & {"c1", "c2"}
    finally:
        src.close()


def test_the_checkpoint_state_regenerates_untrained_groups_first():
    fleet = ScriptedFleet()
    src = source(fleet, max_staleness=1, buffer_groups=2)
    try:
        src.batch(1, no_stop)
        time.sleep(0.05)
        src.after_update(1, dict)
        state = src.state()
    finally:
        src.close()
    assert state["cursor"] == [3, 0]
    assert sorted(state["requeue"]) == ["c2.g0", "c2.g1"]   # in flight when the checkpoint was taken
    again = source(ScriptedFleet(tick_s=0.001), start=1, state=state, max_staleness=1, buffer_groups=2)
    try:
        rollout, _ = again.batch(2, no_stop)
        assert sorted({i.rsplit(".", 1)[0] for i in rollout.sample_ids}) == ["c2.g0", "c2.g1"]
        assert all(v == [1] * 20 for v in rollout.token_versions)   # generated anew with the restored weights
        third, _ = again.batch(3, no_stop)
        assert {i.split(".g")[0] for i in third.sample_ids} == {"c3"}
    finally:
        again.close()


def test_a_fleet_error_reaches_the_controller():
    src = source(ScriptedFleet(fail=True))
    try:
        with pytest.raises(RuntimeError, match="rollout engine 0 died"):
            src.batch(1, no_stop)
    finally:
        src.close()


def test_a_stop_request_while_waiting_for_samples_is_raised():
    src = source(ScriptedFleet(tick_s=1.0))
    calls = []

    def stop():
        calls.append(1)
        raise KeyboardInterrupt("stop")

    try:
        with pytest.raises(KeyboardInterrupt):
            src.batch(1, stop)
        assert calls
    finally:
        src.close()


def test_buffer_smaller_than_a_step_is_refused():
    with pytest.raises(Exception, match="trainer.buffer_groups"):
        source(ScriptedFleet(), buffer_groups=1)


def test_async_samples_carry_their_engines_handles(store):
    """Issue 36: the async producer's samples go to the ranks as the engines' objects. A sample
    generated in one call: its ids and log-probs, and the controller gets its metadata only
    (length, text, digest: the rewards and the versions read those); one resumed after a sync:
    its ids (the last engine put prompt + every token), its log-probs inline (they span calls),
    and the controller's copy of the ids (it built the resumed request from them)."""
    fleet = ScriptedFleet(store=True)
    src = source(fleet, max_staleness=1, buffer_groups=2)
    try:
        first, _ = src.batch(1, no_stop)
        assert len(first.stored_ids) == len(first.stored_logprobs) == len(first) == 4
        assert first.response_ids == first.sample_logprobs == [None] * 4
        for i in range(len(first)):
            ids, logprobs = fetch([first.stored_ids[i], first.stored_logprobs[i]])
            response = ids.tolist()[len(first.prompt_ids[i]):]
            assert ids.dtype == torch.int32 and response == first.responses([i])[0]
            assert response == [7 + len(first.prompt_ids[i]) + t for t in range(20)]   # ScriptedFleet's tokens
            assert logprobs.dtype == torch.float64 and logprobs.tolist() == [-0.5 - t / 100 for t in response]
            assert first.texts[i] == "x" * 20 and first.token_versions[i] == [0] * 20
        time.sleep(0.05)                       # the next chunk is being generated: the sync pauses it
        src.after_update(1, dict)
        second, _ = src.batch(2, no_stop)
        assert all(len(set(v)) == 2 for v in second.token_versions)   # every sample spans both calls
        assert second.stored_logprobs == [] and len(second.stored_ids) == 4 and second.texts == []
        # calls: chunk 1's groups, chunk 2's (paused by the sync), chunk 2's resumed: the controller keeps a copy
        assert [all(r.get("inline") for r in call) for call in fleet.requests[:3]] == [False, False, True]
        assert not any(r.get("inline") for r in fleet.requests[0] + fleet.requests[1])
        for i in range(len(second)):
            assert fetch([second.stored_ids[i]])[0].tolist() == second.prompt_ids[i] + second.response_ids[i]
    finally:
        src.close()


def test_rollout_select_keeps_ids_and_versions_aligned():
    r = Rollout([[1], [2]], [[3], [4, 5]], [[-1.0], [-1.0, -2.0]], [0, 1], ["a", "b"], [False, True],
                sample_ids=["s1.g0.0", "s1.g1.0"], token_versions=[TokenVersions.of([0]), TokenVersions.of([0, 1])])
    sub = r.select([1])
    assert sub.sample_ids == ["s1.g1.0"] and sub.token_versions == [[0, 1]]
    assert version_runs([0, 0, 1, 1, 1, 2]) == [[0, 2], [1, 3], [2, 1]]
    assert threading.active_count() >= 1


def test_token_versions_are_runs_that_read_as_per_token_versions():
    import pickle
    import tracemalloc

    v = TokenVersions()
    v.extend(3, 2)
    v.extend(3, 1)     # same version: the run grows
    v.extend(4, 0)     # nothing
    v.extend(4, 2)
    assert v.runs == [[3, 3], [4, 2]] and len(v) == 5 and list(v) == [3, 3, 3, 4, 4] == v
    assert v == TokenVersions.of([3, 3, 3, 4, 4]) and v != [3, 3, 4] and v[0] == 3 and v[3] == 4 and v[-1] == 4
    assert v.min() == 3 and v.distinct() == {3, 4} and bool(v) and not TokenVersions()
    assert v.tensor(torch.int32).tolist() == [3, 3, 3, 4, 4] and v.tensor().dtype == torch.long
    assert TokenVersions().tensor().numel() == 0 and torch.tensor(v).tolist() == list(v)
    c = v.copy()
    c.extend(5, 1)
    assert len(v) == 5 and len(c) == 6 and pickle.loads(pickle.dumps(v)) == v
    with pytest.raises(IndexError):
        v[5]
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    long = TokenVersions([(7, 100_000)])   # an on-policy sample: one run, whatever its length
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert len(long) == 100_000 and held < 1024, held
