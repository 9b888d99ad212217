"""Reward extraction and equivalence, the reward registry, and the timed worker pool.

The module-level functions below are reward functions run inside spawned pool workers (they are
sent by reference, so they must live at module level in an importable module).
"""

import math
import os
import signal
import threading
import time

import psutil
import pytest

from megarl.rewards import RewardPool, get_reward_fn
from megarl.rewards.math import (
    answers_equivalent,
    boxed_math_reward,
    extract_boxed,
    extract_gsm8k_answer,
    format_reward,
    gsm8k_reward,
    parse_number,
)
from megarl.rewards.pool import RewardWorkerCrash
from megarl.rewards.registry import REWARD_FUNCTIONS

# -- reward functions for the pool -------------------------------------------------------------


def flaky_reward(response, answer, **extra):
    """Sleeps past the timeout, raises, or returns NaN on request; otherwise the GSM8K reward."""
    if response == "sleep":
        time.sleep(60)
    if response == "raise":
        raise RuntimeError("reward exploded")
    if response == "nan":
        return math.nan
    if response == "text":
        return "one"
    return gsm8k_reward(response, answer)


def math_verify_in_worker(response, answer, **extra):
    """math-verify with its signal.alarm timeouts on: 1.0 when it parses and verifies in this process."""
    from math_verify import parse, verify

    gold = parse("\\boxed{" + answer + "}", parsing_timeout=2)
    pred = parse("\\boxed{" + response + "}", parsing_timeout=2)
    return 1.0 if verify(gold, pred, timeout_seconds=2) else 0.0


def exit_worker(response, answer, **extra):
    import os

    os._exit(3)


def echo_extra(response, answer, **extra):
    return float(extra["weight"])


def weight_only(response, answer, weight):
    """Names its one keyword and takes no ``**extra``: the pool must leave the other columns out."""
    return float(weight)


@pytest.fixture(scope="module")
def pool():
    with RewardPool(num_workers=2, timeout_s=3.0) as reward_pool:
        yield reward_pool


# -- extraction ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("3 + 4 = 7\n#### 7", "7"),
        ("#### 1,234.", "1234"),
        ("#### $72", "72"),
        ("#### -5", "-5"),
        ("#### 2.50", "2.50"),
        ("first #### 3 then #### 4", "4"),
        ("the answer is 7", None),
        ("#### seven", None),
    ],
)
def test_extract_gsm8k_answer(text, expected):
    assert extract_gsm8k_answer(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
        ("\\boxed{a{b{c}}d}", "a{b{c}}d"),
        ("\\boxed{1} and finally \\boxed{2}", "2"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces are not grouping
        ("\\boxed{2} then a broken \\boxed{3", "2"),  # last one unbalanced: take the last good one
        ("\\boxed{3", None),
        ("\\boxed{}", None),
        ("$\\boxed 5$", "5"),
        ("\\fbox{9}", "9"),
        ("no box here", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


def test_parse_number():
    assert parse_number("1/2") == parse_number("0.5") == parse_number("\\frac{1}{2}") == parse_number("$0.50$")
    assert parse_number("-\\frac{3}{4}") == parse_number("-0.75")
    assert parse_number("1,000") == 1000
    assert parse_number("x + 1") is None
    assert parse_number("1/0") is None


# -- equivalence and rewards --------------------------------------------------------------------


@pytest.mark.parametrize(
    "pred, gold",
    [
        ("1/2", "0.5"),
        ("0.5", "\\frac{1}{2}"),
        ("\\frac{1}{2}", "1/2"),
        ("\\dfrac{1}{2}", "0.5"),
        ("\\frac12", "1/2"),  # only math-verify parses the brace-less \frac
        ("3.0", "3"),
        ("1,000", "1000"),
        ("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}"),  # symbolic: math-verify
        ("\\text{ 5 }", "5"),
    ],
)
def test_equivalent_forms(pred, gold):
    assert answers_equivalent(pred, gold)


@pytest.mark.parametrize("pred, gold", [("0.5", "0.6"), ("", "1"), ("2", "\\frac{1}{3}"), ("x+1", "x+2"), ("\\pi", "3")])
def test_non_equivalent_forms(pred, gold):
    assert not answers_equivalent(pred, gold)


def test_boxed_math_reward():
    assert boxed_math_reward("so the answer is $\\boxed{\\frac{1}{2}}$", "0.5") == 1.0
    assert boxed_math_reward("\\boxed{1/3}", "0.5") == 0.0
    assert boxed_math_reward("\\boxed{1/3}", "0.5", format_score=0.1) == 0.1
    assert boxed_math_reward("the answer is 0.5", "0.5") == 0.0  # no box: malformed
    assert boxed_math_reward("\\boxed{0.5", "0.5") == 0.0  # unbalanced: malformed
    assert boxed_math_reward("\\boxed{2}", "The answer is \\boxed{2}.") == 1.0  # boxed gold


def test_gsm8k_reward():
    gold = "Natalia sold 48/2 = 24 clips in May.\n48 + 24 = 72\n#### 72"
    assert gsm8k_reward("48 + 24 = 72\n#### 72", gold) == 1.0
    assert gsm8k_reward("#### 72.0", "72") == 1.0
    assert gsm8k_reward("#### 71", "72") == 0.0
    assert gsm8k_reward("#### 71", "72", format_score=0.1) == 0.1
    assert gsm8k_reward("the answer is 72", "72") == 0.0  # strict: needs ####
    assert gsm8k_reward("the answer is 72", "72", strict=False) == 1.0
    assert gsm8k_reward("#### 72", "72", data_source="gsm8k", level=3) == 1.0  # unknown extras are ignored


def test_format_reward():
    assert format_reward("3 + 4 = 7\n#### 7\n") == 1.0
    assert format_reward("#### 7 apples") == 0.0
    assert format_reward("#### 7\nand then more text") == 0.0
    assert format_reward("", "") == 0.0
    assert format_reward("\\boxed{7}", style="boxed") == 1.0
    assert format_reward("\\boxed{7", style="boxed") == 0.0
    assert format_reward("<think>4 + 3</think> 7", style="think") == 1.0
    assert format_reward("<think>4 + 3</think>", style="think") == 0.0
    with pytest.raises(ValueError) as err:
        format_reward("x", style="xml")
    assert str(err.value) == "unknown format style 'xml'; known: ['boxed', 'gsm8k', 'think']"


def test_registry():
    assert get_reward_fn("gsm8k") is gsm8k_reward
    assert get_reward_fn("math") is boxed_math_reward
    assert get_reward_fn("megarl.rewards.math:format_reward") is format_reward
    assert get_reward_fn("megarl.rewards.math.format_reward") is format_reward
    assert set(REWARD_FUNCTIONS) == {"arithmetic", "format", "gsm8k", "gsm8k_lenient", "math", "calculator",
                                     "calculator_bonus"}
    with pytest.raises(ValueError) as err:
        get_reward_fn("countdown")
    assert str(err.value) == (
        "unknown reward function 'countdown'; known: ['arithmetic', 'calculator', 'calculator_bonus', 'format', 'gsm8k', "
        "'gsm8k_lenient', 'math'] "
        "(or a dotted path 'package.module:function')"
    )
    with pytest.raises(TypeError, match="resolved to str, which is not callable"):
        get_reward_fn("megarl.rewards.math:__doc__")


def test_math_verify_signals_fail_outside_the_main_thread():
    # Why the pool runs each call in a worker's main thread: math-verify's alarm needs it.
    errors = []

    def run():
        try:
            math_verify_in_worker("0.5", "1/2")
        except ValueError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert errors and "threaded environment" in errors[0]


# -- the pool -----------------------------------------------------------------------------------


def test_pool_scores_equivalent_forms_with_math_verify_in_workers(pool):
    responses = ["\\boxed{1/2}", "\\boxed{0.5}", "$\\boxed{\\frac12}$", "\\boxed{\\sqrt{2}/2}", "no box", "\\boxed{0.6}"]
    answers = ["0.5", "\\frac{1}{2}", "1/2", "\\frac{\\sqrt{2}}{2}", "0.5", "0.5"]
    result = pool.score("math", responses, answers)
    assert result.rewards == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    assert result.stats == {"n_errors": 0, "n_timeouts": 0}
    direct = pool.score(math_verify_in_worker, ["0.5", "\\frac{1}{2}", "0.7"], ["1/2", "0.5", "1/2"])
    assert direct.rewards == [1.0, 1.0, 0.0] and direct.n_errors == 0


def test_pool_survives_timeouts_and_errors(pool):
    responses = ["#### 3", "sleep", "raise", "#### 4", "nan", "#### 5", "text", "#### 6"]
    answers = ["3", "3", "3", "4", "0", "0", "0", "6"]
    start = time.monotonic()
    result = pool.score(flaky_reward, responses, answers)
    elapsed = time.monotonic() - start
    # sleep -> timeout; raise, nan and a str result -> errors; "#### 5" vs "0" is simply wrong.
    assert result.rewards == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    assert result.stats == {"n_errors": 3, "n_timeouts": 1}
    assert any("RuntimeError: reward exploded" in e for e in result.errors)
    assert any("sample 1: timed out" in e for e in result.errors)
    assert elapsed < 30, elapsed  # the 60 s sleeper was killed, not waited for
    # The replaced pool keeps working.
    again = pool.score("gsm8k", ["#### 8"], ["8"])
    assert again.rewards == [1.0] and again.stats == {"n_errors": 0, "n_timeouts": 0}


def test_pool_dotted_path_extras_and_dead_worker(pool):
    result = pool.score(f"{__name__}:echo_extra", ["a", "b"], ["", ""], extras=[{"weight": 0.25}, {"weight": 2}])
    assert result.rewards == [0.25, 2.0], result.errors
    dead = pool.score(exit_worker, ["x"], ["y"])   # two pool breaks: under max_consecutive_crashes
    assert dead.rewards == [0.0] and dead.n_errors == 1 and dead.n_timeouts == 0
    assert dead.errors == ["sample 0: worker process died twice (exit code 3)"]
    assert pool.score("gsm8k", ["#### 1"], ["1"]).rewards == [1.0]


def test_pool_passes_the_keywords_a_function_accepts(pool):
    # weight_only names `weight`: data_source and the other columns are left out; **extra gets
    # them all, except a column named like a positional parameter (it would collide with it)
    row = {"weight": 2, "data_source": "gsm8k", "level": 3, "response": "column"}
    named = pool.score(weight_only, ["a", "b"], ["", ""], extras=[row, {"data_source": "gsm8k"}])
    assert named.rewards == [2.0, 0.0] and named.n_errors == 1
    assert "missing 1 required positional argument: 'weight'" in named.errors[0]
    assert pool.score(echo_extra, ["a"], [""], extras=[row]).stats == {"n_errors": 0, "n_timeouts": 0}


def test_pool_raises_a_named_error_when_every_call_kills_its_worker():
    me = psutil.Process()
    with RewardPool(num_workers=1, timeout_s=3.0) as crashing:   # one worker starts fastest
        crashing.score("gsm8k", ["#### 1"], ["1"])
        first_pids = crashing.worker_pids
        others = {p.pid for p in me.children(recursive=True)} - set(first_pids)   # other pools, resource tracker
        start = time.monotonic()
        with pytest.raises(RewardWorkerCrash) as err:
            crashing.score(exit_worker, ["x"] * 6, ["y"] * 6)
        assert time.monotonic() - start < 30
        assert str(err.value).startswith(
            f"reward function {__name__}:exit_worker: its worker process died 3 times in a row with no call "
            "finishing in between (last: exit code 3); the reward pool is shut down."), err.value
        # sample 0 broke two pools (an error, as a sometimes-crashing reward), sample 1 the third
        assert crashing.num_restarts == 2 and crashing.worker_pids == []
        # no reward worker is left: neither the first pool's nor any replacement's
        assert not [pid for pid in first_pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
        assert {p.pid for p in me.children(recursive=True)} - others == set()


def test_pool_workers_ignore_sigint(pool):
    # a terminal's Ctrl-C signals the whole foreground process group; the controller decides
    pool.score("gsm8k", ["#### 1"], ["1"])
    pids, restarts = pool.worker_pids, pool.num_restarts
    for pid in pids:
        os.kill(pid, signal.SIGINT)
    time.sleep(0.5)
    assert pool.score("gsm8k", ["#### 1", "#### 3"], ["1", "2"]).rewards == [1.0, 0.0]
    assert pool.worker_pids == pids and pool.num_restarts == restarts


def test_pool_input_errors(pool):
    with pytest.raises(TypeError, match="define it at module level"):
        pool.score(lambda response, answer, **extra: 1.0, ["a"], ["b"])
    with pytest.raises(ValueError, match="got 2 responses but 1 answers"):
        pool.score("gsm8k", ["a", "b"], ["c"])
    with pytest.raises(ValueError, match="timeout_s must be > 0, got 0"):
        RewardPool(timeout_s=0)


def test_gsm8k_lenient_falls_back_to_last_number():
    lenient = get_reward_fn("gsm8k_lenient")
    assert lenient("4 + 5 = 9", "9") == 1.0            # no '####': last number 9 is right
    assert lenient("1 + 8 = 9", "8") == 0.0            # last number 9 is wrong
    assert lenient("so 8 #### 9", "8") == 0.0          # '####' wins over the last-number fallback
    assert gsm8k_reward("4 + 5 = 9", "9") == 0.0       # the strict reward needs '####'


def test_workers_die_with_a_killed_owner():
    """SIGKILL to the process that owns a pool (not to its process group) takes its workers with it."""
    import subprocess
    import sys

    code = ("from megarl.rewards import RewardPool\n"
            "import sys, time\n"
            "pool = RewardPool(num_workers=2, timeout_s=10.0).__enter__()\n"
            "pool.score('gsm8k', ['#### 1'], ['1'])\n"
            "print(*pool.worker_pids, flush=True)\n"
            "time.sleep(600)\n")
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        workers = [int(p) for p in owner.stdout.readline().split()]
        assert len(workers) == 2, workers
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        deadline = time.monotonic() + 20
        while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in workers):
            assert time.monotonic() < deadline, [p for p in workers if psutil.pid_exists(p)]
            time.sleep(0.1)
    finally:
        if owner.poll() is None:
            os.killpg(owner.pid, signal.SIGKILL)
