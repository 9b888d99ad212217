"""Per-sample read-outs of the update's forward (megarl/data/readout.py): computed on the ranks
from the micro-batches the controller sends, they give the metrics and the sample log that the
per-token path gives (the alarm, the mismatch metrics of correct_rollout, entropy, k1 KL, version
runs), here written out per token with the formulas the controller used before, to 1e-12."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from megarl.algorithms.offpolicy import correct_rollout
from megarl.config.loader import load_config
from megarl.config.passes import correction_in_forward
from megarl.actors.algorithm import forward_tis_weights
from megarl.data.batch import Rollout, TokenVersions, micro_batches_for, scatter_sequences
from megarl.data.readout import (controller_readouts, forward_readout_inputs, micro_batch_readouts,
                                    readout_metrics)

VERSION = 3
LENGTHS = [5, 3, 7, 4, 6]


def _rollout(agent: bool, versions: str) -> tuple[Rollout, list, list, list]:
    """Five samples; the trainer's log-probs, entropies and reference log-probs of their tokens.
    ``agent``: tool-result tokens (no loss, NaN vLLM log-prob); ``versions``: 'same' (all of the
    trained version), 'mixed' (partial samples of older versions)."""
    g = torch.Generator().manual_seed(0)
    lp = [-torch.rand(n, generator=g, dtype=torch.float32) * 3 for n in LENGTHS]
    vllm = [(t.double() + 0.05 * torch.randn(len(t), generator=g, dtype=torch.float64)).tolist() for t in lp]
    masks = []
    if agent:
        for i, n in enumerate(LENGTHS):
            m = [True] * n
            m[1] = m[2] = False              # an inserted tool result
            for j in (1, 2):
                vllm[i][j] = math.nan
            masks.append(m)
    if versions == "same":
        token_versions = [TokenVersions([(VERSION, n)]) for n in LENGTHS]
    else:
        token_versions = [TokenVersions([(VERSION - 1, n // 2), (VERSION, n - n // 2)]) for n in LENGTHS]
        token_versions[3] = TokenVersions([(VERSION - 2, LENGTHS[3])])
    rollout = Rollout([[1, 2]] * 5, [list(range(10, 10 + n)) for n in LENGTHS], vllm, [0, 0, 1, 1, 1], [""] * 5,
                      [False] * 5, token_versions=token_versions, loss_masks=masks,
                      sample_ids=[f"s{i}" for i in range(5)])
    entropy = [torch.rand(n, generator=g) for n in LENGTHS]
    ref = [t - torch.rand(len(t), generator=g) * 0.1 for t in lp]
    return rollout, lp, entropy, ref


def _on_ranks(rollout, lp, entropy, ref, correction: str) -> list[dict]:
    """The path of a step without an old-log-prob pass: the controller's per-sample inputs,
    micro-batches for two DP ranks, each micro-batch read where the forward ran, scattered back."""
    algorithm = load_config(None, [f"algorithm.rollout_correction={correction}"]).algorithm
    tis = correction_in_forward(algorithm)
    per_sample = forward_readout_inputs(rollout, VERSION, tis)
    per_sample.update(ref_logprobs_T=ref, advantages_T=[torch.zeros(n) for n in LENGTHS])
    plan = SimpleNamespace(micro_batches={0: [[0, 2], [4]], 1: [[3, 1]]})
    outs = {}
    for dp_rank in (0, 1):
        outs[dp_rank] = []
        for indices, batch in zip(plan.micro_batches[dp_rank], micro_batches_for(rollout, plan, dp_rank, per_sample)):
            lp_R, entropy_R = torch.cat([lp[i] for i in indices]), torch.cat([entropy[i] for i in indices])
            weights = forward_tis_weights(algorithm, lp_R, batch) if tis else None
            outs[dp_rank].append(micro_batch_readouts(lp_R, entropy_R, batch, VERSION, weights))
    return scatter_sequences(rollout, plan, outs), algorithm


def _per_token_metrics(rollout, lp, entropy, ref, algorithm) -> dict:
    """The metrics as the controller computed them from the tokens (before the read-outs)."""
    diffs = []
    for i, (v, t) in enumerate(zip(rollout.sample_logprobs, lp)):
        d = (torch.tensor(v, dtype=torch.float64) - t.double()).abs()
        keep = ~d.isnan() & (torch.tensor(rollout.token_versions[i]) == VERSION)
        diffs.append(d[keep])
    diff = torch.cat(diffs)
    out = {"rollout/logprob_diff_mean": float(diff.mean()) if diff.numel() else math.nan,
           "rollout/logprob_diff_max": float(diff.max()) if diff.numel() else math.nan,
           "actor/entropy": float(torch.cat(entropy).double().mean()),
           "actor/kl": float(torch.cat([a - b for a, b in zip(lp, ref)]).double().mean())}
    out.update(correct_rollout(lp, rollout.sample_logprobs, algorithm)[1])
    return out


def _per_token_runs(rollout, lp) -> list[list]:
    """samples.jsonl's mean |vLLM - trainer| per version run over the sampled tokens, per token."""
    out = []
    for i, (versions, v, t) in enumerate(zip(rollout.token_versions, rollout.sample_logprobs, lp)):
        d = (torch.tensor(v, dtype=torch.float64) - t.double()).abs()
        sampled = rollout.loss_mask_T(i) & ~d.isnan()
        runs, at = [], 0
        for count in torch.unique_consecutive(torch.tensor(versions), return_counts=True)[1].tolist():
            part = d[at:at + count][sampled[at:at + count]]
            runs.append(float(part.mean()) if part.numel() else None)
            at += count
        out.append(runs)
    return out


def _flat(x) -> list:
    """Nested lists and dicts (sorted keys) -> their leaves, None as NaN (approx compares flat lists)."""
    if isinstance(x, dict):
        return [leaf for k in sorted(x) for leaf in _flat(x[k])]
    if isinstance(x, (list, tuple)):
        return [leaf for v in x for leaf in _flat(v)]
    return [math.nan if x is None else x]


@pytest.mark.parametrize("correction", ["none", "tis"])
@pytest.mark.parametrize("agent", [False, True])
@pytest.mark.parametrize("versions", ["same", "mixed"])
def test_readouts_on_the_ranks_give_the_per_token_metrics(correction, agent, versions):
    rollout, lp, entropy, ref = _rollout(agent, versions)
    readouts, algorithm = _on_ranks(rollout, lp, entropy, ref, correction)
    got, want = readout_metrics(readouts), _per_token_metrics(rollout, lp, entropy, ref, algorithm)
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-12, abs=1e-15, nan_ok=True), k
    if correction == "tis":
        assert 0 < got["rollout_corr/weight_mean"] <= algorithm.correction_cap
    assert _flat([r["runs"] for r in readouts]) == pytest.approx(_flat(_per_token_runs(rollout, lp)), rel=1e-12,
                                                                      nan_ok=True)
    # the controller's read-outs of the same tokens (an old-log-prob pass) agree, less the mismatch sums
    here = controller_readouts(rollout, lp, entropy, ref, VERSION)
    assert [sorted(r) for r in here] == [sorted(set(r) - {"mismatch"}) for r in readouts]
    assert _flat(here) == pytest.approx(_flat([{k: v for k, v in r.items() if k != "mismatch"} for r in readouts]),
                                        rel=1e-12, nan_ok=True)
    if agent:
        assert [r["sampled"] for r in readouts] == [n - 2 for n in LENGTHS]


def test_only_what_the_ranks_need_travels():
    """On-policy (every token of the trained version) sends no versions; tis adds its token mask."""
    rollout, *_ = _rollout(agent=False, versions="same")
    assert sorted(forward_readout_inputs(rollout, VERSION, False)) == ["rollout_logprobs_T"]
    assert sorted(forward_readout_inputs(rollout, VERSION, True)) == ["mask_T", "rollout_logprobs_T"]
    rollout, *_ = _rollout(agent=False, versions="mixed")
    inputs = forward_readout_inputs(rollout, VERSION, False)
    assert [v.tolist() for v in inputs["versions_T"]] == rollout.token_versions
    assert inputs["versions_T"][0].dtype == torch.int32


def test_a_step_with_no_token_of_the_trained_version_reads_nan():
    rollout, lp, entropy, ref = _rollout(agent=False, versions="mixed")
    rollout.token_versions = [TokenVersions([(VERSION - 1, n)]) for n in LENGTHS]
    got = readout_metrics(_on_ranks(rollout, lp, entropy, ref, "none")[0])
    assert math.isnan(got["rollout/logprob_diff_mean"]) and math.isnan(got["rollout/logprob_diff_max"])
