"""A quiet console: megarl's own lines on the terminal, every other library's output in a log file.

A run prints its progress line, the per-step metrics table and megarl's one-line messages (the
``megarl`` logger); Ray, vLLM, megatron-core, transformers and Python warnings from outside
megarl go to ``<run_dir>/logs/`` (``driver.log`` for the controller, ``worker_<rank>.log`` per
HybridWorker, ``engine_<k>.log`` per rollout engine actor). The redirection is done on file
descriptors 1 and 2, not on ``sys.stdout``, so C++ libraries (gloo, Ray's core worker) and child
processes (vLLM's engine core and workers, reward workers) land in the file too.

``logging.level`` sets the ``megarl`` logger's level and is the floor of what third-party loggers
write to the files (vLLM reads it from ``VLLM_LOGGING_LEVEL`` in its own processes). ``verbose``
(``megarl train --verbose``) leaves the descriptors alone: third-party output shows on the
terminal as it would without megarl.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Iterator, TextIO

LOGGER = "megarl"
_PACKAGE_DIR = str(Path(__file__).resolve().parents[1])
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def level_number(level: str) -> int:
    """``logging.level`` ("debug", "info", ...) as the logging module's number."""
    number = logging.getLevelName(level.upper())
    if not isinstance(number, int):
        raise ValueError(f"logging.level={level!r}: expected one of debug, info, warning, error")
    return number


def library_env(level: str) -> dict[str, str]:
    """Environment variables that set the floor in processes megarl does not configure itself
    (vLLM's engine core and workers read them at import)."""
    return {"VLLM_LOGGING_LEVEL": level.upper()}


def _show_warning(message, category, filename, lineno, file=None, line=None):
    """``warnings.showwarning`` of a quiet process: megarl's own warnings are one-line messages
    of the megarl logger (the terminal), the others go to the ``py.warnings`` logger (the file)."""
    if str(Path(filename).resolve()).startswith(_PACKAGE_DIR):
        logging.getLogger(LOGGER).warning("%s: %s", category.__name__, message)
    else:
        logging.getLogger("py.warnings").warning(
            warnings.formatwarning(message, category, filename, lineno, line).rstrip())


def _attach_file(log_file: Path, level: str) -> logging.Handler:
    """Route Python logging at ``level`` and above, the warnings and sys.stdout/sys.stderr into
    ``log_file``; point descriptors 1 and 2 at it. Returns the root logger's new handler."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.update(library_env(level))
    # line-buffered: a process killed later keeps what it printed
    handler = logging.StreamHandler(open(log_file, "a", buffering=1))
    handler.setFormatter(logging.Formatter(_FORMAT))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(level_number(level))
    warnings.showwarning = _show_warning
    # Python-level writes too, where sys.stdout/sys.stderr are not the descriptors' own streams
    # (pytest's capture, notebooks)
    sys.stdout = sys.stderr = handler.stream
    return handler


def redirect_process_output(log_file: str | os.PathLike, level: str) -> None:
    """For a process that only writes logs (a Ray actor): everything it and its children print
    goes to ``log_file`` from now on, Python loggers from ``level`` up."""
    _attach_file(Path(log_file), level)
    logging.getLogger(LOGGER).setLevel(level_number(level))


@contextlib.contextmanager
def run_console(log_dir: str | os.PathLike, level: str, verbose: bool = False) -> Iterator[TextIO]:
    """The controller's console for one run: yields the stream megarl's own output is written to
    (the terminal) while the process's descriptors 1 and 2 point at ``log_dir/driver.log``.
    Everything is restored on exit; an exception's traceback is also written to the log."""
    logger = logging.getLogger(LOGGER)
    root = logging.getLogger()
    old_level, old_propagate, old_showwarning, old_root_level = (logger.level, logger.propagate,
                                                                 warnings.showwarning, root.level)
    logger.setLevel(level_number(level))
    old_streams = sys.stdout, sys.stderr
    if verbose:
        console, saved, file_handler = sys.stdout, None, None
    else:
        saved = (os.dup(1), os.dup(2))
        console = os.fdopen(os.dup(1), "w", buffering=1)   # a line-buffered copy of the terminal
        file_handler = _attach_file(Path(log_dir) / "driver.log", level)
    handler = logging.StreamHandler(console)
    handler.setFormatter(logging.Formatter("megarl: %(message)s"))
    logger.addHandler(handler)
    logger.propagate = not verbose   # quiet: megarl's lines also reach the file through the root
    try:
        yield console
    except BaseException:
        if file_handler is not None:
            file_handler.stream.write(traceback.format_exc())
        raise
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        logger.propagate = old_propagate
        if saved is not None:
            sys.stdout.flush()
            sys.stdout, sys.stderr = old_streams
            root.removeHandler(file_handler)
            root.setLevel(old_root_level)
            file_handler.close()
            file_handler.stream.close()
            warnings.showwarning = old_showwarning
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            console.close()
