"""Per-step JSON-lines files (metrics, samples, timeline, routing): reading them, and cutting them
back to the steps before a resumed step so that no step is written twice."""
from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["keep_steps_before", "read_jsonl"]


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def keep_steps_before(path: str | os.PathLike, rows: list[dict], step: int) -> list[dict]:
    """Rewrite the per-step JSON-lines file ``path`` (its ``rows``, as read) with the rows of steps
    before ``step`` only, atomically: a run resumed at ``step`` writes the later ones again, and
    a file never holds a step twice. Returns the rows kept."""
    path = Path(path)
    kept = [r for r in rows if r["step"] < step]
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, path)
    return kept
