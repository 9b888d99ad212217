"""The python tool on a remote SandboxFusion code-execution service, not the local sandbox.

``rollout.tools: calculator,megarl.agent.remote:sandbox_fusion_python`` gives the model a tool
named ``python`` whose code runs on a SandboxFusion server (``MEGARL_SANDBOX_URL``, default
``http://127.0.0.1:8080/run_code``), so model-written code never runs on the training hosts. The
answer becomes a tool result as the local sandbox's does (output truncated at ``output_limit``,
``[exit status N]``, ``[timeout after T s: process killed]``); an unreachable service or an HTTP
or ``SandboxError`` answer gives an ``error: ...`` result, never an exception in the rollout.

Any other service plugs in the same way: a factory
``factory(*, timeout_s, memory_mb, output_limit) -> megarl.agent.tools.Tool`` named by its dotted
path in ``rollout.tools`` (docs/security.md).
"""
from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

from megarl.agent.tools import Tool, ToolError, ToolResult

__all__ = ["DEFAULT_URL", "sandbox_fusion_python"]

DEFAULT_URL = "http://127.0.0.1:8080/run_code"
_MARKER = "\n...[output truncated: {n} more bytes]"


def _truncate(text: str, limit: int) -> str:
    data = text.encode("utf-8")
    if len(data) <= limit:
        return text
    return data[:limit].decode("utf-8", errors="ignore") + _MARKER.format(n=len(data) - limit)


def sandbox_fusion_python(*, timeout_s: float = 5.0, memory_mb: int = 256, output_limit: int = 4096,
                          url: str | None = None) -> Tool:
    """A ``python`` tool that runs code on the SandboxFusion server at ``url`` (default:
    ``MEGARL_SANDBOX_URL``). ``memory_mb`` is the service's to enforce (SandboxFusion's server
    configuration); the run timeout is sent with each request."""
    endpoint = url or os.environ.get("MEGARL_SANDBOX_URL", DEFAULT_URL)

    def run(arguments: dict) -> ToolResult:
        body = json.dumps({"code": arguments["code"], "language": "python",
                           "run_timeout": max(1, int(round(timeout_s)))}).encode()
        request = urllib.request.Request(endpoint, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s + 10.0) as response:
                answer = json.loads(response.read().decode("utf-8"))
        except urllib.error.HTTPError as err:
            raise ToolError(f"sandbox service {endpoint}: HTTP {err.code}") from None
        except (urllib.error.URLError, OSError, ValueError) as err:
            raise ToolError(f"sandbox service {endpoint} unreachable or unreadable: {err}") from None
        if answer.get("status") == "SandboxError" or not isinstance(answer.get("run_result"), dict):
            raise ToolError(f"sandbox service: {answer.get('message') or answer.get('status') or 'no run_result'}")
        result = answer["run_result"]
        output = (result.get("stdout") or "") + (result.get("stderr") or "")
        lines = [_truncate(output, output_limit)] if output else []
        timed_out = result.get("status") == "TimeLimitExceeded"
        code = result.get("return_code")
        if timed_out:
            lines.append(f"[timeout after {timeout_s:g} s: process killed]")
        elif code:
            lines.append(f"[exit status {code}]")
        return ToolResult(content="\n".join(lines) or "(no output)", error=timed_out or bool(code),
                          timeout=timed_out)

    return Tool(
        name="python",
        description=(f"Run a Python 3 program and return what it prints (stdout and stderr), on a remote sandbox; "
                     f"{timeout_s:g} s at most; print the results you need."),
        parameters={"type": "object", "properties": {"code": {"type": "string", "description": "the program"}},
                    "required": ["code"]},
        fn=run,
    )
