"""Supervised and preference data of ``megarl sft`` and ``megarl rm``: reading, checking, tokenising.

Rows (``.jsonl`` or ``.parquet``): SFT has ``messages`` (the last one the assistant's answer, the
only tokens with loss) or ``prompt`` with ``response``; preferences have ``prompt``, ``chosen``,
``rejected`` and an optional ``margin`` (for ``posttrain.margin``). With
``data.use_chat_template`` the response is what the rendered conversation adds to the rendered
prompt, up to and with its end-of-turn token, so it is tokenised exactly as generation produces
it; without it the texts are tokenised as they are and the response ends with EOS.

A bad row (missing or mistyped field, empty response, chosen identical to rejected, a sequence
over ``posttrain.max_seq_tokens``) is an error naming the file, line (jsonl 1-based; parquet row
0-based) and field, before any worker starts; ``data.on_bad_row: skip`` drops and counts it
(:attr:`Examples.skipped`). ``builtin:arithmetic_sft`` / ``builtin:arithmetic_prefs`` in place of
a file are generated offline from ``data.seed`` (:func:`builtin_rows`; ``megarl data`` writes
them to a file).
"""
from __future__ import annotations

import json
import math
import os
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

BUILTIN = ("builtin:arithmetic_sft", "builtin:arithmetic_prefs")
SFT_SEED_OFFSET = 7_919
"""The built-in sets draw their problems from ``data.seed + SFT_SEED_OFFSET`` (the RL task's
prompt stream of the same level draws from other seeds: :class:`megarl.driver.rollouts.PromptSource`)."""


class DataError(ValueError):
    """A bad row: the message names the file, the line or row, and the field."""


@dataclass
class Examples:
    """Tokenised examples: SFT sequences, or preference pairs (``chosen`` then ``rejected``)."""

    kind: str
    """'sft' or 'pairs'."""
    prompt_ids: list = field(default_factory=list)
    response_ids: list = field(default_factory=list)
    """SFT: one response per example; pairs: the chosen response."""
    rejected_ids: list = field(default_factory=list)
    margins: list = field(default_factory=list)
    where: list = field(default_factory=list)
    """Per example, ``file: line N`` (for messages about it)."""
    skipped: Counter = field(default_factory=Counter)
    """Rows dropped by ``data.on_bad_row: skip``, by reason."""

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def select(self, keep: list) -> "Examples":
        pick = lambda xs: [xs[i] for i in keep] if xs else []   # noqa: E731
        return Examples(self.kind, pick(self.prompt_ids), pick(self.response_ids), pick(self.rejected_ids),
                        pick(self.margins), pick(self.where), Counter(self.skipped))

    def sequences(self, indices: list) -> tuple[list, list]:
        """(prompt + response ids, prompt length) of each sequence of the examples ``indices``:
        one per SFT example, two per pair (chosen, then rejected)."""
        seqs, prompts = [], []
        for i in indices:
            p = self.prompt_ids[i]
            for r in ([self.response_ids[i], self.rejected_ids[i]] if self.kind == "pairs" else [self.response_ids[i]]):
                seqs.append(p + r)
                prompts.append(len(p))
        return seqs, prompts

    def length(self, i: int, tp: int = 1, cp: int = 1) -> int:
        """Tokens of example ``i`` as the data plane plans it. A pair is one unit of two
        sequences, each padded to the layout's alignment (:func:`megarl.data.packing.padded_length`
        with ``tp``, ``cp``): the plan's packed size of the sum is then exactly what the two take,
        and a micro-batch of pairs stays within the token budget."""
        from megarl.data.packing import padded_length

        p = len(self.prompt_ids[i])
        if self.kind == "pairs":
            return sum(padded_length(p + len(r), tp, cp) for r in (self.response_ids[i], self.rejected_ids[i]))
        return p + len(self.response_ids[i])


# ----------------------------------------------------------------------------- reading
def read_rows(path: str) -> list[tuple[str, dict]]:
    """(where, row) of every row of a ``.jsonl`` or ``.parquet`` file; ``where`` is
    ``path: line N`` (jsonl) or ``path: row N`` (parquet)."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in (".jsonl", ".parquet"):
        raise DataError(f"{path}: unsupported file type {suffix!r}; expected .jsonl or .parquet")
    if not os.path.exists(path):
        raise DataError(f"{path}: file not found")
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return [(f"{path}: row {i}", row) for i, row in enumerate(pq.read_table(path).to_pylist())]
    from megarl.tasks.dataset import _read_jsonl

    try:
        rows = [(f"{path}: line {n}", row) for n, row in _read_jsonl(path, numbered=True)]
    except ValueError as err:
        raise DataError(str(err)) from None
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def _messages(value: Any, where: str, name: str) -> list:
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}, field {name!r}: empty {name}")
        return [{"role": "user", "content": value}]
    if isinstance(value, (list, tuple)) or type(value).__name__ == "ndarray":
        out = []
        for i, m in enumerate(value):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise DataError(f"{where}, field {name!r}: message {i} must be {{'role': str, 'content': str}}")
            out.append({"role": m["role"], "content": m["content"]})
        if not out or not any(m["content"].strip() for m in out):
            raise DataError(f"{where}, field {name!r}: empty {name} (no message with content)")
        return out
    raise DataError(f"{where}, field {name!r}: expected a string or a list of chat messages, got "
                    f"{type(value).__name__}")


def _text(row: dict, name: str, where: str) -> str:
    if name not in row:
        raise DataError(f"{where}: missing field {name!r}; found {sorted(row)}")
    value = row[name]
    if not isinstance(value, str):
        raise DataError(f"{where}, field {name!r}: expected a string, got {type(value).__name__}")
    if not value.strip():
        raise DataError(f"{where}, field {name!r}: empty {name}")
    return value


def parse_sft_row(row: dict, where: str) -> tuple[list, str]:
    """(prompt messages, response text) of an SFT row."""
    if "messages" in row:
        messages = _messages(row["messages"], where, "messages")
        if messages[-1]["role"] != "assistant":
            raise DataError(f"{where}, field 'messages': the last message must be the assistant's (the response), "
                            f"got role {messages[-1]['role']!r}")
        if not messages[-1]["content"].strip():
            raise DataError(f"{where}, field 'messages': empty response (the last assistant message)")
        if len(messages) < 2:
            raise DataError(f"{where}, field 'messages': no prompt before the assistant's message")
        return messages[:-1], messages[-1]["content"]
    if "prompt" not in row:
        raise DataError(f"{where}: missing field 'messages' or 'prompt'; found {sorted(row)}")
    return _messages(row["prompt"], where, "prompt"), _text(row, "response", where)


def parse_pair_row(row: dict, where: str) -> tuple[list, str, str, float]:
    """(prompt messages, chosen, rejected, margin) of a preference row."""
    if "prompt" not in row:
        raise DataError(f"{where}: missing field 'prompt'; found {sorted(row)}")
    prompt = _messages(row["prompt"], where, "prompt")
    chosen, rejected = _text(row, "chosen", where), _text(row, "rejected", where)
    if chosen.strip() == rejected.strip():
        raise DataError(f"{where}, field 'rejected': identical to 'chosen' (a pair needs two different answers)")
    margin = row.get("margin", 0.0)
    if margin is None:
        margin = 0.0
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin):
        raise DataError(f"{where}, field 'margin': expected a finite number, got {margin!r}")
    return prompt, chosen, rejected, float(margin)


# ----------------------------------------------------------------------------- tokenising
class Tokenize:
    """Prompt and response ids of chat messages, through the chat template or not."""

    def __init__(self, tokenizer, use_chat_template: bool):
        self.tok, self.chat = tokenizer, use_chat_template and getattr(tokenizer, "chat_template", None)

    def _ids(self, out) -> list:
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    def __call__(self, prompt: list, response: str) -> tuple[list, list]:
        if self.chat:
            p = self._ids(self.tok.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True))
            full = self._ids(self.tok.apply_chat_template(prompt + [{"role": "assistant", "content": response}],
                                                          tokenize=True))
            if full[:len(p)] != p:   # a template that renders the prompt differently once answered
                raise DataError("the chat template renders the prompt differently with and without the answer; "
                                "set data.use_chat_template=false")
            response = full[len(p):]
            eos = self.tok.eos_token_id
            if eos in response:   # what follows the end of turn (a newline) is never generated: not trained on
                response = response[:len(response) - response[::-1].index(eos)]
            return p, response
        text = "\n".join(m["content"] for m in prompt)
        r = self.tok(response, add_special_tokens=False).input_ids
        return list(self.tok(text).input_ids), list(r) + ([self.tok.eos_token_id] if self.tok.eos_token_id is not None
                                                          else [])


def load_examples(path: str, kind: str, tokenizer, *, use_chat_template: bool, max_seq_tokens: int,
                  on_bad_row: str = "error", rows: Optional[list] = None) -> Examples:
    """Read, check and tokenise ``path`` (``rows``: already read ``(where, row)`` pairs, e.g.
    :func:`builtin_rows`'). ``kind``: 'sft' or 'pairs'."""
    rows = read_rows(path) if rows is None else rows
    tokenize = Tokenize(tokenizer, use_chat_template)
    out = Examples(kind)
    for where, row in rows:
        try:
            if kind == "sft":
                prompt, response = parse_sft_row(row, where)
                p, r = tokenize(prompt, response)
                parts, margin = [r], 0.0
            else:
                prompt, chosen, rejected, margin = parse_pair_row(row, where)
                p, r = tokenize(prompt, chosen)
                parts = [r, tokenize(prompt, rejected)[1]]
            for name, part in zip(("response", "rejected") if kind == "sft" else ("chosen", "rejected"), parts):
                if not part:
                    raise DataError(f"{where}, field {name!r}: the {name} has no tokens")
                if len(p) + len(part) > max_seq_tokens:
                    raise DataError(f"{where}, field {name!r}: prompt + {name} is {len(p) + len(part)} tokens > "
                                    f"posttrain.max_seq_tokens={max_seq_tokens}")
        except DataError as err:
            if on_bad_row != "skip":
                raise
            out.skipped[_reason(str(err))] += 1
            continue
        out.prompt_ids.append(p)
        out.response_ids.append(parts[0])
        if kind == "pairs":
            out.rejected_ids.append(parts[1])
            out.margins.append(margin)
        out.where.append(where)
    if not out:
        raise DataError(f"{path}: no usable row" + (f" ({sum(out.skipped.values())} skipped: "
                                                     f"{dict(out.skipped)})" if out.skipped else ""))
    return out


def _reason(message: str) -> str:
    """The kind of a DataError without its location (the skipped-rows counter's key)."""
    tail = message.split(": ", 2)[-1] if ", field" in message else message.split(": ", 1)[-1]
    return tail.split(" (")[0].split(" > ")[0][:60]


def split_eval(examples: Examples, fraction: float, seed: int) -> tuple[Examples, Examples]:
    """(train, held-out) split: ``fraction`` of the examples (at least one when > 0), chosen by seed."""
    n = len(examples)
    k = max(1, round(n * fraction)) if fraction > 0 else 0
    if k >= n:
        raise DataError(f"posttrain.eval_fraction={fraction} leaves no training example of {n}")
    order = list(range(n))
    random.Random(seed).shuffle(order)
    held = sorted(order[:k])
    keep = sorted(order[k:])
    return examples.select(keep), examples.select(held)


def epoch_order(n: int, epoch: int, seed: int) -> list:
    """The examples' order in ``epoch`` (0-based): a permutation by (seed, epoch)."""
    order = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def step_indices(n: int, batch_size: int, step: int, seed: int) -> tuple[int, list]:
    """(epoch, example indices) of optimizer step ``step`` (1-based): epochs of ``n // batch_size``
    full batches each (a partial last batch is dropped; every batch has the same size)."""
    per_epoch = max(1, n // batch_size)
    epoch, k = divmod(step - 1, per_epoch)
    order = epoch_order(n, epoch, seed)
    return epoch, order[k * batch_size:(k + 1) * batch_size]


def steps_per_epoch(n: int, batch_size: int) -> int:
    return max(1, n // batch_size)


# ----------------------------------------------------------------------------- built-in sets
def worked_answer(expression: str, slip: Optional[tuple] = None) -> tuple[str, int]:
    """A step-by-step answer to an arithmetic expression (``*`` first, then left to right),
    ending with ``#### value``. ``slip`` ``(k, delta)``: step k's result is off by ``delta`` and the
    later steps carry the error on, consistently (a plausible wrong answer)."""
    tokens = expression.split()
    nums, ops = [int(tokens[0])], []
    for op, x in zip(tokens[1::2], tokens[2::2]):
        ops.append(op)
        nums.append(int(x))
    lines = []

    def result(value: int) -> int:
        if slip is not None and len(lines) == slip[0]:
            return value + slip[1]
        return value

    while "*" in ops:   # products first
        i = ops.index("*")
        product = result(nums[i] * nums[i + 1])
        lines.append(f"{nums[i]} * {nums[i + 1]} = {product}.")
        nums[i:i + 2] = [product]
        del ops[i]
    total = nums[0]
    for op, x in zip(ops, nums[1:]):
        new = result(total + x if op == "+" else total - x)
        lines.append(f"{total} {op} {x} = {new}.")
        total = new
    if not lines:
        lines.append(f"The value is {total}.")
    return "\n".join(lines + [f"#### {total}"]), total


def builtin_rows(name: str, num_examples: int, level: int, seed: int) -> list[tuple[str, dict]]:
    """The rows of a built-in set, deterministic in its arguments: the arithmetic task's problems
    (:mod:`megarl.tasks.arithmetic`, level >= 2) with worked answers in the ``#### n`` format, and
    preference pairs whose rejected answer is, a third each, a slip in one step carried on
    consistently, a final answer that does not follow from the steps, or the steps without the
    ``####`` line. No level-1 problem (the quickstart's 100), so the quickstart measures what an
    SFT stage taught, not what it memorised."""
    from megarl.tasks.arithmetic import generate_arithmetic

    if name not in BUILTIN:
        raise DataError(f"unknown built-in data {name!r}; known: {', '.join(BUILTIN)}")
    if level < 2:
        raise DataError(f"{name} at data.difficulty={level}: level 1 has only 100 problems (every one a quickstart "
                        "prompt); the built-in sets are drawn from level 2 and up, without level-1 problems")
    records, draw = [], 0
    while len(records) < num_examples:   # level 2 also yields one-digit sums: those are left out
        batch = generate_arithmetic(num_examples, level=level, seed=seed + SFT_SEED_OFFSET + draw)
        records += [r for r in batch if not _level1(r.extra["expression"])][:num_examples - len(records)]
        draw += 1
    rng = random.Random(seed + 1)
    rows = []
    for i, rec in enumerate(records):
        answer, value = worked_answer(rec.extra["expression"])
        if name == "builtin:arithmetic_sft":
            row = {"prompt": rec.prompt, "response": answer}
        else:
            kind = rng.random()
            delta = rng.choice([-10, -2, -1, 1, 2, 10])
            if kind < 1 / 3:     # a slip in one step, carried on consistently: well formatted, wrong
                steps = answer.count("\n")
                rejected, wrong = worked_answer(rec.extra["expression"], slip=(rng.randrange(steps), delta))
                if wrong == value:   # a slip a later product by 0 erased: a final answer that does not follow
                    rejected = answer.rsplit("#### ", 1)[0] + f"#### {value + delta}"
            elif kind < 2 / 3:   # the right steps, then a final answer that does not follow from them
                rejected = answer.rsplit("#### ", 1)[0] + f"#### {value + delta}"
            else:                # the right steps, no final-answer line
                rejected = answer.rsplit("\n#### ", 1)[0].replace(f"= {value}.", "is the result.")
                rejected = rejected if rejected.strip() and rejected != answer else f"I think it is about {value + 1}."
            row = {"prompt": rec.prompt, "chosen": answer, "rejected": rejected}
        rows.append((f"{name}: row {i}", row))
    return rows


def _level1(expression: str) -> bool:
    """Whether ``expression`` is a level-1 problem (two one-digit operands added): the quickstart's."""
    parts = expression.split()
    return len(parts) == 3 and parts[1] == "+" and len(parts[0]) == 1 and len(parts[2]) == 1


def write_rows(rows: list, path: str) -> None:
    """Rows as ``.jsonl`` or ``.parquet`` (by suffix), readable by :func:`read_rows`."""
    plain = [row for _, row in rows]
    if path.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(plain), path)
        return
    with open(path, "w", encoding="utf-8") as f:
        for row in plain:
            f.write(json.dumps(row) + "\n")
