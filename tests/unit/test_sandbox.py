"""megarl.agent.sandbox: the python tool under bubblewrap.

1. Escape attempts, each asserted to fail: read /etc/passwd, the repo's README, a file under the
   model cache, the prompt file of a task (with its answers); list host processes; see the host's
   environment, devices or the virtual environment's packages; write a file that outlives the
   call (scratch, /tmp, the host's /tmp, the interpreter's prefix); fill the scratch space past its
   cap; open a socket to the host's 127.0.0.1; a fork bomb; allocate past the memory cap; run past
   the deadline.
2. The limits and results as the tool reports them (output cap, process count, exit statuses).
3. No silent fallback: without bwrap, or where it cannot build the sandbox, the tool refuses to
   start with the fix, and the preflight of a recipe that uses it says so.

Real processes, about 0.1 s each (1 s for each timeout case). The tests run as root (the machine's
and CI's user), so the root path (bwrap without a user namespace, the code dropped to uid 65534)
is the one covered.
"""
import json
import os
import socket
import sys
import time
from pathlib import Path

import pytest

from megarl.agent import sandbox as sandbox_mod
from megarl.agent.sandbox import PythonSandbox, SandboxUnavailable, sandbox_problem, session_processes
from megarl.agent.tools import ToolRegistry, ToolResult, python_tool
from megarl.models.fixtures import cache_root

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(sandbox_problem() is not None, reason=f"no sandbox here: {sandbox_problem()}")


def _leftovers(run):
    """Processes (zombies too) still in the run's session."""
    return session_processes(run.pid, include_zombies=True)


def _refused(run, *errors):
    """The code raised one of ``errors`` (names of exception classes) and printed nothing else."""
    assert run.returncode == 1 and not run.timed_out, run
    assert any(run.output.rstrip().splitlines()[-1].startswith(e) for e in errors), run.output
    assert _leftovers(run) == []


# -- 1. escape attempts ------------------------------------------------------------------------------

def test_host_files_are_not_there(tmp_path):
    # the prompt file of a task with its answers: a reward-hacking channel if the code could read it
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is 6 * 7?", "answer": "42"}) + "\n")
    os.chmod(tmp_path, 0o755)
    os.chmod(prompts, 0o644)   # world-readable, as prompt files are
    cache_file = cache_root() / "sandbox-probe.txt"
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    cache_file.write_text("model cache")
    try:
        box = PythonSandbox(timeout_s=5.0)
        for path in ("/etc/passwd", str(REPO / "README.md"), str(cache_file), str(prompts), "/root/.bashrc",
                     "/home", str(Path(sys.prefix) / "pyvenv.cfg")):
            _refused(box.run(f"print(open({path!r}).read())"), "FileNotFoundError", "PermissionError",
                     "IsADirectoryError")
        # what the code sees of the file system: the stand-ins above the interpreter, nothing beside it
        run = box.run("import os\nprint(sorted(os.listdir('/')))\nprint(sorted(os.listdir('/dev')))\n"
                      "print(sorted(os.listdir(os.path.dirname(__import__('sys').prefix))))")
        top, dev, beside = [eval(line) for line in run.output.splitlines()]
        assert set(top) <= {"dev", "lib", "lib32", "lib64", "proc", "root", "home", "opt", "scratch", "tmp", "usr"}, top
        assert "etc" not in top and "work" not in top
        assert dev == ["null", "urandom", "zero"]
        assert beside == [os.path.basename(sandbox_mod.interpreter(sys.executable)[1])]  # pyenv's other versions: no
        # the virtual environment's packages and the host's environment are not there either
        _refused(box.run("import torch"), "ModuleNotFoundError")
        run = box.run("import os\nprint(sorted(os.environ))")
        assert eval(run.output) == sorted(["HOME", "LANG", "LC_ALL", "MKL_NUM_THREADS", "OMP_NUM_THREADS",
                                           "OPENBLAS_NUM_THREADS", "PATH", "PWD", "TMPDIR"])
    finally:
        cache_file.unlink()


def test_host_processes_are_not_visible():
    run = PythonSandbox(timeout_s=5.0).run(
        "import os\npids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\nprint(pids)\n"
        "print([open(f'/proc/{p}/cmdline', 'rb').read().split(b'\\0')[0].decode() for p in pids])\n"
        f"os.kill({os.getpid()}, 0)")
    pids, commands = run.output.splitlines()[:2]
    assert eval(pids) == [1, 2]   # the namespace's init (the prelude) and the code itself
    assert eval(commands) == [sandbox_mod.interpreter(sys.executable)[0]] * 2
    assert "ProcessLookupError" in run.output   # the test's own pid is not in its namespace


def test_nothing_written_outlives_the_call():
    box = PythonSandbox(timeout_s=5.0)
    marker = f"megarl-sandbox-{os.getpid()}-{time.time_ns()}"
    run = box.run("import os\nprint(os.getcwd())\n"
                  f"for d in ('/scratch', '/tmp'):\n    open(os.path.join(d, {marker!r}), 'w').write('x')\n"
                  "print(sorted(os.listdir('/tmp')))")
    assert run.returncode == 0 and run.output == f"/scratch\n['{marker}']\n"
    assert not os.path.exists(os.path.join("/tmp", marker))   # the host's /tmp is not the sandbox's
    run = box.run(f"import os\nprint(os.listdir('/scratch'), os.listdir('/tmp'))")
    assert run.output == "[] []\n"
    prefix = sandbox_mod.interpreter(sys.executable)[1]
    for path in (f"/{marker}", f"/root/{marker}", os.path.join(prefix, marker), f"/proc/{marker}"):
        _refused(box.run(f"open({path!r}, 'w').write('x')"), "OSError", "PermissionError", "FileNotFoundError")
        assert not os.path.exists(path)


def test_scratch_space_is_capped():
    box = PythonSandbox(timeout_s=10.0, scratch_mb=4, file_size_mb=64)
    code = ("import errno\nfor d in ('/scratch', '/tmp'):\n    n = 0\n    try:\n"
            "        with open(d + '/fill', 'wb') as f:\n"
            "            while True:\n                f.write(b'x' * 65536); f.flush(); n += 65536\n"
            "    except OSError as e:\n        print(d, n, errno.errorcode[e.errno])")
    run = box.run(code)
    lines = run.output.splitlines()
    assert [line.split()[0] for line in lines] == ["/scratch", "/tmp"] and all(l.endswith("ENOSPC") for l in lines)
    assert all(int(line.split()[1]) <= 4 << 20 for line in lines), lines


def test_python_network_blocked():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(0.2)
        port = server.getsockname()[1]
        run = PythonSandbox(timeout_s=5.0).run(
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')")
        # the sandbox has a loopback of its own, where nothing listens
        _refused(run, "ConnectionRefusedError")
        with pytest.raises(socket.timeout):
            server.accept()
    run = PythonSandbox(timeout_s=5.0).run("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)")
    _refused(run, "OSError")
    assert "Network is unreachable" in run.output


def test_python_fork_bomb_is_bounded_and_killed():
    sandbox = PythonSandbox(timeout_s=1.0, max_processes=32)
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


def test_python_memory_limit():
    sandbox = PythonSandbox(timeout_s=5.0, memory_mb=128)
    assert sandbox.run("x = bytearray(32 << 20); print(len(x))").output == f"{32 << 20}\n"
    run = sandbox.run("x = bytearray(256 << 20)")
    assert run.returncode == 1 and run.output.rstrip().endswith("MemoryError")


def test_python_timeout_kills_a_busy_loop():
    sandbox = PythonSandbox(timeout_s=1.0)
    start = time.monotonic()
    run = sandbox.run("print('started', flush=True)\nwhile True: pass")
    assert time.monotonic() - start < 1.0 + 2.0
    assert run.timed_out and run.output == "started\n" and run.returncode == -9 or run.returncode == 137
    assert _leftovers(run) == []
    result = ToolRegistry([python_tool(timeout_s=0.5)]).call("python", {"code": "while True: pass"})
    assert (result.content, result.error, result.timeout) == ("[timeout after 0.5 s: process killed]", True, True)


def test_leftover_processes_end_with_the_call():
    # background processes, one of them in a session of its own, must not outlive the call
    code = ("import os, subprocess, sys\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(987.25)'])\n"
            "if os.fork() == 0:\n    os.setsid()\n    os.execv(sys.executable, [sys.executable, '-c', "
            "'import time; time.sleep(987.5)'])\nprint('started')")
    run = PythonSandbox(timeout_s=5.0).run(code)
    assert run.returncode == 0 and not run.timed_out and run.seconds < 3.0 and run.output == "started\n"
    assert _leftovers(run) == []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    assert b"time.sleep(987." not in f.read()
            except OSError:
                pass


@pytest.mark.skipif(os.geteuid() != 0, reason="a root parent drops the code to uid 65534")
def test_python_root_drops_to_nobody():
    code = ("import os\nprint(os.getuid(), os.getgid(), os.getgroups())\n"
            "print([line.split()[1] for line in open('/proc/self/status')\n"
            "       if line.startswith(('CapInh', 'CapPrm', 'CapEff', 'CapAmb', 'NoNewPrivs'))])")
    run = PythonSandbox(timeout_s=5.0).run(code)
    # no capability in any set that counts, and none to gain by exec (no_new_privs)
    assert run.output == "65534 65534 []\n" + str(["0" * 16] * 4 + ["1"]) + "\n"


# -- 2. limits and results as the tool reports them ---------------------------------------------------

def test_python_tool_results():
    registry = ToolRegistry([python_tool(timeout_s=5.0)])
    assert registry.call("python", {"code": "print(6 * 7)"}) == ToolResult("42\n", seconds=pytest.approx(0.0, abs=5))
    failed = registry.call("python", {"code": "x = 1\n1 / x\nraise ValueError('bad value')"})
    assert failed.error and not failed.timeout
    assert 'File "main.py", line 3' in failed.content and "ValueError: bad value" in failed.content
    assert failed.content.endswith("[exit status 1]")
    assert registry.call("python", {"code": "import sys; sys.exit(3)"}).content == "[exit status 3]"
    assert registry.call("python", {"code": "pass"}).content == "(no output)"
    assert registry.call("python", {"code": "print('é' * 3)"}).content == "ééé\n"


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


# -- 3. no sandbox, no tool ------------------------------------------------------------------------

def test_missing_bwrap_is_refused_with_the_install_line(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))   # no bwrap on it
    sandbox_problem.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable, match=r"bubblewrap, which is not installed .*apt-get install bubblewrap"):
            python_tool()
        # and where bwrap runs but cannot make its namespaces (what a kernel without user namespaces says)
        fake = tmp_path / "bwrap"
        fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to creating new namespace' >&2\nexit 1\n")
        fake.chmod(0o755)
        sandbox_problem.cache_clear()
        with pytest.raises(SandboxUnavailable, match=r"could not create the python tool's sandbox here \(bwrap: No "
                                                     r"permissions to creating new namespace\)"):
            PythonSandbox()
    finally:
        sandbox_problem.cache_clear()


def test_preflight_names_the_missing_sandbox(monkeypatch, tmp_path):
    from megarl.config import load_config
    from megarl.config.errors import ConfigError
    from megarl.preflight import preflight

    cfg = load_config(None, [f"trainer.run_dir={tmp_path / 'run'}", "rollout.agent=tools",
                             "rollout.tools=calculator,python", "checkpoint.save_every=0",
                             "model.path=fixture:tiny-qwen2"])
    assert not [w for w in preflight(cfg, "train", backend="cpu") if "rollout.tools" in w]
    monkeypatch.setenv("PATH", str(tmp_path))
    sandbox_problem.cache_clear()
    try:
        with pytest.raises(ConfigError, match=r"^rollout.tools: .*apt-get install bubblewrap"):
            preflight(cfg, "train", backend="cpu")
        assert any(w.startswith("rollout.tools: ") for w in preflight(cfg, "config", backend="cpu"))
    finally:
        sandbox_problem.cache_clear()
