"""Tools for multi-turn agent rollouts: a registry, three built-in tools and a bounded pool.

The agent loop hands each parsed call ``{"name": ..., "arguments": {...}}`` to
:meth:`ToolRegistry.call` (or :meth:`ToolRunner.submit` for many at once). A call never raises: a
bad call or a failing tool comes back as ``ToolResult(content="error: ...", error=True)``.

Built-in tools (``rollout.tools``):

- ``calculator``: arithmetic on Python's ``ast`` (no ``eval``); integers stay exact, exponents and
  result sizes are bounded (:data:`CALC_MAX_EXPONENT`, :data:`CALC_MAX_INT_BITS`) so nothing hangs.
- ``python``: code under bubblewrap with limits and a deadline (:mod:`megarl.agent.sandbox`).
- ``search``: BM25 over a small local corpus (:class:`SearchIndex`).
- any other entry is a dotted path ``package.module:factory`` to a function returning a
  :class:`Tool` (e.g. a remote sandbox service; docs/security.md).
"""

from __future__ import annotations

import ast
import concurrent.futures as cf
import heapq
import itertools
import json
import logging
import math
import operator
import os
import re
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megarl.agent.sandbox import PythonSandbox, SandboxRun, session_processes

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

@dataclass
class PythonToolFn:
    """The python tool's function: runs the code in :attr:`sandbox` and turns the run into a result."""
    sandbox: PythonSandbox

    def __call__(self, arguments: dict[str, Any]) -> ToolResult:
        return _sandbox_result(self.sandbox, self.sandbox.run(arguments["code"]))


def _sandbox_result(sandbox: PythonSandbox, run: SandboxRun) -> ToolResult:
    lines = [run.output] if run.output else []
    if run.timed_out:
        lines.append(f"[timeout after {sandbox.timeout_s:g} s: process killed]")
    elif run.output_exceeded:
        lines.append(f"[process killed: output exceeded {sandbox._output_cap()} bytes]")
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
    """The ``python`` tool; ``sandbox`` goes to :class:`PythonSandbox` (max_processes, scratch_mb,
    ...). Raises :class:`megarl.agent.sandbox.SandboxUnavailable` where bubblewrap cannot run."""
    runner = PythonSandbox(timeout_s=timeout_s, memory_mb=memory_mb, output_limit=output_limit, **sandbox)
    return Tool(
        name="python",
        description=(f"Run a Python 3 program and return what it prints (stdout and stderr). No network, no files "
                     f"but its own scratch directory; {timeout_s:g} s and {memory_mb} MB at most; print the results "
                     f"you need."),
        parameters={"type": "object",
                    "properties": {"code": {"type": "string", "description": "the program"}},
                    "required": ["code"]},
        fn=PythonToolFn(runner),
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
    """The registry of the tools named in ``rollout.tools``: built-in names, or dotted paths
    ``package.module:factory`` to a function called as ``factory(timeout_s=..., memory_mb=...,
    output_limit=...)`` that returns a :class:`Tool` (a remote code executor, say)."""
    from megarl.plugins import load_function

    registry = ToolRegistry()
    for name in names:
        if name not in KNOWN_TOOLS and ":" not in name and "." not in name:
            raise ValueError(f"rollout.tools: unknown tool {name!r}; known tools: {', '.join(KNOWN_TOOLS)} "
                             "(or a dotted path 'package.module:factory' returning a Tool)")
        if name == "calculator":
            tool = calculator_tool()
        elif name == "python":
            tool = python_tool(timeout_s=timeout_s, memory_mb=memory_mb, output_limit=output_limit)
        elif name == "search":
            if not search_corpus:
                raise ValueError("rollout.search_corpus: the search tool needs a corpus (a .txt file of "
                                 "blank-line separated documents or a .jsonl file of {\"text\": ...})")
            tool = search_tool(search_corpus)
        else:
            tool = load_function(name)(timeout_s=timeout_s, memory_mb=memory_mb, output_limit=output_limit)
            if not isinstance(tool, Tool):
                raise TypeError(f"rollout.tools: {name!r} returned {type(tool).__name__}, expected a "
                                "megarl.agent.tools.Tool")
        if tool.name in registry.names():
            raise ValueError(f"rollout.tools: tool {tool.name!r} is named twice")
        registry.register(tool)
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
