"""megarl.agent.tools: the calculator's values and refusals, registry validation messages, the
python sandbox's limits (timeout, fork bomb, output, memory, network, scratch directory, leftover
processes), BM25 search, build_registry's errors, and the concurrent ToolRunner.

The sandbox tests run real processes (about 0.1 s each, 1 s for each timeout case). Those with
``isolate`` parametrized run both the namespace path and the fallback (no PID/network namespace)
that containers without ``unshare`` get.
"""

import json
import os
import socket
import sys
import threading
import time

import pytest

from megarl.agent.tools import _needs_read_search  # noqa: I001 - the sandbox's own rule, checked below
from megarl.agent.tools import (
    CALC_MAX_CHARS,
    PythonSandbox,
    Tool,
    ToolError,
    ToolRegistry,
    ToolResult,
    ToolRunner,
    build_registry,
    calculator_tool,
    evaluate_arithmetic,
    python_tool,
    search_tool,
    session_processes,
)

# -- calculator --------------------------------------------------------------------------------


@pytest.mark.parametrize("expression, expected", [
    ("2 + 3 * 4", "14"),
    ("(2 + 3) * 4", "20"),
    ("2 ** 100", "1267650600228229401496703205376"),
    ("123456789 * 987654321", "121932631112635269"),
    ("6 / 3", "2"),                      # exact division stays an integer
    ("2 ** 64 / 2", "9223372036854775808"),  # exact past 2**53 (float division would round)
    ("7 / 2", "3.5"),
    ("1 / 3", "0.333333333333"),         # 12 significant digits
    ("0.1 + 0.2", "0.3"),
    ("-3 ** 2", "-9"),                   # ** binds tighter than unary minus, as in Python
    ("(-3) ** 2", "9"),
    ("-7 // 2", "-4"),
    ("7 % 3", "1"),
    ("2 ** -1", "0.5"),
    ("+5 - -5", "10"),
    ("1.5e3 * 2", "3000"),
    ("2 ** 0.5", "1.41421356237"),
])
def test_calculator_values(expression, expected):
    assert ToolRegistry([calculator_tool()]).call("calculator", {"expression": expression}).content == expected


@pytest.mark.parametrize("expression, message", [
    ("x + 1", "name 'x'"),
    ("abs(-1)", "function call"),
    ("__import__('os').system('true')", "function call"),
    ("(1).real", "attribute 'real'"),
    ("[1, 2][0]", "subscript"),
    ("'a' * 3", "constant 'a'"),
    ("True + 1", "constant True"),
    ("2 << 3", "operator LShift"),
    ("1 / 0", "division by zero"),
    ("1 // 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("9 ** 9 ** 9", "exponent 387420489 is too large"),
    ("10 ** 200 * 10 ** 200", "result too large"),
    ("1e300 * 1e300", "result too large"),
    ("(-8) ** 0.5", "complex result"),
    ("1 +", "not an arithmetic expression"),
    ("1" + "+1" * CALC_MAX_CHARS, f"at most {CALC_MAX_CHARS}"),
])
def test_calculator_refuses(expression, message):
    start = time.monotonic()
    result = ToolRegistry([calculator_tool()]).call("calculator", {"expression": expression})
    assert result.error and result.content.startswith("error: ") and message in result.content, result.content
    assert time.monotonic() - start < 0.5  # 9**9**9 is refused before it is computed


def test_evaluate_arithmetic_types():
    assert evaluate_arithmetic("10 / 4") == 2.5 and isinstance(evaluate_arithmetic("10 / 5"), int)
    with pytest.raises(ToolError):
        evaluate_arithmetic("__import__('os')")


# -- registry ----------------------------------------------------------------------------------

def _echo_tool(name="echo"):
    return Tool(name=name, description="echo", fn=lambda a: f"{a['text']}x{a.get('times', 1)}",
                parameters={"type": "object", "required": ["text"],
                            "properties": {"text": {"type": "string"}, "times": {"type": "integer"},
                                           "scale": {"type": "number"}}})


def test_tool_schema_is_the_function_tool_dict():
    assert calculator_tool().schema() == {
        "type": "function",
        "function": {"name": "calculator", "description": calculator_tool().description,
                     "parameters": calculator_tool().parameters}}
    registry = ToolRegistry([calculator_tool(), _echo_tool()])
    assert registry.names() == ["calculator", "echo"]
    assert [s["function"]["name"] for s in registry.schemas()] == ["calculator", "echo"]
    assert registry.get("echo").name == "echo"


def test_registry_duplicate_and_unknown():
    registry = ToolRegistry([_echo_tool()])
    with pytest.raises(ValueError, match="tool 'echo' is already registered"):
        registry.register(_echo_tool())
    with pytest.raises(ValueError, match="unknown tool 'nope'; known tools: echo"):
        registry.validate("nope", {})


@pytest.mark.parametrize("arguments, message", [
    ({}, "tool 'echo': missing required argument 'text' (string)"),
    ({"text": 3}, "tool 'echo': argument 'text' must be string, got integer 3"),
    ({"text": "a", "times": 2.5}, "tool 'echo': argument 'times' must be integer, got number 2.5"),
    ({"text": "a", "times": True}, "tool 'echo': argument 'times' must be integer, got boolean True"),
    ({"text": "a", "scale": "2"}, "tool 'echo': argument 'scale' must be number, got string '2'"),
    ({"text": "a", "colour": 1}, "tool 'echo': unexpected argument 'colour'; its arguments are text, times, scale"),
    (["a"], "tool 'echo': arguments must be a JSON object, got array ['a']"),
])
def test_registry_validation_messages(arguments, message):
    registry = ToolRegistry([_echo_tool()])
    with pytest.raises(ValueError) as info:
        registry.validate("echo", arguments)
    assert str(info.value) == message
    result = registry.call("echo", arguments)
    assert result == ToolResult(content=f"error: {message}", error=True, seconds=result.seconds)


def test_registry_call_never_raises():
    def boom(_):
        raise RuntimeError("boom")
    registry = ToolRegistry([_echo_tool(), Tool("boom", "fails", {"type": "object", "properties": {}}, boom)])
    ok = registry.call("echo", {"text": "hi", "times": 2, "scale": 1})
    assert (ok.content, ok.error, ok.timeout) == ("hix2", False, False) and ok.seconds >= 0
    bad = registry.call("boom", {})
    assert (bad.content, bad.error) == ("error: RuntimeError: boom", True)
    assert registry.call("missing", {}).content == "error: unknown tool 'missing'; known tools: echo, boom"


# -- python sandbox ----------------------------------------------------------------------------

def _leftovers(run):
    """Processes (zombies too) still in the run's session."""
    return session_processes(run.pid, include_zombies=True)


def test_python_tool_results():
    registry = ToolRegistry([python_tool(timeout_s=5.0)])
    assert registry.call("python", {"code": "print(6 * 7)"}) == ToolResult("42\n", seconds=pytest.approx(0.0, abs=5))
    failed = registry.call("python", {"code": "x = 1\n1 / x\nraise ValueError('bad value')"})
    assert failed.error and not failed.timeout
    assert 'File "main.py", line 3' in failed.content and "ValueError: bad value" in failed.content
    assert failed.content.endswith("[exit status 1]")
    assert registry.call("python", {"code": "import sys; sys.exit(3)"}).content == "[exit status 3]"
    assert registry.call("python", {"code": "pass"}).content == "(no output)"


def test_python_timeout_kills_a_busy_loop():
    sandbox = PythonSandbox(timeout_s=1.0)
    start = time.monotonic()
    run = sandbox.run("print('started', flush=True)\nwhile True: pass")
    assert time.monotonic() - start < 1.0 + 2.0
    assert run.timed_out and run.output == "started\n"
    assert _leftovers(run) == []
    result = ToolRegistry([python_tool(timeout_s=0.5)]).call("python", {"code": "while True: pass"})
    assert (result.content, result.error, result.timeout) == ("[timeout after 0.5 s: process killed]", True, True)


@pytest.mark.parametrize("isolate", [True, False])
def test_python_fork_bomb_is_bounded_and_killed(isolate):
    sandbox = PythonSandbox(timeout_s=1.0, max_processes=32, isolate=isolate)
    margin_s = 3.0  # killed processes must still be scheduled to exit: 0.1-0.5 s, >2 s at load 28 on 2 cores
    # the plain bomb: forks refused by RLIMIT_NPROC raise (BlockingIOError) and end their process;
    # the program ends when its first process does, or at the timeout
    start = time.monotonic()
    run = sandbox.run("import os\nwhile True: os.fork()")
    assert time.monotonic() - start < 1.0 + margin_s
    assert run.returncode != 0 and run.output.startswith("Traceback (most recent call last):")
    assert _leftovers(run) == []
    # a bomb that survives refused forks runs until the wall clock kills all of it
    start = time.monotonic()
    run = sandbox.run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    assert time.monotonic() - start < 1.0 + margin_s
    assert run.timed_out
    assert _leftovers(run) == []


def test_python_process_limit_counts():
    # forks that wait: exactly max_processes - 1 succeed (the program itself is the first task);
    # threads count too
    code = ("import os, threading, time\nn = 0\nwhile True:\n    try:\n        pid = os.fork()\n"
            "    except OSError as e:\n        print('forks', n, e.errno); break\n"
            "    if pid == 0:\n        time.sleep(60); os._exit(0)\n    n += 1\n"
            "try:\n    threading.Thread(target=time.sleep, args=(1,)).start()\n"
            "except RuntimeError as e:\n    print(e)")
    run = PythonSandbox(timeout_s=5.0, max_processes=8).run(code)
    assert run.output == "forks 7 11\ncan't start new thread\n"  # 11 = EAGAIN
    assert run.seconds < 2.0 and _leftovers(run) == []  # the sleeping children ended with the program


def test_python_output_truncated():
    sandbox = PythonSandbox(timeout_s=5.0, output_limit=1000)
    run = sandbox.run("print('a' * 5000)")  # 5001 bytes with the newline
    assert run.output == "a" * 1000 + "\n...[output truncated: 4001 more bytes]"
    start = time.monotonic()
    run = sandbox.run("while True: print('x' * 100)")
    assert time.monotonic() - start < 5.0  # killed past the output cap, not at the timeout
    assert run.output_exceeded and run.output.startswith("x" * 100)
    head, marker = run.output.split("\n...[output truncated: ")
    assert len(head.encode()) == 1000 and marker.endswith(" more bytes]")
    assert _leftovers(run) == []
    result = ToolRegistry([python_tool(output_limit=1000)]).call("python", {"code": "while True: print('x' * 100)"})
    assert result.error and result.content.endswith(f"bytes]\n[process killed: output exceeded {1 << 20} bytes]")
    assert len(result.content) < 1000 + 100


def test_python_memory_limit():
    sandbox = PythonSandbox(timeout_s=5.0, memory_mb=128)
    assert sandbox.run("x = bytearray(32 << 20); print(len(x))").output == f"{32 << 20}\n"
    run = sandbox.run("x = bytearray(256 << 20)")
    assert run.returncode == 1 and run.output.rstrip().endswith("MemoryError")


@pytest.mark.parametrize("isolate", [True, False])
def test_python_network_blocked(isolate):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(0.2)
        port = server.getsockname()[1]
        run = PythonSandbox(timeout_s=5.0, isolate=isolate).run(
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')")
        assert run.returncode == 1 and "connected" not in run.output
        # the second message is the fallback's, also taken by isolate=True where unshare is refused
        assert "Network is unreachable" in run.output or "network access is disabled" in run.output
        with pytest.raises(socket.timeout):
            server.accept()


@pytest.mark.parametrize("isolate", [True, False])
def test_python_scratch_dir_and_leftover_processes(isolate):
    # a background process (one of them leaving the session) must not outlive the call
    code = ("import os, subprocess\nprint(os.getcwd())\nopen('out.txt', 'w').write('data')\n"
            "subprocess.Popen(['sleep', '987.25'])\n"
            "if os.fork() == 0:\n    os.setsid()\n    os.execvp('sleep', ['sleep', '987.5'])\n")
    run = PythonSandbox(timeout_s=5.0, isolate=isolate).run(code)
    assert run.returncode == 0 and not run.timed_out and run.seconds < 2.0
    assert run.output == run.scratch_dir + "\n"
    assert os.path.basename(run.scratch_dir).startswith("megarl-python-")
    assert not os.path.exists(run.scratch_dir)
    assert _leftovers(run) == []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    assert f.read() not in (b"sleep\x00987.25\x00", b"sleep\x00987.5\x00")
            except OSError:
                pass


@pytest.mark.skipif(os.geteuid() != 0, reason="a root parent drops the code to uid 65534")
def test_python_root_drops_to_nobody():
    code = ("import os, math\nprint(os.getuid(), os.getgid(), os.getgroups())\n"
            "print([line.split()[1] for line in open('/proc/self/status')\n"
            "       if line.startswith(('CapEff', 'NoNewPrivs'))])")
    run = PythonSandbox(timeout_s=5.0).run(code)
    # CAP_DAC_READ_SEARCH (bit 2) only when the interpreter sits under a directory closed to others
    cap_eff = "0000000000000004" if _needs_read_search(sys.executable) else "0000000000000000"
    assert run.output == f"65534 65534 []\n['{cap_eff}', '1']\n"


# -- search ------------------------------------------------------------------------------------

DOCS = ["The Eiffel Tower is a wrought-iron lattice tower in Paris, France.",
        "Photosynthesis converts light energy into chemical energy in plants.",
        "Paris is the capital of France; the Seine flows through Paris."]


def test_search_ranks_the_relevant_document_first(tmp_path):
    registry = ToolRegistry([search_tool(DOCS)])
    result = registry.call("search", {"query": "How do plants use light energy?", "k": 2})
    assert result.content == f"1. {DOCS[1]}"  # the only document sharing a term
    result = registry.call("search", {"query": "capital of France", "k": 3})
    assert result.content.startswith(f"1. {DOCS[2]}\n\n2. {DOCS[0]}")
    assert registry.call("search", {"query": "quantum chromodynamics"}).content == "no results"
    assert registry.call("search", {"query": "paris", "k": 0}).content == "error: k must be between 1 and 10, got 0"
    # the same corpus from a .txt and a .jsonl file
    (tmp_path / "c.txt").write_text("\n\n".join(DOCS) + "\n")
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    for path in ("c.txt", "c.jsonl"):
        tool = search_tool(tmp_path / path)
        assert tool.fn({"query": "eiffel tower", "k": 1}) == f"1. {DOCS[0]}"


def test_search_corpus_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "missing.txt")):
        search_tool(str(tmp_path / "missing.txt"))
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"title": "no text"}\n')
    with pytest.raises(ValueError, match="line 2: expected a JSON object with a string 'text'"):
        search_tool(tmp_path / "bad.jsonl")
    (tmp_path / "c.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="expected a .txt or .jsonl file"):
        search_tool(tmp_path / "c.csv")


# -- build_registry ----------------------------------------------------------------------------

def test_build_registry():
    registry = build_registry(["calculator", "python", "search"], timeout_s=2.0, memory_mb=128,
                              output_limit=512, search_corpus=DOCS)
    assert registry.names() == ["calculator", "python", "search"]
    assert registry.get("python").fn.timeout_s == 2.0 and registry.get("python").fn.output_limit == 512
    with pytest.raises(ValueError, match=r"rollout.tools: unknown tool 'shell'; known tools: calculator, python, "
                                         r"search"):
        build_registry(["calculator", "shell"], timeout_s=1, memory_mb=64, output_limit=64)
    with pytest.raises(ValueError, match="rollout.search_corpus"):
        build_registry(["search"], timeout_s=1, memory_mb=64, output_limit=64)


# -- runner ------------------------------------------------------------------------------------

def test_runner_runs_calls_concurrently_and_counts():
    release = threading.Event()
    sleepy = Tool("sleepy", "sleeps", {"type": "object", "properties": {"s": {"type": "number"}}},
                  lambda a: (time.sleep(a["s"]), "slept")[1])
    stuck = Tool("stuck", "waits", {"type": "object", "properties": {}}, lambda a: (release.wait(30), "late")[1])
    registry = ToolRegistry([calculator_tool(), sleepy, stuck])
    with ToolRunner(registry, workers=4, timeout_s=1.0) as runner:
        start = time.monotonic()
        futures = [runner.submit("sleepy", {"s": 0.4}) for _ in range(4)]
        assert [f.result(5).content for f in futures] == ["slept"] * 4
        assert time.monotonic() - start < 0.4 * 2  # ~one call, not four (1.6 s)
        timed = runner.submit("stuck", {})
        errors = [runner.submit("calculator", {"expression": "1/0"}), runner.submit("nope", {})]
        result = timed.result(5)
        assert result == ToolResult("error: tool stuck timed out after 1 s", error=True, timeout=True,
                                    seconds=pytest.approx(1.0, abs=0.5))
        assert [f.result(5).error for f in errors] == [True, True]
        release.set()
        time.sleep(0.05)  # the stuck call returns late; it must not count twice
        assert runner.stats() == {"calls": {"sleepy": 4, "stuck": 1, "calculator": 1, "nope": 1},
                                  "errors": {"sleepy": 0, "stuck": 1, "calculator": 1, "nope": 1},
                                  "timeouts": {"sleepy": 0, "stuck": 1, "calculator": 0, "nope": 0},
                                  "num_calls": 7, "num_errors": 3, "num_timeouts": 1, "num_pending": 0}


def test_runner_python_calls_in_parallel_and_close():
    registry = ToolRegistry([python_tool(timeout_s=5.0)])
    with ToolRunner(registry, workers=3, timeout_s=8.0) as runner:
        start = time.monotonic()
        futures = [runner.submit("python", {"code": f"import time; time.sleep(1); print({i})"}) for i in range(3)]
        assert [f.result(10).content for f in futures] == ["0\n", "1\n", "2\n"]
        assert time.monotonic() - start < 2.9  # three 1 s calls in parallel (serial: > 3.3 s)
    release = threading.Event()
    stuck = Tool("stuck", "waits", {"type": "object", "properties": {}}, lambda a: (release.wait(30), "late")[1])
    runner = ToolRunner(ToolRegistry([stuck]), workers=1, timeout_s=30.0)
    running, queued = runner.submit("stuck", {}), runner.submit("stuck", {})
    runner.close()
    assert running.result(1).content == queued.result(1).content == "error: the tool runner was closed"
    release.set()
    with pytest.raises(RuntimeError, match="closed"):
        runner.submit("stuck", {})
