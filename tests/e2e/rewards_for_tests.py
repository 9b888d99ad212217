"""Rewards of the tests (e2e, and tests/unit/test_trainer_batch.py through sys.path): rewards with
spread on random tiny models (their outputs never solve arithmetic)."""


def token_parity_reward(response: str, answer: str, **extra) -> float:
    """1.0 when the response has an even number of characters, else 0.0."""
    return float(len(response) % 2 == 0)


def char_variety_reward(response: str, answer: str, **extra) -> float:
    """Distinct characters per character (+1): a graded reward in [0, 1) whose ties are rare, so
    that estimators that rank a group's responses (pass@k GRPO, PF-PPO's filter) have a best."""
    return len(set(response)) / (len(response) + 1)


def column_reward(response: str, answer: str, *, bonus: float, data_source: str) -> float:
    """The row's ``bonus`` column plus the parity of the response's length. Takes no ``**extra``:
    the pool passes only the keywords named here, and ``data_source`` must arrive too."""
    if not data_source:
        raise ValueError("data_source is empty")
    return float(bonus) + len(response) % 2


def crash_reward(response: str, answer: str, **extra) -> float:
    """:func:`token_parity_reward` for the first ``$MEGARL_TEST_REWARD_CALLS`` calls, then ends its
    worker process on every call (tests/e2e/test_faults_e2e.py: a run whose next step's reward
    kills its workers). The calls are counted in the file ``$MEGARL_TEST_REWARD_COUNTER`` (one byte
    appended per call), which the pool's workers and their replacements share."""
    import os

    fd = os.open(os.environ["MEGARL_TEST_REWARD_COUNTER"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, b".")
        calls = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if calls > int(os.environ["MEGARL_TEST_REWARD_CALLS"]):
        os._exit(3)
    return token_parity_reward(response, answer)
