"""Score a batch of responses in worker processes, each call under a timeout, never killing the run
for a failing call (only for a function that kills every worker it runs on).

:class:`RewardPool` runs ``fn(response, answer, **extra)`` in a ``ProcessPoolExecutor`` (spawn by
default, forkserver works; fork is refused: the driver holds threads and CUDA/Ray state), passing
only the keywords ``fn`` accepts (all with ``**extra``, else those its signature names). Failures:
an exception or a non-finite result scores 0.0 (``n_errors``); a call past ``timeout_s`` scores
0.0 (``n_timeouts``) and, since a running call cannot be cancelled, the pool is killed and
replaced and its other calls resubmitted; a dying worker breaks the pool and its calls are
resubmitted once (twice is an error); ``max_consecutive_crashes`` breaks in a row raise
:class:`RewardWorkerCrash` (going on would train on all-zero rewards). Workers ignore SIGINT: the
controller decides how the run stops.

At most ``num_workers`` calls are in flight, so a deadline counts from submission; workers are
warmed up (rewards, math-verify, the function's module imported) before the first batch and after
every replacement. Each call runs in the worker's main thread, where math-verify's
``signal.alarm`` works.
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib
import inspect
import logging
import math
import multiprocessing
import os
import pickle
import signal
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

from megarl.rewards.registry import get_reward_fn

__all__ = ["RewardBatchResult", "RewardPool", "RewardWorkerCrash"]

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


class RewardWorkerCrash(RuntimeError):
    """The reward function's worker processes died on every call (see ``max_consecutive_crashes``)."""


def _worker_init(owner_pid: int | None = None) -> None:
    """A worker ignores SIGINT and dies with the process that owns the pool (Linux
    ``PR_SET_PDEATHSIG``): a controller killed with SIGKILL while it spawns a replacement worker
    leaves no worker blocked forever on the pool's queue."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(owner_pid)
    # Import the heavy modules once per worker, before any timed call.
    import megarl.rewards.math  # noqa: F401

    try:
        import math_verify  # noqa: F401
    except ImportError:
        pass


def _die_with_parent(owner_pid: int | None) -> None:
    """SIGKILL this process when its parent exits; exit now when the owner (a spawn worker's
    parent; None: a forkserver's worker, whose parent is the fork server) is already gone."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return   # not Linux: the pool's own shutdown is the only cleanup
    if owner_pid is not None and os.getppid() != owner_pid:
        os._exit(1)


def _worker_pid(delay_s: float, module: str | None = None) -> int:
    if module is not None:   # the reward's own module: its imports must not eat into a call's timeout
        importlib.import_module(module)
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


def _keyword_filter(fn: Callable[..., Any]) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
    """The module docstring's rule: a sample's extras -> the keywords ``fn`` accepts."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):   # no signature to read (some builtins): pass every column
        return dict
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    bound = set(positional[:2])   # response and answer, passed by position
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return lambda extra: {k: v for k, v in extra.items() if k not in bound}
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - bound
    return lambda extra: {k: v for k, v in extra.items() if k in named}


def _name(fn: Callable[..., Any]) -> str:
    """``module:function`` (the dotted-path form ``data.reward`` accepts), for messages."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    return f"{module}:{qualname}" if module and qualname else repr(fn)


def _describe_exit(exit_codes: Sequence[int | None]) -> str:
    """The dead worker's exit status; the pool SIGTERMs the other workers of a broken pool, so a
    SIGTERM is reported only when no worker ended otherwise."""
    known = [code for code in exit_codes if code is not None]
    own = [code for code in known if code != -signal.SIGTERM] or known
    if not own:
        return "exit status unknown"
    code = own[0]
    return f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


class RewardPool:
    """A process pool that scores batches with per-call timeouts; use as a context manager or ``close()``."""

    def __init__(
        self,
        num_workers: int = 2,
        timeout_s: float = 10.0,
        *,
        mp_context: str = "spawn",
        startup_timeout_s: float = 120.0,
        max_consecutive_crashes: int = 3,
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if mp_context not in ("spawn", "forkserver"):
            raise ValueError(f"mp_context must be 'spawn' or 'forkserver', got {mp_context!r}")
        if max_consecutive_crashes < 1:
            raise ValueError(f"max_consecutive_crashes must be >= 1, got {max_consecutive_crashes}")
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.startup_timeout_s = float(startup_timeout_s)
        self._context = multiprocessing.get_context(mp_context)
        self._executor: cf.ProcessPoolExecutor | None = None
        self.max_consecutive_crashes = max_consecutive_crashes
        """Pool breaks in a row, with no call finishing in between, that raise :class:`RewardWorkerCrash`."""
        self.num_restarts = 0
        """Pools replaced after a timeout or a crashed worker (for monitoring)."""
        self._consecutive_crashes = 0

    # -- pool lifecycle ---------------------------------------------------------------------------

    def _start(self, fn: Callable[..., Any]) -> cf.ProcessPoolExecutor:
        owner = os.getpid() if self._context.get_start_method() == "spawn" else None   # a spawn worker's parent
        executor = cf.ProcessPoolExecutor(self.num_workers, mp_context=self._context, initializer=_worker_init,
                                         initargs=(owner,))
        # Spawned workers start on demand; keep submitting short tasks until every worker has
        # answered once, so that start-up and imports are done before any timed call.
        deadline = time.monotonic() + self.startup_timeout_s
        seen: set[int] = set()
        while len(seen) < self.num_workers:
            try:
                futures = [executor.submit(_worker_pid, 0.05, getattr(fn, "__module__", None))
                           for _ in range(self.num_workers)]
                remaining = deadline - time.monotonic()
                done, not_done = cf.wait(futures, timeout=max(remaining, 0.0))
                if not_done:
                    self._kill(executor)
                    raise RuntimeError(f"reward workers did not start within "
                                       f"startup_timeout_s={self.startup_timeout_s}")
                seen.update(f.result() for f in done)
            except BrokenProcessPool:
                exit_status = _describe_exit(self._kill(executor))
                raise RewardWorkerCrash(
                    f"reward worker processes died while starting ({exit_status}); a spawned worker imports "
                    "megarl.rewards and re-imports the driver's main script: check that "
                    "`python -c 'import megarl.rewards.math'` works and that the script guards its code with "
                    "`if __name__ == '__main__':`"
                ) from None
            except ImportError as exc:
                self._kill(executor)
                raise ImportError(f"reward function {_name(fn)}: its module does not import in a reward worker "
                                  f"process (a fresh interpreter with the driver's sys.path): {exc}") from exc
        return executor

    @staticmethod
    def _processes(executor: cf.ProcessPoolExecutor | None) -> list:
        # private ``_processes`` (pid -> Process): Python 3.14 adds kill_workers() for what _kill does
        return list((getattr(executor, "_processes", None) or {}).values())

    @classmethod
    def _kill(cls, executor: cf.ProcessPoolExecutor) -> list[int | None]:
        """SIGKILL the workers (a running call cannot be cancelled otherwise); their exit codes.

        The executor's manager thread reaps a dead worker itself (``join``); a status read while it
        does can find the child gone and the exit code not yet stored (measured under load: 3 in
        80 crashes read no code), so the codes are read after that thread has ended."""
        processes = cls._processes(executor)
        manager = getattr(executor, "_executor_manager_thread", None)   # private, like _processes
        executor.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            if process.is_alive():
                process.kill()
        for process in processes:
            process.join(timeout=5.0)
        if manager is not None:
            manager.join(timeout=5.0)   # it ends once the workers are gone (broken pool or shutdown)
        return [process.exitcode for process in processes]

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the current pool's workers (none before the first batch or after close)."""
        return [process.pid for process in self._processes(self._executor)]

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
        """Score ``fn(responses[i], answers[i], **extras[i])`` for every i (keywords that ``fn`` does not
        accept are left out, see the module docstring); never raises for a failing call, only
        :class:`RewardWorkerCrash` when the workers die on every call.

        ``fn`` is a registered reward name, a dotted path, or a module-level function (it is sent
        to the workers by reference, so lambdas and closures are refused up front).
        """
        fn = get_reward_fn(fn)
        try:
            pickle.dumps(fn)
        except Exception as exc:
            raise TypeError(f"reward function {fn!r} cannot be sent to worker processes "
                            f"(define it at module level): {exc}") from exc
        if len(responses) != len(answers):
            raise ValueError(f"got {len(responses)} responses but {len(answers)} answers")
        if extras is None:
            extras = [{}] * len(responses)
        elif len(extras) != len(responses):
            raise ValueError(f"got {len(responses)} responses but {len(extras)} extras")
        keywords = _keyword_filter(fn)
        kwargs = [keywords(extra) for extra in extras]

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
                self._executor = self._start(fn)
            crashed = expired = finished = False
            died_twice: list[int] = []
            while pending and len(in_flight) < self.num_workers:
                index = pending.popleft()
                try:
                    future = self._executor.submit(_call_reward, fn, responses[index], answers[index], kwargs[index])
                except BrokenProcessPool:
                    pending.appendleft(index)
                    crashed = True
                    break
                in_flight[future] = (index, time.monotonic() + self.timeout_s)
            if not crashed:
                next_deadline = min(deadline for _, deadline in in_flight.values())
                done, _ = cf.wait(in_flight, timeout=max(next_deadline - time.monotonic(), 0.0),
                                  return_when=cf.FIRST_COMPLETED)
                for future in done:
                    index, _ = in_flight.pop(future)
                    try:
                        result.rewards[index] = future.result()
                        finished = True
                    except BrokenProcessPool:
                        crashed = True
                        crashes[index] += 1
                        if crashes[index] >= 2:
                            died_twice.append(index)
                        else:
                            pending.appendleft(index)
                    except Exception as exc:
                        finished = True   # the call failed, its worker lives
                        fail(index, "error", f"{type(exc).__name__}: {exc}")
                now = time.monotonic()
                expired_futures = [future for future, (_, deadline) in in_flight.items() if deadline <= now]
                for future in expired_futures:
                    index, _ = in_flight.pop(future)
                    fail(index, "timeout", f"timed out after {self.timeout_s}s")
                expired = bool(expired_futures)
            if finished:
                self._consecutive_crashes = 0
            if crashed or expired:
                # Calls still on the dying pool are innocent: run them again on the new one.
                for index, _ in sorted(in_flight.values(), reverse=True):
                    pending.appendleft(index)
                in_flight.clear()
                exit_status = _describe_exit(self._kill(self._executor))
                self._executor = None
                for index in died_twice:
                    fail(index, "error", f"worker process died twice ({exit_status})")
                if crashed:
                    self._consecutive_crashes += 1
                    if self._consecutive_crashes >= self.max_consecutive_crashes:
                        self._consecutive_crashes = 0
                        raise RewardWorkerCrash(
                            f"reward function {_name(fn)}: its worker process died {self.max_consecutive_crashes} "
                            f"times in a row with no call finishing in between (last: {exit_status}); the reward "
                            f"pool is shut down. The function ends the process it runs in (a crash in native code, "
                            f"os._exit, the out-of-memory killer): call it on one sample in a plain Python process "
                            f"to see why, and make it raise instead (a raising call scores 0 and the run goes on)"
                        )
                self.num_restarts += 1
        if result.n_errors or result.n_timeouts:
            logger.warning(
                "reward %s: %d errors, %d timeouts in %d samples; first: %s",
                _name(fn), result.n_errors, result.n_timeouts, len(responses), result.errors[:1],
            )
        return result
