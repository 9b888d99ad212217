"""Offline arithmetic task: seeded, deterministic integer problems with ``#### <number>`` answers.

Made for the GRPO quickstart on SmolLM2-135M-Instruct: levels 1-2 are solvable some of the time
by such a model, higher levels give headroom. Problems are integer expressions with the usual
precedence, so the answer is exact.

  level  operands  digits per operand  operators
  1      2         1                   +
  2      2         1-2                 + -        (never negative at this level)
  3      3         1-2                 + -
  4      3         1-2                 + - *      (at most one *, its factors have 1 digit)
  5      4         1-3                 + - *

The only randomness is ``random.Random(seed)``, so (num_examples, level, seed) fixes the output on
every platform. ``data_source="arithmetic"`` selects :func:`megarl.rewards.math.gsm8k_reward`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from megarl.tasks.dataset import PromptRecord

__all__ = ["LEVELS", "ArithmeticLevel", "make_problem", "generate_arithmetic", "PROMPT_TEMPLATE"]

PROMPT_TEMPLATE = (
    "What is {expression}? Work it out step by step, then write the final answer on the last line "
    "in the form '#### <number>'."
)


@dataclass(frozen=True)
class ArithmeticLevel:
    num_operands: int
    min_digits: int
    max_digits: int
    operators: str
    allow_negative: bool = True
    max_multiplications: int = 0
    """0 = no limit (when ``*`` is among the operators)."""


LEVELS: dict[int, ArithmeticLevel] = {
    1: ArithmeticLevel(2, 1, 1, "+", allow_negative=False),
    2: ArithmeticLevel(2, 1, 2, "+-", allow_negative=False),
    3: ArithmeticLevel(3, 1, 2, "+-"),
    4: ArithmeticLevel(3, 1, 2, "+-*", max_multiplications=1),
    5: ArithmeticLevel(4, 1, 3, "+-*"),
}


def _operand(rng: random.Random, min_digits: int, max_digits: int) -> int:
    digits = rng.randint(min_digits, max_digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def _evaluate(operands: list[int], operators: list[str]) -> int:
    """Integer value with * binding tighter than + and -, left to right otherwise."""
    terms, signs = [operands[0]], []
    for op, value in zip(operators, operands[1:]):
        if op == "*":
            terms[-1] *= value
        else:
            signs.append(op)
            terms.append(value)
    total = terms[0]
    for sign, term in zip(signs, terms[1:]):
        total = total + term if sign == "+" else total - term
    return total


def make_problem(rng: random.Random, level: int) -> tuple[str, int]:
    """One (expression, value) pair at ``level``, drawn from ``rng``."""
    if level not in LEVELS:
        raise ValueError(f"unknown arithmetic level {level!r}; known: {sorted(LEVELS)}")
    spec = LEVELS[level]
    while True:
        operators = [rng.choice(spec.operators) for _ in range(spec.num_operands - 1)]
        if spec.max_multiplications and operators.count("*") > spec.max_multiplications:
            continue
        operands = []
        for i in range(spec.num_operands):
            # Factors of a product stay one digit at level 4 so the product is mental-math sized.
            next_is_mul = i < len(operators) and operators[i] == "*"
            prev_is_mul = i > 0 and operators[i - 1] == "*"
            max_digits = 1 if spec.max_multiplications and (next_is_mul or prev_is_mul) else spec.max_digits
            operands.append(_operand(rng, spec.min_digits, max_digits))
        value = _evaluate(operands, operators)
        if value < 0 and not spec.allow_negative:
            continue
        parts = [str(operands[0])]
        for op, operand in zip(operators, operands[1:]):
            parts += [op, str(operand)]
        return " ".join(parts), value


def generate_arithmetic(num_examples: int, level: int = 1, seed: int = 0) -> list[PromptRecord]:
    """``num_examples`` problems at ``level``; the same (level, seed) always gives the same list."""
    if num_examples <= 0:
        raise ValueError(f"num_examples must be > 0, got {num_examples}")
    if level not in LEVELS:
        raise ValueError(f"unknown arithmetic level {level!r}; known: {sorted(LEVELS)}")
    rng = random.Random(seed)
    records = []
    for _ in range(num_examples):
        expression, value = make_problem(rng, level)
        records.append(
            PromptRecord(
                prompt=PROMPT_TEMPLATE.format(expression=expression),
                answer=str(value),
                data_source="arithmetic",
                extra={"level": level, "expression": expression},
            )
        )
    return records
