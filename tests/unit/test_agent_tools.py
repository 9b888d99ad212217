"""megarl.agent.tools: the calculator's values and refusals, registry validation messages, BM25
search, build_registry (built-in names, dotted-path factories, errors), and the concurrent
ToolRunner. The python tool's sandbox has its own file: tests/unit/test_sandbox.py."""

import json
import threading
import time

import pytest
from helpers import write_jsonl

from megarl.agent.tools import (
    CALC_MAX_CHARS,
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
    write_jsonl(tmp_path / "c.jsonl", [{"text": d} for d in DOCS])
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
    sandbox = registry.get("python").fn.sandbox
    assert sandbox.timeout_s == 2.0 and sandbox.output_limit == 512 and sandbox.memory_mb == 128
    with pytest.raises(ValueError, match=r"rollout.tools: unknown tool 'shell'; known tools: calculator, python, "
                                         r"search"):
        build_registry(["calculator", "shell"], timeout_s=1, memory_mb=64, output_limit=64)
    with pytest.raises(ValueError, match="rollout.search_corpus"):
        build_registry(["search"], timeout_s=1, memory_mb=64, output_limit=64)
    with pytest.raises(ValueError, match="tool 'calculator' is named twice"):
        build_registry(["calculator", "calculator"], timeout_s=1, memory_mb=64, output_limit=64)
    # a factory by dotted path (a remote executor, say) gets the tool settings and returns a Tool
    registry = build_registry(["calculator", f"{__name__}:echo_factory"], timeout_s=3.0, memory_mb=64,
                              output_limit=100)
    assert registry.names() == ["calculator", "echo"]
    assert registry.call("echo", {"text": "hi", "times": 1, "scale": 1}).content == "hi timeout=3.0 limit=100"
    with pytest.raises(TypeError, match=r"returned str, expected a megarl.agent.tools.Tool"):
        build_registry([f"{__name__}:not_a_tool_factory"], timeout_s=1, memory_mb=64, output_limit=64)


def echo_factory(*, timeout_s, memory_mb, output_limit):
    tool = _echo_tool()
    return Tool(tool.name, tool.description, tool.parameters,
                lambda args: f"{args['text']} timeout={timeout_s} limit={output_limit}")


def not_a_tool_factory(**settings):
    return "calculator"


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


# -- a remote executor (megarl.agent.remote) -------------------------------------------------------

def test_sandbox_fusion_tool_against_a_local_service(monkeypatch):
    """The client side of the remote executor: a local HTTP server answering in SandboxFusion's
    run_code format (a fake of the service, for the client's request and result handling)."""
    import http.server

    from megarl.agent.remote import sandbox_fusion_python

    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.path, body))
            answers = {"print(42)": {"status": "Success", "run_result": {"status": "Finished", "return_code": 0,
                                                                         "stdout": "42\n", "stderr": ""}},
                       "boom": {"status": "Failed", "run_result": {"status": "Finished", "return_code": 1,
                                                                   "stdout": "", "stderr": "NameError\n"}},
                       "loop": {"status": "Failed", "run_result": {"status": "TimeLimitExceeded", "return_code": None,
                                                                   "stdout": "x" * 50, "stderr": ""}},
                       "broken": {"status": "SandboxError", "message": "no executor"}}
            if body["code"] == "http500":
                self.send_response(500)
                self.end_headers()
                return
            data = json.dumps(answers[body["code"]]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        monkeypatch.setenv("MEGARL_SANDBOX_URL", f"http://127.0.0.1:{server.server_port}/run_code")
        registry = build_registry(["megarl.agent.remote:sandbox_fusion_python"], timeout_s=3.0, memory_mb=64,
                                  output_limit=20)
        assert registry.names() == ["python"]
        assert registry.call("python", {"code": "print(42)"}).content == "42\n"
        assert seen[0] == ("/run_code", {"code": "print(42)", "language": "python", "run_timeout": 3})
        failed = registry.call("python", {"code": "boom"})
        assert failed.error and failed.content == "NameError\n\n[exit status 1]"
        slow = registry.call("python", {"code": "loop"})
        assert slow.timeout and slow.content == ("x" * 20 + "\n...[output truncated: 30 more bytes]\n"
                                                 "[timeout after 3 s: process killed]")
        assert registry.call("python", {"code": "broken"}).content == "error: sandbox service: no executor"
        assert registry.call("python", {"code": "http500"}).content.endswith(": HTTP 500")
    finally:
        server.shutdown()
        server.server_close()
    gone = build_registry(["megarl.agent.remote:sandbox_fusion_python"], timeout_s=1.0, memory_mb=64,
                          output_limit=20).call("python", {"code": "print(1)"})
    assert gone.error and "unreachable" in gone.content
