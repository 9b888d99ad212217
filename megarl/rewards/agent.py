"""Rewards for multi-turn agent trajectories (``data_source="calculator"``, :mod:`megarl.tasks.word_problems`).

:func:`calculator_reward`: 1.0 when the number after the last ``####`` of the final turn equals the
gold answer (exactly, as fractions; commas are thousands separators), else 0.0; plus ``tool_bonus``
when the trajectory made a well-formed tool call and no malformed one, and the final turn has a
``#### <number>`` line, right or wrong. Not for a call alone: a trajectory that calls the
calculator and never answers would outrank siblings that ended without an answer line. Not only
on a right answer: a small model's correct answers are rare early on, so it would mostly reward
lucky guesses. Keep it small next to 1.0 (0.1 or less), or it teaches calling the tool for show.
"""

from __future__ import annotations

from megarl.rewards.math import extract_gsm8k_answer, gsm8k_reward

__all__ = ["calculator_reward", "calculator_bonus_reward"]


def calculator_reward(response: str, answer: str, tool_calls_ok: int = 0, tool_calls_bad: int = 0,
                      tool_bonus: float = 0.0, **extra) -> float:
    """Correctness of the ``#### N`` answer in ``response`` (the final turn's text) plus the tool bonus.

    ``answer``: the gold integer as a string (or a full solution ending in ``#### N``).
    ``tool_calls_ok``/``tool_calls_bad``: the trajectory's well-formed and malformed tool calls.
    ``tool_bonus``: added when ``tool_calls_ok >= 1``, ``tool_calls_bad == 0`` and the answer line
    is present (see the module docstring). Other keywords (``data_source``, dataset columns) are
    ignored."""
    score = gsm8k_reward(response, answer)   # 1.0 right, 0.0 wrong or no '####' number
    if tool_bonus and tool_calls_ok >= 1 and tool_calls_bad == 0 and extract_gsm8k_answer(response) is not None:
        score += float(tool_bonus)
    return score


def calculator_bonus_reward(response: str, answer: str, tool_calls_ok: int = 0, tool_calls_bad: int = 0,
                            **extra) -> float:
    """:func:`calculator_reward` with ``tool_bonus=0.1`` (registry name ``calculator_bonus``)."""
    return calculator_reward(response, answer, tool_calls_ok, tool_calls_bad, tool_bonus=0.1)
