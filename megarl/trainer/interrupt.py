"""SIGINT/SIGTERM of a training run: stop at the next safe point, or at once on a second signal.

The first signal only sets a flag (and says so on the console); the loop
(:func:`megarl.trainer.loop.train`) reads it at its safe points:

- between phases before the step's first optimizer update (after generation and scoring, after
  the log-probs): the step is abandoned - its metrics are not written, the KL controller goes
  back to its value at the step's start - nothing else a checkpoint holds has changed yet;
- once an update has run (critic or policy), the step finishes (weight sync, eval, metrics,
  scheduled checkpoint) and the run stops after it.

The phase in flight always finishes: a Ray call is not interrupted mid-collective. Generation is
the long one: the rollout engines' actors are busy until their requests finish, and a running
generation is not cut short (its samples would be lost), so the stop waits for at most one
generate call (``data.prompts_per_step`` x ``rollout.n`` samples up to
``rollout.max_response_tokens``; with dynamic sampling one round per call) plus its scoring.
Then the run writes a checkpoint of the last completed step when it has none
(``checkpoint.save_on_interrupt``), stops the engines, reward workers and Ray, and ``train``
raises :class:`RunInterrupted`; the CLI prints where to resume from and exits with 128 + the
signal number (130 SIGINT, 143 SIGTERM).

A second signal raises KeyboardInterrupt in the main thread: a blocking ``ray.get`` passes it on
at once (Ray runs Python's signal handlers while it waits and returns on KeyboardInterrupt; any
other exception raised there would surface only when the call ends, as a SystemError), the run
releases its processes without waiting for busy actors and writes no checkpoint. Later signals
are ignored so that this release is not interrupted in turn.

The handlers are installed by :meth:`StopRequest.arm` in the main thread only, after Ray has
started (``ray.init`` installs its own SIGTERM handler), and the previous ones are restored when
the run has released everything. A terminal's Ctrl-C reaches the whole foreground process
group: besides the driver, that is Ray's daemons (they block SIGINT), the reward pool's workers
(they ignore it, :mod:`megarl.rewards.pool`) and multiprocessing's resource tracker (ignores it);
Ray's actors and their vLLM processes run in process groups of their own.
"""
from __future__ import annotations

import os
import signal
import threading
from typing import TextIO

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StepAbandoned(Exception):
    """Raised at a safe point of a step whose updates have not started, when a stop was requested."""


class RunInterrupted(BaseException):
    """``train`` stopped early on SIGINT/SIGTERM, after releasing everything it started.

    A BaseException like KeyboardInterrupt: ``except Exception`` clean-up code lets it through."""

    def __init__(self, signum: int, last_step: int, hard: bool):
        self.signum, self.last_step, self.hard = signum, last_step, hard
        name = signal.Signals(signum).name
        how = f"at once by a second {name}" if hard else f"by {name}"
        super().__init__(f"stopped {how} after step {last_step}" if last_step else
                         f"stopped {how} before a step completed")

    @property
    def exit_code(self) -> int:
        """The shell's code of a process ended by the signal: 130 (SIGINT), 143 (SIGTERM)."""
        return 128 + self.signum


class StopRequest:
    """The stop state of one run, a context manager that restores the signal handlers on exit.

    The loop keeps ``step`` and ``phase`` (what is in flight, for the console message) and
    ``last_step`` (the last completed step) up to date."""

    def __init__(self, console: TextIO | None = None):
        self.signum: int | None = None
        self.hard = False
        self.step, self.phase, self.last_step = 0, "start-up", 0
        self._previous: dict = {}
        try:   # written with os.write from the handler: a buffered stream may be mid-write
            self._fd = console.fileno() if console is not None else None
        except (AttributeError, OSError, ValueError):   # e.g. pytest's captured sys.stdout
            self._fd = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def arm(self) -> None:
        """Install the handlers (main thread only: elsewhere Python cannot, and the run keeps the
        process's own handlers)."""
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}

    def __enter__(self) -> "StopRequest":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Restore the handlers; the KeyboardInterrupt of a second signal becomes RunInterrupted
        (Ray re-raises it as a plain KeyboardInterrupt, so the type alone does not tell)."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
        if self.hard and isinstance(exc, KeyboardInterrupt):
            raise RunInterrupted(self.signum, self.last_step, hard=True) from None

    def abandon_if_requested(self, step_metrics: dict) -> None:
        """A safe point before the step's first update: when a stop was requested, drop the step's
        metrics (``MetricsLogger.step`` writes a raising step's metrics when there are any) and
        raise StepAbandoned."""
        if self.requested:
            step_metrics.clear()
            raise StepAbandoned(f"step {self.step} abandoned after its {self.phase} phase, before any update")

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum is None:
            self.signum = signum
            doing = f"{self.phase} phase of step {self.step}" if self.step else self.phase
            self._say(f"{name}: stopping at the next safe point, once the {doing} in flight is done "
                      f"({name} again stops at once, without a checkpoint)")
        elif not self.hard:
            self.hard = True
            self._say(f"{name} again: stopping now; releasing the engines, reward workers and Ray")
            raise KeyboardInterrupt(name)

    def _say(self, message: str) -> None:
        if self._fd is not None:
            try:
                os.write(self._fd, f"megarl: {message}\n".encode())
            except OSError:
                pass


__all__ = ["RunInterrupted", "StepAbandoned", "StopRequest", "SIGNALS"]
