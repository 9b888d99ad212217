"""Speculative rollouts: the acceptance / residual rule on explicit tables, the draft store,
the prompt epochs and the config's refusals (megarl/rollout/speculative.py, drafts.py)."""
import functools
import itertools
import math

import numpy as np
import pytest

from megarl.rollout.speculative import (accepted_prefix, draft_uniforms, residual_token, spec_metrics,
                                        speculative_sample)

V = 3        # tokens 0, 1, 2
LENGTH = 3   # every response has 3 tokens (no end token: the tables are the whole story)


@functools.lru_cache(maxsize=None)
def _dist(seed: int, prefix: tuple) -> dict:
    """A fixed, prefix-dependent distribution over V tokens."""
    rng = np.random.default_rng(abs(hash((seed,) + prefix)) % 2**32)
    w = rng.dirichlet(np.ones(V) * 0.7)
    return {t: float(w[t]) for t in range(V)}


def _p(prefix):
    return _dist(1, tuple(prefix))


def _q(prefix):
    return _dist(2, tuple(prefix))


def _seq_prob(fn, seq) -> float:
    return math.prod(fn(seq[:t])[x] for t, x in enumerate(seq))


def _exact_output_law(lenience: float, exact: bool) -> dict:
    """The law of the speculative output, by enumeration: a draft ~ q, each token accepted with
    min(1, l p/q), the first rejected position replaced (exact: residual; lenient: from p), the rest
    sampled from p."""
    law: dict = {}
    for draft in itertools.product(range(V), repeat=LENGTH):
        w_draft = _seq_prob(_q, draft)
        reach = 1.0
        for m in range(LENGTH + 1):
            prefix = draft[:m]
            if m == LENGTH:
                law[prefix] = law.get(prefix, 0.0) + w_draft * reach
                break
            q, p = _q(prefix)[draft[m]], _p(prefix)[draft[m]]
            a = min(1.0, lenience * p / q)
            if exact:
                pp, qq = _p(prefix), _q(prefix)
                res = {x: max(0.0, pp[x] - qq[x]) for x in range(V)}
                z = sum(res.values())
                repl = {x: v / z for x, v in res.items()} if z > 0 else pp
            else:
                repl = _p(prefix)
            for x, w in repl.items():
                for tail in itertools.product(range(V), repeat=LENGTH - m - 1):
                    seq = prefix + (x,) + tail
                    rest = math.prod(_p(seq[:t])[seq[t]] for t in range(m + 1, LENGTH))
                    law[seq] = law.get(seq, 0.0) + w_draft * reach * (1 - a) * w * rest
            reach *= a
    return law


def test_exact_rule_reproduces_the_target_law_by_enumeration():
    target = {seq: _seq_prob(_p, seq) for seq in itertools.product(range(V), repeat=LENGTH)}
    exact = _exact_output_law(1.0, exact=True)
    assert sum(exact.values()) == pytest.approx(1.0, abs=1e-12)
    assert max(abs(exact.get(s, 0.0) - target[s]) for s in target) < 1e-12
    lenient = _exact_output_law(math.exp(0.5), exact=False)
    assert sum(lenient.values()) == pytest.approx(1.0, abs=1e-12)
    tv = 0.5 * sum(abs(lenient.get(s, 0.0) - target[s]) for s in target)
    draft_tv = 0.5 * sum(abs(_seq_prob(_q, s) - target[s]) for s in target)
    assert tv > 0.02 and tv < draft_tv   # biased toward q, but not q


def test_the_pure_functions_sample_the_exact_law():
    """Monte Carlo through accepted_prefix / residual_token (via speculative_sample) matches the
    enumerated target within sampling noise (chi-square at 40,000 draws)."""
    rng = np.random.default_rng(0)
    target = {seq: _seq_prob(_p, seq) for seq in itertools.product(range(V), repeat=LENGTH)}
    counts = dict.fromkeys(target, 0)
    n = 40_000

    def draw(fn, prefix, u):
        cdf = np.cumsum([fn(prefix)[t] for t in range(V)])
        return int(np.searchsorted(cdf, u * cdf[-1], side="right"))

    for i in range(n):
        draft = []
        for _ in range(LENGTH):
            draft.append(draw(_q, draft, rng.random()))
        u = draft_uniforms(1000 + i, LENGTH)
        q_tables = [_q(draft[:t]) for t in range(LENGTH)]
        m, kept, repl = speculative_sample(draft, q_tables, _p, u)
        seq = list(kept) + ([] if repl is None else [repl])
        while len(seq) < LENGTH:
            seq.append(draw(_p, seq, rng.random()))
        counts[tuple(seq)] += 1
    chi2 = sum((counts[s] - n * target[s]) ** 2 / (n * target[s]) for s in target)
    # df 26: the 1e-3 critical value is 54.1 (60: ~2e-4); a 2% TV shift adds a noncentrality >= 4 n 0.02^2 = 64
    assert chi2 < 60.0, chi2


def test_accepted_prefix_rule():
    q = [math.log(0.5)] * 3
    assert accepted_prefix(q, [math.log(0.5)] * 3, [0.99, 0.99, 0.99]) == 3            # p = q: all accepted
    assert accepted_prefix(q, [math.log(0.25)] * 3, [0.49, 0.51, 0.1]) == 1            # ratio 0.5
    assert accepted_prefix(q, [math.log(0.25)] * 3, [0.49, 0.51, 0.1], lenience=2.0) == 3   # l * ratio = 1
    assert accepted_prefix([], [], []) == 0


def test_residual_token_draws_max_p_minus_q():
    lp = lambda xs: [math.log(x) for x in xs]   # noqa: E731
    # p = [0.5, 0.3, 0.2] over tokens 0, 1, 2; q stored on S = {0, 1}: [0.7, 0.1]; token 2 unstored
    # residual: [0, 0.2] on S, p(2) = 0.2 outside: tokens 1 and 2 with weight 0.2 each
    picks = [residual_token([0, 1], lp([0.5, 0.3]), lp([0.7, 0.1]), 2, u)[0] for u in (0.1, 0.49, 0.51, 0.99)]
    assert picks == [1, 1, 2, 2]
    token, z, unstored = residual_token([0, 1], lp([0.5, 0.3]), lp([0.7, 0.1]), 2, 0.3)
    assert z == pytest.approx(0.4) and unstored == pytest.approx(0.2)
    # S holds every token (no outside draw): the residual on S only
    assert residual_token([0, 1, 2], lp([0.5, 0.3, 0.2]), lp([0.7, 0.1, 0.2]), None, 0.99)[0] == 1
    # p <= q everywhere (rejection had probability 0): falls back to p
    assert residual_token([0, 1], lp([0.5, 0.5]), lp([0.5, 0.5]), None, 0.75)[0] == 1


def test_residual_with_an_unstored_tail_is_exact_against_q_hat():
    """Monte Carlo of the outside branch: S = {0, 1} of 4 tokens; the outside draw comes from p
    restricted to {2, 3}; the result follows max(0, p - q_hat) / Z with q_hat = 0 outside S."""
    rng = np.random.default_rng(1)
    p, q = np.array([0.4, 0.1, 0.3, 0.2]), np.array([0.2, 0.3])
    target = np.clip(p - np.append(q, [0.0, 0.0]), 0, None)
    target /= target.sum()
    n, counts = 40_000, np.zeros(4)
    for _ in range(n):
        outside = 2 + int(rng.random() >= 0.6)          # p(2 | {2, 3}) = 0.3 / 0.5
        counts[residual_token([0, 1], np.log(p[:2]), np.log(q), outside, rng.random())[0]] += 1
    assert np.abs(counts / n - target).max() < 0.01, (counts / n, target)


def test_uniforms_are_a_function_of_the_seed():
    assert np.array_equal(draft_uniforms(7, 5), draft_uniforms(7, 5))
    assert not np.array_equal(draft_uniforms(7, 5), draft_uniforms(8, 5))
    assert len(draft_uniforms(7, 5)) == 6


def test_spec_metrics():
    recs = [{"offered": 10, "accepted": 10, "residual_tv_bound": 0.0},
            {"offered": 20, "accepted": 5, "residual_tv_bound": 0.01}, None, None]
    m = spec_metrics(recs, [10, 12, 8, 10])
    assert m["spec/drafted_frac"] == 0.5 and m["spec/acceptance"] == 15 / 30
    assert m["spec/full_accept_frac"] == 0.5 and m["spec/reused_frac"] == 15 / 40
    assert m["spec/offered_tokens"] == 15 and m["spec/accepted_tokens"] == 7.5
    # positions 0..15: sample 1 reaches 10 accepted; sample 2 reaches 6 (5 accepted + 1 rejected)
    assert m["spec/accept_rate_pos0_16"] == 15 / 16
    assert "spec/accept_rate_pos16_64" not in m    # nobody reached position 16
    assert m["spec/residual_tv_bound"] == pytest.approx(0.005)
    assert spec_metrics([None, None], [1, 1]) == {"spec/drafted_frac": 0.0}


def _sample(tokens, k=2):
    return {"token_ids": tokens, "logprobs": [-0.1] * len(tokens), "clipped": False,
            "top_ids": np.zeros((len(tokens), k), np.int32), "top_logprobs": np.zeros((len(tokens), k), np.float32)}


def test_draft_store_bounds_keys_and_checkpoints(tmp_path):
    from megarl.rollout.drafts import DraftStore

    store = DraftStore(max_bytes=10_000)
    store.put("0", [1, 2, 3], [_sample([5, 6, 7]), _sample([8])])
    assert store.bytes == 4 * 4 * (2 + 2 * 2)
    got = store.get("0", [1, 2, 3])
    assert [d["token_ids"].tolist() for d in got] == [[5, 6, 7], [8]]
    assert store.get("0", [1, 2, 4]) is None and store.get("1", [1]) is None and store.get(None, [1]) is None
    store.put("0", [1, 2, 3], [_sample([9])])                  # replaced, bytes follow
    assert store.bytes == 4 * 1 * 6
    store.save(tmp_path)
    from megarl.checkpoint_files import load_plain

    other = DraftStore(max_bytes=10_000)
    assert other.load(tmp_path, load_plain) and other.bytes == store.bytes
    assert other.get("0", [1, 2, 3])[0]["token_ids"].tolist() == [9]
    assert not DraftStore(1).load(tmp_path / "none", load_plain)
    small = DraftStore(max_bytes=300)                            # ~240 B a prompt: the oldest goes
    small.put("a", [1], [_sample([1] * 10)])
    small.put("b", [1], [_sample([1] * 10)])
    assert small.get("a", [1]) is None and small.get("b", [1]) is not None and small.evicted == 1


def test_prompt_epochs_pool_and_uids():
    from megarl.config.schema import DataConfig
    from megarl.driver.rollouts import PromptSource

    src = PromptSource(DataConfig(task="arithmetic", num_prompts=6, prompts_per_step=4, seed=3))
    steps = [src.batch(s, 4) for s in (1, 2, 3)]
    ids = [[r.uid for r in b] for b in steps]
    epoch0 = ids[0] + ids[1][:2]
    epoch1 = ids[1][2:] + ids[2]
    assert sorted(epoch0) == sorted(map(str, range(6))) and sorted(epoch1) == sorted(map(str, range(6)))
    assert epoch0 != epoch1                                       # each epoch in its own order
    assert [r.uid for r in PromptSource(DataConfig(task="arithmetic", num_prompts=6, prompts_per_step=4,
                                                   seed=3)).batch(2, 4)] == ids[1]   # resume repeats
    assert (src.epoch(1), src.epoch(2), src.epoch(3)) == (0, 0, 1)   # step 3 starts at position 8
    fresh = PromptSource(DataConfig(task="arithmetic", prompts_per_step=4))
    assert all(r.uid is None for r in fresh.batch(1, 4))
    # held-out prompts are not the pool's
    pool = {r.prompt for r in src.records}
    assert not pool & {r.prompt for r in src.eval_batch(4)} or len(pool) < 6


def test_config_epochs_and_refusals(tmp_path):
    from megarl.config import load_config
    from megarl.config.errors import ConfigError

    cfg = load_config(None, ["data.num_prompts=10", "data.prompts_per_step=4", "data.epochs=3"])
    assert cfg.trainer.steps == 8                                  # ceil(3 * 10 / 4)
    with pytest.raises(ConfigError, match="data.epochs"):
        load_config(None, ["data.epochs=2"])
    with pytest.raises(ConfigError, match="data.num_prompts"):
        load_config(None, ["rollout.speculative=exact"])
    ok = ["data.num_prompts=8", "rollout.speculative=exact"]
    assert load_config(None, ok).rollout.speculative == "exact"
    for bad, key in ((["rollout.temperature=0.7"], "rollout.temperature"), (["rollout.top_p=0.9"], "rollout.top_p"),
                     (["trainer.mode=async"], "rollout.speculative"),
                     (["rollout.agent=tools", "data.task=calculator"], "rollout.speculative"),
                     (["rollout.speculative_lenience=0.5"], "speculative_lenience")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, ok + bad)
    assert load_config(None, ok + ["trainer.mode=one_step_off"]).trainer.mode == "one_step_off"


def test_rollouts_keep_a_bounded_draft_store_only_when_speculative():
    from megarl.config import load_config
    from megarl.driver.rollouts import Rollouts

    cfg = load_config(None, ["data.num_prompts=8", "rollout.speculative=lenient", "rollout.draft_store_mb=2"])
    assert Rollouts(cfg, sample_fn=None, tokenizer=object()).drafts.max_bytes == 2 * 2**20
    assert Rollouts(load_config(None, []), sample_fn=None, tokenizer=object()).drafts is None
