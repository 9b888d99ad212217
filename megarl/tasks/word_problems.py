"""Offline word problems for tool use: seeded multi-step integer arithmetic where a calculator helps.

Each problem is a short story with one positive integer answer, e.g. "A shop has 37 boxes of 24
pencils. It sells 158 pencils and packs the rest into bags of 5. How many full bags can it pack?"
-> (37 * 24 - 158) // 5 = 146 (``//`` for full bags, rounding up for how many are needed).

  level  steps  quantities   factors / divisors
  1      2-3    12-99        3-9
  2      2-3    100-999      6-25
  3      3-4    100-999      12-99
  4      4-5    1000-9999    12-99

The prompt asks for the calculator when needed and a last line ``#### <answer>``
(``data_source="calculator"``, :func:`megarl.rewards.agent.calculator_reward`); ``extra`` holds
the level, the story ``kind`` and its ``numbers`` (a list, to round-trip through parquet), so the
answer can be recomputed. ``random.Random(seed)`` is the only randomness, and a longer list starts
with the shorter one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from megarl.tasks.dataset import PromptRecord

__all__ = ["LEVELS", "KINDS", "WordProblemLevel", "PROMPT_SUFFIX", "make_word_problem", "generate_word_problems"]

PROMPT_SUFFIX = (
    " Use the calculator tool if you need it. Write the final answer on the last line in the form "
    "'#### <number>'."
)


@dataclass(frozen=True)
class WordProblemLevel:
    min_steps: int
    max_steps: int
    quantity: tuple[int, int]
    """Range of the main quantities (items per box, passengers per trip, prices)."""
    factor: tuple[int, int]
    """Range of the counts that multiply or divide them (boxes, days, bag sizes)."""


LEVELS: dict[int, WordProblemLevel] = {
    1: WordProblemLevel(2, 3, (12, 99), (3, 9)),
    2: WordProblemLevel(2, 3, (100, 999), (6, 25)),
    3: WordProblemLevel(3, 4, (100, 999), (12, 99)),
    4: WordProblemLevel(4, 5, (1000, 9999), (12, 99)),
}

Story = tuple[str, int, dict]   # (text, answer, numbers)


def _part(rng: random.Random, total: int) -> int:
    """A quantity to take away from ``total``: between a quarter and three quarters of it."""
    return rng.randint(max(1, total // 4), max(1, 3 * total // 4))


def _bus(rng, q, f) -> Story:   # 2 steps
    seats, trips, days = rng.randint(*q), rng.randint(*f), rng.randint(*f)
    text = (f"A bus carries {seats} passengers on each trip and makes {trips} trips a day. "
            f"How many passengers does it carry in {days} days?")
    return text, seats * trips * days, {"seats": seats, "trips": trips, "days": days}


def _orchard(rng, q, f) -> Story:   # 2 steps
    rows, per_row = rng.randint(*f), rng.randint(*q)
    cut = _part(rng, rows * per_row)
    text = (f"An orchard has {rows} rows of {per_row} apple trees. The farmer cuts down {cut} old trees. "
            f"How many trees are left?")
    return text, rows * per_row - cut, {"rows": rows, "per_row": per_row, "cut": cut}


def _savings(rng, q, f) -> Story:   # 2 steps (and a rounding up)
    earns = rng.randint(*q)
    spends = rng.randint(1, earns // 2)
    price = rng.randint(q[0] * f[0], q[1] * f[1])
    weekly = earns - spends
    text = (f"Maria earns ${earns} a week and spends ${spends} of it. She saves the rest. How many weeks "
            f"must she save to have at least ${price} for a bike?")
    return text, -(-price // weekly), {"earns": earns, "spends": spends, "price": price}


def _pencils(rng, q, f) -> Story:   # 3 steps
    boxes, per_box, bag = rng.randint(*f), rng.randint(*q), rng.randint(*f)
    sold = _part(rng, boxes * per_box)
    text = (f"A shop has {boxes} boxes of {per_box} pencils. It sells {sold} pencils and packs the rest "
            f"into bags of {bag}. How many full bags can it pack?")
    return text, (boxes * per_box - sold) // bag, {"boxes": boxes, "per_box": per_box, "sold": sold, "bag": bag}


def _factory(rng, q, f) -> Story:   # 3 steps
    per_hour, hours = rng.randint(*q), rng.randint(f[0], min(f[1], 24))   # a day has 24 hours
    days, crate = rng.randint(*f), rng.randint(*f)
    text = (f"A factory makes {per_hour} toys an hour and works {hours} hours a day. After {days} days, "
            f"all the toys are packed in crates of {crate}. How many crates are filled completely?")
    return text, per_hour * hours * days // crate, {"per_hour": per_hour, "hours": hours, "days": days, "crate": crate}


def _theater(rng, q, f) -> Story:   # 4 steps
    adults, adult_price = rng.randint(*q), rng.randint(*f)
    children, child_price = rng.randint(*q), rng.randint(f[0], max(f[0], adult_price - 1))
    costs = _part(rng, adults * adult_price + children * child_price)
    text = (f"A theater sells {adults} adult tickets at ${adult_price} each and {children} child tickets at "
            f"${child_price} each. It pays ${costs} for the show. How many dollars are left?")
    value = adults * adult_price + children * child_price - costs
    return text, value, {"adults": adults, "adult_price": adult_price, "children": children,
                         "child_price": child_price, "costs": costs}


def _warehouse(rng, q, f) -> Story:   # 4 steps
    crates, extra, per_crate, stores = rng.randint(*f), rng.randint(*f), rng.randint(*q), rng.randint(*f)
    shipped = _part(rng, (crates + extra) * per_crate)
    text = (f"A warehouse holds {crates} crates of {per_crate} cans. A truck brings {extra} more crates of "
            f"{per_crate} cans. The warehouse ships {shipped} cans, then shares the rest equally among "
            f"{stores} stores (leftover cans stay in the warehouse). How many cans does each store get?")
    value = ((crates + extra) * per_crate - shipped) // stores
    return text, value, {"crates": crates, "per_crate": per_crate, "extra": extra, "shipped": shipped, "stores": stores}


def _school_trip(rng, q, f) -> Story:   # 4 steps (and a rounding up)
    schools, students, teachers = rng.randint(*f), rng.randint(*q), rng.randint(*f)
    seats, bus_price = rng.randint(20, 60), rng.randint(*q)
    buses = -(-(schools * students + teachers) // seats)
    text = (f"{schools} schools each send {students} students on a trip, with {teachers} teachers in all. "
            f"A bus has {seats} seats and costs ${bus_price}. How many dollars do the buses cost if they rent "
            f"just enough buses for everyone?")
    return text, buses * bus_price, {"schools": schools, "students": students, "teachers": teachers,
                                     "seats": seats, "bus_price": bus_price}


def _bakery(rng, q, f) -> Story:   # 5 steps
    trays, per_tray, days, box = rng.randint(*f), rng.randint(*q), rng.randint(*f), rng.randint(*f)
    baked = trays * per_tray * days
    sold = _part(rng, baked)
    given = _part(rng, baked - sold)
    text = (f"A bakery bakes {trays} trays of {per_tray} cookies every day for {days} days. It sells "
            f"{sold} cookies, gives away {given}, and packs the rest into boxes of {box}. How many full "
            f"boxes does it pack?")
    return text, (baked - sold - given) // box, {"trays": trays, "per_tray": per_tray, "days": days,
                                                 "sold": sold, "given": given, "box": box}


KINDS: dict[str, tuple[int, Callable[..., Story]]] = {
    "bus": (2, _bus),
    "orchard": (2, _orchard),
    "savings": (2, _savings),
    "pencils": (3, _pencils),
    "factory": (3, _factory),
    "theater": (4, _theater),
    "warehouse": (4, _warehouse),
    "school_trip": (4, _school_trip),
    "bakery": (5, _bakery),
}
"""Story kind -> (number of arithmetic steps, generator)."""


def make_word_problem(rng: random.Random, level: int) -> tuple[str, str, int, list[int]]:
    """One (kind, text, answer, numbers in the order the story states them) at ``level``."""
    if level not in LEVELS:
        raise ValueError(f"unknown word-problem level {level!r}; known: {sorted(LEVELS)}")
    spec = LEVELS[level]
    kinds = [k for k, (steps, _) in KINDS.items() if spec.min_steps <= steps <= spec.max_steps]
    while True:
        kind = rng.choice(kinds)
        text, value, numbers = KINDS[kind][1](rng, spec.quantity, spec.factor)
        if value > 0:
            return kind, text, value, list(numbers.values())


DEMO_MESSAGES = [
    {"role": "user", "content": "A baker makes 48 rolls and sells 12 of them. He packs the rest into bags of 4. "
                                "How many bags does he fill?" + PROMPT_SUFFIX},
    {"role": "assistant", "content": '<tool_call>\n{"name": "calculator", "arguments": {"expression": '
                                     '"(48 - 12) / 4"}}\n</tool_call>'},
    {"role": "tool", "content": "9"},
    {"role": "assistant", "content": "He fills 9 bags.\n#### 9"},
]
"""One worked exchange put before every problem (``demo=True``): a small model (SmolLM2-135M)
never writes a tool call from the tools' description alone (0 of 64 samples, measured), and
does in about 4 of 10 samples after this demonstration (most malformed at first: the loop sends
their parse errors back, and the reward's tool bonus pays for well-formed ones). It uses the
Hermes ``<tool_call>`` format, the agent loop's fallback (SmolLM2's template has none of its own)."""


def generate_word_problems(num_examples: int, level: int = 1, seed: int = 0,
                           demo: bool = False) -> list[PromptRecord]:
    """``num_examples`` word problems at ``level``; the same (level, seed) gives the same list.
    ``demo``: each prompt is chat messages, :data:`DEMO_MESSAGES` then the problem."""
    if num_examples <= 0:
        raise ValueError(f"num_examples must be > 0, got {num_examples}")
    if level not in LEVELS:
        raise ValueError(f"unknown word-problem level {level!r}; known: {sorted(LEVELS)}")
    rng = random.Random(seed)
    records = []
    for _ in range(num_examples):
        kind, text, value, numbers = make_word_problem(rng, level)
        prompt = text + PROMPT_SUFFIX
        if demo:
            prompt = [dict(m) for m in DEMO_MESSAGES] + [{"role": "user", "content": prompt}]
        records.append(PromptRecord(prompt=prompt, answer=str(value), data_source="calculator",
                                    extra={"level": level, "kind": kind, "numbers": numbers}))
    return records
