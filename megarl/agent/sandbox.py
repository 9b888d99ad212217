"""The python tool's sandbox: model-written code under bubblewrap, with rlimits and a deadline.

Model-written code is untrusted, and RL turns any file it can read (answers, reward code) or leave
behind into a reward-hacking channel. The file-system view, namespaces and device nodes are
therefore bubblewrap's (``bwrap``); this module adds what bwrap does not do: resource limits, the
wall clock, the output cap and clean-up. docs/security.md lists what the code sees and what is
tested. Each call runs bwrap (leader of a new session) -> a prelude ``python -I -c`` as pid 1 of a
new PID namespace (``--as-pid-1``, so bwrap reaps it and no zombie is left), which drops
privileges, sets the limits and forks the code; when it exits the kernel kills the namespace.

A root parent runs bwrap without a user namespace and the prelude drops to uid 65534 with no
capability and no_new_privs, because ``RLIMIT_NPROC`` does not apply to uid 0 and is what bounds a
fork bomb; a non-root parent gets a user namespace and keeps its uid (untested: tests run as root).
At ``timeout_s`` every process of the session but bwrap is SIGKILLed; output past
``output_limit`` is counted in a marker. Where bwrap is missing or cannot make its namespaces,
:class:`PythonSandbox` refuses to start (:func:`sandbox_problem`): there is no weaker fallback.
"""
from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

__all__ = ["PythonSandbox", "SandboxRun", "SandboxUnavailable", "require_sandbox", "sandbox_problem",
           "session_processes"]

logger = logging.getLogger(__name__)

SANDBOX_UID = 65534   # "nobody": what a root parent drops the code to, so RLIMIT_NPROC applies
SCRATCH_DIR = "/scratch"
_KILL_GRACE_S = 5.0   # after a kill: how long to wait for the processes to exit before forcing bwrap
_TRUNCATION_MARKER = "\n...[output truncated: {n} more bytes]"
_DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom")
_LIBRARY_DIRS = ("/usr/lib", "/usr/lib64", "/usr/lib32", "/lib", "/lib64", "/lib32")
INSTALL_HINT = "apt-get install bubblewrap (Debian, Ubuntu), dnf install bubblewrap (Fedora, RHEL)"

# Runs in the sandbox as `python -I -u -c _PRELUDE <json config>`; standalone (-I leaves the
# parent's sys.path and PYTHON* variables out). Everything it imports is imported before
# privileges are dropped; the code arrives on stdin, so nothing of it touches the host's disk.
_PRELUDE = r'''
import atexit, ctypes, json, os, resource, sys, traceback
cfg = json.loads(sys.argv[1])
source = sys.stdin.buffer.read().decode("utf-8")
null = os.open("/dev/null", os.O_RDONLY)
os.dup2(null, 0)
os.close(null)
libc = ctypes.CDLL(None, use_errno=True)
PR_SET_NO_NEW_PRIVS = 38

def cap(which, value):
    soft, hard = resource.getrlimit(which)
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(which, (value, value))

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

if cfg["uid"] is not None:   # root parent: leaving uid 0 clears every capability
    os.setgroups([])
    os.setresgid(cfg["uid"], cfg["uid"], cfg["uid"])
    os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
    # the inheritable set keeps bwrap's --cap-add; empty it too (no_new_privs makes it moot anyway)
    libc.capset((ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)())
if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
    os._exit(126)
child = os.fork()
if child:   # pid 1 of the namespace: when it exits, the kernel kills everything left in it
    os._exit(reap_until(child))
os.nice(cfg["nice"])
cap(resource.RLIMIT_CORE, 0)
cap(resource.RLIMIT_FSIZE, cfg["file_bytes"])
cap(resource.RLIMIT_NOFILE, 256)
cap(resource.RLIMIT_CPU, cfg["cpu_s"])  # SIGKILL at the limit; the wall clock comes first anyway
cap(resource.RLIMIT_NPROC, cfg["nproc"])
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


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing or cannot create its sandbox here; the message says how to fix it."""


# -- processes -------------------------------------------------------------------------------------

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


def _kernel_at_least(major: int, minor: int) -> bool:
    found = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return bool(found) and (int(found.group(1)), int(found.group(2))) >= (major, minor)


# -- the bwrap command line ------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def interpreter(python: str) -> tuple[str, str]:
    """(executable, installation prefix) of the base interpreter behind ``python``: a virtual
    environment's interpreter is a link to (or a copy of) its base, and only the base's prefix is
    mounted in the sandbox (the environment's packages stay out of sight)."""
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        executable, prefix = getattr(sys, "_base_executable", sys.executable), sys.base_prefix
    else:
        out = subprocess.run([python, "-I", "-c", "import sys; print(sys._base_executable); print(sys.base_prefix)"],
                             capture_output=True, text=True, timeout=60, check=True).stdout.split("\n")
        executable, prefix = out[0], out[1]
    return os.path.realpath(executable), os.path.realpath(prefix)


def _parents(path: str) -> list[str]:
    """The directories above ``path``, outermost first, without ``/``."""
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[:i + 1]) for i in range(len(parts))]


def bwrap_args(prefix: str, scratch_bytes: int, root: bool) -> list[str]:
    """bwrap's options for a sandbox that sees ``prefix`` (read-only) and nothing else of the host
    but the system libraries and three device nodes."""
    args = ["--die-with-parent", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try"]
    if root:   # no user namespace (see the module docstring); the prelude needs only these two
        args += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        args += ["--unshare-user"]
    bound: set[str] = set()   # mounted or linked: everything below is there already
    made: set[str] = set()    # empty stand-in directories
    for path in (prefix, *_LIBRARY_DIRS):
        if not os.path.lexists(path) or any(path == p or path.startswith(p.rstrip("/") + "/") for p in bound):
            continue
        if os.path.islink(path):   # merged /usr: /lib -> usr/lib
            args += ["--symlink", os.readlink(path), path]
        else:
            for parent in _parents(path):   # bwrap would make them 0700: uid 65534 could not pass
                if parent not in made:
                    args += ["--perms", "0755", "--dir", parent]
                    made.add(parent)
            args += ["--ro-bind", path, path]
        bound.add(path)
    args += ["--proc", "/proc", "--perms", "0755", "--dir", "/dev"]
    for device in _DEVICES:
        args += ["--dev-bind", device, device]
    for tmp in (SCRATCH_DIR, "/tmp"):
        args += ["--perms", "1777", "--size", str(scratch_bytes), "--tmpfs", tmp]
    return args + ["--chdir", SCRATCH_DIR]


@functools.lru_cache(maxsize=None)
def sandbox_problem(python: str = sys.executable) -> str | None:
    """None when bubblewrap can run ``python`` in the sandbox here; else what is wrong and the fix.
    Runs one real sandboxed call the first time (~0.1 s); the answer is cached per interpreter."""
    if shutil.which("bwrap") is None:
        return (f"the python tool runs code under bubblewrap, which is not installed (no 'bwrap' on PATH); "
                f"install it: {INSTALL_HINT}")
    try:
        run = PythonSandbox(timeout_s=20.0, python=python, _checked=True).run("print(6 * 7)")
    except (OSError, subprocess.SubprocessError) as exc:
        return f"the python tool's sandbox could not start {python!r}: {exc}"
    if run.output == "42\n" and run.returncode == 0:
        return None
    detail = run.output.strip().splitlines()[-1] if run.output.strip() else f"exit status {run.returncode}"
    hint = ("" if os.geteuid() == 0 else
            "; unprivileged user namespaces must be allowed (sysctl user.max_user_namespaces > 0, "
            "kernel.unprivileged_userns_clone=1 where it exists, kernel.apparmor_restrict_unprivileged_userns=0 "
            "on Ubuntu 24.04+), or run as root")
    return f"bubblewrap could not create the python tool's sandbox here ({detail}){hint}"


def require_sandbox(python: str = sys.executable) -> None:
    problem = sandbox_problem(python)
    if problem is not None:
        raise SandboxUnavailable(problem)


# -- the sandbox -----------------------------------------------------------------------------------

@dataclass
class SandboxRun:
    output: str
    """stdout and stderr as they came, truncated to the output limit (with the marker)."""
    returncode: int | None
    """Exit status of the code (128+N for signal N: 137 after a timeout); -9 when bwrap itself
    had to be killed."""
    timed_out: bool
    output_exceeded: bool
    """Killed because it wrote more than :meth:`PythonSandbox._output_cap` bytes."""
    seconds: float
    pid: int
    """Session id (= pid of bwrap) of the run."""
    scratch_dir: str = SCRATCH_DIR
    """Working directory of the code, inside the sandbox (a tmpfs gone when the run returns)."""


@dataclass
class PythonSandbox:
    """Runs Python code under bubblewrap with limits; see the module docstring for what is
    enforced. Thread-safe: each :meth:`run` has its own processes and mounts. Raises
    :class:`SandboxUnavailable` at construction where bubblewrap cannot work."""

    timeout_s: float = 5.0
    memory_mb: int = 256
    output_limit: int = 4096
    """Bytes of output kept; the rest is counted in the truncation marker."""
    max_processes: int = 64
    """Tasks (processes and threads) the code may add."""
    file_size_mb: int = 16
    scratch_mb: int = 32
    """Size cap of each of the two tmpfs mounts (the working directory and /tmp)."""
    nice: int = 10
    """Niceness added to the code's: a busy tool call yields the CPU to the trainer (and to the
    thread that must kill it at the deadline)."""
    python: str = field(default_factory=lambda: sys.executable)
    _checked: bool = field(default=False, repr=False)

    def __post_init__(self):
        for name in ("timeout_s", "memory_mb", "output_limit", "max_processes", "file_size_mb", "scratch_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"python tool: {name} must be positive, got {getattr(self, name)!r}")
        if not self._checked:
            require_sandbox(self.python)

    def _output_cap(self) -> int:
        # output past this is only counted; a process still writing is killed rather than read
        # until its timeout
        return max(1 << 20, 16 * self.output_limit)

    def command(self) -> list[str]:
        root = os.geteuid() == 0
        executable, prefix = interpreter(self.python)
        tasks_now = _count_tasks(SANDBOX_UID) if root else 0
        cfg = {
            "uid": SANDBOX_UID if root else None,
            "memory_bytes": self.memory_mb << 20, "file_bytes": self.file_size_mb << 20,
            "cpu_s": math.ceil(self.timeout_s) + 1, "nice": self.nice,
            # the code's budget plus the namespace's init (same uid), on top of, for root, what
            # uid 65534 has now; for a user, per (namespace, uid) since 5.14, before that the
            # user's whole count
            "nproc": (tasks_now if root else 0 if _kernel_at_least(5, 14) else _count_tasks(os.getuid()))
                     + self.max_processes + 1,
        }
        return [shutil.which("bwrap") or "bwrap", "--as-pid-1", *bwrap_args(prefix, self.scratch_mb << 20, root),
                executable, "-I", "-u", "-c", _PRELUDE, json.dumps(cfg)]

    def run(self, code: str) -> SandboxRun:
        start = time.monotonic()
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": SCRATCH_DIR, "TMPDIR": "/tmp",
               "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1",
               "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        proc = subprocess.Popen(self.command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True, close_fds=True)
        try:
            try:   # the prelude reads all of stdin before anything else, so this cannot deadlock
                proc.stdin.write(code.encode("utf-8"))
            except BrokenPipeError:   # bwrap failed to start: its message is in the output
                pass
            finally:
                try:
                    proc.stdin.close()
                except BrokenPipeError:
                    pass
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
                          seconds=time.monotonic() - start, pid=proc.pid)

    def _collect(self, proc: subprocess.Popen, start: float) -> tuple[bytes, int, bool, bool]:
        """Read the output pipe until EOF (bwrap and everything under it are gone), killing the
        code at the deadline or when it writes too much."""
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
