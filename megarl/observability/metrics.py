"""Per-step metrics: a stdout table, JSONL, the run's trackers (TensorBoard, wandb, mlflow) and a live progress line.

One :class:`MetricsLogger` per run (on the controller). ``log(step, metrics)`` writes every sink;
values must be plain numbers. JSONL lines are flushed per step so a killed run keeps every
completed step, and a step that raises under ``with logger.step(s) as m:`` still writes the
metrics it reached (how a failed run shows what failed); on resume the logger drops lines of steps
at or after the resumed step, so the file never holds a step twice.

The terminal table groups keys by their prefix (``reward/mean`` -> ``reward``), several per line:
one step fits in about a dozen lines; the JSONL file has every key under its full name.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path

from megarl.observability.jsonl import keep_steps_before, read_jsonl


class PhaseTimer:
    """Accumulates wall seconds per named phase: ``with timer("generate"): ...``."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def __call__(self, phase: str):
        return _Phase(self, phase)

    def pop(self) -> dict[str, float]:
        out, self.seconds = {f"time/{k}_s": v for k, v in self.seconds.items()}, {}
        return out


class _Phase:
    def __init__(self, timer: PhaseTimer, phase: str):
        self.timer, self.phase = timer, phase

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        self.timer.seconds[self.phase] = self.timer.seconds.get(self.phase, 0.0) + time.perf_counter() - self.t0


TABLE_WIDTH = 110
"""Characters per line of the terminal table."""


def _fmt(value) -> str:
    if isinstance(value, float):
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
            return f"{value:.3e}"
        return f"{value:.4f}"
    return str(value)


class MetricsLogger:
    def __init__(self, run_dir: str | os.PathLike, *, stdout: bool = True, jsonl: bool = True,
                 tensorboard: bool = True, progress: bool = True, total_steps: int | None = None,
                 resume_step: int | None = None, stream=None, trackers: list | None = None):
        """``trackers``: started :class:`megarl.observability.trackers.Guarded` trackers (wandb,
        mlflow, ...) that get every step too; ``tensorboard`` adds TensorBoard to them."""
        from megarl.observability.trackers import Guarded, TensorBoard

        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.stdout, self.progress, self.total_steps = stdout, progress, total_steps
        self.stream = stream or sys.stdout
        self.jsonl_path = self.run_dir / "metrics.jsonl" if jsonl else None
        if self.jsonl_path is not None and resume_step is not None and self.jsonl_path.exists():
            self._truncate_from(resume_step)
        self.trackers = list(trackers or [])
        if tensorboard and not any(t.name == "tensorboard" for t in self.trackers):
            self.trackers.insert(0, Guarded(TensorBoard(self.run_dir, None)))
        self._t0 = time.time()

    def _truncate_from(self, step: int):
        keep_steps_before(self.jsonl_path, read_jsonl(self.jsonl_path), step)

    def log(self, step: int, metrics: dict[str, float]):
        clean = {}
        for key, value in metrics.items():
            value = float(value) if not isinstance(value, (int, float)) else value
            if isinstance(value, float) and not math.isfinite(value):
                value = None if math.isnan(value) else value
            clean[key] = value
        if self.jsonl_path is not None:
            with open(self.jsonl_path, "a") as fh:
                fh.write(json.dumps({"step": step, **clean}) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
        for tracker in self.trackers:
            tracker.call("metrics", step, clean)
        if self.stdout:
            self._print_table(step, clean)

    def add_text(self, tag: str, text: str, step: int) -> None:
        """A text entry in every tracker (TensorBoard text, a wandb summary field, an mlflow tag)."""
        for tracker in self.trackers:
            tracker.call("text", tag, text, step)

    def add_samples(self, step: int, rows: list[dict]) -> None:
        """The sample table of ``step`` (rows as ``megarl.observability.generations`` records them)."""
        for tracker in self.trackers:
            tracker.call("samples", step, [{"step": step, **r} for r in rows])

    @contextlib.contextmanager
    def step(self, step: int):
        """``with logger.step(s) as m:`` fill ``m``; it is logged when the block ends, also when
        it raises (with the exception's ``metrics`` attribute when it has one)."""
        metrics: dict = {}
        try:
            yield metrics
        except BaseException as err:
            metrics.update(getattr(err, "metrics", None) or {})
            if metrics:
                self.log(step, metrics)
            raise
        self.log(step, metrics)

    def _print_table(self, step: int, metrics: dict):
        total = f"/{self.total_steps}" if self.total_steps else ""
        lines = [f"step {step}{total}  ({time.time() - self._t0:.0f}s elapsed)"]
        groups: dict[str, list[str]] = {}
        for key in sorted(metrics):
            group, _, name = key.rpartition("/")
            groups.setdefault(group, []).append(f"{name}={_fmt(metrics[key])}")
        width = max((len(g) for g in groups), default=0)
        for group, cells in groups.items():
            rows, row = [], []
            for cell in cells:   # as many cells per line as fit in TABLE_WIDTH
                if row and width + 4 + len("  ".join(row + [cell])) > TABLE_WIDTH:
                    rows.append(row)
                    row = []
                row.append(cell)
            rows.append(row)
            lines.extend(f"  {group if i == 0 else '':<{width}}  " + "  ".join(r) for i, r in enumerate(rows))
        print("\n".join(lines), file=self.stream, flush=True)

    def progress_line(self, step: int, phase: str, **fields):
        """One-line live status (carriage-return updated on a terminal)."""
        if not self.progress:
            return
        total = f"/{self.total_steps}" if self.total_steps else ""
        extra = " ".join(f"{k}={_fmt(v)}" for k, v in fields.items())
        end = "\r" if getattr(self.stream, "isatty", lambda: False)() else "\n"
        print(f"[step {step}{total}] {phase:<10s} {extra}", end=end, file=self.stream, flush=True)

    def close(self, status: str = "finished"):
        """End the trackers' runs: ``status`` finished, failed or killed (interrupted)."""
        for tracker in self.trackers:
            tracker.call("close", status)
        self.trackers = []

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        # an error is an Exception; a stop (KeyboardInterrupt, megarl's RunInterrupted) is not
        self.close("finished" if exc_type is None else "failed" if issubclass(exc_type, Exception) else "killed")


def open_metrics(cfg, run_dir: str | os.PathLike, *, total_steps: int, start: int, stream) -> MetricsLogger:
    """The run's :class:`MetricsLogger` as ``cfg.logging`` says, with its trackers (started after
    checkpoint ``start``: > 0 continues the trackers' runs)."""
    from megarl.observability.trackers import open_trackers

    lg = cfg.logging
    return MetricsLogger(run_dir, stdout=lg.stdout, jsonl="jsonl" in lg.trackers, tensorboard=False,
                         progress=lg.progress, total_steps=total_steps, resume_step=start + 1, stream=stream,
                         trackers=open_trackers(cfg, run_dir, resumed=start > 0))
