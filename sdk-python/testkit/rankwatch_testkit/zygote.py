"""Starting the test suites' Python jobs from a process that has already imported torch.

Every rank and launcher a suite starts is a new interpreter that imports torch and, at its first
DistributedDataParallel, `torch._dynamo`: about 4 CPU-seconds on this project's 2-core machine
before the job trains a step, and the SDK suite starts about a hundred of them. A zygote imports
those modules once, runs nothing, and forks a child per job; the child takes the job's argv,
environment, working directory and standard streams, runs the script as `__main__` and leaves
through the interpreter's normal exit (atexit handlers, non-daemon threads joined, objects
finalized: an unfinished run's agent delivers what it holds, as in a fresh process). That exit
is most of what a job started so still costs (about 1.3 CPU-seconds against about 4.6 for a
fresh start and exit).

    python -m rankwatch_testkit.zygote serve SOCKET           # the zygote
    python -m rankwatch_testkit.zygote run SOCKET -- ARGV...  # in place of ARGV (python ...)

`command(argv)` gives the second form, starting the calling process's zygote on first use.
`run` is a trampoline started in place of the job: it hands its own standard streams to the
zygote, waits, and exits as the job did (its code, or the signal that ended it). Killing it kills
the job (the zygote watches the connection); SIGTERM, SIGINT and SIGHUP are passed on. It starts
a fresh interpreter instead (`exec`, so nothing differs from not using it) whenever the zygote
could not give the same start: the zygote gone or refusing, interpreter options in ARGV, or a
difference from the zygote's environment in a variable read at the start: the interpreter's
and native libraries' (`NATIVE_PREFIXES`), and those of torch's and Triton's the preload's
imports looked up, recorded as they ran (`TORCH_LOGS`, dozens of compiler settings).
The zygote also refuses to fork while it has a second thread. Jobs whose subject is
how a process starts (attaching to one, spawn against fork, the installed wheel) are started
fresh by their tests on purpose; `RANKWATCH_TESTKIT_ZYGOTE=off` starts every job fresh.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import struct
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

ENV_SWITCH = "RANKWATCH_TESTKIT_ZYGOTE"
# What the zygote imports before forking. rankwatch itself is cheap to import and reads its
# environment when imported, so each job imports it.
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch.nn.parallel", "numpy")
# Environment variables whose values the preloaded modules (or the interpreter, or the loader)
# read once at start: a job that sets one differently needs its own fresh start.
# Environment variables read once at a process's start, by the interpreter or by native
# libraries (OpenMP's runtime and the BLAS when torch loads them, glibc, the loader): a job
# that sets one otherwise than the zygote needs its own start.
NATIVE_PREFIXES = ("PYTHON", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "LD_", "MALLOC_")
# Families of variables torch's Python code reads; those the preload's imports looked up are
# recorded while they run (torch's configuration modules read dozens at import), and a job that
# sets one of those otherwise needs its own start too. Those read later, as
# PYTORCH_NVML_BASED_CUDA_CHECK is at the first CUDA query, are the job's to read.
PYTHON_READ_PREFIXES = ("TORCH", "PYTORCH_", "TRITON_", "AOT", "INDUCTOR_")
_HEADER = struct.Struct("!I")
_STREAMS = 3


def _shapes(key: str, read: set[str]) -> bool:
    return key.startswith(NATIVE_PREFIXES) or (key.startswith(PYTHON_READ_PREFIXES) and key in read)


@contextlib.contextmanager
def _recording_reads(read: set[str]) -> Iterator[None]:
    """While open, every lookup of `os.environ` (`[]`, `get`, `getenv`, `in`) adds its key to
    READ."""
    environ_type = type(os.environ)
    original = environ_type.__getitem__

    def recording(self: Any, key: str) -> str:
        read.add(key)
        return original(self, key)

    environ_type.__getitem__ = recording  # type: ignore[method-assign]
    try:
        yield
    finally:
        environ_type.__getitem__ = original  # type: ignore[method-assign]


def command(argv: list[str]) -> list[str]:
    """ARGV as a test starts it: through this process's zygote (started on first use) when ARGV
    runs this interpreter; ARGV itself when `RANKWATCH_TESTKIT_ZYGOTE=off` or the zygote could
    not start. The trampoline still falls back to ARGV itself where it must."""
    if not argv or not _this_interpreter(argv[0]) or os.environ.get(ENV_SWITCH) == "off":
        return list(argv)
    path = _zygote_socket()
    if path is None:
        return list(argv)
    return [sys.executable, "-m", "rankwatch_testkit.zygote", "run", path, "--", *argv]


_started: dict[str, Any] = {}
_starting = threading.Lock()


def _zygote_socket() -> str | None:
    """The socket of this process's zygote, started (and waited for) on the first call; it ends
    when this process does, as its stdin is a pipe from here."""
    with _starting:
        if "socket" not in _started:
            _start_zygote()
        return _started["socket"]


def _start_zygote() -> None:
    import atexit
    import shutil
    import subprocess
    import tempfile

    folder = tempfile.mkdtemp(prefix="rankwatch-zygote-")
    path = os.path.join(folder, "zygote.sock")
    # Its own log (why a job started fresh), not this process's stderr: under pytest that is the
    # capture of whichever test came first.
    with open(os.path.join(folder, "zygote.log"), "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "rankwatch_testkit.zygote", "serve", path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
    assert proc.stdout is not None
    ready = proc.stdout.readline().strip() == "ready"
    if not ready:
        print("rankwatch_testkit.zygote: the zygote did not start; jobs start fresh", file=sys.stderr)
        proc.kill()
        proc.wait()

    def stop() -> None:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(folder, ignore_errors=True)

    if ready:
        atexit.register(stop)
    _started["socket"] = path if ready else None
    _started["log"] = os.path.join(folder, "zygote.log")


def log_text() -> str:
    """What this process's zygote has said (why jobs started fresh); empty before it started."""
    try:
        with open(_started.get("log", ""), encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


# ---------------------------------------------------------------- the trampoline (`run`)


def _this_interpreter(path: str) -> bool:
    """Whether PATH names this interpreter. Symbolic links are not followed: a venv's python
    links to the base interpreter, which would start without the venv."""
    return os.path.normpath(os.path.abspath(path)) == os.path.normpath(os.path.abspath(sys.executable))


def _exec_fresh(argv: list[str]) -> NoReturn:
    os.execv(argv[0], argv)


def _job_of(argv: list[str]) -> list[str] | None:
    """The job's own argv (what follows the interpreter) if the zygote can run it: a script, `-m
    module` or `-c code`, and no interpreter option."""
    if len(argv) < 2 or not _this_interpreter(argv[0]):
        return None
    first = argv[1]
    if first in ("-m", "-c"):
        return argv[1:] if len(argv) > 2 else None
    return None if first.startswith("-") else argv[1:]


def _send_request(sock: socket.socket, request: dict[str, Any]) -> None:
    body = json.dumps(request).encode()
    socket.send_fds(sock, [_HEADER.pack(len(body)) + body], list(range(_STREAMS)))


_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def trampoline(path: str, argv: list[str]) -> NoReturn:
    job = _job_of(argv)
    if job is None:
        _exec_fresh(argv)
    # Forwarding is armed before the job exists: a job forked from a preloaded zygote can be up
    # (and its caller signalling it) before its pid arrives here. Until then signals wait.
    pid: int | None = None
    pending: list[int] = []

    def forward(signum: int, _frame: Any) -> None:
        if pid is None:
            pending.append(signum)
            return
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for s in _FORWARDED:
        signal.signal(s, forward)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # One buffered reader for both lines: the job can end before this process reads its pid,
    # and then both lines come in one read.
    replies = sock.makefile("rb")
    try:
        sock.connect(path)
        _send_request(sock, {"job": job, "env": dict(os.environ), "cwd": os.getcwd()})
        answer = _read_line(replies)
    except OSError:
        answer = b""
    if not answer.startswith(b"pid "):
        # The zygote refused (its reason is on its stderr) or is gone: a fresh start, unless the
        # caller already asked the job to end, which then ends here as a fresh job would.
        sock.close()
        for forwarded in _FORWARDED:
            signal.signal(forwarded, signal.SIG_DFL)
        for signum in pending:
            os.kill(os.getpid(), signum)
        _exec_fresh(argv)
    pid = int(answer.split()[1])
    for signum in pending:
        forward(signum, None)
    status = _read_line(replies)
    # The job is reaped: its pid may be another process's soon.
    pid = None
    for forwarded in _FORWARDED:
        signal.signal(forwarded, signal.SIG_IGN)
    if not status.startswith(b"exit "):
        print("rankwatch_testkit.zygote: lost the zygote while the job ran", file=sys.stderr)
        os._exit(70)
    code = int(status.split()[1])
    if code < 0:
        # Ended by a signal: end the same way, so the caller sees what the job's end was.
        # (SIGKILL's disposition cannot be set, nor needs to be.)
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


def _read_line(replies: Any) -> bytes:
    try:
        return bytes(replies.readline())
    except OSError:
        return b""


# ---------------------------------------------------------------- the zygote (`serve`)


@dataclass
class _Job:
    argv: list[str]
    env: dict[str, str]
    cwd: str
    streams: list[int]


@dataclass
class _Child:
    pid: int
    pidfd: int
    conn: socket.socket


@dataclass
class _Server:
    listener: socket.socket
    selector: selectors.BaseSelector
    base_env: dict[str, str]
    # What importing PRELOAD added to the environment (torch sets TORCHINDUCTOR_CACHE_DIR), as
    # a fresh start's imports would add it to the job's.
    added_env: dict[str, str]
    # The variables the preload's imports looked up.
    read_env: set[str]
    children: dict[int, _Child] = field(default_factory=dict)

    def close_in_child(self) -> None:
        """Closes what the server holds, in a forked child, through the objects that own each
        descriptor: a bare `os.close` would leave a socket object to close its number again when
        collected, by then perhaps the job's own socket."""
        self.selector.close()
        self.listener.close()
        for child in self.children.values():
            os.close(child.pidfd)
            child.conn.close()
        self.children.clear()


def _receive(conn: socket.socket) -> _Job | None:
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, _STREAMS)
    if len(fds) != _STREAMS or len(data) < _HEADER.size:
        for fd in fds:
            os.close(fd)
        return None
    try:
        (length,) = _HEADER.unpack_from(data)
        body = data[_HEADER.size :]
        while len(body) < length:
            chunk = conn.recv(length - len(body))
            if not chunk:
                break
            body += chunk
        request = json.loads(body)
        return _Job(argv=request["job"], env=request["env"], cwd=request["cwd"], streams=fds)
    except BaseException:
        # Never left open: every later job would inherit a dead caller's pipes.
        for fd in fds:
            os.close(fd)
        raise


def _refusal(server: _Server, job: _Job) -> str | None:
    differing = _shaping_differences(job.env, server.base_env, server.added_env, server.read_env)
    if differing:
        return f"the job's environment differs in {differing}"
    # The launcher's count (its test of a safe fork); torch is loaded here already.
    from rankwatch_testkit.spawn import _threads

    threads = _threads()
    if threads != 1:
        return f"the zygote has {threads} threads and cannot fork safely"
    return None


def _shaping_differences(job: dict[str, str], base: dict[str, str], added: dict[str, str], read: set[str]) -> list[str]:
    """The shaping variables the job sets otherwise than the zygote started with. One the
    preload's imports set is no difference when the job lacks it or has the value they set (a
    process that imported torch has `TORCHINDUCTOR_CACHE_DIR` so, and passes it on)."""
    differing = []
    for key in sorted(k for k in set(job) | set(base) if _shapes(k, read)):
        if job.get(key) == base.get(key) or (key in added and job.get(key) in (None, added[key])):
            continue
        differing.append(key)
    return differing


def serve(path: str) -> _Job:
    """Preloads, then serves until its stdin closes or it is terminated; returns only in a
    forked child, with that child's job."""
    import importlib

    before = dict(os.environ)
    read: set[str] = set()
    with _recording_reads(read):
        for name in PRELOAD:
            importlib.import_module(name)
    added = {k: v for k, v in os.environ.items() if k not in before}
    owner = os.getpid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    server = _Server(listener, selectors.DefaultSelector(), before, added, read)
    server.selector.register(listener, selectors.EVENT_READ, "accept")
    # The process that started the zygote holds the other end of its stdin: when that closes
    # (it ended, or died), the zygote ends too.
    server.selector.register(sys.stdin, selectors.EVENT_READ, "stdin")
    print("ready", flush=True)
    try:
        while True:
            for key, _ in server.selector.select():
                if key.data == "stdin":
                    if not os.read(sys.stdin.fileno(), 1 << 12):
                        return _shutdown(server)
                elif key.data == "accept":
                    job = _accept(server)
                    if job is not None:
                        return job
                else:
                    _child_event(server, key.data)
    finally:
        if os.getpid() == owner:
            Path(path).unlink(missing_ok=True)


def _accept(server: _Server) -> _Job | None:
    """Receives a job and forks its child; in the child, returns the job."""
    conn, _ = server.listener.accept()
    try:
        job = _receive(conn)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"rankwatch_testkit.zygote: a malformed request: {e}", file=sys.stderr, flush=True)
        conn.close()
        return None
    if job is None:
        conn.close()
        return None
    reason = _refusal(server, job)
    if reason is not None:
        _send_fresh(conn, job, reason)
        return None
    try:
        pid = os.fork()
    except OSError as e:
        _send_fresh(conn, job, f"cannot fork ({e})")
        return None
    if pid == 0:
        job.env = {**server.added_env, **job.env}
        server.close_in_child()
        conn.close()
        return job
    for fd in job.streams:
        os.close(fd)
    pidfd = os.pidfd_open(pid)
    child = _Child(pid, pidfd, conn)
    server.children[pid] = child
    server.selector.register(pidfd, selectors.EVENT_READ, ("exited", pid))
    server.selector.register(conn, selectors.EVENT_READ, ("conn", pid))
    try:
        conn.sendall(f"pid {pid}\n".encode())
    except OSError:
        # The trampoline died meanwhile (a test's timeout): so does the job. It stays
        # registered, to be reaped when it has ended.
        os.kill(pid, signal.SIGKILL)
    return None


def _send_fresh(conn: socket.socket, job: _Job, reason: str) -> None:
    """Tells the trampoline to start its job fresh, and why (in the zygote's log)."""
    print(f"rankwatch_testkit.zygote: starting {job.argv[:2]} fresh: {reason}", file=sys.stderr, flush=True)
    for fd in job.streams:
        os.close(fd)
    try:
        conn.sendall(b"fresh\n")
    except OSError:
        pass  # the trampoline is gone: nothing to start
    conn.close()


def _child_event(server: _Server, data: tuple[str, int]) -> None:
    what, pid = data
    child = server.children.get(pid)
    if child is None:
        return
    if what == "conn":
        # The trampoline sends nothing after its request: readable means it is gone (killed,
        # most likely by a test's timeout), and the job goes with it.
        try:
            gone = not child.conn.recv(1)
        except OSError:
            gone = True
        if gone:
            server.selector.unregister(child.conn)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return
    _pid, status = os.waitpid(pid, 0)
    server.selector.unregister(child.pidfd)
    os.close(child.pidfd)
    try:
        server.selector.unregister(child.conn)
    except KeyError:
        pass
    try:
        child.conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
    except OSError:
        pass
    child.conn.close()
    del server.children[pid]


def _shutdown(server: _Server) -> NoReturn:
    for pid in list(server.children):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    sys.exit(0)


def run_job(job: _Job) -> NoReturn:
    """In the forked child: become the job, then leave as the interpreter leaves a script."""
    for target, fd in enumerate(job.streams):
        os.dup2(fd, target)
        os.close(fd)
    # Stream objects made for the new descriptors, line-buffered where a fresh start's would be
    # (stdout on a terminal, stderr always); `sys.__stdout__` and the others keep the zygote's
    # objects, which write to the same descriptors.
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False, buffering=1)
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(s, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(job.cwd)
    os.environ.clear()
    os.environ.update(job.env)
    import runpy

    first = job.argv[0]
    try:
        if first == "-m":
            sys.argv = [first, *job.argv[2:]]
            sys.path[0] = job.cwd
            runpy.run_module(job.argv[1], run_name="__main__", alter_sys=True)
        elif first == "-c":
            sys.argv = ["-c", *job.argv[2:]]
            sys.path[0] = ""
            _run_code(job.argv[1])
        else:
            script = os.path.join(job.cwd, first)
            sys.argv = list(job.argv)
            sys.path[0] = os.path.dirname(os.path.realpath(script))
            runpy.run_path(script, run_name="__main__")
    except SystemExit:
        raise
    except BaseException:  # noqa: BLE001 - printed and turned into exit code 1, as the interpreter does
        # Through the job's own excepthook, without this module's frames or runpy's, as a
        # fresh interpreter would print it.
        kind, value, tb = sys.exc_info()
        while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>", runpy.__file__):
            tb = tb.tb_next
        if value is not None:
            value = value.with_traceback(tb)
        # What the interpreter records before it prints an uncaught exception, which exit
        # handlers read (rankwatch's tells a crash from a clean end by it).
        sys.last_type, sys.last_value, sys.last_traceback = kind, value, tb
        if sys.version_info >= (3, 12):
            sys.last_exc = value
        sys.excepthook(kind, value, tb)  # type: ignore[arg-type]
        sys.exit(1)
    sys.exit(0)


def _run_code(code: str) -> None:
    import types

    module = types.ModuleType("__main__")
    module.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = module
    exec(compile(code, "<string>", "exec"), module.__dict__)


def main(argv: list[str]) -> None:
    if len(argv) >= 2 and argv[0] == "serve":
        run_job(serve(argv[1]))
    if len(argv) >= 3 and argv[0] == "run" and argv[2] == "--":
        trampoline(argv[1], argv[3:])
    print("usage: python -m rankwatch_testkit.zygote serve SOCKET | run SOCKET -- ARGV...", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main(sys.argv[1:])
