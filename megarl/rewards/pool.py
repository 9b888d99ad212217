"""Score a batch of responses in worker processes, each call under a timeout, never killing the run.

:class:`RewardPool` runs ``fn(response, answer, **extra)`` in a ``ProcessPoolExecutor`` (spawn
context by default; forkserver also works; fork is refused because the driver holds threads and
CUDA/Ray state). Failure handling:

- an exception in ``fn`` (or a non-numeric / non-finite result) gives reward 0.0 and counts in
  ``n_errors``;
- a call still running ``timeout_s`` after it started gives reward 0.0 and counts in
  ``n_timeouts``. A process pool cannot cancel a running call, so the pool is torn down (its
  workers are SIGKILLed) and replaced; the other calls that were running on it are resubmitted
  to the new pool;
- a worker that dies (segfault, ``os._exit``) breaks the whole pool: the calls in flight are
  resubmitted once on a fresh pool; a call that breaks a pool twice counts as an error.

Timing: at most ``num_workers`` calls are in flight, so a submitted call starts at once on an
idle worker and its deadline is measured from submission. Workers are started and warmed up
(modules imported) before the first batch and after every replacement, so process start-up does
not eat into the first calls' timeouts.

math-verify inside workers: it uses ``signal.alarm``; each call runs in the worker's main thread,
where that works (tests/unit/test_rewards.py checks it).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import math
import multiprocessing
import os
import pickle
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

from megarl.rewards.registry import get_reward_fn

__all__ = ["RewardBatchResult", "RewardPool"]

logger = logging.getLogger(__name__)

_MAX_ERROR_MESSAGES = 8


@dataclass
class RewardBatchResult:
    rewards: list[float]
    """One reward per response, in input order; 0.0 where the call failed or timed out."""
    n_errors: int = 0
    """Calls that raised, returned a non-finite or non-numeric value, or crashed their worker."""
    n_timeouts: int = 0
    """Calls still running after ``timeout_s``."""
    errors: list[str] = field(default_factory=list)
    """The first few failure messages, ``"sample <i>: <error>"``."""

    @property
    def stats(self) -> dict[str, int]:
        return {"n_errors": self.n_errors, "n_timeouts": self.n_timeouts}


def _worker_init() -> None:
    # Import the heavy modules once per worker, before any timed call.
    import megarl.rewards.math  # noqa: F401

    try:
        import math_verify  # noqa: F401
    except ImportError:
        pass


def _worker_pid(delay_s: float) -> int:
    time.sleep(delay_s)
    return os.getpid()


def _call_reward(fn: Callable[..., Any], response: str, answer: str, extra: Mapping[str, Any]) -> float:
    value = fn(response, answer, **extra)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            value = float(value)  # numpy / torch scalars
        except (TypeError, ValueError):
            raise TypeError(f"reward function returned {type(value).__name__}, expected a float") from None
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"reward function returned a non-finite value {value}")
    return value


class RewardPool:
    """A process pool that scores batches with per-call timeouts; use as a context manager or ``close()``."""

    def __init__(
        self,
        num_workers: int = 2,
        timeout_s: float = 10.0,
        *,
        mp_context: str = "spawn",
        startup_timeout_s: float = 120.0,
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if mp_context not in ("spawn", "forkserver"):
            raise ValueError(f"mp_context must be 'spawn' or 'forkserver', got {mp_context!r}")
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.startup_timeout_s = float(startup_timeout_s)
        self._context = multiprocessing.get_context(mp_context)
        self._executor: cf.ProcessPoolExecutor | None = None
        self.num_restarts = 0
        """Pools replaced after a timeout or a crashed worker (for monitoring)."""

    # -- pool lifecycle ---------------------------------------------------------------------------

    def _start(self) -> cf.ProcessPoolExecutor:
        executor = cf.ProcessPoolExecutor(self.num_workers, mp_context=self._context, initializer=_worker_init)
        # Spawned workers start on demand; keep submitting short tasks until every worker has
        # answered once, so that start-up and imports are done before any timed call.
        deadline = time.monotonic() + self.startup_timeout_s
        seen: set[int] = set()
        while len(seen) < self.num_workers:
            futures = [executor.submit(_worker_pid, 0.05) for _ in range(self.num_workers)]
            remaining = deadline - time.monotonic()
            done, not_done = cf.wait(futures, timeout=max(remaining, 0.0))
            if not_done:
                self._kill(executor)
                raise RuntimeError(f"reward workers did not start within startup_timeout_s={self.startup_timeout_s}")
            seen.update(f.result() for f in done)
        return executor

    @staticmethod
    def _kill(executor: cf.ProcessPoolExecutor) -> None:
        # ProcessPoolExecutor cannot cancel a running call; SIGKILL its workers (private
        # ``_processes``: Python 3.14 adds kill_workers() for this).
        processes = list((getattr(executor, "_processes", None) or {}).values())
        executor.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            if process.is_alive():
                process.kill()
        for process in processes:
            process.join(timeout=5.0)

    def _replace(self) -> None:
        if self._executor is not None:
            self._kill(self._executor)
        self._executor = None
        self.num_restarts += 1

    def close(self) -> None:
        if self._executor is not None:
            self._kill(self._executor)
            self._executor = None

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -- scoring ----------------------------------------------------------------------------------

    def score(
        self,
        fn: str | Callable[..., Any],
        responses: Sequence[str],
        answers: Sequence[str],
        extras: Sequence[Mapping[str, Any]] | None = None,
    ) -> RewardBatchResult:
        """Score ``fn(responses[i], answers[i], **extras[i])`` for every i; never raises for a failing call.

        ``fn`` is a registered reward name, a dotted path, or a module-level function (it is sent
        to the workers by reference, so lambdas and closures are refused up front).
        """
        fn = get_reward_fn(fn)
        try:
            pickle.dumps(fn)
        except Exception as exc:
            raise TypeError(f"reward function {fn!r} cannot be sent to worker processes (define it at module level): {exc}") from exc
        if len(responses) != len(answers):
            raise ValueError(f"got {len(responses)} responses but {len(answers)} answers")
        if extras is None:
            extras = [{}] * len(responses)
        elif len(extras) != len(responses):
            raise ValueError(f"got {len(responses)} responses but {len(extras)} extras")

        result = RewardBatchResult(rewards=[0.0] * len(responses))

        def fail(index: int, kind: str, message: str) -> None:
            if kind == "timeout":
                result.n_timeouts += 1
            else:
                result.n_errors += 1
            if len(result.errors) < _MAX_ERROR_MESSAGES:
                result.errors.append(f"sample {index}: {message}")

        pending: deque[int] = deque(range(len(responses)))
        crashes = [0] * len(responses)
        in_flight: dict[cf.Future, tuple[int, float]] = {}
        while pending or in_flight:
            if self._executor is None:
                self._executor = self._start()
            broken = False
            while pending and len(in_flight) < self.num_workers:
                index = pending.popleft()
                try:
                    future = self._executor.submit(_call_reward, fn, responses[index], answers[index], dict(extras[index]))
                except BrokenProcessPool:
                    pending.appendleft(index)
                    broken = True
                    break
                in_flight[future] = (index, time.monotonic() + self.timeout_s)
            if not broken:
                next_deadline = min(deadline for _, deadline in in_flight.values())
                done, _ = cf.wait(in_flight, timeout=max(next_deadline - time.monotonic(), 0.0), return_when=cf.FIRST_COMPLETED)
                for future in done:
                    index, _ = in_flight.pop(future)
                    try:
                        result.rewards[index] = future.result()
                    except BrokenProcessPool:
                        broken = True
                        crashes[index] += 1
                        if crashes[index] >= 2:
                            fail(index, "error", "worker process died (twice)")
                        else:
                            pending.appendleft(index)
                    except Exception as exc:
                        fail(index, "error", f"{type(exc).__name__}: {exc}")
                now = time.monotonic()
                expired = [future for future, (_, deadline) in in_flight.items() if deadline <= now]
                for future in expired:
                    index, _ = in_flight.pop(future)
                    fail(index, "timeout", f"timed out after {self.timeout_s}s")
                if expired:
                    broken = True
            if broken:
                # Calls still on the dying pool are innocent: run them again on the new one.
                for index, _ in sorted(in_flight.values(), reverse=True):
                    pending.appendleft(index)
                in_flight.clear()
                self._replace()
        if result.n_errors or result.n_timeouts:
            logger.warning(
                "reward %s: %d errors, %d timeouts in %d samples; first: %s",
                getattr(fn, "__name__", fn), result.n_errors, result.n_timeouts, len(responses), result.errors[:1],
            )
        return result
