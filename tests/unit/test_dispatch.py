"""megarl.rollout.dispatch: LPT dealing, response-length learning and its fallbacks, hand-computed cases."""

import random

import pytest
from helpers import flat_sorted

from megarl.rollout.dispatch import LengthDispatcher, busy_ratio, lpt, round_robin


def test_lpt_known_case_two_engines():
    # n=1, default 0: cost = prompt length. Order 7(i1) 5(i3) 4(i4) 3(i0) 3(i5) 2(i2):
    # e0 7, e1 5, e1 9, e0 10, e1 12, e0 12 -> loads 12 / 12
    router = LengthDispatcher(2, default_response_tokens=0)
    parts = router.assign([3, 7, 2, 5, 4, 3], keys=list(range(6)))
    assert parts == [[0, 1, 2], [3, 4, 5]]


def test_lpt_graham_worst_case_three_engines():
    # Graham's 4/3 example: 5 5 4 4 3 3 3 on 3 engines. LPT: e0 5, e1 5, e2 4, e2 8, e0 8, e1 8,
    # then a three-way tie at 8 goes to the lowest engine: e0 11 (the optimum is 9).
    parts = lpt([5, 5, 4, 4, 3, 3, 3], 3)
    assert parts == [[0, 4, 6], [1, 5], [2, 3]]
    assert busy_ratio([11, 8, 8]) == pytest.approx(11 / 9)


def test_same_key_learning_isolates_a_long_prompt():
    router = LengthDispatcher(2, default_response_tokens=16, n=4)
    keys = [f"p{i}" for i in range(8)]
    # step 1: nothing observed, all cost 10 + 4*16 = 74: dealt alternately (ties to the lower engine)
    assert router.assign([10] * 8, keys) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    for k in keys:
        router.observe(k, [200] * 4 if k == "p5" else [16] * 4)
    # step 2: p5 costs 10 + 4*200 = 810 > the other seven together (7 * 74 = 518): alone on e0
    assert router.predicted_cost(10, "p5") == 810
    assert router.assign([10] * 8, keys) == [[5], [0, 1, 2, 3, 4, 6, 7]]


def test_expected_length_fallback_order():
    router = LengthDispatcher(3, default_response_tokens=100, n=2)
    assert router.expected_response_len("a") == 100          # nothing observed: the default
    router.observe("a", [10, 30])
    assert router.expected_response_len("a") == 20           # own group mean
    assert router.expected_response_len("b") == 20           # unseen: dataset mean
    router.observe("c", [60])
    assert router.expected_response_len("b") == pytest.approx(100 / 3)   # (10 + 30 + 60) / 3
    assert router.expected_response_len("a") == 20           # own mean beats the dataset mean
    router.observe("a", [50, 50])
    assert router.expected_response_len("a") == 50           # the latest group, not an average of steps
    assert router.predicted_cost(5, "a") == 5 + 2 * 50


def test_deterministic_and_every_prompt_once():
    rng = random.Random(0)
    for num_engines in (1, 2, 3, 8):
        for num_prompts in (0, 1, 5, 33):
            lens = [rng.randint(1, 50) for _ in range(num_prompts)]
            keys = list(range(num_prompts))
            a, b = LengthDispatcher(num_engines, 8, n=4), LengthDispatcher(num_engines, 8, n=4)
            for k in keys[::3]:
                a.observe(k, [rng.randint(0, 99)])
            b.load_state_dict(a.state_dict())
            parts = a.assign(lens, keys)
            assert len(parts) == num_engines
            assert flat_sorted(parts) == list(range(num_prompts))
            assert all(p == sorted(p) for p in parts)
            assert b.assign(lens, keys) == parts == a.assign(lens, keys)


def test_one_engine_takes_everything():
    assert LengthDispatcher(1, 10).assign([4, 1, 9], ["x", "y", "z"]) == [[0, 1, 2]]
    assert round_robin(3, 1) == [[0, 1, 2]]


def test_router_beats_round_robin_on_bimodal_tokens():
    # 16 prompts, n=4, responses 16 tokens except 160 for every 8th: round-robin puts both long ones
    # on engine 0; the router, once it has observed them, splits them.
    resp = [160 if i % 8 == 0 else 16 for i in range(16)]
    router = LengthDispatcher(2, default_response_tokens=16, n=4)
    for i, r in enumerate(resp):
        router.observe(i, [r] * 4)
    work = [10 + 4 * r for r in resp]
    rr = round_robin(16, 2)
    routed = router.assign([10] * 16, list(range(16)))
    assert busy_ratio([sum(work[i] for i in p) for p in rr]) == pytest.approx(1744 / 1168)   # 2*650 + 6*74 vs 8*74
    assert busy_ratio([sum(work[i] for i in p) for p in routed]) == 1.0


def test_round_robin_and_busy_ratio():
    assert round_robin(5, 2) == [[0, 2, 4], [1, 3]]
    assert round_robin(1, 3) == [[0], [], []]
    assert busy_ratio([1.0, 3.0]) == 1.5
    assert busy_ratio([0.0, 0.0]) == 1.0


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="num_engines must be an integer >= 1, got 0"):
        LengthDispatcher(0, 10)
    with pytest.raises(ValueError, match="n .samples per prompt. must be an integer >= 1"):
        LengthDispatcher(2, 10, n=0)
    with pytest.raises(ValueError, match="default_response_tokens must be >= 0"):
        LengthDispatcher(2, -1)
    router = LengthDispatcher(2, 10)
    with pytest.raises(ValueError, match="keys has 1 entries but prompt_lens has 2"):
        router.assign([1, 2], [0])
    with pytest.raises(ValueError, match=r"prompt_lens\[1\] must be an integer >= 0"):
        router.assign([1, -2], [0, 1])
    with pytest.raises(TypeError, match=r"keys\[0\] must be hashable"):
        router.assign([1], [[0]])
    with pytest.raises(ValueError, match="response_lens of key 'k' is empty"):
        router.observe("k", [])
    with pytest.raises(ValueError, match="must be integers >= 0"):
        router.observe("k", [3, -1])
    with pytest.raises(ValueError, match=r"missing entries \['key_mean'"):
        router.load_state_dict({})
    with pytest.raises(ValueError, match="saved with n=4 samples per prompt but this router has n=1"):
        router.load_state_dict(LengthDispatcher(2, 10, n=4).state_dict())
    with pytest.raises(ValueError, match="round_robin: num_engines"):
        round_robin(3, 0)
    with pytest.raises(ValueError, match="busy_ratio: loads is empty"):
        busy_ratio([])
