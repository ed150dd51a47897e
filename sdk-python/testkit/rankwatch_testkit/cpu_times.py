"""A pytest plugin (`-p rankwatch_testkit.cpu_times`) that measures the CPU each test spends,
its own and that of the processes it started and waited for (training ranks, launchers, a
collector a test stopped), from its setup to its teardown.

`cargo xtask test` runs every suite on two cores, so what bounds the run is CPU, not any one
test's wall time: a test that sleeps for a minute costs the other lane nothing, one that trains
four ranks for twenty seconds costs forty core-seconds. Each test's figure goes into the JUnit
report as its `cpu_seconds` property, and the suite ends with the tests that cost the most,
beside pytest's `--durations`. Live children count too, with what they have reaped (a test
kit's zygote forks the jobs, so their CPU is its children's): a collector a fixture keeps
across tests is counted, for each test, for what it spent during it.
"""

from __future__ import annotations

import os
from collections.abc import Generator

import pytest

_KEY = pytest.StashKey[float]()
_SPENT: list[tuple[float, str]] = []
# How many of the costliest tests the summary lists.
SHOWN = 25


_TICK = os.sysconf("SC_CLK_TCK")


def _live_children_cpu() -> float:
    """User and system CPU of this process's live children, with the children they reaped."""
    total = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0.0
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                pids = f.read().split()
        except OSError:
            continue
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue  # it ended meanwhile: os.times() has it once it is reaped
            # utime, stime, cutime, cstime: fields 14-17 of stat, 12-15 after the name.
            total += sum(int(x) for x in fields[11:15])
    return total / _TICK


def _cpu_now() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system + _live_children_cpu()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    item.stash[_KEY] = _cpu_now()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    yield
    started = item.stash.get(_KEY, None)
    if started is None:
        return
    spent = _cpu_now() - started
    # Read by the JUnit report when it writes the teardown's report, which comes after this.
    item.user_properties.append(("cpu_seconds", f"{spent:.2f}"))
    _SPENT.append((spent, item.nodeid))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _SPENT:
        return
    total = sum(s for s, _ in _SPENT)
    terminalreporter.write_sep("=", f"costliest {min(SHOWN, len(_SPENT))} tests by CPU (their own and their waited-for children's)")
    for spent, nodeid in sorted(_SPENT, reverse=True)[:SHOWN]:
        terminalreporter.write_line(f"{spent:7.2f}s cpu  {nodeid}")
    terminalreporter.write_line(f"{total:7.2f}s cpu  in all, over {len(_SPENT)} tests")
