"""Queueing code in a running CPython on x86-64 Linux with ptrace alone (no gdb).

Why not gdb here: a debugger that calls a function in the target must put every register back
afterwards, and Linux takes a thread's extended state (XSAVE: the SSE, AVX and AMX registers)
only whole, at the size this CPU's XSAVE area has. gdb 13 (Debian 12's) writes it at a fixed
2,696 bytes; on a CPU with AMX (Sapphire Rapids and later, 11 KB) every call it makes ends in
"Couldn't write extended state status: Bad address". This module saves the area whole, at the
size the kernel reports, and writes back exactly that.

How, for one process:

1. `PTRACE_SEIZE` its main thread and `PTRACE_INTERRUPT` it. Only that thread stops; the job's
   other threads (gloo, autograd, loaders) run on, so a lock one of them holds is let go.
2. Save its general registers and its whole extended state.
3. Each call: a frame 512 bytes below the stack pointer (past the 128-byte red zone the
   interrupted code may use), 16-byte aligned as the ABI wants, whose return address is 0; rip
   set to the function, the arguments in rdi, rsi, ...; `orig_rax` set to -1 so that the kernel
   does not restart the system call the thread was interrupted in into this frame. Continue,
   and wait for the SIGSEGV at address 0 that ends the call: rax holds its result. Signals the
   thread receives meanwhile are held back and sent again once it is let go.
4. The calls: libc's `mmap` (one page for the code: a plain system call, safe wherever the
   thread stopped, unlike `malloc`, whose lock it may hold); the code written there through
   /proc/PID/mem; `Py_AddPendingCall(PyRun_SimpleString, page)`, which only queues: the
   interpreter runs pending calls in its main thread between two bytecodes, holding the GIL.
5. Every register put back, whatever happened (a call still running is stopped first); held
   signals sent again; detach. A system call the thread was in restarts as it does after any
   signal (those that return EINTR after any stop, `epoll_wait` or `sigtimedwait`, do so here
   as under gdb).

Faults the kernel raises for the call's own instructions are never held or sent to the job, and
a thread with SIGSEGV blocked or ignored is refused (ending a call with SIGSEGV would reset its
handler). While the calls run, this process blocks SIGINT, SIGTERM, SIGHUP and SIGQUIT: a
Ctrl-C here must not leave the thread running injected code with no tracer. What cannot be
guarded: this process killed with SIGKILL mid-call (the thread then returns to address 0 and
the job dies, as with a killed gdb), and a main thread stopped while it held the interpreter's
pending-call lock (the second call blocks; after the timeout the thread is put back, and the
abandoned wait is the one thing not undone).

Functions are found in the ELF dynamic symbol tables of the files the process maps (libc, and
the python executable or its libpython), at the address each file was loaded.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import signal
import struct
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from pathlib import Path

PTRACE_GETREGS = 12
PTRACE_SETREGS = 13
PTRACE_GETFPREGS = 14
PTRACE_SETFPREGS = 15
PTRACE_CONT = 7
PTRACE_DETACH = 17
PTRACE_GETSIGINFO = 0x4202
PTRACE_GETREGSET = 0x4204
PTRACE_SETREGSET = 0x4205
PTRACE_SEIZE = 0x4206
PTRACE_INTERRUPT = 0x4207
NT_X86_XSTATE = 0x202
WALL = 0x40000000
PTRACE_EVENT_STOP = 128
MASK64 = (1 << 64) - 1
# Past the red zone (128 bytes) the interrupted function may keep data in, with room to spare.
FRAME_GAP = 512
# Larger than any XSAVE area (AMX: 11,008 bytes); the kernel says how much it filled.
XSTATE_BUFFER = 1 << 16
STT_FUNC = 2
SHT_DYNSYM = 11
PT_LOAD = 1
SYS_TGKILL = 234


class InjectError(RuntimeError):
    """Queueing the code failed; the message says why. The process was left as it was."""


class NotPermitted(InjectError):
    """ptrace was refused (rights, or another tracer)."""


class _Regs(ctypes.Structure):
    # struct user_regs_struct, x86-64 (sys/user.h), in its order.
    _fields_ = [
        (name, ctypes.c_ulonglong)
        for name in (
            "r15", "r14", "r13", "r12", "rbp", "rbx", "r11", "r10", "r9", "r8", "rax", "rcx", "rdx", "rsi", "rdi",
            "orig_rax", "rip", "cs", "eflags", "rsp", "ss", "fs_base", "gs_base", "ds", "es", "fs", "gs",
        )
    ]  # fmt: skip


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_ptrace_fn = _libc.ptrace
_ptrace_fn.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
_ptrace_fn.restype = ctypes.c_long


def _ptrace(request: int, pid: int, addr: int = 0, data: int = 0) -> None:
    ctypes.set_errno(0)
    if _ptrace_fn(request, pid, addr, data) == -1 and (err := ctypes.get_errno()):
        raise OSError(err, os.strerror(err))


# -- finding the functions --------------------------------------------------------------------


def _loaded_files(pid: int) -> dict[str, int]:
    """Each file the process maps, with the address its first page (file offset 0) is at."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and int(parts[2], 16) == 0 and parts[5].startswith("/") and not parts[5].endswith(" (deleted)"):
            out.setdefault(parts[5], int(parts[0].split("-")[0], 16))
    return out


def _elf_functions(path: Path, wanted: set[str]) -> tuple[dict[str, int], int]:
    """The wanted functions' addresses in `path`'s dynamic symbol table (relative to its link
    address), and the link address of its first page."""
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"\x7fELF" or m[4] != 2 or m[5] != 1:
            raise InjectError(f"{path} is not a 64-bit little-endian ELF file")
        (phoff, shoff) = struct.unpack_from("<QQ", m, 32)
        (phentsize, phnum, shentsize, shnum) = struct.unpack_from("<HHHH", m, 54)
        first_page = None
        for i in range(phnum):
            p_type, _, p_offset, p_vaddr = struct.unpack_from("<IIQQ", m, phoff + i * phentsize)
            if p_type == PT_LOAD and p_offset < mmap.PAGESIZE:
                first_page = (p_vaddr - p_offset) & ~(mmap.PAGESIZE - 1)
                break
        if first_page is None:
            raise InjectError(f"{path} has no segment loaded from its first page")
        found: dict[str, int] = {}
        for i in range(shnum):
            _, sh_type, _, _, sh_offset, sh_size, sh_link, _ = struct.unpack_from("<IIQQQQII", m, shoff + i * shentsize)
            if sh_type != SHT_DYNSYM:
                continue
            strtab = struct.unpack_from("<Q", m, shoff + sh_link * shentsize + 24)[0]
            for st_name, st_info, _, st_shndx, st_value, _ in struct.iter_unpack("<IBBHQQ", m[sh_offset : sh_offset + sh_size]):
                if st_shndx == 0 or st_value == 0 or st_info & 0xF != STT_FUNC:
                    continue
                end = m.find(b"\0", strtab + st_name)
                name = m[strtab + st_name : end].decode(errors="replace")
                if name in wanted:
                    found.setdefault(name, st_value)
        return found, first_page


def find_functions(pid: int, libc_names: AbstractSet[str], python_names: AbstractSet[str]) -> dict[str, int]:
    """Addresses in `pid` of libc's `libc_names` and the interpreter's `python_names` (those
    that could not be found are missing from the answer)."""
    exe = os.readlink(f"/proc/{pid}/exe")
    out: dict[str, int] = {}
    for path, start in _loaded_files(pid).items():
        base = os.path.basename(path)
        wanted: set[str] = set()
        if base.startswith(("libc.so", "libc-", "ld-musl")):
            wanted |= libc_names
        if path == exe or base.startswith("libpython"):
            wanted |= python_names
        wanted -= out.keys()
        if not wanted:
            continue
        try:
            functions, first_page = _elf_functions(Path(f"/proc/{pid}/root{path}"), wanted)
        except (OSError, ValueError, struct.error, InjectError):  # unreadable or not ELF: look elsewhere
            continue
        out.update({name: start - first_page + value for name, value in functions.items()})
    return out


# -- stopping, calling, letting go --------------------------------------------------------------


class _SigInfo(ctypes.Structure):
    # The head of siginfo_t; si_addr (for faults) is the union's first field, at 16.
    _fields_ = [("signo", ctypes.c_int), ("errno", ctypes.c_int), ("code", ctypes.c_int), ("pad", ctypes.c_int), ("addr", ctypes.c_ulonglong), ("rest", ctypes.c_byte * 104)]


# Signals the kernel raises for the instruction a thread runs: from the borrowed thread, only
# the call can have raised them, and they are never the job's.
FAULTS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGTRAP})


class _Stopped:
    """One thread, seized and stopped, with everything needed to put it back as it was."""

    def __init__(self, pid: int, deadline: float) -> None:
        self.pid = pid
        self.deadline = deadline
        self.held_signals: list[int] = []
        # True while an injected call runs: the thread must be stopped again before it is let go.
        self.running = False
        try:
            _ptrace(PTRACE_SEIZE, pid)
        except OSError as e:
            if e.errno == errno.ESRCH:
                raise InjectError(f"there is no process {pid}") from e
            raise NotPermitted(f"ptrace refused ({e.strerror})") from e
        try:
            _ptrace(PTRACE_INTERRUPT, pid)
            self._wait_for_interrupt()
        except TimeoutError:
            # Still seized, with the interrupt pending: released when this process exits (a
            # tracer's exit detaches its tracees).
            raise
        except BaseException:
            _detach_quietly(pid)
            raise
        try:
            self.regs = _Regs()
            _ptrace(PTRACE_GETREGS, pid, 0, ctypes.addressof(self.regs))
            self.xstate, self.xstate_size = self.read_extended_state()
            # Written back at once: a state that could not be put back must stop us before
            # any call, not after one.
            self._put_back_extended_state()
            self._refuse_if_faults_are_masked()
        except BaseException:
            _detach_quietly(pid)
            raise

    def read_extended_state(self) -> tuple[ctypes.Array[ctypes.c_char], int | None]:
        """The thread's extended state as it is now: the whole XSAVE area and its size, or
        (no XSAVE on this CPU) the 512-byte FXSAVE area, which is then the whole state, and
        None."""
        buffer = ctypes.create_string_buffer(XSTATE_BUFFER)
        iov = _IoVec(ctypes.addressof(buffer), XSTATE_BUFFER)
        try:
            _ptrace(PTRACE_GETREGSET, self.pid, NT_X86_XSTATE, ctypes.addressof(iov))
            return buffer, iov.iov_len
        except OSError as e:
            if e.errno != errno.ENODEV:
                raise
        _ptrace(PTRACE_GETFPREGS, self.pid, 0, ctypes.addressof(buffer))
        return buffer, None

    def _refuse_if_faults_are_masked(self) -> None:
        # A call ends in a SIGSEGV: with SIGSEGV blocked or ignored in the thread, the kernel
        # would reset the job's handler to the default and unblock it for good.
        fields = dict(line.split(":\t", 1) for line in Path(f"/proc/{self.pid}/task/{self.pid}/status").read_text().splitlines() if ":\t" in line)
        bit = 1 << (signal.SIGSEGV - 1)
        if int(fields.get("SigBlk", "0"), 16) & bit or int(fields.get("SigIgn", "0"), 16) & bit:
            raise InjectError("its main thread has SIGSEGV blocked or ignored just now; try again")

    def _wait(self) -> int:
        while True:
            got, status = os.waitpid(self.pid, os.WNOHANG | WALL)
            if got == self.pid:
                if os.WIFEXITED(status) or os.WIFSIGNALED(status):
                    raise InjectError("the process ended while it was stopped")
                return status
            if time.monotonic() > self.deadline:
                raise TimeoutError
            time.sleep(0.001)

    def _fault(self, sig: int) -> _SigInfo | None:
        """The signal's details if the kernel raised it for an instruction (a call's fault)."""
        info = _SigInfo()
        _ptrace(PTRACE_GETSIGINFO, self.pid, 0, ctypes.addressof(info))
        return info if sig in FAULTS and info.code > 0 else None

    def _next_stop(self) -> tuple[int, _SigInfo] | None:
        """Waits for the thread's next stop that is ours: None for an interrupt (or a group
        stop), else a fault the kernel raised for the call (its signal and details). The job's
        own signals met on the way are held back, to be sent again when it is let go."""
        while True:
            status = self._wait()
            if status >> 16:
                return None
            sig = os.WSTOPSIG(status)
            fault = self._fault(sig)
            if fault is not None:
                return sig, fault
            self.held_signals.append(sig)
            _ptrace(PTRACE_CONT, self.pid)

    def _wait_for_interrupt(self) -> None:
        """Waits for the stop an interrupt asked for; a fault the call raised on the way is
        dropped, never delivered."""
        while self._next_stop() is not None:
            _ptrace(PTRACE_CONT, self.pid)

    def write(self, address: int, data: bytes) -> None:
        fd = os.open(f"/proc/{self.pid}/mem", os.O_RDWR)
        try:
            if os.pwrite(fd, data, address) != len(data):
                raise InjectError(f"writing {len(data)} bytes at {address:#x} was cut short")
        finally:
            os.close(fd)

    def call(self, function: int, *args: int) -> int:
        """Runs `function(*args)` in the stopped thread; its return value (rax)."""
        regs = _Regs.from_buffer_copy(self.regs)
        sp = ((self.regs.rsp - FRAME_GAP) & ~0xF) - 8
        self.write(sp, b"\0" * 8)  # the return address
        regs.rsp, regs.rip, regs.rax, regs.orig_rax = sp, function, 0, MASK64
        regs.eflags &= ~0x400  # the ABI wants the direction flag clear at a call
        for name, value in zip(("rdi", "rsi", "rdx", "rcx", "r8", "r9"), args, strict=False):
            setattr(regs, name, value & MASK64)
        _ptrace(PTRACE_SETREGS, self.pid, 0, ctypes.addressof(regs))
        self.running = True
        _ptrace(PTRACE_CONT, self.pid)
        while (stop := self._next_stop()) is None:  # an interrupt or group stop: not this call's
            _ptrace(PTRACE_CONT, self.pid)
        sig, fault = stop
        self.running = False  # stopped at the fault, which is never delivered
        _ptrace(PTRACE_GETREGS, self.pid, 0, ctypes.addressof(regs))
        if sig == signal.SIGSEGV and regs.rip == 0 and fault.addr == 0:
            return int(regs.rax)
        raise InjectError(f"the call to {function:#x} faulted ({signal.Signals(sig).name} at {regs.rip:#x})")

    def _put_back_extended_state(self) -> None:
        if self.xstate_size is None:
            _ptrace(PTRACE_SETFPREGS, self.pid, 0, ctypes.addressof(self.xstate))
        else:
            iov = _IoVec(ctypes.addressof(self.xstate), self.xstate_size)
            _ptrace(PTRACE_SETREGSET, self.pid, NT_X86_XSTATE, ctypes.addressof(iov))

    def let_go(self) -> None:
        """Puts every register back and detaches (each step tried, whatever failed before);
        held signals are sent again. Stops the thread first if a call is still running."""
        errors: list[Exception] = []
        if self.running:
            self.deadline = time.monotonic() + 10.0
            try:
                _ptrace(PTRACE_INTERRUPT, self.pid)
                self._wait_for_interrupt()
                self.running = False
            except (OSError, InjectError, TimeoutError) as e:
                errors.append(e)
        steps: tuple[Callable[[], None], ...] = (
            lambda: _ptrace(PTRACE_SETREGS, self.pid, 0, ctypes.addressof(self.regs)),
            self._put_back_extended_state,
            self._send_held_signals,
            lambda: _ptrace(PTRACE_DETACH, self.pid),
        )
        for step in steps:
            try:
                step()
            except (OSError, InjectError) as e:
                errors.append(e)
        if errors:
            raise InjectError(f"putting the thread back failed: {errors[0]}") from errors[0]

    def _send_held_signals(self) -> None:
        # Queued to the thread while it is still stopped, each one (real-time signals queue),
        # so that each is delivered as it runs on.
        for sig in self.held_signals:
            if _libc.syscall(SYS_TGKILL, self.pid, self.pid, sig) != 0:
                raise InjectError(f"sending back signal {sig} failed: {os.strerror(ctypes.get_errno())}")


def _detach_quietly(pid: int) -> None:
    try:
        _ptrace(PTRACE_DETACH, pid)
    except OSError:
        pass  # not stopped, or gone: released when this process exits


# What the injection calls: libc's, then the interpreter's.
LIBC_FUNCTIONS = frozenset({"mmap"})
PYTHON_FUNCTIONS = frozenset({"Py_AddPendingCall", "PyRun_SimpleString"})


def _steps(functions: dict[str, int], code: bytes, stopped: _Stopped) -> None:
    size = (len(code) + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
    # PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS; kept for the life of the process.
    page = stopped.call(functions["mmap"], 0, size, 3, 0x22, MASK64, 0)
    if page >= MASK64 - 4095:  # MAP_FAILED, or -errno from a raw system call
        raise InjectError("mmap of a page for the code failed in the process")
    stopped.write(page, code)
    result = stopped.call(functions["Py_AddPendingCall"], functions["PyRun_SimpleString"], page) & 0xFFFFFFFF
    if result != 0:
        raise InjectError(f"Py_AddPendingCall refused the call (returned {ctypes.c_int32(result).value}: its queue is full)")


def queue_code(pid: int, code: bytes, timeout: float = 30.0) -> None:
    """Queues `code` (NUL-terminated Python source) to run in `pid`'s main thread at its next
    safe point, as `PyRun_SimpleString` does. Raises InjectError (NotPermitted where ptrace is
    refused); whatever happens, the thread is put back and let go."""
    if not code.endswith(b"\0"):
        raise ValueError("the code must end with a NUL byte (it is handed to PyRun_SimpleString)")
    try:
        functions = find_functions(pid, LIBC_FUNCTIONS, PYTHON_FUNCTIONS)
    except OSError as e:
        raise InjectError(f"cannot read process {pid}'s memory map: {e.strerror}") from e
    missing = sorted((LIBC_FUNCTIONS | PYTHON_FUNCTIONS) - functions.keys())
    if missing:
        raise InjectError(f"process {pid} has no CPython runtime to call ({', '.join(missing)} not found)")
    # The attaching command must not be stopped mid-call by Ctrl-C or a hang-up: the borrowed
    # thread would be left running injected code with no tracer to take it back.
    shielded = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, shielded)
    try:
        _queue(pid, functions, code, timeout)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _queue(pid: int, functions: dict[str, int], code: bytes, timeout: float) -> None:
    try:
        stopped = _Stopped(pid, time.monotonic() + timeout)
    except TimeoutError as e:
        raise InjectError(f"process {pid}'s main thread did not stop within {timeout:.0f} s (blocked in the kernel?)") from e
    try:
        _steps(functions, code, stopped)
    except TimeoutError as e:
        raise InjectError(f"a call in process {pid} did not return within {timeout:.0f} s; the thread was put back where it was") from e
    finally:
        stopped.let_go()  # a call still running is stopped first
