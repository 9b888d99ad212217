"""The old-log-prob and reference passes' per-token outputs stay on the training ranks. What a DP
leader computes of a micro-batch (megarl/data/readout.py: ``old_pass_outputs``,
``reference_pass_outputs``) equals the one-process oracle on the same tokens (``correct_rollout``, ``controller_readouts``), and the
update's micro-batches, which regroup the samples, get back exactly each sample's tensors
(megarl/data/store.py: ``Rows``, ``Column``, ``fetch_batches``). Ray's put/get are replaced by a
dict here (the real object store, 2 ranks and 2 engines: tests/e2e/test_dataplane_e2e.py)."""
import math
from types import SimpleNamespace

import pytest
import torch

from megarl.algorithms.offpolicy import correct_rollout
from megarl.data.store import Column, Rows, Stored, fetch_batches, fetch_rows, put_rows
from megarl.data.batch import Rollout, micro_batches_for
from megarl.driver.routing_replay import StepRouting
from megarl.data.readout import (controller_readouts, forward_readout_inputs, old_pass_outputs, readout_metrics,
                                    reference_pass_outputs)


def algorithm(mode="icepop", level="token"):
    return SimpleNamespace(rollout_correction=mode, correction_level=level, correction_cap=2.0, correction_low=0.8,
                           correction_high=1.25)


def rollout_of(sizes, seed=0):
    g = torch.Generator().manual_seed(seed)
    vllm = [(-torch.rand(n, generator=g, dtype=torch.float64) * 2).tolist() for n in sizes]
    vllm[1][0] = math.nan   # a token vLLM did not sample (the agent loop's tool result)
    loss_masks = [[True] * n for n in sizes]
    loss_masks[1][0] = False
    r = Rollout(prompt_ids=[[1, 2]] * len(sizes), response_ids=[list(range(3, 3 + n)) for n in sizes],
                sample_logprobs=vllm, group_ids=[0] * len(sizes), answers=[""] * len(sizes),
                clipped=[False] * len(sizes), loss_masks=loss_masks)
    train = [torch.tensor(v, dtype=torch.float64).nan_to_num(-1.0).float()
             + 0.3 * torch.randn(len(v), generator=g) for v in vllm]
    entropy = [torch.rand(n, generator=g) for n in sizes]
    return r, train, entropy


@pytest.mark.parametrize("mode,level", [("icepop", "token"), ("mask", "sequence"), ("tis", "sequence"),
                                        ("none", "token")])
def test_old_pass_on_the_ranks_equals_the_controller(store, mode, level, tmp_path):
    sizes = [5, 3, 7, 4]
    r, train, entropy = rollout_of(sizes)
    a = algorithm(mode, level)
    corrected, m_corr = correct_rollout(train, r.sample_logprobs, a)
    expected = controller_readouts(r, train, entropy, None, 0)
    # the pass's plan: samples 2, 0 on one micro-batch, 3, 1 on another (the extras it carries)
    plan = SimpleNamespace(micro_batches={0: [[2, 0], [3, 1]]})
    inputs = forward_readout_inputs(r, 0, False)
    misses = [torch.randint(0, 3, (n,), generator=torch.Generator().manual_seed(n), dtype=torch.int16) for n in sizes]
    kept = {}
    for indices, mb in zip(plan.micro_batches[0], micro_batches_for(r, plan, 0, inputs)):
        lp = torch.cat([train[i] for i in indices])
        out = old_pass_outputs(lp, torch.cat([entropy[i] for i in indices]), mb, 0, a,
                               torch.cat([misses[i] for i in indices]))
        for k, v in out.items():
            for i, x in zip(indices, v):
                kept.setdefault(k, [None] * len(sizes))[i] = x
    assert all(isinstance(x, Rows) for x in kept["old_logprobs_T"])
    # a routing comparison's metrics: the ranks' per-sample sums give the controller's numbers
    report = {"report": {"routing_agree": 0.5, "routing_agree_per_layer": [0.5]}}
    routing = StepRouting(SimpleNamespace(algorithm=SimpleNamespace(router_replay="off")), tmp_path, 1)
    on_controller = routing.metrics(r, train, {**report, "misses": misses}, 0)
    on_ranks = routing.metrics_from_sums(report, kept["routing"])
    assert on_controller["routing/disagree_tokens"] > 0 and on_ranks.keys() == on_controller.keys()
    # (sample 1's unsampled token, NaN in vLLM's log-probs, makes one of the means NaN in both)
    assert all(on_ranks[k] == v or math.isnan(on_ranks[k]) and math.isnan(v) for k, v in on_controller.items())
    for i in range(len(sizes)):   # the read-outs of the controller, plus the mismatch sums
        got = dict(kept["readouts"][i])
        got.pop("mismatch")
        assert got == expected[i]
    assert readout_metrics(expected) == {k: v for k, v in readout_metrics(kept["readouts"]).items()
                                         if not k.startswith("rollout_corr/")}
    from_sums = {k: v for k, v in readout_metrics(kept["readouts"]).items() if k.startswith("rollout_corr/")}
    assert from_sums.keys() == m_corr.keys() and all(math.isclose(from_sums[k], m_corr[k], rel_tol=1e-12,
                                                                  abs_tol=1e-15) for k in m_corr), (from_sums, m_corr)
    if mode in ("mask", "icepop"):   # the band drops some tokens (a whole sequence at sequence level)
        dropped = sum(int((~k).sum()) for k in corrected["mask_T"])
        assert 1 < dropped < sum(sizes) - 1, dropped
    assert set(corrected) == ({"is_weights_T", "mask_T"} if mode != "none" else set()) == \
        set(kept) - {"old_logprobs_T", "readouts", "routing"}
    for k, per_sample in corrected.items():   # the same weights and kept tokens, bit for bit
        assert all(torch.equal(x, y) for x, y in zip(fetch_rows(kept[k]), per_sample)), k
    assert all(torch.equal(x, y) for x, y in zip(fetch_rows(kept["old_logprobs_T"]), train))

    # the update's micro-batches regroup the samples; each rank assembles exactly the controller's tensors
    update_plan = SimpleNamespace(micro_batches={0: [[0, 1, 2], [3]]})
    per_sample = {"old_logprobs_T": kept["old_logprobs_T"], **{k: kept[k] for k in corrected}}
    new = micro_batches_for(r, update_plan, 0, per_sample)
    assert all(isinstance(v, Column) for mb in new for k, v in mb.extras.items() if k in per_sample)
    fetch_batches(new)
    old = micro_batches_for(r, update_plan, 0, {"old_logprobs_T": train, **corrected})
    for a_mb, b_mb in zip(new, old):
        assert a_mb.extras.keys() == b_mb.extras.keys()
        for k in b_mb.extras:
            assert torch.equal(a_mb.extras[k], b_mb.extras[k]), k
    assert not new[0].extras["mask_T"][5]   # sample 1's first token: no loss (and ANDed into the correction's)


def test_reference_pass_gives_the_k1_sums_and_bf16_survives_the_store(store):
    sizes = [4, 6]
    r, train, _ = rollout_of(sizes)
    ref = [t - 0.01 * (k + 1) for k, t in enumerate(train)]
    plan = SimpleNamespace(micro_batches={0: [[1, 0]]})
    old_rows = put_rows(torch.cat([train[0], train[1]]), sizes)   # the old pass's micro-batch: 0, 1
    (mb,) = micro_batches_for(r, plan, 0, {"old_logprobs_T": old_rows})
    fetch_batches([mb])
    out = reference_pass_outputs(torch.cat([ref[1], ref[0]]), mb, with_kl=True)
    expected = controller_readouts(r, train, None, ref, 0)
    assert out["kl"] == [expected[1]["kl"], expected[0]["kl"]]
    assert all(torch.equal(x, y) for x, y in zip(fetch_rows(out["ref_logprobs_T"]), [ref[1], ref[0]]))
    bf16 = torch.randn(9).to(torch.bfloat16)
    s = Stored.put(bf16)
    assert s.dtype == "bfloat16" and s.nbytes == 18
    (back,) = fetch_rows([Rows(s, 2, 7)])
    assert back.dtype == torch.bfloat16 and torch.equal(back, bf16[2:7])


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_advantages_on_a_rank_equal_the_controllers(store, estimator):
    """With the object store, a step whose advantages read per-token inputs (a critic's values for
    GAE, the old and reference log-probs of a KL reward) has rank 0 compute them from the passes'
    objects (``stored_advantages``): bit for bit what the controller computes from the same
    tensors, the same metrics, and the update's micro-batches read back exactly those advantages
    and returns. Only lengths, rewards, groups and masks travel (``AdvantageInputs``)."""
    from megarl.algorithms.registry import get_advantage_estimator
    from megarl.data.batch import advantage_metrics, compute_advantages, critic_metrics, stored_advantages

    sizes = [3, 5, 4, 2]
    r, old, _ = rollout_of(sizes, seed=3)
    r.rewards, r.group_ids = [1.0, 0.0, 0.5, 1.0], [0, 0, 1, 1]
    g = torch.Generator().manual_seed(4)
    ref = [t + 0.1 * torch.randn(len(t), generator=g) for t in old]
    values = [torch.randn(n, generator=g) for n in sizes] if estimator == "gae" else None
    adv_fn = get_advantage_estimator(estimator)
    opts = {"gamma": 1.0, "lam": 0.95} if estimator == "gae" else {}
    want_adv, want_ret = compute_advantages(r, adv_fn, opts, [-0.05 * (a - b) for a, b in zip(old, ref)], values)

    def kept(tensors):   # as two DP leaders put them: one object per micro-batch
        return put_rows(torch.cat(tensors[:2]), sizes[:2]) + put_rows(torch.cat(tensors[2:]), sizes[2:])

    inputs = r.advantage_inputs(adv_fn)   # neither estimator reads vLLM's log-probs
    assert inputs.sample_logprobs == [] and inputs.response_lengths == sizes
    got = stored_advantages(inputs, adv_fn, opts, 0.05, kept(old), kept(ref), kept(values) if values else None)
    for name, want in (("advantages_T", want_adv), ("returns_T", want_ret)):
        assert all(isinstance(x, Rows) for x in got[name])
        assert all(torch.equal(a, b) for a, b in zip(fetch_rows(got[name]), want)), name
    assert got["metrics"] == {**advantage_metrics(r, want_adv), **(critic_metrics(values, want_ret) if values else {})}
    assert got["metrics"]["actor/adv_abs_max"] > 0
    plan = SimpleNamespace(micro_batches=[[[3, 0], [2, 1]]])
    new = micro_batches_for(r, plan, 0, {"advantages_T": got["advantages_T"]})
    fetch_batches(new)
    for mb, want in zip(new, micro_batches_for(r, plan, 0, {"advantages_T": want_adv})):
        assert torch.equal(mb.extras["advantages_T"], want.extras["advantages_T"])
