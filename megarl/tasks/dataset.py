"""Prompt datasets from parquet or jsonl files, validated row by row.

Required columns: ``prompt`` (a non-empty string, or a non-empty list of chat messages
``{"role": str, "content": str}``), ``answer`` (string) and ``data_source`` (non-empty string,
used to pick the reward function). Other columns are kept per row in ``PromptRecord.extra`` and
reach the reward function as keyword arguments, with ``data_source`` (the rule for functions that
do not take ``**extra``: :mod:`megarl.rewards.pool`).

Errors name the file, the row (0-based index among the data rows; for jsonl, blank lines are
skipped and do not count) and the column, e.g.
``data.jsonl: row 3, column 'answer': expected str, got int (42)``. Numbers are not silently turned
into strings: a numeric gold answer usually means the wrong column was exported.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

__all__ = ["REQUIRED_COLUMNS", "PromptRecord", "load_prompt_dataset", "overlong_message", "overlong_rows", "prompt_ids",
           "save_prompt_dataset", "validate_rows"]

REQUIRED_COLUMNS = ("prompt", "answer", "data_source")

Prompt = Union[str, list]


@dataclass
class PromptRecord:
    prompt: Prompt
    """The question: a plain string, or chat messages ``[{"role": ..., "content": ...}, ...]``."""
    answer: str
    """Gold answer passed to the reward function."""
    data_source: str
    """Where the row comes from; selects the reward function (e.g. ``gsm8k``, ``arithmetic``)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Other columns of the row."""
    uid: str | None = None
    """A stable id of the prompt within its run's prompt set (its row, or its place in a
    generated pool; :class:`megarl.driver.rollouts.PromptSource`): what the draft store of
    speculative rollouts is keyed by. None: a prompt that never recurs. Not a column."""

    def to_row(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "answer": self.answer, "data_source": self.data_source, **self.extra}


def _where(path: str, row: int, column: str) -> str:
    return f"{path}: row {row}, column {column!r}"


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} ({text if len(text) <= 40 else text[:37] + '...'})"


def _check_prompt(value: Any, path: str, row: int) -> Prompt:
    where = _where(path, row, "prompt")
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"{where}: empty prompt")
        return value
    if isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray)) or _is_array(value):
        messages = list(value)
        if not messages:
            raise ValueError(f"{where}: empty prompt (no messages)")
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
                raise ValueError(f"{where}: message {i} must be {{'role': str, 'content': str}}, got {_describe(message)}")
        if not any(m["content"].strip() for m in messages):
            raise ValueError(f"{where}: empty prompt (all messages empty)")
        return [dict(m) for m in messages]
    raise ValueError(f"{where}: expected str or list of chat messages, got {_describe(value)}")


def _is_array(value: Any) -> bool:
    # pyarrow's to_pylist gives lists, but keep numpy arrays (pandas exports) working too.
    return type(value).__name__ == "ndarray"


def validate_rows(rows: Iterable[Mapping[str, Any]], path: str) -> list[PromptRecord]:
    """Validate raw rows (``path`` is only used in messages) and convert them to records."""
    records = []
    for row, values in enumerate(rows):
        missing = [c for c in REQUIRED_COLUMNS if c not in values]
        if missing:
            raise ValueError(f"{path}: row {row}: missing column(s) {missing}; found {sorted(values)}")
        prompt = _check_prompt(values["prompt"], path, row)
        for column in ("answer", "data_source"):
            if not isinstance(values[column], str):
                raise ValueError(f"{_where(path, row, column)}: expected str, got {_describe(values[column])}")
        if not values["data_source"].strip():
            raise ValueError(f"{_where(path, row, 'data_source')}: empty data_source")
        extra = {k: v for k, v in values.items() if k not in REQUIRED_COLUMNS}
        records.append(PromptRecord(prompt, values["answer"], values["data_source"], extra))
    if not records:
        raise ValueError(f"{path}: no rows")
    return records


def _read_jsonl(path: str, max_rows: int | None = None, numbered: bool = False) -> list:
    """The JSON objects of a jsonl file (blank lines skipped); ``numbered``: ``(line number, object)``
    pairs (1-based). A line that is not a JSON object raises ValueError naming file and line."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if max_rows is not None and len(rows) == max_rows:
                break
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: line {line_number}: invalid JSON ({exc.msg})") from None
            if not isinstance(value, dict):
                raise ValueError(f"{path}: line {line_number}: expected a JSON object, got {type(value).__name__}")
            rows.append((line_number, value) if numbered else value)
    return rows


def _read_parquet(path: str, max_rows: int | None = None) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    if max_rows is None:
        table = pq.read_table(path)
    else:   # the first row groups only (a preflight look at a large file)
        parquet = pq.ParquetFile(path)
        table = next(parquet.iter_batches(batch_size=max_rows), parquet.schema_arrow.empty_table())
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise ValueError(f"{path}: missing column(s) {missing}; found {table.column_names}")
    return table.to_pylist()


_READERS = {".jsonl": _read_jsonl, ".parquet": _read_parquet}


def load_prompt_dataset(path: str | os.PathLike, max_rows: int | None = None) -> list[PromptRecord]:
    """Load and validate a ``.jsonl`` or ``.parquet`` prompt file (only its first ``max_rows`` rows
    when given: :mod:`megarl.preflight` checks a file without reading it whole)."""
    path = os.fspath(path)
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in _READERS:
        raise ValueError(f"{path}: unsupported file type {suffix!r}; known: {sorted(_READERS)}")
    if not os.path.exists(path):
        raise FileNotFoundError(f"prompt dataset not found: {path}")
    return validate_rows(_READERS[suffix](path, max_rows), path)


def save_prompt_dataset(records: Sequence[PromptRecord], path: str | os.PathLike) -> None:
    """Write records as ``.jsonl`` or ``.parquet`` (by suffix), readable by :func:`load_prompt_dataset`."""
    path = os.fspath(path)
    suffix = os.path.splitext(path)[1].lower()
    rows = [r.to_row() for r in records]
    if suffix == ".jsonl":
        with open(path, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    elif suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        raise ValueError(f"{path}: unsupported file type {suffix!r}; known: {sorted(_READERS)}")


def prompt_ids(tokenizer, prompt: Prompt, use_chat_template: bool) -> list[int]:
    """The token ids a single-turn rollout sends for ``prompt``: through the tokenizer's chat
    template (a string is one user message) with the generation prompt, or the text as it is."""
    if use_chat_template:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return list(tokenizer(prompt if isinstance(prompt, str) else prompt[-1]["content"]).input_ids)


def overlong_rows(lengths: Sequence[int], limit: int) -> list[tuple[int, int]]:
    """(row, tokens) of the rows whose prompt has more than ``limit`` tokens."""
    return [(row, n) for row, n in enumerate(lengths) if n > limit]


def overlong_message(path: str, overlong: list[tuple[int, int]], total: int, limit: int, shown: int = 5) -> str:
    """What to tell the user about the over-long prompts of the file ``path``: how many, the first
    rows (0-based, as the other row errors name them) with their lengths, the limit, the ways out."""
    rows = ", ".join(f"row {row} ({n} tokens)" for row, n in overlong[:shown])
    more = f" and {len(overlong) - shown} more" if len(overlong) > shown else ""
    return (f"{len(overlong)} of {total} prompts in {path} have more than rollout.max_prompt_tokens={limit} "
            f"tokens: {rows}{more}; raise rollout.max_prompt_tokens, shorten them, or set "
            "data.overlong_prompts=skip to drop them")
