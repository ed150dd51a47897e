"""Watching a job that never imports rankwatch: `rankwatch run -- torchrun ...`, a dormant run
switched on and off through the collector, and `rankwatch attach --pid` into a job started
plain (ptrace on x86-64, gdb elsewhere; `sys.remote_exec` where the interpreter is 3.14). The job is
`examples/train_plain.py`: 2 gloo ranks of DDP over a small GPT-2, AdamW. Every case checks that the
metrics arrive for both ranks at the same steps and that the watched job ends with exactly the
parameters of its unwatched twin. Every process has a timeout: a hang fails the test."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import SDK_ROOT, Collector, collector_binary, sdk_env

pytest.importorskip("transformers")

TRAIN = str(SDK_ROOT / "examples" / "train_plain.py")
EVERY = "grad=1,sketch=3,dot=3,activations=3,spectral=3"
# How `attach --pid` gets into a Python < 3.14 here (inject.py): its own ptrace on x86-64, gdb elsewhere.
WAY_IN = "ptrace" if sys.platform == "linux" and platform.machine() == "x86_64" else "gdb"
CANNOT_GET_IN = WAY_IN == "gdb" and shutil.which("gdb") is None


def _env(**extra: str) -> dict[str, str]:
    # Quick switch polling for the tests.
    return sdk_env(**{"RANKWATCH_SWITCH_POLL_S": "0.3", "HF_HUB_OFFLINE": "1", **extra})


def _torchrun(*args: str) -> list[str]:
    # --standalone: torchrun binds a free rendezvous port itself (a port picked here could be
    # taken by another test before torchrun binds it).
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", TRAIN, *args]


def _plain_twin(tmp_path: Path, steps: int, *args: str) -> dict[str, torch.Tensor]:
    out = tmp_path / "unwatched.pt"
    done = subprocess.run(_torchrun("--steps", str(steps), "--out", str(out), *args), env=_env(), timeout=300, capture_output=True, text=True)
    # The twin runs without rankwatch; if it fails, its own output is what says why.
    assert done.returncode == 0, f"the unwatched twin failed (exit {done.returncode}): {done.stderr[-4000:]}"
    return torch.load(out)


def _assert_equal_parameters(watched: Path, twin: dict[str, torch.Tensor]) -> None:
    got = torch.load(watched)
    assert got.keys() == twin.keys()
    different = [k for k in got if not torch.equal(got[k], twin[k])]
    assert not different, f"watching changed training: {different[:5]}"


def _steps(collector: Collector, run: str, metric: str) -> dict[int, list[int]]:
    rows = collector.sql(f"SELECT rank, step FROM samples WHERE run = '{run}' AND metric = '{metric}' GROUP BY rank, step ORDER BY rank, step")
    out: dict[int, list[int]] = {}
    for r in rows:
        out.setdefault(r["rank"], []).append(r["step"])
    return out


def _wait_for(predicate, timeout: float, what: str, context=None):  # type: ignore[no-untyped-def]
    """`predicate()` once truthy; on timeout a failure naming `what`, and `context()` (what
    arrived, what the job said) so that a rare failure explains itself."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.3)
    pytest.fail(f"timed out after {timeout} s waiting for {what}" + (f"\n{context()}" if context is not None else ""))


def _arrived(collector: Collector, run: str, job_stderr: str) -> str:
    """What the collector holds of `run` (rows per metric) and the end of the job's stderr."""
    rows = collector.sql(f"SELECT metric, count(*) AS n FROM samples WHERE run = '{run}' GROUP BY metric ORDER BY metric")
    held = ", ".join(f"{r['metric']} {r['n']}" for r in rows) or "nothing"
    return f"the collector holds of run {run!r}: {held}\nthe job's stderr ends:\n{job_stderr[-3000:]}"


# -- in-process and small-process checks ------------------------------------------------------


def test_when_imported_fires_after_the_import_and_at_once_for_an_imported_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rankwatch.auto.imports import when_imported

    (tmp_path / "rw_late_module.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[int] = []
    when_imported("rw_late_module", lambda m: seen.append(m.VALUE))
    assert seen == []
    import rw_late_module  # noqa: F401

    assert seen == [7]
    assert type(rw_late_module.__loader__).__name__ == "SourceFileLoader", "the module keeps its real loader"
    when_imported("json", lambda m: seen.append(len(m.__name__)))
    assert seen == [7, 4]


def test_parse_every_accepts_numbers_and_pairs_and_names_bad_ones() -> None:
    from rankwatch.auto.launch import parse_every

    assert parse_every("50") == 50
    assert parse_every("grad=1, spectral=100") == {"grad": 1, "spectral": 100}
    with pytest.raises(ValueError, match="'spectrall=3'"):
        parse_every("spectrall=3")
    with pytest.raises(ValueError, match="probe=steps"):
        parse_every("grad=x")


def test_sitecustomize_chains_the_users_own_and_leaves_processes_without_torch_alone(tmp_path: Path) -> None:
    users = tmp_path / "user"
    users.mkdir()
    (users / "sitecustomize.py").write_text("import os\nos.environ['USER_SITE_RAN'] = 'yes'\n")
    from rankwatch.auto.launch import environment

    env = environment(["python", "x.py"], run="r", collector=None, every=None, dormant=False, mode="offline", base=_env(PYTHONPATH=str(users)))
    probe = "import os, sys; print(os.environ.get('USER_SITE_RAN'), 'torch' in sys.modules, 'rankwatch.auto.agent' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["yes", "False", "False"], "the user's sitecustomize ran; neither torch nor the agent was loaded"
    assert done.stderr == ""


def test_a_process_that_imports_torch_but_never_steps_an_optimizer_is_left_alone(tmp_path: Path) -> None:
    from rankwatch.auto.launch import environment

    env = environment(["python"], run="r", collector=None, every=None, dormant=False, mode="offline", base=_env(RANKWATCH_SPOOL_DIR=str(tmp_path / "spool")))
    code = (
        "import threading, torch, rankwatch.auto.agent as a; m = torch.nn.Linear(2, 2); m(torch.ones(1, 2)).sum().backward();"
        "print(a.agent() is not None, a.agent().state, a.agent().run, [t.name for t in threading.enumerate()])"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True dormant None ['MainThread']", "the agent waits for an optimizer step: no run, no thread"
    assert not (tmp_path / "spool").exists()


def test_training_ranks_are_found_below_a_launcher_and_dataloader_workers_are_not(tmp_path: Path) -> None:
    from rankwatch.auto.inject import AttachError, training_ranks

    # A launcher (no RANK) with two ranks, each with a child that inherits its RANK (a worker).
    # Each line goes out in one write: the ranks share the launcher's pipe, and print() may
    # write a pid and its newline separately (CI once read "3086430865" and then "").
    rank_code = "import os, subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); os.write(1, f'{c.pid}\\n'.encode()); time.sleep(60)"
    launcher_code = (
        "import os, subprocess, sys, time\n"
        "ps = [subprocess.Popen([sys.executable, '-c', sys.argv[1]], env={**os.environ, 'RANK': str(r)}, stdout=sys.stdout) for r in range(2)]\n"
        "os.write(1, ('ranks ' + ' '.join(str(p.pid) for p in ps) + '\\n').encode()); time.sleep(60)\n"
    )
    launcher = subprocess.Popen([sys.executable, "-c", launcher_code, rank_code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    lines: list[list[str]] = []
    try:
        assert launcher.stdout is not None and launcher.stderr is not None
        raw = [launcher.stdout.readline() for _ in range(3)]
        lines = [line.split() for line in raw]
        # Say what was read, should a line ever come back broken.
        if not all(lines):
            launcher.kill()
            pytest.fail(f"the launcher's lines came back broken: {raw}; exit {launcher.wait()}; stderr {launcher.stderr.read()[-2000:]!r}")
        ranks = sorted(int(x) for line in lines if line[0] == "ranks" for x in line[1:])
        time.sleep(0.5)
        assert training_ranks(launcher.pid) == ranks
        assert training_ranks(ranks[0]) == [ranks[0]]
    finally:
        for p in [launcher.pid, *(int(x) for line in lines for x in line if x.isdigit())]:
            try:
                os.kill(p, 9)
            except ProcessLookupError:
                pass
        launcher.wait()
    with pytest.raises(AttachError, match="no process"):
        training_ranks(2**22 + 12345)


def test_the_agent_stands_aside_where_the_script_calls_rankwatch_itself(tmp_path: Path) -> None:
    import rankwatch
    from rankwatch.auto.agent import AutoAgent, Settings

    mine = rankwatch.init(run="mine", mode="offline", spool_dir=tmp_path)
    agent = AutoAgent(Settings(run="auto", mode="offline", spool_dir=str(tmp_path)))
    agent.install()
    try:
        model = torch.nn.Linear(4, 4)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()
        assert agent.state == "dormant" and agent.run is None
        assert agent.error is not None and "'mine'" in agent.error and "stands aside" in agent.error
        assert agent.steps == 2, "it still counts the steps"
    finally:
        agent.uninstall()
        mine.finish(timeout=5)


def test_an_agent_that_fails_removes_itself_and_training_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure while watching (here: the report of a step raises) stops the agent: its run is
    finished, the probes' hooks and the loss capture are gone, a warning says so once, and the
    parameters end where an unwatched twin's do."""
    from rankwatch.auto import agent as auto
    from rankwatch.run import RankwatchWarning, Run

    from rankwatch_testkit.models import NanoGPT, NanoGPTConfig

    hooked: list[int] = []

    def hooks(model: torch.nn.Module) -> int:
        forward = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
        return forward + sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())

    def train(watched: bool) -> tuple[dict[str, torch.Tensor], auto.AutoAgent | None]:
        torch.manual_seed(0)
        model = NanoGPT(NanoGPTConfig(block_size=8, vocab_size=16, n_layer=2, n_head=2, n_embd=16, dropout=0.0))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(1)
        agent = None
        if watched:
            agent = auto.AutoAgent(auto.Settings(run="failing", mode="offline", spool_dir=str(tmp_path)))
            agent.install()
        for step in range(6):
            if step == 3:
                hooked.append(hooks(model))
                monkeypatch.setattr(Run, "log", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("report broke")))
            x = torch.randint(0, 16, (2, 8), generator=gen)
            model(x, torch.roll(x, -1, 1))[1].backward()
            optimizer.step()
            optimizer.zero_grad()
        hooked.append(hooks(model))
        monkeypatch.undo()
        if agent is not None:
            agent.uninstall()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}, agent

    with pytest.warns(RankwatchWarning, match="the agent stopped itself .*report broke"):
        watched, agent = train(True)
    unwatched, _ = train(False)
    assert agent is not None and agent.state == "dormant" and agent.run is None
    assert hooked[0] > 0 and hooked[1] == 0, f"probes were installed, then every hook removed: {hooked}"
    assert torch.autograd.backward.__module__ == "torch.autograd", "the loss capture was undone"
    assert all(torch.equal(watched[k], unwatched[k]) for k in watched)


def _two_rank_agreement(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The agent as rank 0 of 2, agreeing through an in-memory store that the test plays rank 1
    in (no process group: this process is one of two only as far as the agreement knows)."""
    import torch.distributed as dist

    from rankwatch.auto.agreement import PREFIX, Agreement

    store = dist.PrefixStore(PREFIX, dist.HashStore())
    monkeypatch.setattr(Agreement, "of_job", classmethod(lambda cls, lead: cls(store, 0, 2, lead)))
    return store


def _tiny_training(agent_steps: Any) -> None:
    from rankwatch_testkit.models import NanoGPT, NanoGPTConfig

    torch.manual_seed(0)
    model = NanoGPT(NanoGPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=2, n_embd=16, dropout=0.0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(1, 13):
        x = torch.randint(0, 16, (2, 8))
        model(x, torch.roll(x, -1, 1))[1].backward()
        optimizer.step()
        optimizer.zero_grad()
        agent_steps(step)


def test_a_dormant_agent_that_hears_the_switch_in_its_first_step_still_waits_for_the_other_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The poller starts in the first step and may hear the switch before that step's end reads
    the request: that is a switch to agree on, not a job launched watching (one rank started
    alone at step 1 while the other waited for an agreement that never came)."""
    from rankwatch.auto import agent as auto

    store = _two_rank_agreement(monkeypatch)
    agent = auto.AutoAgent(auto.Settings(run="dormant", mode="offline", dormant=True, spool_dir=str(tmp_path)))
    agent.request("activate")  # heard before the first step's end
    agent.install()
    states: list[str] = []
    try:
        _tiny_training(lambda step: states.append(agent.state))
    finally:
        agent.uninstall()
    assert states == ["dormant"] * 12, "rank 1 never acknowledged: rank 0 must not start alone"
    assert store.check(["1.1/at"]) and store.get("1.1/at").decode() == "4:1", "it proposed step 1 + the minimum lead"


def test_an_injected_request_waits_for_the_go_file_then_takes_the_minimum_lead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`attach --pid`: the first rank injected goes on training while gdb reaches the others; its
    request waits for the go file (written once all are injected) and then proposes the minimum
    lead, not the collector poll's (seconds, so many steps: a short job could end first)."""
    from rankwatch.auto import agent as auto
    from rankwatch.auto.agreement import MIN_LEAD_STEPS

    store = _two_rank_agreement(monkeypatch)
    go = tmp_path / "go"
    agent = auto.AutoAgent(auto.Settings(run="injected", mode="offline", injected=True, spool_dir=str(tmp_path)))
    agent.poll_interval = 100.0  # a poll lead of 101 s: hundreds of steps
    agent.request_once(go, "activate")
    agent.install()
    proposals: dict[int, str | None] = {}

    def each_step(step: int) -> None:
        proposals[step] = store.get("1.1/at").decode() if store.check(["1.1/at"]) else None
        if step == 5:
            go.write_text("")
        if step == 5 + MIN_LEAD_STEPS - 1:
            store.set("1.1/ack/1", "1")  # rank 1 read it too, and acknowledges in time

    try:
        _tiny_training(each_step)
        assert all(proposals[s] is None for s in range(1, 6)), f"nothing proposed before the go file: {proposals}"
        at = store.get("1.1/at").decode()
        assert agent.state == "watching" and agent.run is not None, (agent.state, agent.error, at)
    finally:
        agent.uninstall()
    assert at.startswith(f"{6 + MIN_LEAD_STEPS}:"), at


# -- end to end with a collector ---------------------------------------------------------------


def test_rankwatch_run_watches_a_plain_torchrun_job(tmp_path: Path, collector: Collector) -> None:
    steps = 10
    cmd = [sys.executable, "-m", "rankwatch", "run", "--collector", collector.url, "--run", "zero-code", "--every", EVERY, "--", *_torchrun("--steps", str(steps), "--out", str(tmp_path / "watched.pt"))]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("rankwatch: watching DistributedDataParallel(GPT2LMHeadModel)") == 2, done.stderr[-3000:]
    _assert_equal_parameters(tmp_path / "watched.pt", _plain_twin(tmp_path, steps))
    # The agent starts at the end of step 1: every later step, on both ranks.
    _wait_for(lambda: _steps(collector, "zero-code", "loss") == {0: list(range(2, steps + 1)), 1: list(range(2, steps + 1))}, 30, "the loss of steps 2..10 on both ranks")
    for metric in ("grad_norm", "grad_norm_mean", "cos_to_mean", "spectral.ratio"):
        by_rank = _steps(collector, "zero-code", metric)
        assert set(by_rank) == {0, 1} or metric == "spectral.ratio", (metric, by_rank)
        assert by_rank, metric
    act = collector.sql("SELECT DISTINCT metric FROM samples WHERE run = 'zero-code' AND metric LIKE 'act%'")
    assert act, "activation metrics arrived"
    # The loss is this rank's own: the mean token loss the model returned, as the script printed.
    losses = collector.sql("SELECT rank, step, value FROM samples WHERE run = 'zero-code' AND metric = 'loss' AND step = 5")
    assert len({round(r["value"], 6) for r in losses}) == 2, "each rank reports its own loss"


@pytest.mark.parametrize("layout", ["ddp", "fsdp2"])
def test_a_dormant_run_is_switched_on_and_off_through_the_collector(tmp_path: Path, collector: Collector, layout: str) -> None:
    """Every rank switches at the same step, on and off: under FSDP2 the gradient probe's own
    all-reduce would otherwise pair with another rank's training collective."""
    steps = 120  # long enough that it is still running well after the detach, on a busy machine too
    run = f"sleeper-{layout}"
    cmd = [
        sys.executable, "-m", "rankwatch", "run", "--dormant", "--collector", collector.url, "--run", run, "--every", EVERY, "--",
        *_torchrun("--steps", str(steps), "--step-delay", "0.25", "--out", str(tmp_path / "watched.pt"), *(["--fsdp2"] if layout == "fsdp2" else [])),
    ]  # fmt: skip
    # Polls several steps apart, so that the ranks hear of each switch at different steps (with
    # the switch taking effect where each hears of it, this job hung under FSDP2).
    job = subprocess.Popen(cmd, env=_env(RANKWATCH_SWITCH_POLL_S="1.7"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(3)
        assert _steps(collector, run, "loss") == {}, "a dormant job reports nothing"
        cli = [collector_binary(), "attach", run, "--url", collector.url]
        switched = subprocess.run(cli, capture_output=True, text=True, timeout=30)
        assert switched.returncode == 0 and "probes on" in switched.stdout, switched.stderr
        try:
            on = _wait_for(lambda: job.poll() is not None or ((s := _steps(collector, run, "loss")) and len(s.get(0, [])) >= 3 and len(s.get(1, [])) >= 3 and s), 90, "metrics after attach")
            assert job.poll() is None, "the job ended before the probes reported"
        except BaseException:
            job.kill()
            print(job.communicate()[1][-5000:])  # the agents' messages, for the failure report
            raise
        assert on[0][0] == on[1][0], f"both ranks start at the same step: {on}"
        subprocess.run([collector_binary(), "detach", run, "--url", collector.url], check=True, capture_output=True, timeout=30)
        detached_at = time.monotonic()
        time.sleep(6)  # a poll (1.7 s) and the lead (the poll and a second, in steps)
        settled = _steps(collector, run, "loss")
        time.sleep(2.5)
        assert _steps(collector, run, "loss") == settled, "no rows after the detach took effect"
        assert job.poll() is None, "the job was still running while detached"
        assert time.monotonic() - detached_at < 12
        out, err = job.communicate(timeout=240)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode == 0, err[-3000:]
    assert settled[0] == settled[1], f"both ranks report the same steps, from the switch on to the switch off: {settled}"
    assert settled[0] == list(range(settled[0][0], settled[0][-1] + 1))
    last = max(settled[0])
    assert last < steps - 3, f"rows stopped at step {last}, well before the job's end ({steps})"
    assert set(_steps(collector, run, "grad_norm")) == {0, 1}
    _assert_equal_parameters(tmp_path / "watched.pt", _plain_twin(tmp_path, steps, *(["--fsdp2"] if layout == "fsdp2" else [])))


def _attach_mid_run(tmp_path: Path, collector: Collector, run: str, every: str, steps: int, pause_at: int, *job_args: str) -> tuple[str, int, str]:
    """A plain 2-rank job paused at step `pause_at`, attached by pid, then let go to its end:
    the attach command's stdout, and the job's exit status and stderr."""
    paused, resume = tmp_path / "paused", tmp_path / "resume"
    job = subprocess.Popen(
        _torchrun("--steps", str(steps), "--step-delay", "0.1", "--out", str(tmp_path / "watched.pt"), "--pause-at", str(pause_at), "--paused", str(paused), "--resume", str(resume), *job_args),
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for(paused.exists, 240, f"the job to reach step {pause_at}")
        progress = tmp_path / "attach.err"
        with progress.open("w") as progress_file:
            attach = subprocess.Popen(
                [sys.executable, "-m", "rankwatch", "attach", "--pid", str(job.pid), "--run", run, "--collector", collector.url, "--every", every, "--timeout", "120"],
                env=_env(),
                stdout=subprocess.PIPE,
                stderr=progress_file,
                text=True,
            )
        # The job goes on once both ranks are injected (it says so as each is): gdb takes seconds
        # a process on a busy machine, and a job resumed earlier could be near its end by then.
        _wait_for(lambda: attach.poll() is not None or progress.read_text().count(f": injected (via {WAY_IN})") == 2, 120, "both ranks injected")
        resume.write_text("go")
        out = attach.communicate(timeout=180)[0]
        assert attach.returncode == 0, out + progress.read_text()
        job_err = job.communicate(timeout=300)[1]
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    return out, job.returncode, job_err


@pytest.mark.skipif(CANNOT_GET_IN, reason="gdb is not installed")
def test_attach_by_pid_to_a_job_started_without_rankwatch(tmp_path: Path, collector: Collector) -> None:
    steps = 30
    out, code, job_err = _attach_mid_run(tmp_path, collector, "attached", EVERY, steps, 8)
    lines = [line for line in out.splitlines() if line.startswith("pid ")]
    assert len(lines) == 2 and all("watching DistributedDataParallel(GPT2LMHeadModel)" in line and f"(via {WAY_IN})" in line for line in lines), out
    assert code == 0, job_err[-3000:]
    _assert_equal_parameters(tmp_path / "watched.pt", _plain_twin(tmp_path, steps))
    by_rank = _wait_for(lambda: (s := _steps(collector, "attached", "loss")) and len(s) == 2 and max(s[0]) == steps and max(s[1]) == steps and s, 30, "the loss up to the last step")
    # Ranks are injected one after the other, then agree on the step to start at (the optimizer's
    # own step count numbers the steps alike): both report the same steps, to the job's last.
    assert by_rank[0] == by_rank[1], by_rank
    got = by_rank[0]
    assert got == list(range(got[0], steps + 1)), got
    assert 8 < got[0] < steps - 3, f"attached mid-run: {got}"
    assert set(_steps(collector, "attached", "grad_norm")) == {0, 1}


def _run_summary(collector: Collector, run: str) -> dict[str, Any]:
    import requests

    runs = requests.get(f"{collector.url}/api/v1/runs", timeout=30).json()["runs"]
    return next(r for r in runs if r["run"] == run)


@pytest.mark.skipif(CANNOT_GET_IN, reason="gdb is not installed")
def test_attach_by_pid_to_a_compiled_job_whose_blocks_no_table_knows(tmp_path: Path, collector: Collector) -> None:
    """nanoGPT's way (torch.compile before DDP) with OLMo's block layout, which no family table
    or name pattern knows: attached mid-run, the blocks are read off their data flow, every
    layer's spectral ratio and each rank's gradient statistics arrive, and the job ends with the
    parameters of its unwatched twin."""
    steps, args = 24, ("--zoo", "olmo", "--compile")
    out, code, job_err = _attach_mid_run(tmp_path, collector, "zoo-attached", "grad=1,spectral=2,activations=2", steps, 6, *args)
    assert out.count(": watching") == 2, out
    assert code == 0, job_err[-3000:]
    assert "layer probes off" not in job_err, job_err[-3000:]
    # Its graphs were compiled before the agent came, so they would never call activation hooks.
    assert "activation probe off: the model is already compiled" in job_err, job_err[-3000:]
    _assert_equal_parameters(tmp_path / "watched.pt", _plain_twin(tmp_path, steps, *args))
    _wait_for(lambda: set(_steps(collector, "zoo-attached", "grad_norm")) == {0, 1}, 30, "grad_norm from both ranks")
    query = "SELECT DISTINCT layer FROM samples WHERE run = 'zoo-attached' AND metric = 'spectral.ratio'"
    assert _wait_for(lambda: {r["layer"] for r in collector.sql(query)} == {0, 1}, 30, "the spectral ratio of both layers")
    assert _run_summary(collector, "zoo-attached")["family"] == "structural"


def test_rankwatch_run_hands_the_mapping_to_every_rank_and_the_collector_keeps_it(tmp_path: Path, collector: Collector) -> None:
    steps = 6
    mapping = {"blocks": "trunk", "q": "attn.Wqkv", "o": "attn.out_proj", "up": "ffn.up_proj", "down": "ffn.down_proj"}
    cmd = [
        sys.executable, "-m", "rankwatch", "run", "--collector", collector.url, "--run", "mapped", "--every", "grad=1,spectral=1",
        "--mapping", json.dumps(mapping), "--", *_torchrun("--steps", str(steps), "--zoo", "mpt", "--out", str(tmp_path / "watched.pt")),
    ]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_equal_parameters(tmp_path / "watched.pt", _plain_twin(tmp_path, steps, "--zoo", "mpt"))
    # Spectral values are the layer's, not a rank's: read them by site.
    query = "SELECT DISTINCT site FROM samples WHERE run = 'mapped' AND metric = 'spectral.sigma'"
    sites = _wait_for(lambda: {r["site"] for r in collector.sql(query)} or None, 30, "spectral values", lambda: _arrived(collector, "mapped", done.stderr))
    assert sites == {"q", "o", "up", "down"}, "exactly the mapped sites: the mapping, not discovery, described the model"
    summary = _run_summary(collector, "mapped")
    assert summary["family"] == "mapping", summary
    assert json.loads(summary["tags"]["mapping"]) == mapping


@pytest.mark.parametrize(("layout", "sharding"), [("rotary_args", ()), ("olmo", ("--fsdp2",))], ids=["ddp-first-call", "fsdp2"])
def test_rankwatch_run_reads_blocks_no_table_knows_and_trains_as_the_unwatched_twin(tmp_path: Path, collector: Collector, layout: str, sharding: tuple[str, ...]) -> None:
    """Two layouts the data flow reads, under the zero-code agent on 2 gloo ranks: blocks that
    want rotary tables and a mask (read at their first forward) under DDP, and OLMo's fused
    weights measured shard by shard under FSDP2. Every mapped site is measured and the job
    ends with its unwatched twin's parameters, bit for bit; a hang fails at the timeout."""
    steps, args = 6, ("--zoo", layout, *sharding)
    cmd = [
        sys.executable, "-m", "rankwatch", "run", "--collector", collector.url, "--run", f"zoo-{layout}", "--every", "grad=1,spectral=1,activations=1",
        "--", *_torchrun("--steps", str(steps), "--out", str(tmp_path / "watched.pt"), *args),
    ]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "layer probes off" not in done.stderr, done.stderr[-3000:]
    _assert_equal_parameters(tmp_path / "watched.pt", _plain_twin(tmp_path, steps, *args))
    query = f"SELECT DISTINCT site FROM samples WHERE run = 'zoo-{layout}' AND metric = 'spectral.sigma'"
    sites = _wait_for(lambda: {r["site"] for r in collector.sql(query)} or None, 30, "spectral values", lambda: _arrived(collector, f"zoo-{layout}", done.stderr))
    assert sites >= {"q", "k", "v", "o", "up", "down"}, sites
    assert _run_summary(collector, f"zoo-{layout}")["family"] == "structural"


def test_the_queued_code_runs_the_payload_and_never_raises(tmp_path: Path) -> None:
    """A pending call that fails would raise into the training loop: the scheduled code must
    swallow whatever the payload does, and it is what PyRun_SimpleString will compile."""
    from rankwatch.auto.inject import _gdb_script, _scheduled_code

    payload = tmp_path / "payload.py"
    script = _gdb_script(payload, tmp_path / "code.bin")
    assert any(line.startswith("restore ") for line in script) and not any("malloc" in line or "strdup" in line for line in script)
    code = (tmp_path / "code.bin").read_bytes()
    assert code == _scheduled_code(payload), "gdb and ptrace queue the same code"
    assert code.endswith(b"\0")
    source = code[:-1].decode()
    for body in ("import builtins; builtins.rw_ran = 1", "raise SystemExit(3)", "raise KeyboardInterrupt", "this is not python"):
        payload.write_text(body)
        exec(compile(source, "<pending call>", "exec"), {})
    import builtins

    assert getattr(builtins, "rw_ran", None) == 1
    del builtins.rw_ran  # type: ignore[attr-defined]
    payload.unlink()
    exec(compile(source, "<pending call>", "exec"), {})  # a payload gone (a late call) is no error either


@pytest.mark.skipif(CANNOT_GET_IN, reason="gdb is not installed")
def test_attach_says_so_when_a_rank_runs_no_python(tmp_path: Path) -> None:
    """A rank blocked in C (here a long `time.sleep`; in real jobs a collective) cannot run the
    injected code: the command answers within its timeout and says why, and the process is
    unharmed."""
    stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=_env(RANK="0"))
    try:
        time.sleep(1.0)
        done = subprocess.run([sys.executable, "-m", "rankwatch", "attach", "--pid", str(stuck.pid), "--timeout", "3"], env=_env(), capture_output=True, text=True, timeout=120)
        assert done.returncode == 1, done.stdout + done.stderr
        assert f"pid {stuck.pid}: timeout: no answer within 3 s" in done.stderr and "stuck in a collective" in done.stderr, done.stderr
        assert stuck.poll() is None, "the process goes on"
    finally:
        stuck.kill()
        stuck.wait()


@pytest.mark.skipif(not hasattr(sys, "remote_exec"), reason="sys.remote_exec needs Python >= 3.14, which this interpreter is not")
def test_attach_by_pid_uses_remote_exec_on_python_314(tmp_path: Path) -> None:
    from rankwatch.auto import inject

    job = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.05)"], env=_env())
    try:
        assert inject._inject(job.pid, inject._payload(tmp_path, {"action": "detach", "status_dir": str(tmp_path)})) == "sys.remote_exec"
        status = _wait_for(lambda: (tmp_path / f"{job.pid}.json").exists(), 30, "the payload to run")
        assert status
        assert json.loads((tmp_path / f"{job.pid}.json").read_text())["event"] == "not-watching"
    finally:
        job.kill()
        job.wait()


def test_attach_names_the_reason_when_a_process_cannot_be_watched(tmp_path: Path) -> None:
    from rankwatch.auto.inject import AttachError, training_ranks

    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        with pytest.raises(AttachError, match="not a Python process"):
            training_ranks(sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait()
    done = subprocess.run([sys.executable, "-m", "rankwatch", "run", "--every", "grad=x", "--", "true"], env=_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--every takes" in done.stderr
    done = subprocess.run([sys.executable, "-m", "rankwatch", "run", "--", "no-such-command-xyz"], env=_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 127 and "not a command" in done.stderr



@pytest.mark.parametrize("framework", ["hf", "lightning"])
def test_under_the_zero_code_agent_a_framework_reports_what_its_callback_reports(framework: str, tmp_path: Path) -> None:
    """The Hugging Face Trainer and Lightning (2 gloo ranks, DDP, accumulation 2): the agent
    `rankwatch run` starts reports, from its first step on (step 2), the same per-rank loss and
    gradient statistics, at the same step numbers, as rankwatch's callback for that framework."""
    pytest.importorskip("lightning" if framework == "lightning" else "accelerate")
    from conftest import torchrun

    torchrun([str(Path(__file__).with_name("zero_code_worker.py")), str(tmp_path), framework], nproc=2, timeout=400, env={"HF_HUB_OFFLINE": "1"})
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        callback, agent = got["callback"], got["auto"]
        assert sorted(map(int, callback)) == [1, 2, 3, 4, 5], callback.keys()
        assert sorted(map(int, agent)) == [2, 3, 4, 5], "the agent starts at the end of step 1"
        for step in agent:
            for metric in ("loss", "grad_norm", "grad_norm_mean", "cos_to_mean", "nonfinite"):
                want, have = callback[step][metric], agent[step][metric]
                assert abs(want - have) <= 1e-6 * max(1.0, abs(want)), (framework, rank, step, metric, want, have)
