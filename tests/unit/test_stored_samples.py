"""Issue 36: a rollout engine puts what the training ranks read of each finished sample (its token
ids and vLLM's log-probs) into Ray's object store; the controller holds handles and the ranks
fetch them. Here: the micro-batches carry the handles, a rank that fetches gets exactly the
tensors the controller would have sent inline (ids as int32, log-probs as float64), samples
without handles (an engine that died, another source) mix with stored ones, and a rollout keeps
its handles aligned through select and concat. Ray's put/get are a dict here (the real store, 2
ranks and 2 engines: tests/e2e/test_dataplane_e2e.py)."""
import pickle

import numpy as np
import pytest
import torch

from megarl.data import BatchBudget, plan_batches
from megarl.data.store import Column, Outbox, Stored, claim, fetch, fetch_batches
from megarl.data.wire import decode_batches, encode_batches
from megarl.parallel import Topology
from megarl.data.batch import Rollout, micro_batches_for
from megarl.data.readout import forward_readout_inputs


class Engine:
    """What claim() calls of an engine actor: take_stored.remote(keys) (ray.get passes it through)."""

    def __init__(self):
        self.outbox = Outbox()
        self.take_stored = self

    def remote(self, keys):
        return self.outbox.take(keys)


class Tokenizer:
    """What the engine and the controller call of a tokenizer: batch_decode (ids < 10 special)."""

    def batch_decode(self, ids, skip_special_tokens=False):
        return [" ".join(str(t) for t in x if t >= 10 or not skip_special_tokens) for x in ids]


def generations(engine: Engine, prompts, sizes, stash, metadata=False):
    """Per prompt, its samples as EngineActor.generate_stream gives them (stash: its Stash.put_pairs;
    ``metadata``: the ids and log-probs only in the store, the controller gets the metadata, as
    without rollout.speculative). A prompt's samples of equal size are equal (a group with
    repeated responses)."""
    from megarl.rollout.stash import to_metadata

    g = torch.Generator().manual_seed(len(sizes))
    out = []
    for prompt, ns in zip(prompts, sizes):
        samples = []
        for n in ns:
            twin = next((x for x in samples if len(x["token_ids"]) == n), None)
            s = {"token_ids": list(twin["token_ids"]) if twin else torch.randint(5, 90, (n,), generator=g).tolist(),
                 "logprobs": (-torch.rand(n, generator=g, dtype=torch.float64)).tolist(), "clipped": False}
            if stash:
                s["stored_ids"] = engine.outbox.put(np.asarray(prompt + s["token_ids"], np.int32))
                s["stored_logprobs"] = engine.outbox.put(np.asarray(s["logprobs"], np.float64))
            samples.append(s)
        if stash and metadata:
            to_metadata(samples, Tokenizer())
        out.append(samples)
    claim(engine, [s for samples in out for s in samples])
    return out


def sent_and_fetched(rollout, plan, rank, per_sample):
    """The rank's micro-batches as Ray delivers them (pickled) and as the rank reads them."""
    mbs = pickle.loads(pickle.dumps(encode_batches(micro_batches_for(rollout, plan, rank, per_sample))))
    decode_batches(mbs)
    fetch_batches(mbs)
    return mbs


def test_ranks_fetch_exactly_what_the_controller_would_send(store):
    prompts, sizes = [[1, 2, 3], [4, 5]], [[3, 5], [4, 2]]
    engine = Engine()
    stored = Rollout.from_generations(prompts, ["", ""], generations(engine, prompts, sizes, stash=True))
    inline = Rollout.from_generations(prompts, ["", ""], generations(Engine(), prompts, sizes, stash=False))
    assert len(engine.outbox) == 0 and all(isinstance(h, Stored) for h in stored.stored_ids + stored.stored_logprobs)
    assert inline.stored_ids == inline.stored_logprobs == []
    assert stored.response_ids == inline.response_ids and stored.sample_logprobs == inline.sample_logprobs
    plan = plan_batches(stored.lengths(), Topology(world_size=2), BatchBudget(max_tokens_per_micro_batch=12))
    for rank in range(2):
        handles = micro_batches_for(stored, plan, rank, forward_readout_inputs(stored, 0, True))
        for mb in handles:   # what leaves the controller: handles, no ids or log-probs
            assert all(isinstance(x, Stored) for x in mb.input_ids)
            assert isinstance(mb.extras["rollout_logprobs_T"], Column)
        got = sent_and_fetched(stored, plan, rank, forward_readout_inputs(stored, 0, True))
        want = micro_batches_for(inline, plan, rank, forward_readout_inputs(inline, 0, True))
        assert len(got) == len(want) > 0
        for a, b in zip(got, want):
            assert [x.dtype for x in a.input_ids] == [torch.int32] * len(b.input_ids)
            assert all(torch.equal(x, y) for x, y in zip(a.input_ids, b.input_ids))
            assert a.prompt_lengths == b.prompt_lengths and a.response_lengths == b.response_lengths
            assert a.extras.keys() == b.extras.keys()
            for k in b.extras:
                assert a.extras[k].dtype == b.extras[k].dtype and torch.equal(a.extras[k], b.extras[k]), k


def test_samples_without_handles_mix_with_stored_ones(store):
    """An engine restarted mid-call: the fleet drops the handles of what it had delivered
    (megarl/rollout/fleet.py), so a micro-batch may hold both kinds."""
    prompts, sizes = [[1, 2, 3], [4, 5]], [[3, 5], [4, 2]]
    gens = generations(Engine(), prompts, sizes, stash=True)
    for s in gens[0]:
        s.pop("stored_ids")
        s.pop("stored_logprobs")
    r = Rollout.from_generations(prompts, ["", ""], gens)
    assert [h is None for h in r.stored_ids] == [True, True, False, False]
    plan = plan_batches(r.lengths(), Topology(world_size=1), BatchBudget(max_tokens_per_micro_batch=100))
    (mb,) = sent_and_fetched(r, plan, 0, forward_readout_inputs(r, 0, False))
    order = plan.micro_batches[0][0]
    assert [x.tolist() for x in mb.input_ids] == [r.prompt_ids[i] + r.response_ids[i] for i in order]
    assert mb.extras["rollout_logprobs_T"].tolist() == [x for i in order for x in r.sample_logprobs[i]]


def test_handles_stay_aligned_through_select_and_concat(store):
    prompts, sizes = [[1, 2, 3], [4, 5]], [[3, 5], [4, 2]]
    stored = Rollout.from_generations(prompts, ["", ""], generations(Engine(), prompts, sizes, stash=True))
    inline = Rollout.from_generations(prompts, ["", ""], generations(Engine(), prompts, sizes, stash=False))
    both = stored.select([3, 0]).concat(inline.select([1]))
    assert len(both.stored_ids) == len(both.stored_logprobs) == 3
    assert both.stored_ids[:2] == [stored.stored_ids[3], stored.stored_ids[0]] and both.stored_ids[2] is None
    assert inline.concat(inline).stored_ids == []


def test_a_handle_of_the_wrong_size_is_refused(store):
    gens = generations(Engine(), [[1, 2]], [[3]], stash=True)
    gens[0][0]["token_ids"].append(7)   # the inline ids and the stored ones disagree
    with pytest.raises(ValueError, match=r"stored_ids of shape \(5,\), expected \(6,\)"):
        Rollout.from_generations([[1, 2]], [""], gens)


def test_an_outbox_puts_only_what_is_claimed_and_through_its_keeper(store, monkeypatch):
    """An engine's Outbox keeps its arrays until the controller claims them; the claim has the
    engine's keeper put them (one call for the claimed ones: the keeper owns them) and hands over
    handles that fetch exactly what was kept (a bf16 tensor as its bits). Ray's actor call is a
    stand-in here: ``keeper.put.remote(arrays)`` answers one reference to the list of references."""
    import ray

    calls = []

    class Keeper:
        def __init__(self):
            self.put = self

        def remote(self, arrays):
            calls.append(len(arrays))
            return ("answer", [ray.put(a) for a in arrays])

    get = ray.get
    monkeypatch.setattr(ray, "get", lambda x: x[1] if isinstance(x, tuple) else get(x))
    box = Outbox(Keeper())
    ids = box.put(np.arange(5, dtype=np.int32))
    lp = box.put(torch.tensor([0.5, -1.0], dtype=torch.bfloat16))
    box.put(np.zeros((2, 3), np.int16))
    assert (ids.shape, ids.dtype, ids.nbytes) == ((5,), "int32", 20)
    assert (lp.shape, lp.dtype, lp.nbytes) == ((2,), "bfloat16", 4)
    assert not store and not calls and len(box) == 3   # nothing is in the object store before a claim
    got = box.take([ids.key, 999, lp.key])
    assert calls == [2] and len(store) == 2 and got[1] is None and len(box) == 1
    assert all(isinstance(h, Stored) for h in (got[0], got[2]))
    a, b = fetch([got[0], got[2]])
    assert a.dtype == torch.int32 and a.tolist() == [0, 1, 2, 3, 4]
    assert b.dtype == torch.bfloat16 and b.tolist() == [0.5, -1.0]
    assert box.take([ids.key]) == [None] and calls == [2]   # claimed once; nothing to put, no call


def test_a_rank_fetches_ids_routing_and_columns_in_one_get(store, monkeypatch):
    """What a rank's micro-batches carry by reference (the engines' ids and log-probs, the
    routing, a pass's rows shared by two micro-batches) comes in one ``ray.get`` of the distinct
    objects, and equals what the controller would send inline."""
    import ray

    from megarl.data.store import put_all, put_rows

    prompts, sizes = [[1, 2, 3], [4, 5]], [[3, 5], [4, 2]]
    stored = Rollout.from_generations(prompts, ["", ""], generations(Engine(), prompts, sizes, stash=True))
    inline = Rollout.from_generations(prompts, ["", ""], generations(Engine(), prompts, sizes, stash=False))
    routing = [torch.arange(len(p) + len(r), dtype=torch.int16).view(-1, 1, 1).expand(-1, 2, 3).contiguous()
               for p, r in zip(stored.prompt_ids, stored.response_ids)]
    values = torch.randn(sum(len(r) for r in stored.response_ids))
    rows = put_rows(values, [len(r) for r in stored.response_ids])   # one object for the 4 samples
    plan = plan_batches(stored.lengths(), Topology(world_size=1), BatchBudget(max_tokens_per_micro_batch=12))
    assert len(plan.micro_batches[0]) > 1   # the samples' rows are spread over several micro-batches
    per_sample = dict(forward_readout_inputs(stored, 0, False), returns_T=rows)
    mbs = pickle.loads(pickle.dumps(encode_batches(micro_batches_for(stored, plan, 0, per_sample, put_all(routing)))))
    decode_batches(mbs)
    gets, get = [], ray.get
    monkeypatch.setattr(ray, "get", lambda refs: gets.append(len(refs)) or get(refs))
    fetch_batches(mbs)
    # 4 ids + 4 log-probs + 4 routings + the values' one object, fetched once
    assert gets == [13], gets
    inline_values = list(torch.split(values, [len(r) for r in stored.response_ids]))
    want = micro_batches_for(inline, plan, 0, dict(forward_readout_inputs(inline, 0, False), returns_T=inline_values),
                             routing)
    for a, b in zip(mbs, want):
        assert all(torch.equal(x, y) for x, y in zip(a.input_ids, b.input_ids))
        assert all(torch.equal(x, y) for x, y in zip(a.routing, b.routing))
        for k in b.extras:
            assert a.extras[k].dtype == b.extras[k].dtype and torch.equal(a.extras[k], b.extras[k]), k


def test_samples_only_in_the_store_reach_the_ranks_the_rewards_and_the_estimators_exactly(store):
    """An engine that keeps no copy of the ids and log-probs for the controller (the default
    without rollout.speculative) sends each sample's metadata: the lengths, the rewards' text, the
    metrics' digests and the micro-batches (their lengths from the handles) equal the inline
    run's; token-level tis's mask covers every token; the readers of ids (a reward model, the
    generations log) and of vLLM's log-probs (the optimal token baseline) get them fetched."""
    from megarl.algorithms.registry import get_advantage_estimator
    from megarl.data.batch import compute_advantages
    from megarl.driver.rollouts import Rollouts, _length_metrics

    prompts, sizes = [[1, 2, 3], [4, 5]], [[3, 5, 3], [4, 2, 2]]
    only = Rollout.from_generations(prompts, ["", ""], generations(Engine(), prompts, sizes, stash=True,
                                                                   metadata=True))
    inline = Rollout.from_generations(prompts, ["", ""], generations(Engine(), prompts, sizes, stash=False))
    assert only.sample_logprobs == [None] * 6 and only.vllm_logprobs() == inline.sample_logprobs
    assert only.response_ids == [None] * 6 and only.responses() == inline.response_ids
    assert only.responses([4, 1]) == [inline.response_ids[4], inline.response_ids[1]]
    assert only.response_lengths() == [3, 5, 3, 4, 2, 2] == inline.response_lengths()
    assert only.lengths() == inline.lengths() and inline.texts == inline.digests == []
    rollouts = Rollouts.__new__(Rollouts)   # what scoring reads of it: the tokenizer
    rollouts.tokenizer = Tokenizer()
    assert rollouts.decode(only) == only.texts == rollouts.decode(inline)
    metrics = _length_metrics(inline)
    assert metrics == _length_metrics(only) and metrics["rollout/distinct_frac"] == (2 / 3 + 2 / 3) / 2
    mixed = only.select([0, 1]).concat(inline.select([2]))   # a sample with ids, beside two without
    assert mixed.texts == only.texts[:2] + [None] and mixed.responses() == inline.response_ids[:3]
    assert _length_metrics(mixed)["rollout/distinct_frac"] == 2 / 3
    plan = plan_batches(only.lengths(), Topology(world_size=2), BatchBudget(max_tokens_per_micro_batch=12))
    for rank in range(2):
        got = sent_and_fetched(only, plan, rank, forward_readout_inputs(only, 0, True))
        want = micro_batches_for(inline, plan, rank, forward_readout_inputs(inline, 0, True))
        for a, b in zip(got, want):
            assert all(torch.equal(x, y) for x, y in zip(a.input_ids, b.input_ids))
            for k in b.extras:
                assert a.extras[k].dtype == b.extras[k].dtype and torch.equal(a.extras[k], b.extras[k]), k
    for r in (only, inline):
        r.rewards, r.group_ids = [1.0, 0.0, 0.5, 1.0, 0.25, 0.0], [0, 0, 0, 1, 1, 1]
    fn = get_advantage_estimator("optimal_token_baseline")
    (a_only, _), (a_inline, _) = (compute_advantages(r, fn, {"gamma": 1.0}) for r in (only, inline))
    assert all(torch.equal(x, y) for x, y in zip(a_only, a_inline))
    broken = generations(Engine(), [[1]], [[2]], stash=False)
    broken[0][0]["logprobs"] = None
    with pytest.raises(ValueError, match="neither logprobs nor stored_logprobs"):
        Rollout.from_generations([[1]], [""], broken)
    broken = generations(Engine(), [[1]], [[2]], stash=True, metadata=True)
    broken[0][0]["stored_ids"] = None
    with pytest.raises(ValueError, match="neither token_ids nor stored_ids"):
        Rollout.from_generations([[1]], [""], broken)
