"""Who was busy when: spans per lane (a rollout engine, a training rank, the driver) and, per step,
each lane's busy and idle seconds and how long generation and training overlapped.

The controller records spans from any thread (``timeline.span(lane, phase)`` around a call or
``record(lane, phase, start, end)`` after it, ``time.monotonic()`` times); ``step_metrics(step,
start, end)`` measures the window: ``timeline/<lane>_busy_s`` (the union of the lane's spans
clipped to the window) and ``_idle_s`` for every lane seen so far (stable metric columns),
``timeline/generate_s`` / ``train_s`` (the union over ``engine*`` / ``rank*`` lanes),
``timeline/overlap_s`` (some engine and some rank both busy) and ``timeline/step_s``. A span that
straddles windows counts in each, clipped; an open span counts up to the window's end. Spans that
ended before the window are forgotten, so memory holds about one step.

File ``<run_dir>/timeline.jsonl`` (appended, one ``fsync`` per step): per step a window line, then
the clipped spans, in seconds from t0; t0 continues after the file's last line, so a resumed run's
bars follow the earlier ones, and ``resume_step=k`` drops steps >= k as ``metrics.jsonl`` does.
``megarl plot`` draws it as a Gantt chart (:func:`megarl.observability.plot.plot_timeline`).
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import threading
import time
from pathlib import Path
from typing import Iterator

from megarl.observability.jsonl import keep_steps_before

ENGINE_PREFIX = "engine"
"""Lanes named ``engine*`` are rollout engines (``timeline/generate_s``)."""
RANK_PREFIX = "rank"
"""Lanes named ``rank*`` are training ranks (``timeline/train_s``)."""

Interval = tuple[float, float]


def union(intervals: list[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same points as ``intervals``."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def length(intervals: list[Interval]) -> float:
    """Total length of sorted, disjoint intervals."""
    return sum(end - start for start, end in intervals)


def intersection(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Intersection of two lists of sorted, disjoint intervals (a two-pointer sweep)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def read_timeline(path: str | os.PathLike) -> list[dict]:
    """The lines of a timeline file. A torn last line (the run was killed while writing it) is
    skipped; a bad line elsewhere raises ``ValueError`` naming the file and line."""
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            if number == len(lines):
                break
            raise ValueError(f"{path}: line {number} is not JSON ({err}): {line[:80]!r}") from err
    return rows


class Timeline:
    def __init__(self, path: str | os.PathLike | None, *, resume_step: int | None = None):
        self.path = Path(path) if path is not None else None
        self.t0 = time.monotonic()
        self._lock = threading.Lock()          # guards the span lists (several recording threads)
        self._file_lock = threading.Lock()     # one step's lines stay together in the file
        self._spans: list[tuple[str, str, float, float]] = []
        self._open: dict[int, tuple[str, str, float]] = {}
        self._tokens = itertools.count()
        self._lanes: set[str] = set()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path is not None and self.path.exists():
            rows = read_timeline(self.path)
            if resume_step is not None:
                rows = keep_steps_before(self.path, rows, resume_step)
            self.t0 -= max((r["end"] for r in rows), default=0.0)

    def record(self, lane: str, phase: str, start: float, end: float) -> None:
        """A finished span of ``lane`` (``time.monotonic()`` seconds)."""
        if end < start:
            raise ValueError(f"timeline span {lane}/{phase}: end {end} is before start {start}")
        with self._lock:
            self._lanes.add(lane)
            self._spans.append((lane, phase, start, end))

    @contextlib.contextmanager
    def spans(self, lanes: list[str], phase: str) -> Iterator[None]:
        """Records [enter, exit] on every lane of ``lanes`` (all ranks run a collective phase);
        until the exit the spans are open and count as busy up to a window's end."""
        start = time.monotonic()
        with self._lock:
            tokens = [next(self._tokens) for _ in lanes]
            for token, lane in zip(tokens, lanes):
                self._lanes.add(lane)
                self._open[token] = (lane, phase, start)
        try:
            yield
        finally:
            end = time.monotonic()
            with self._lock:
                for token in tokens:
                    lane, phase, start = self._open.pop(token)
                    self._spans.append((lane, phase, start, end))

    def span(self, lane: str, phase: str):
        """``with timeline.span("engine0", "generate"): ...``"""
        return self.spans([lane], phase)

    def step_metrics(self, step: int, start: float, end: float) -> dict[str, float]:
        """``timeline/*`` metrics of the window [start, end] (``time.monotonic()`` seconds) and
        the step's lines in the file (see the module docstring)."""
        if end < start:
            raise ValueError(f"timeline step {step}: window end {end} is before its start {start}")
        with self._lock:
            spans = self._spans + [(lane, phase, s, end) for lane, phase, s in self._open.values()]
            lanes = sorted(self._lanes)
            self._spans = [sp for sp in self._spans if sp[3] > start]
        clipped = sorted(((lane, phase, max(s, start), min(e, end)) for lane, phase, s, e in spans
                          if min(e, end) > max(s, start)), key=lambda sp: (sp[2], sp[0]))
        per_lane: dict[str, list[Interval]] = {lane: [] for lane in lanes}
        for lane, _, s, e in clipped:
            per_lane[lane].append((s, e))
        busy = {lane: union(intervals) for lane, intervals in per_lane.items()}
        engines = union([iv for lane, ivs in busy.items() if lane.startswith(ENGINE_PREFIX) for iv in ivs])
        ranks = union([iv for lane, ivs in busy.items() if lane.startswith(RANK_PREFIX) for iv in ivs])
        window = end - start
        metrics = {"timeline/step_s": window, "timeline/generate_s": length(engines),
                   "timeline/train_s": length(ranks), "timeline/overlap_s": length(intersection(engines, ranks))}
        for lane, intervals in busy.items():
            metrics[f"timeline/{lane}_busy_s"] = length(intervals)
            metrics[f"timeline/{lane}_idle_s"] = window - length(intervals)
        if self.path is not None:
            self._write(step, start, end, clipped)
        return metrics

    def _write(self, step: int, start: float, end: float, clipped: list[tuple[str, str, float, float]]):
        def rel(t: float) -> float:
            return round(t - self.t0, 3)

        lines = [{"step": step, "start": rel(start), "end": rel(end)}]
        lines += [{"step": step, "lane": lane, "phase": phase, "start": rel(s), "end": rel(e)}
                  for lane, phase, s, e in clipped]
        with self._file_lock, open(self.path, "a") as fh:
            fh.write("".join(json.dumps(line) + "\n" for line in lines))
            fh.flush()
            os.fsync(fh.fileno())
