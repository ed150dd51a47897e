"""The x86-64 ptrace injector (`rankwatch.auto.ptrace`) on real processes: it queues code that
runs, it puts back every register of the thread it borrowed (the extended state too: the part
gdb 13 cannot write on a CPU with AMX), a sleeping thread sleeps on, and a process without
CPython is refused by name and left alone."""

from __future__ import annotations

import platform
import subprocess
import sys
import time
from pathlib import Path

import pytest

if not (sys.platform == "linux" and platform.machine() == "x86_64"):
    pytest.skip("the ptrace injector is for x86-64 Linux (gdb is used elsewhere)", allow_module_level=True)

from rankwatch.auto import ptrace  # noqa: E402

# FXSAVE layout (the first 512 bytes of the XSAVE area): MXCSR at 24, xmm0-15 at 160..416. The
# AVX upper halves of ymm0-15 sit at 576..832 in the standard (uncompacted) XSAVE format.
MXCSR = slice(24, 28)
XMM = slice(160, 416)
YMM_HIGH = slice(576, 832)
GENERAL = [field[0] for field in ptrace._Regs._fields_ if field[0] not in ("rax", "orig_rax")]


def _sleeper(seconds: float) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds}); print('slept', flush=True)"], stdout=subprocess.PIPE)
    time.sleep(1.0)  # into its sleep
    return proc


SYSCALL = b"\x0f\x05"


def _state(pid: int) -> tuple[dict[str, int], bytes, int | None]:
    """The thread's general registers, with `rip` read as the system call it is in where it is
    in one, its extended state and that state's size."""
    stopped = ptrace._Stopped(pid, time.monotonic() + 30)
    try:
        regs = {name: getattr(stopped.regs, name) for name in GENERAL}
        # A thread stopped in a sleep is caught either just after its `syscall` instruction (in
        # the call) or on it, when the kernel has just moved it back two bytes to restart the
        # call a stop interrupted: the same point of the program either way.
        with open(f"/proc/{pid}/mem", "rb") as mem:
            mem.seek(regs["rip"] - 2)
            around = mem.read(4)
        if around[2:] != SYSCALL and around[:2] == SYSCALL:
            regs["rip"] -= 2
        return regs, bytes(stopped.xstate), stopped.xstate_size
    finally:
        stopped.let_go()


def _has_avx2() -> bool:
    return " avx2 " in Path("/proc/cpuinfo").read_text().replace("\n", " ")


def test_queued_code_runs_in_the_process_and_it_goes_on(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    proc = subprocess.Popen([sys.executable, "-c", "import time\nfor _ in range(400): time.sleep(0.01)\nprint('done', flush=True)"], stdout=subprocess.PIPE)
    try:
        time.sleep(1.0)
        for i in range(5):
            ptrace.queue_code(proc.pid, f"open({str(marker)!r}, 'a').write('{i}')\n".encode() + b"\0")
        out = proc.communicate(timeout=60)[0]
    finally:
        proc.kill()
    assert marker.read_text() == "01234", "each queued code ran once, in order"
    assert proc.returncode == 0 and out == b"done\n"


def test_every_register_is_put_back_after_a_call_that_clobbers_vector_registers() -> None:
    """A call made in the borrowed thread sets xmm0/xmm1 (and ymm0's upper half, with AVX2) to
    all ones; once the thread is let go, the next stop finds every general register and the
    vector state exactly as before the call."""
    proc = _sleeper(60)
    try:
        before_regs, before_x, size = _state(proc.pid)
        stopped = ptrace._Stopped(proc.pid, time.monotonic() + 30)
        try:
            fn = ptrace.find_functions(proc.pid, {"mmap"}, set())["mmap"]
            page = stopped.call(fn, 0, 4096, 7, 0x22, ptrace.MASK64, 0)  # RWX, private anonymous
            assert page < ptrace.MASK64 - 4095, "mmap failed in the target"
            # pcmpeqd xmm0,xmm0; pcmpeqd xmm1,xmm1; [vpcmpeqd ymm2,ymm2,ymm2]; ret
            code = bytes.fromhex("660f76c0660f76c9") + (bytes.fromhex("c5ed76d2") if _has_avx2() else b"") + b"\xc3"
            stopped.write(page, code)
            stopped.call(page)
            # What the call left in the thread (read while it is still stopped): clobbered.
            clobbered, _ = stopped.read_extended_state()
            assert clobbered.raw[XMM][:32] == b"\xff" * 32, "the test call did set xmm0 and xmm1"
            assert clobbered.raw[XMM] != before_x[XMM]
        finally:
            stopped.let_go()
        after_regs, after_x, after_size = _state(proc.pid)
        assert after_size == size
        assert after_regs == before_regs
        assert after_x[MXCSR] == before_x[MXCSR]
        assert after_x[XMM] == before_x[XMM], "xmm registers put back"
        if size is not None and size >= YMM_HIGH.stop:
            assert after_x[YMM_HIGH] == before_x[YMM_HIGH], "ymm upper halves put back"
        assert proc.poll() is None, "the process goes on"
    finally:
        proc.kill()
        proc.wait()


def test_a_sleep_interrupted_for_the_injection_sleeps_its_full_time() -> None:
    """The thread was stopped inside clock_nanosleep: the system call restarts where it was, so
    the sleep is neither cut short nor broken by EINTR."""
    started = time.monotonic()
    proc = _sleeper(4)
    try:
        ptrace.queue_code(proc.pid, b"pass\n\0")
        out = proc.communicate(timeout=60)[0]
    finally:
        proc.kill()
    assert proc.returncode == 0 and out == b"slept\n"
    assert time.monotonic() - started >= 4.0


def test_a_process_without_cpython_is_refused_by_name_and_left_alone() -> None:
    proc = subprocess.Popen(["sleep", "30"])
    try:
        time.sleep(0.3)
        with pytest.raises(ptrace.InjectError, match="no CPython runtime to call"):
            ptrace.queue_code(proc.pid, b"pass\n\0")
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_code_without_its_nul_is_refused_before_anything_is_touched() -> None:
    with pytest.raises(ValueError, match="NUL"):
        ptrace.queue_code(1, b"pass\n")


def test_a_process_another_tracer_holds_is_refused_and_attach_says_why(tmp_path: Path) -> None:
    """ptrace allows one tracer: while one holds the process (here this test; in life py-spy or
    a debugger), the injector is refused, and `attach` names rights and other debuggers."""
    from rankwatch.auto.inject import AttachError, _inject_ptrace

    proc = _sleeper(60)
    try:
        holder = ptrace._Stopped(proc.pid, time.monotonic() + 30)
        try:
            with pytest.raises(ptrace.NotPermitted, match="ptrace refused"):
                ptrace.queue_code(proc.pid, b"pass\n\0")
            with pytest.raises(AttachError, match="not permitted to trace process .* no other debugger attached"):
                _inject_ptrace(proc.pid, tmp_path / "payload.py")
        finally:
            holder.let_go()
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_a_signal_that_arrives_during_a_call_is_held_and_delivered_once_afterwards(tmp_path: Path) -> None:
    """The job's own signal (here SIGUSR1, sent to the borrowed thread while it is stopped) is
    not delivered into the injected call: it is held back and sent again once the thread is
    let go, so the job's handler runs exactly once, in its own code."""
    import signal

    count = tmp_path / "usr1"
    script = (
        "import signal, time\n"
        f"signal.signal(signal.SIGUSR1, lambda *_: open({str(count)!r}, 'a').write('x'))\n"
        "for _ in range(600): time.sleep(0.05)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        time.sleep(1.0)
        stopped = ptrace._Stopped(proc.pid, time.monotonic() + 30)
        try:
            ptrace._libc.syscall(ptrace.SYS_TGKILL, proc.pid, proc.pid, signal.SIGUSR1)
            fn = ptrace.find_functions(proc.pid, {"getpid"}, set())["getpid"]
            assert stopped.call(fn) == proc.pid, "the call ran in the target"
            assert stopped.held_signals == [signal.SIGUSR1]
            assert not count.exists(), "not delivered while the thread was borrowed"
        finally:
            stopped.let_go()
        deadline = time.monotonic() + 10
        while not count.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        assert count.read_text() == "x", "delivered once after the thread was let go"
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
