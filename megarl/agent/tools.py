"""Tools for multi-turn agent rollouts: a registry, three built-in tools and a bounded pool.

The agent loop parses a tool call ``{"name": ..., "arguments": {...}}`` from the model's output
and hands it to :meth:`ToolRegistry.call` (or :meth:`ToolRunner.submit` to run many at once). A
call never raises: a bad call (unknown tool, missing or mistyped argument) or a failing tool comes
back as ``ToolResult(content="error: ...", error=True)``, which the model sees like any result.

Built-in tools (``rollout.tools``):

- ``calculator``: arithmetic on Python's ``ast`` (no ``eval``): numbers, ``+ - * / // % **``,
  unary signs, parentheses. Integers stay exact (``2**100``, ``6/3 == 2``); an inexact division
  gives a float printed with 12 significant digits. Exponents at most :data:`CALC_MAX_EXPONENT`
  in magnitude and results at most :data:`CALC_MAX_INT_BITS` bits, so ``9**9**9`` is an error,
  not a hang.
- ``python``: runs code in a separate, limited process (:class:`PythonSandbox`, below).
- ``search``: BM25 over a small local corpus (:class:`SearchIndex`).

The python sandbox. Each call starts ``sys.executable -I -u -c <prelude>`` in a new session, in a
fresh scratch directory (removed afterwards) with a minimal environment. Three processes:

  supervisor (our child, session leader; a child subreaper, so orphans come to it)
    -> namespace init (pid 1 of a new PID namespace; reaps, passes the exit status on)
       -> the code (limits set, privileges dropped), and whatever it forks

What is enforced, and how (measured on Linux 6.18 as root; tests/unit/test_agent_tools.py):

- Wall clock: after ``timeout_s`` every process of the session except the supervisor is
  SIGKILLed (found by ``/proc/<pid>/stat`` session id, since children may change process group);
  killing the namespace init makes the kernel kill the whole PID namespace, including processes
  that called ``setsid``. The supervisor is spared so it reaps the init: this host's PID 1 does
  not reap orphans, and every orphan would stay a zombie. It is killed too if it has not exited
  ``_KILL_GRACE_S`` later. When the code's main process exits, what it started ends with it (the
  namespace ends with its init; without one the supervisor kills the rest, see Network).
- Processes: ``RLIMIT_NPROC``. Linux counts tasks (threads included) per real user id, and does not
  apply the limit to uid 0 at all (``copy_process``: ``user != INIT_USER && !capable(...)``). So a
  root parent drops the code to uid/gid 65534 ("nobody") with no_new_privs set and no capability,
  except CAP_DAC_READ_SEARCH when uid 65534 could not reach the interpreter's files otherwise (a
  pyenv under a 0700 /root, as on the test machine); the limit is the number of tasks uid 65534
  has now plus ``max_processes``. Concurrent calls under root share uid 65534's count: a fork bomb
  in one call can make forks in another fail until it is killed. A non-root parent keeps its uid
  and makes a user namespace; since kernel 5.14 the count is then per (namespace, uid), so the
  limit is ``max_processes`` plus the supervisor and init, which moved into the namespace (before
  5.14: the user's tasks now plus those). The tests run as root, so the non-root path is untested.
- CPU: niceness +``nice`` (10); ``RLIMIT_CPU`` = ceil(timeout) + 1 s per process.
- Memory and files: ``RLIMIT_AS`` = ``memory_mb`` (address space, not RSS: an allocation past it
  raises MemoryError in the code), ``RLIMIT_FSIZE`` = ``file_size_mb``, ``RLIMIT_CORE`` = 0,
  ``RLIMIT_NOFILE`` = 256.
- Network: a new network namespace (only a downed loopback; connecting anywhere fails). Root
  makes it directly, a non-root user inside the new user namespace. Where ``unshare`` is refused
  (a container's seccomp profile), the fallback is best effort only: ``socket.socket`` refuses
  AF_INET/AF_INET6 in the child, which ``_socket`` used directly gets around. Without a PID
  namespace the supervisor ends what the code leaves behind: processes of its session and its
  children (as a subreaper it inherits every orphaned descendant, also one that called ``setsid``).
- Output: stdout and stderr share one pipe, read without deadlock by a selector loop; the first
  ``output_limit`` bytes are kept and the rest counted in a marker
  ``...[output truncated: N more bytes]``; past ``_output_cap()`` bytes the process is killed.

Not enforced: reading files (the code reads what uid 65534, with CAP_DAC_READ_SEARCH every file, or
the non-root user can; /proc is the host's), disk use beyond the per-file size limit, a CPU share
(beyond the niceness; use cgroups outside).
"""

from __future__ import annotations

import ast
import concurrent.futures as cf
import functools
import heapq
import itertools
import json
import logging
import math
import operator
import os
import re
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "KNOWN_TOOLS",
    "PythonSandbox",
    "SandboxRun",
    "SearchIndex",
    "Tool",
    "ToolError",
    "ToolRegistry",
    "ToolResult",
    "ToolRunner",
    "build_registry",
    "calculator_tool",
    "evaluate_arithmetic",
    "format_number",
    "load_corpus",
    "python_tool",
    "search_tool",
    "session_processes",
]

logger = logging.getLogger(__name__)


# -- results, tools, registry ------------------------------------------------------------------

@dataclass
class ToolResult:
    content: str
    """What the model sees (an error starts with ``error:``)."""
    error: bool = False
    """The call failed: bad arguments, an exception, a non-zero exit status, a timeout."""
    timeout: bool = False
    """The call ran past its wall-clock limit (``error`` is then True too)."""
    seconds: float = 0.0
    """Wall time of the call."""


class ToolError(ValueError):
    """An expected failure of a tool call; its message is shown to the model as ``error: <msg>``."""


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    """JSON schema of the arguments: ``{"type": "object", "properties": {...}, "required": [...]}``."""
    fn: Callable[[dict[str, Any]], str | ToolResult]
    """Runs a validated call. Returns the content, or a full :class:`ToolResult` when the tool
    decides ``error``/``timeout`` itself (the python tool does)."""

    def schema(self) -> dict[str, Any]:
        """The OpenAI / HF function-tool dict that ``tokenizer.apply_chat_template(tools=...)`` takes."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def _json_type_name(value: Any) -> str:
    for name in ("boolean", "integer", "number", "string", "array", "object", "null"):
        if _JSON_TYPES[name](value):
            return name
    return type(value).__name__


class ToolRegistry:
    """Tools by name. :meth:`call` validates the arguments against the tool's schema, runs it and
    turns any failure into an error result."""

    def __init__(self, tools: Sequence[Tool] = ()):
        self._tools: dict[str, Tool] = {}
        for tool in tools:
            self.register(tool)

    def register(self, tool: Tool) -> None:
        if tool.name in self._tools:
            raise ValueError(f"tool {tool.name!r} is already registered (tools: {', '.join(self._tools)})")
        if tool.parameters.get("type") != "object":
            raise ValueError(f"tool {tool.name!r}: parameters must be a JSON schema of type 'object', "
                             f"got {tool.parameters!r}")
        self._tools[tool.name] = tool

    def get(self, name: str) -> Tool:
        try:
            return self._tools[name]
        except KeyError:
            raise ToolError(f"unknown tool {name!r}; known tools: {', '.join(self._tools) or '(none)'}") from None

    def names(self) -> list[str]:
        return list(self._tools)

    def schemas(self) -> list[dict[str, Any]]:
        return [tool.schema() for tool in self._tools.values()]

    def validate(self, name: str, arguments: Any) -> None:
        """Raise :class:`ToolError` (a ValueError) naming the tool and argument when ``arguments`` do
        not fit the tool's schema: required names, JSON types, and no names the schema lacks
        (unless it sets ``additionalProperties``)."""
        tool = self.get(name)
        if not isinstance(arguments, dict):
            raise ToolError(f"tool {name!r}: arguments must be a JSON object, got {_json_type_name(arguments)} "
                            f"{arguments!r}")
        properties = tool.parameters.get("properties", {})
        for arg in tool.parameters.get("required", []):
            if arg not in arguments:
                expected = properties.get(arg, {}).get("type", "any")
                raise ToolError(f"tool {name!r}: missing required argument {arg!r} ({expected})")
        for arg, value in arguments.items():
            if arg not in properties:
                if tool.parameters.get("additionalProperties"):
                    continue
                raise ToolError(f"tool {name!r}: unexpected argument {arg!r}; its arguments are "
                                f"{', '.join(properties) or '(none)'}")
            expected = properties[arg].get("type")
            if expected is None:
                continue
            allowed = [expected] if isinstance(expected, str) else list(expected)
            if not any(_JSON_TYPES.get(t, lambda v: True)(value) for t in allowed):
                raise ToolError(f"tool {name!r}: argument {arg!r} must be {' or '.join(allowed)}, got "
                                f"{_json_type_name(value)} {value!r:.80}")

    def call(self, name: str, arguments: Any) -> ToolResult:
        """Validate and run one call; never raises."""
        start = time.monotonic()
        try:
            self.validate(name, arguments)
            out = self._tools[name].fn(arguments)
            result = out if isinstance(out, ToolResult) else ToolResult(content=str(out))
        except ToolError as e:
            result = ToolResult(content=f"error: {e}", error=True)
        except BaseException as e:  # noqa: BLE001 - a tool call must never take the rollout down
            if isinstance(e, KeyboardInterrupt):
                raise
            result = ToolResult(content=f"error: {type(e).__name__}: {e}", error=True)
        result.seconds = time.monotonic() - start
        return result


# -- calculator --------------------------------------------------------------------------------

CALC_MAX_CHARS = 200
"""Longest expression accepted (also bounds the nesting depth)."""
CALC_MAX_EXPONENT = 256
"""Largest exponent magnitude."""
CALC_MAX_INT_BITS = 1024
"""Largest integer result (about 308 digits, the float range)."""


def _div(a: int | float, b: int | float) -> int | float:
    if isinstance(a, int) and isinstance(b, int) and b != 0 and a % b == 0:
        return a // b  # exact, even past 2**53
    return a / b


def _pow(base: int | float, exp: int | float) -> int | float:
    if abs(exp) > CALC_MAX_EXPONENT:
        raise ToolError(f"exponent {exp} is too large (at most {CALC_MAX_EXPONENT} in magnitude)")
    # |base| >= 2**(bit_length - 1): a lower bound of the result's size, checked before computing it
    if isinstance(base, int) and isinstance(exp, int) and (abs(base).bit_length() - 1) * exp > CALC_MAX_INT_BITS:
        raise ToolError(f"result too large (more than {CALC_MAX_INT_BITS} bits)")
    result = base ** exp
    if isinstance(result, complex):
        raise ToolError("complex result (a negative number to a fractional power)")
    return result


_BINARY_OPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: _div,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: _pow,
}


def _describe(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return f"name {node.id!r}"
    if isinstance(node, ast.Call):
        return "function call"
    if isinstance(node, ast.Attribute):
        return f"attribute {node.attr!r}"
    if isinstance(node, ast.Subscript):
        return "subscript"
    if isinstance(node, ast.Constant):
        return f"constant {node.value!r}"
    if isinstance(node, (ast.BinOp, ast.UnaryOp)):
        return f"operator {type(node.op).__name__}"
    return type(node).__name__


def _check_magnitude(value: int | float) -> int | float:
    if isinstance(value, int) and value.bit_length() > CALC_MAX_INT_BITS:
        raise ToolError(f"result too large (more than {CALC_MAX_INT_BITS} bits)")
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("result too large (float overflow)")
    return value


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # type(): bools are not numbers here
        return _check_magnitude(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        try:
            return _check_magnitude(_BINARY_OPS[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError("result too large (float overflow)") from None
    raise ToolError(f"unsupported {_describe(node)}: only numbers, + - * / // % **, unary +/- and "
                    "parentheses are allowed")


def evaluate_arithmetic(expression: str) -> int | float:
    """The value of an arithmetic expression; :class:`ToolError` for anything else."""
    if len(expression) > CALC_MAX_CHARS:
        raise ToolError(f"expression is {len(expression)} characters long; at most {CALC_MAX_CHARS} are allowed")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        raise ToolError(f"not an arithmetic expression: {getattr(e, 'msg', e)}") from None
    return _evaluate(tree.body)


def format_number(value: int | float) -> str:
    """Integers exactly; floats with 12 significant digits (``0.1+0.2`` -> ``0.3``)."""
    if isinstance(value, int):
        return str(value)
    text = f"{value:.12g}"
    return "0" if text == "-0" else text


def calculator_tool() -> Tool:
    return Tool(
        name="calculator",
        description="Evaluate an arithmetic expression exactly: numbers, + - * / // % ** and parentheses.",
        parameters={"type": "object",
                    "properties": {"expression": {"type": "string",
                                                  "description": "for example (12 + 30) * 2 / 7"}},
                    "required": ["expression"]},
        fn=lambda args: format_number(evaluate_arithmetic(args["expression"])),
    )


# -- python sandbox ----------------------------------------------------------------------------

_SANDBOX_UID = 65534  # "nobody": what a root parent drops the code to, so RLIMIT_NPROC applies
_KILL_GRACE_S = 5.0  # after a kill: how long to wait for the processes to exit before forcing the supervisor
_TRUNCATION_MARKER = "\n...[output truncated: {n} more bytes]"

# Runs in the child as `python -I -u -c _PRELUDE <json config>`; standalone (no megarl imports:
# -I leaves the parent's sys.path and PYTHON* variables out). Everything it imports is imported
# before privileges are dropped.
_PRELUDE = r'''
import atexit, ctypes, json, os, resource, sys, traceback
cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
PR_SET_KEEPCAPS, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 8, 36, 38
root = os.geteuid() == 0

def strays():
    # live processes of this session, and our children (a subreaper gets every orphaned
    # descendant, also one that left the session with setsid)
    me, sid, found = os.getpid(), os.getsid(0), []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != me:
            try:
                with open("/proc/%s/stat" % name, "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if (int(fields[3]) == sid or int(fields[1]) == me) and fields[0] != b"Z":
                found.append(int(name))
    return found

def reap_until(pid):
    # Reap every child (orphans included) until `pid` ends; its exit code, 128+N for signal N.
    while True:
        try:
            child, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return 1
        if child == pid:
            code = os.waitstatus_to_exitcode(status)
            return code if code >= 0 else 128 - code

pid_ns = False
if cfg["isolate"]:
    # root may make PID and network namespaces itself; a user needs a user namespace for them
    pid_ns = libc.unshare(CLONE_NEWPID | CLONE_NEWNET | (0 if root else CLONE_NEWUSER)) == 0
libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
child = os.fork()
if child:  # supervisor
    code = reap_until(child)
    for _ in range(10000):  # end what the code left behind (no PID namespace to do it)
        found = strays()
        if not found:
            break
        for pid in found:
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
    os._exit(code)
if pid_ns:  # pid 1 of the namespace: when it exits the kernel kills everything left in it
    child = os.fork()
    if child:
        os._exit(reap_until(child))

def cap(which, value):
    soft, hard = resource.getrlimit(which)
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(which, (value, value))

if root and cfg["uid"] is not None:
    # leaving uid 0 clears every capability unless KEEPCAPS is set
    libc.prctl(PR_SET_KEEPCAPS, 1 if cfg["read_search"] else 0, 0, 0, 0)
    os.setgroups([])
    os.setresgid(cfg["uid"], cfg["uid"], cfg["uid"])
    os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
    if cfg["read_search"]:
        # CAP_DAC_READ_SEARCH alone, to read the interpreter's files; if the parent lacks it,
        # capset fails and no capability is left
        header = (ctypes.c_uint32 * 2)(0x20080522, 0)
        data = (ctypes.c_uint32 * 6)(1 << 2, 1 << 2, 0, 0, 0, 0)
        libc.capset(header, data)
libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
os.nice(cfg["nice"])
cap(resource.RLIMIT_CORE, 0)
cap(resource.RLIMIT_FSIZE, cfg["file_bytes"])
cap(resource.RLIMIT_NOFILE, 256)
cap(resource.RLIMIT_CPU, cfg["cpu_s"])  # SIGKILL at the limit; the wall clock comes first anyway
cap(resource.RLIMIT_NPROC, cfg["nproc_userns"] if pid_ns and not root else cfg["nproc"])
if not pid_ns:  # no network namespace: best effort, refuse internet sockets
    import socket
    _socket_init = socket.socket.__init__
    def _guarded_init(self, family=-1, type=-1, proto=-1, fileno=None):
        if fileno is None and family in (-1, socket.AF_INET, socket.AF_INET6):
            raise PermissionError(1, "network access is disabled in this sandbox")
        _socket_init(self, family, type, proto, fileno)
    socket.socket.__init__ = _guarded_init
with open(cfg["code_path"], encoding="utf-8") as f:
    source = f.read()
sys.argv = ["main.py"]
cap(resource.RLIMIT_AS, cfg["memory_bytes"])
del cfg, libc
code = 0
try:
    exec(compile(source, "main.py", "exec"), {"__name__": "__main__", "__file__": "main.py",
                                              "__builtins__": __builtins__})
except SystemExit as e:
    if e.code is None or isinstance(e.code, int):
        code = e.code or 0
    else:
        print(e.code, file=sys.stderr)
        code = 1
except BaseException as e:
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)  # without this prelude's frame
    code = 1
try:
    atexit._run_exitfuncs()
finally:
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)
'''


def _proc_stat(pid: str) -> tuple[str, int] | None:
    """(state, session id) of a process from /proc, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # the name in parentheses may hold spaces
    except OSError:
        return None
    return fields[0].decode(), int(fields[3])


def session_processes(sid: int, *, include_zombies: bool = False) -> list[int]:
    """Pids whose session id is ``sid`` (the session leader included)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _proc_stat(name)
            if stat is not None and stat[1] == sid and (include_zombies or stat[0] != "Z"):
                found.append(int(name))
    return found


def _count_tasks(uid: int) -> int:
    """Tasks (threads included: what RLIMIT_NPROC counts) whose real user id is ``uid``."""
    total = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                status = f.read()
        except OSError:
            continue
        uid_line = re.search(r"^Uid:\s+(\d+)", status, re.M)
        threads = re.search(r"^Threads:\s+(\d+)", status, re.M)
        if uid_line and int(uid_line.group(1)) == uid:
            total += int(threads.group(1)) if threads else 1
    return total


def _kill_session(sid: int, *, spare_leader: bool, within_s: float = _KILL_GRACE_S) -> bool:
    """SIGKILL every live process of session ``sid`` until none is left; True when none is.
    Killed processes still have to be scheduled to exit; the rescans back off so they do not take
    the CPU those need (a rescan catches children forked before the kill landed)."""
    end = time.monotonic() + within_s
    pause = 0.002
    while True:
        alive = [pid for pid in session_processes(sid) if not (spare_leader and pid == sid)]
        if not alive:
            return True
        if not spare_leader:
            try:
                os.killpg(sid, signal.SIGKILL)
            except OSError:
                pass
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if time.monotonic() > end:
            return False
        time.sleep(pause)
        pause = min(2 * pause, 0.05)


@functools.lru_cache(maxsize=None)
def _needs_read_search(python: str) -> bool:
    """True when a directory on the way to the interpreter or its libraries is closed to others
    (no o+x), so uid 65534 could not start or import without CAP_DAC_READ_SEARCH."""
    paths = {python}
    if os.path.realpath(python) == os.path.realpath(sys.executable):  # else its libraries are unknown here
        paths |= {sys.prefix, sys.base_prefix, *sysconfig.get_paths().values()}
    for path in paths:
        path = os.path.realpath(path)
        while True:
            try:
                if os.path.isdir(path) and not os.stat(path).st_mode & stat.S_IXOTH:
                    return True
            except OSError:
                pass
            parent = os.path.dirname(path)
            if parent == path:
                break
            path = parent
    return False


def _kernel_at_least(major: int, minor: int) -> bool:
    found = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return bool(found) and (int(found.group(1)), int(found.group(2))) >= (major, minor)


def _remove_tree(path: str) -> None:
    def retry_writable(fn, target, _exc):  # the code may have made a directory read-only
        try:
            os.chmod(os.path.dirname(target), 0o700)
            fn(target)
        except OSError:
            pass
    shutil.rmtree(path, onerror=retry_writable)
    if os.path.exists(path):
        logger.warning("python tool: could not remove its scratch directory %s", path)


@dataclass
class SandboxRun:
    output: str
    """stdout and stderr as they came, truncated to the output limit (with the marker)."""
    returncode: int | None
    """Exit status of the code (128+N for signal N: 137 after a timeout); -9 when the supervisor
    itself had to be killed."""
    timed_out: bool
    output_exceeded: bool
    """Killed because it wrote more than :meth:`PythonSandbox._output_cap` bytes."""
    seconds: float
    pid: int
    """Session id (= pid of the supervisor) of the run."""
    scratch_dir: str
    """Working directory of the run (removed when the run returns)."""


@dataclass
class PythonSandbox:
    """Runs Python code in a separate limited process; see the module docstring for what is
    enforced. Thread-safe: each :meth:`run` has its own process and directory."""

    timeout_s: float = 5.0
    memory_mb: int = 256
    output_limit: int = 4096
    """Bytes of output kept; the rest is counted in the truncation marker."""
    max_processes: int = 64
    """Tasks (processes and threads) the code may add."""
    file_size_mb: int = 16
    nice: int = 10
    """Niceness added to the code's: a busy tool call yields the CPU to the trainer (and to the
    thread that must kill it at the deadline)."""
    isolate: bool = True
    """Try PID and network namespaces; False (or when refused) uses the best-effort fallback."""
    python: str = field(default_factory=lambda: sys.executable)

    def __post_init__(self):
        for name in ("timeout_s", "memory_mb", "output_limit", "max_processes", "file_size_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"python tool: {name} must be positive, got {getattr(self, name)!r}")

    def _output_cap(self) -> int:
        # output past this is only counted; a process still writing is killed rather than read
        # until its timeout
        return max(1 << 20, 16 * self.output_limit)

    def run(self, code: str) -> SandboxRun:
        start = time.monotonic()
        scratch = tempfile.mkdtemp(prefix="megarl-python-")
        try:
            return self._run_in(code, scratch, start)
        finally:
            _remove_tree(scratch)

    def _run_in(self, code: str, scratch: str, start: float) -> SandboxRun:
        code_path = os.path.join(scratch, "main.py")
        with open(code_path, "w", encoding="utf-8") as f:
            f.write(code)
        root = os.geteuid() == 0
        uid = _SANDBOX_UID if root else None
        if root:
            os.chown(scratch, _SANDBOX_UID, _SANDBOX_UID)
            os.chown(code_path, _SANDBOX_UID, _SANDBOX_UID)
        tasks_now = _count_tasks(_SANDBOX_UID if root else os.getuid())
        cfg = {
            "isolate": self.isolate, "uid": uid, "code_path": code_path,
            "read_search": root and _needs_read_search(self.python),
            "memory_bytes": self.memory_mb << 20, "file_bytes": self.file_size_mb << 20,
            "cpu_s": math.ceil(self.timeout_s) + 1, "nice": self.nice,
            # the code's own budget, plus, for a non-root parent, the supervisor (and the
            # namespace init) that run under the same uid
            "nproc": tasks_now + self.max_processes + (0 if root else 1),
            "nproc_userns": (0 if _kernel_at_least(5, 14) else tasks_now) + self.max_processes + 2,
        }
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch,
               "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1",
               "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        proc = subprocess.Popen([self.python, "-I", "-u", "-c", _PRELUDE, json.dumps(cfg)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                cwd=scratch, env=env, start_new_session=True, close_fds=True)
        try:
            kept, dropped, timed_out, exceeded = self._collect(proc, start)
        finally:
            try:
                proc.wait(timeout=_KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                _kill_session(proc.pid, spare_leader=False)
                proc.wait()
            proc.stdout.close()
            if not _kill_session(proc.pid, spare_leader=False):
                logger.warning("python tool: processes of session %d survived SIGKILL", proc.pid)
        output = kept.decode("utf-8", errors="replace")
        if dropped:
            output += _TRUNCATION_MARKER.format(n=dropped)
        return SandboxRun(output=output, returncode=proc.returncode, timed_out=timed_out, output_exceeded=exceeded,
                          seconds=time.monotonic() - start, pid=proc.pid, scratch_dir=scratch)

    def _collect(self, proc: subprocess.Popen, start: float) -> tuple[bytes, int, bool, bool]:
        """Read the output pipe until EOF (the supervisor and everything under it are gone),
        killing the code at the deadline or when it writes too much."""
        fd = proc.stdout.fileno()
        kept, dropped = bytearray(), 0
        timed_out = exceeded = False
        deadline = start + self.timeout_s
        give_up = None  # after a kill: stop reading here even without EOF
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while True:
                now = time.monotonic()
                if give_up is None and now >= deadline:
                    timed_out = True
                    _kill_session(proc.pid, spare_leader=True)
                    give_up = time.monotonic() + _KILL_GRACE_S
                if give_up is not None and now >= give_up:
                    break
                if not selector.select((give_up or deadline) - now):
                    continue
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    break
                room = max(0, self.output_limit - len(kept))
                kept += chunk[:room]
                dropped += len(chunk) - min(room, len(chunk))
                if dropped > self._output_cap() and give_up is None:
                    exceeded = True
                    _kill_session(proc.pid, spare_leader=True)
                    give_up = time.monotonic() + _KILL_GRACE_S
        return bytes(kept), dropped, timed_out, exceeded

    def __call__(self, arguments: dict[str, Any]) -> ToolResult:
        run = self.run(arguments["code"])
        lines = [run.output] if run.output else []
        if run.timed_out:
            lines.append(f"[timeout after {self.timeout_s:g} s: process killed]")
        elif run.output_exceeded:
            lines.append(f"[process killed: output exceeded {self._output_cap()} bytes]")
        elif run.returncode:
            status = f"[exit status {run.returncode}"
            if run.returncode is not None and run.returncode > 128:
                try:
                    status += f" ({signal.Signals(run.returncode - 128).name})"
                except ValueError:
                    pass
            lines.append(status + "]")
        error = run.timed_out or run.output_exceeded or run.returncode != 0
        return ToolResult(content="\n".join(lines) or "(no output)", error=error, timeout=run.timed_out,
                          seconds=run.seconds)


def python_tool(timeout_s: float = 5.0, memory_mb: int = 256, output_limit: int = 4096, **sandbox: Any) -> Tool:
    """The ``python`` tool; ``sandbox`` goes to :class:`PythonSandbox` (max_processes, ...)."""
    runner = PythonSandbox(timeout_s=timeout_s, memory_mb=memory_mb, output_limit=output_limit, **sandbox)
    return Tool(
        name="python",
        description=(f"Run a Python 3 program and return what it prints (stdout and stderr). No network; "
                     f"{timeout_s:g} s and {memory_mb} MB at most; print the results you need."),
        parameters={"type": "object",
                    "properties": {"code": {"type": "string", "description": "the program"}},
                    "required": ["code"]},
        fn=runner,
    )


# -- search ------------------------------------------------------------------------------------

_WORD = re.compile(r"[a-z0-9]+")


def _tokens(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def load_corpus(corpus: str | os.PathLike | Sequence[str]) -> list[str]:
    """Documents from a list of strings, a .txt file (blank-line separated) or a .jsonl file
    (``{"text": ...}`` per line)."""
    if not isinstance(corpus, (str, os.PathLike)):
        docs = [str(d) for d in corpus]
    else:
        path = Path(corpus)
        if not path.is_file():
            raise FileNotFoundError(f"search corpus {str(path)!r} does not exist (expected a .txt file with "
                                    "blank-line separated documents or a .jsonl file of {\"text\": ...})")
        if path.suffix == ".txt":
            docs = re.split(r"\n\s*\n", path.read_text(encoding="utf-8"))
        elif path.suffix == ".jsonl":
            docs = []
            for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    docs.append(row["text"] if isinstance(row["text"], str) else None)
                except (ValueError, KeyError, TypeError):
                    docs.append(None)
                if docs[-1] is None:
                    raise ValueError(f"search corpus {str(path)!r} line {i}: expected a JSON object with a "
                                     f"string 'text', got {line[:80]!r}")
        else:
            raise ValueError(f"search corpus {str(path)!r}: expected a .txt or .jsonl file")
    docs = [d.strip() for d in docs if d.strip()]
    if not docs:
        raise ValueError(f"search corpus {corpus if isinstance(corpus, (str, os.PathLike)) else '(list)'} "
                         "has no documents")
    return docs


class SearchIndex:
    """Okapi BM25 (k1=1.5, b=0.75, idf = ln(1 + (N - df + 0.5) / (df + 0.5))) over lowercase
    alphanumeric tokens; no stemming or stop words."""

    def __init__(self, documents: Sequence[str], *, k1: float = 1.5, b: float = 0.75):
        self.documents = list(documents)
        self.k1, self.b = k1, b
        self._tf = [Counter(_tokens(d)) for d in self.documents]
        self._len = [sum(tf.values()) for tf in self._tf]
        self._avg_len = max(1e-9, sum(self._len) / len(self._len))
        df = Counter(t for tf in self._tf for t in tf)
        n = len(self.documents)
        self._idf = {t: math.log(1 + (n - c + 0.5) / (c + 0.5)) for t, c in df.items()}

    def scores(self, query: str) -> list[float]:
        terms = [t for t in set(_tokens(query)) if t in self._idf]
        out = []
        for tf, length in zip(self._tf, self._len):
            norm = self.k1 * (1 - self.b + self.b * length / self._avg_len)
            out.append(sum(self._idf[t] * tf[t] * (self.k1 + 1) / (tf[t] + norm) for t in terms if t in tf))
        return out

    def search(self, query: str, k: int = 3) -> list[tuple[int, float]]:
        """(document index, score) of the top ``k`` documents with a positive score, best first."""
        scored = [(i, s) for i, s in enumerate(self.scores(query)) if s > 0]
        scored.sort(key=lambda item: (-item[1], item[0]))
        return scored[:k]


def search_tool(corpus: str | os.PathLike | Sequence[str], *, max_k: int = 10, max_chars: int = 1000) -> Tool:
    index = SearchIndex(load_corpus(corpus))

    def run(args: dict[str, Any]) -> str:
        k = args.get("k", 3)
        if not 1 <= k <= max_k:
            raise ToolError(f"k must be between 1 and {max_k}, got {k}")
        hits = index.search(args["query"], k)
        if not hits:
            return "no results"
        docs = [index.documents[i] for i, _ in hits]
        return "\n\n".join(f"{n}. {d if len(d) <= max_chars else d[:max_chars] + '...'}"
                           for n, d in enumerate(docs, 1))

    return Tool(
        name="search",
        description="Search a local collection of documents; returns the best matching documents, numbered.",
        parameters={"type": "object",
                    "properties": {"query": {"type": "string", "description": "keywords"},
                                   "k": {"type": "integer", "description": f"documents to return (1-{max_k}, "
                                                                           "default 3)"}},
                    "required": ["query"]},
        fn=run,
    )


# -- factories ---------------------------------------------------------------------------------

KNOWN_TOOLS = ("calculator", "python", "search")


def build_registry(names: Sequence[str], *, timeout_s: float, memory_mb: int, output_limit: int,
                   search_corpus: str | os.PathLike | Sequence[str] | None = None) -> ToolRegistry:
    """The registry of the built-in tools named in ``rollout.tools``."""
    registry = ToolRegistry()
    for name in names:
        if name not in KNOWN_TOOLS:
            raise ValueError(f"rollout.tools: unknown tool {name!r}; known tools: {', '.join(KNOWN_TOOLS)}")
        if name in registry.names():
            raise ValueError(f"rollout.tools: tool {name!r} is named twice")
        if name == "calculator":
            registry.register(calculator_tool())
        elif name == "python":
            registry.register(python_tool(timeout_s=timeout_s, memory_mb=memory_mb, output_limit=output_limit))
        else:
            if not search_corpus:
                raise ValueError("rollout.search_corpus: the search tool needs a corpus (a .txt file of "
                                 "blank-line separated documents or a .jsonl file of {\"text\": ...})")
            registry.register(search_tool(search_corpus))
    return registry


# -- concurrent runner -------------------------------------------------------------------------

class _Deadlines:
    """One thread that runs callbacks at deadlines (a heap), so a timeout costs no thread per call."""

    def __init__(self):
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._cond = threading.Condition()
        self._seq = itertools.count()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="megarl-tool-deadlines", daemon=True)
        self._thread.start()

    def at(self, when: float, callback: Callable[[], None]) -> None:
        with self._cond:
            heapq.heappush(self._heap, (when, next(self._seq), callback))
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._cond.wait(None if not self._heap else self._heap[0][0] - time.monotonic())
                if self._closed:
                    return
                _, _, callback = heapq.heappop(self._heap)
            callback()


class ToolRunner:
    """Runs tool calls on at most ``workers`` threads. A call's clock starts when it starts
    running; ``timeout_s`` later its future gets a timeout result. An in-process tool cannot be
    stopped, so its thread stays busy until the tool returns (the pool has one worker less
    meanwhile, and interpreter exit waits for it: concurrent.futures joins its threads). The
    python tool kills its own process at its own timeout; give the runner a ``timeout_s`` a few
    seconds above it (the kill and clean-up take 0.1-0.5 s, more on a loaded machine)."""

    def __init__(self, registry: ToolRegistry, workers: int, timeout_s: float):
        if workers < 1:
            raise ValueError(f"rollout.tool_workers must be >= 1, got {workers}")
        if not timeout_s > 0:
            raise ValueError(f"rollout.tool_timeout_s must be > 0, got {timeout_s}")
        self.registry, self.timeout_s = registry, timeout_s
        self._pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="megarl-tool")
        self._deadlines = _Deadlines()
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[cf.Future, str, float | None]] = {}
        self._ids = itertools.count()
        self._calls: Counter[str] = Counter()
        self._errors: Counter[str] = Counter()
        self._timeouts: Counter[str] = Counter()
        self._closed = False

    def submit(self, name: str, arguments: Any) -> cf.Future:
        """A future of the call's :class:`ToolResult` (never an exception)."""
        future: cf.Future = cf.Future()
        call_id = next(self._ids)
        with self._lock:
            if self._closed:
                raise RuntimeError("ToolRunner is closed")
            self._pending[call_id] = (future, name, None)
        self._pool.submit(self._run, call_id, name, arguments)
        return future

    def _run(self, call_id: int, name: str, arguments: Any) -> None:
        start = time.monotonic()
        with self._lock:
            if call_id not in self._pending:
                return
            self._pending[call_id] = (self._pending[call_id][0], name, start)
        self._deadlines.at(start + self.timeout_s, lambda: self._finish(call_id, ToolResult(
            content=f"error: tool {name} timed out after {self.timeout_s:g} s", error=True, timeout=True,
            seconds=time.monotonic() - start)))
        self._finish(call_id, self.registry.call(name, arguments))

    def _finish(self, call_id: int, result: ToolResult) -> None:
        with self._lock:
            entry = self._pending.pop(call_id, None)
            if entry is None:  # the other of (result, timeout) came first
                return
            future, name, _ = entry
            self._calls[name] += 1
            self._errors[name] += result.error
            self._timeouts[name] += result.timeout
        try:
            future.set_result(result)  # outside the lock: done-callbacks may call stats()
        except cf.InvalidStateError:  # cancelled by the caller
            pass

    def stats(self) -> dict[str, Any]:
        """Finished calls per tool, errors (timeouts included) and timeouts per tool, and totals."""
        with self._lock:
            return {"calls": dict(self._calls), "errors": dict(self._errors), "timeouts": dict(self._timeouts),
                    "num_calls": sum(self._calls.values()), "num_errors": sum(self._errors.values()),
                    "num_timeouts": sum(self._timeouts.values()), "num_pending": len(self._pending)}

    def close(self) -> None:
        """Stop taking calls; calls not finished get an error result. Does not wait for running
        in-process tools (they may never return)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._pending)
        self._pool.shutdown(wait=False, cancel_futures=True)
        for call_id in pending:
            self._finish(call_id, ToolResult(content="error: the tool runner was closed", error=True))
        self._deadlines.close()

    def __enter__(self) -> ToolRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
