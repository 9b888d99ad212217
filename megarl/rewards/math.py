"""Verifiable math rewards: GSM8K ``#### N`` answers, ``\\boxed{}`` answers, and format checks.

Every reward function is ``fn(response: str, answer: str, **extra) -> float`` and ignores extra
keyword arguments it does not know (the dataset passes its other columns, e.g. ``data_source``).

- :func:`gsm8k_reward`: the number after the last ``####`` compared numerically with the gold
  answer; ``strict=False`` falls back to the last number (verl's "flexible" mode).
- :func:`boxed_math_reward`: the last well-formed ``\\boxed{...}`` (nested and escaped braces,
  ``\\fbox``) compared with :func:`answers_equivalent`.
- :func:`answers_equivalent`: normalised string match, then plain numbers / fractions, then
  math-verify (symbolic), on both sides wrapped in ``\\boxed{}``. math-verify's own timeouts use
  ``signal.alarm`` and work only in the main thread; elsewhere the pool timeout is the only bound
  (:mod:`megarl.rewards.pool`). Without math-verify the first two checks decide.
- :func:`format_reward`: 1.0 for the expected format (``gsm8k``, ``boxed`` or ``think``), else 0.0.
"""

from __future__ import annotations

import math
import re
import threading
from fractions import Fraction

__all__ = [
    "extract_gsm8k_answer",
    "extract_last_number",
    "extract_boxed",
    "parse_number",
    "answers_equivalent",
    "gsm8k_reward",
    "boxed_math_reward",
    "format_reward",
]

_NUMBER = r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+"
_GSM8K_RE = re.compile(r"####\s*\$?\s*(" + _NUMBER + r")")
_LAST_NUMBER_RE = re.compile(_NUMBER)
_GSM8K_LINE_RE = re.compile(r"^\s*####\s*\$?\s*(?:" + _NUMBER + r")\s*\.?\s*$")
_THINK_RE = re.compile(r"^\s*<think>.*?</think>\s*\S", re.DOTALL)
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)")


def _clean_number(text: str) -> str:
    return text.replace(",", "").rstrip(".")


def extract_gsm8k_answer(text: str) -> str | None:
    """The number after the last ``####`` (commas removed), or None."""
    matches = _GSM8K_RE.findall(text)
    return _clean_number(matches[-1]) if matches else None


def extract_last_number(text: str) -> str | None:
    """The last number in the text (commas removed), or None."""
    matches = _LAST_NUMBER_RE.findall(text)
    return _clean_number(matches[-1]) if matches else None


def _braced_content(text: str, start: int) -> str | None:
    """Content of the brace group opening at ``text[start] == '{'``, or None if unbalanced."""
    depth = 0
    i = start
    while i < len(text):
        char = text[i]
        if char == "\\":  # \{ and \} are literal braces, not grouping
            i += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i]
        i += 1
    return None


def extract_boxed(text: str) -> str | None:
    """Content of the last well-formed ``\\boxed{...}`` / ``\\fbox{...}`` (or ``\\boxed 5``), else None."""
    for match in reversed(list(_BOXED_RE.finditer(text))):
        rest = match.end()
        if rest < len(text) and text[rest] == "{":
            content = _braced_content(text, rest)
        elif rest < len(text) and text[rest] == " ":  # "\boxed 5": up to the next space or $
            token = re.match(r" +([^\s$]+)", text[rest:])
            content = token.group(1) if token else None
        else:
            content = None
        if content is not None and content.strip():
            return content.strip()
    return None


def _normalise(text: str) -> str:
    text = text.strip().strip("$").strip()
    text = re.sub(r"\\text\{\s*([^{}]*)\}", r"\1", text)
    text = text.replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("\\,", "")
    text = text.replace("dfrac", "frac").replace("tfrac", "frac")
    text = re.sub(r"\s+", "", text)
    return text.rstrip(".")


def parse_number(text: str) -> Fraction | None:
    """A plain number, ``a/b`` or ``\\frac{a}{b}`` as an exact Fraction (commas, ``$``, ``%`` dropped), else None."""
    text = _normalise(text).replace(",", "").rstrip("%")
    frac = re.fullmatch(r"(-?)\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", text)
    try:
        if frac:
            value = Fraction(frac.group(2)) / Fraction(frac.group(3))
            return -value if frac.group(1) else value
        if re.fullmatch(r"-?[\d.]+/-?[\d.]+", text):
            num, den = text.split("/")
            return Fraction(num) / Fraction(den)
        if re.fullmatch(r"-?(\d+\.?\d*|\.\d+)(e-?\d+)?", text):
            return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None
    return None


def _math_verify_equal(pred: str, gold: str) -> bool:
    try:
        from math_verify import parse, verify
    except ImportError:
        return False
    # signal.alarm-based timeouts only work in the main thread; elsewhere the pool timeout bounds us.
    in_main = threading.current_thread() is threading.main_thread()
    timeout = 5 if in_main else None
    gold_parsed = parse("\\boxed{" + gold + "}", parsing_timeout=timeout)
    pred_parsed = parse("\\boxed{" + pred + "}", parsing_timeout=timeout)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))


def answers_equivalent(pred: str, gold: str) -> bool:
    """True when ``pred`` and ``gold`` denote the same answer (see module docstring for the order)."""
    if not pred.strip() or not gold.strip():
        return False
    if _normalise(pred) == _normalise(gold):
        return True
    pred_num, gold_num = parse_number(pred), parse_number(gold)
    if pred_num is not None and gold_num is not None:
        return math.isclose(float(pred_num), float(gold_num), rel_tol=1e-9, abs_tol=1e-9) or pred_num == gold_num
    try:
        return _math_verify_equal(pred, gold)
    except Exception:  # a math-verify failure is a wrong answer, not a crashed reward
        return False


def gsm8k_lenient_reward(response: str, answer: str, **extra) -> float:
    """:func:`gsm8k_reward` that falls back to the last number when there is no ``####`` (small
    models rarely follow the format at first; the quickstart's reward)."""
    return gsm8k_reward(response, answer, strict=False, **extra)


def gsm8k_reward(response: str, answer: str, *, strict: bool = True, format_score: float = 0.0, **extra) -> float:
    """1.0 for the right number after ``####``; ``format_score`` for a wrong one; 0.0 without one.
    Commas, ``$`` and a trailing period are removed; the gold answer may itself be a full GSM8K
    solution ending in ``#### N``."""
    pred = extract_gsm8k_answer(response)
    if pred is None and not strict:
        pred = extract_last_number(response)
    if pred is None:
        return 0.0
    gold = extract_gsm8k_answer(answer) if "####" in answer else _clean_number(answer.strip())
    if gold is None:
        raise ValueError(f"gold answer has no number after '####': {answer!r}")
    pred_num, gold_num = parse_number(pred), parse_number(gold)
    correct = pred_num is not None and gold_num is not None and pred_num == gold_num
    return 1.0 if correct else format_score


def boxed_math_reward(response: str, answer: str, *, format_score: float = 0.0, **extra) -> float:
    """1.0 when the last ``\\boxed{}`` is equivalent to the gold answer; ``format_score`` if wrong; 0.0 if none."""
    pred = extract_boxed(response)
    if pred is None:
        return 0.0
    gold = extract_boxed(answer) or answer
    return 1.0 if answers_equivalent(pred, gold) else format_score


def format_reward(response: str, answer: str = "", *, style: str = "gsm8k", **extra) -> float:
    """1.0 when the response follows the answer format ``style`` (gsm8k: the last non-empty line
    is ``#### <number>``; boxed: a well-formed ``\\boxed{}``; think: a ``<think>...</think>`` block
    followed by an answer), else 0.0."""
    if style == "gsm8k":
        lines = [line for line in response.splitlines() if line.strip()]
        return 1.0 if lines and _GSM8K_LINE_RE.match(lines[-1]) else 0.0
    if style == "boxed":
        return 1.0 if extract_boxed(response) is not None else 0.0
    if style == "think":
        return 1.0 if _THINK_RE.match(response) else 0.0
    raise ValueError(f"unknown format style {style!r}; known: ['boxed', 'gsm8k', 'think']")
