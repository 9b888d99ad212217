"""SIGINT/SIGTERM of a training run: stop at the next safe point, or at once on a second signal.

This module owns a run's stop state (:class:`StopRequest`: the signal handlers and the flag) and
its two outcomes: a step abandoned at a safe point (:class:`StepAbandoned`) and the run's early
end (:class:`RunInterrupted`, whose exit code is 128 + the signal number).

Choices: the first signal only sets a flag, which the loop (:func:`megarl.driver.loop.train`)
reads at its safe points: before the step's first optimizer update the step is abandoned (nothing
a checkpoint holds has changed yet); once an update has run, the step finishes and the run stops
after it. The phase in flight always finishes: a Ray call is not interrupted mid-collective, and a
running generation is not cut short (its samples would be lost). The run then writes a checkpoint
of the last completed step when it has none (``checkpoint.save_on_interrupt``) and releases its
processes. A second signal stops at once, without a checkpoint (:meth:`StopRequest._handle`).
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

    A BaseException like KeyboardInterrupt: ``except Exception`` clean-up code lets it through.
    ``train`` raises it once the run has written its checkpoint (after a first signal only) and
    stopped the engines, reward workers and Ray; the CLI prints where to resume from and exits
    with :attr:`exit_code`."""

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
    ``last_step`` (the last completed step) up to date.

    Generation is the long phase: the rollout engines' actors are busy until their requests
    finish, so a first signal waits for at most one generate call (``data.prompts_per_step`` x
    ``rollout.n`` samples up to ``rollout.max_response_tokens``; with dynamic sampling one round
    per call) plus its scoring."""

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
        process's own handlers). Called after Ray has started (``ray.init`` installs its own
        SIGTERM handler); :meth:`__exit__` restores the replaced ones once the run has released
        everything. A terminal's Ctrl-C reaches the whole foreground process group: besides the
        driver, that is Ray's daemons (they block SIGINT), the reward pool's workers (they ignore
        it, :mod:`megarl.rewards.pool`) and multiprocessing's resource tracker (ignores it); Ray's
        actors and their vLLM processes run in process groups of their own."""
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
        """A safe point before the step's first update (after generation and scoring, after the
        log-probs): when a stop was requested, drop the step's metrics (``MetricsLogger.step``
        writes a raising step's metrics when there are any) and raise StepAbandoned; the loop
        puts the KL controller back to its value at the step's start."""
        if self.requested:
            step_metrics.clear()
            raise StepAbandoned(f"step {self.step} abandoned after its {self.phase} phase, before any update")

    def _handle(self, signum: int, frame) -> None:
        """The first signal sets the flag and says so on the console. A second one raises
        KeyboardInterrupt in the main thread: a blocking ``ray.get`` passes it on at once (Ray runs
        Python's signal handlers while it waits and returns on KeyboardInterrupt; any other
        exception raised there would surface only when the call ends, as a SystemError), and the
        run releases its processes without waiting for busy actors and writes no checkpoint. Later
        signals are ignored so that this release is not interrupted in turn."""
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
