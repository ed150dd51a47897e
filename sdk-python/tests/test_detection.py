"""Detection on real training: a small GPT trained with DDP over gloo (4 CPU processes),
streaming to the real collector with its documented default rules, with faults injected by
`rankwatch_testkit.faults`. Each scenario asserts what the alert engine must (and must not) say, and
records its figures (alert step, lead, false alerts) in `target/detection/<scenario>.json`
for docs/detection.md.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests
from rankwatch_testkit import zygote

from conftest import Collector, free_port

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parent / "examples" / "train_ddp.py"
FIGURES = HERE.parent.parent / "target" / "detection"
SMALL = ["--layers", "2", "--width", "32", "--seq", "32", "--batch", "4", "--vocab", "64", "--corpus", "1024", "--lr", "3e-3"]


def train(collector: Collector, run: str, tmp: Path, *, steps: int, nproc: int = 4, faults: tuple[str, ...] = (), extra: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Runs the example to completion; returns each rank's result (alerts its callbacks saw)."""
    out = tmp / run
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(EXAMPLE), "--nproc", str(nproc), "--steps", str(steps), "--run", run, "--collector", collector.url, "--result-dir", str(out), "--spool-dir", str(tmp / f"spool-{run}"), *SMALL, *extra]
    for f in faults:
        cmd += ["--fault", f]
    run_example(cmd)
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(nproc)]


def run_example(cmd: list[str]) -> None:
    """Runs a training example to completion, started from the test kit's zygote (torch
    imported already); fails the test with the end of its stderr if it fails. The example
    sets one torch thread per rank itself."""
    done = subprocess.run(zygote.command(cmd), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]


def settle(collector: Collector, run: str, last_step: int) -> list[dict[str, Any]]:
    """Waits until the aligner closed the run's last step (its timeout) and returns its alerts."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        rows = collector.sql(f"SELECT max(step) AS s FROM samples WHERE run = '{run}' AND rank IS NULL AND metric = 'loss_mean'")
        if rows and rows[0]["s"] is not None and rows[0]["s"] >= last_step:
            break
        time.sleep(0.5)
    return collector.alerts(run)


def series(collector: Collector, run: str, metric: str) -> dict[int, float]:
    rows = collector.sql(f"SELECT step, value FROM samples WHERE run = '{run}' AND rank IS NULL AND metric = '{metric}' ORDER BY step")
    return {r["step"]: r["value"] for r in rows}


def record(name: str, figures: dict[str, Any]) -> None:
    FIGURES.mkdir(parents=True, exist_ok=True)
    (FIGURES / f"{name}.json").write_text(json.dumps(figures, indent=2, sort_keys=True))


def fired(alerts: list[dict[str, Any]], rule: str) -> list[dict[str, Any]]:
    return [a for a in alerts if a["rule"] == rule and a.get("fired_at_ms") is not None]


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def test_silent_inconsistency_seeds_and_a_corrupted_rank(collector: Collector, tmp_path: Path) -> None:
    """Scenarios 1 and 5: the paper's seed experiment (same seeds / rank 0 differs / every rank
    differs) and the stronger faults — shuffled labels on one rank, a scaled local gradient on
    another — with the same default rules. The faults start at step 240, after the rule's 200
    skipped steps and 30-step warm-up."""
    steps = 320
    runs = {
        "same-seeds": (),
        "seed-rank0": ("data_seed@0:rank=0",),
        "seed-per-rank": ("data_seed@0:rank=all",),
        "grad-scale-r1": ("grad_scale@240:rank=1:factor=8",),
        "labels-r2": ("shuffle_labels@240:rank=2",),
    }
    figures: dict[str, dict[str, Any]] = {}
    for name, faults in runs.items():
        train(collector, name, tmp_path, steps=steps, faults=faults)
    for name in runs:
        alerts = settle(collector, name, steps - 1)
        loss_cv, grad_cv, cw, loss_mean = (series(collector, name, m) for m in ("loss_cv", "grad_norm_cv", "cos_weighted", "loss_mean"))
        late = [s for s in loss_cv if s >= 240]
        figures[name] = {
            "alerts": [{k: a[k] for k in ("rule", "severity", "state", "first_step", "outlier_ranks", "explanation")} for a in alerts],
            "loss_cv_mean_after_240": mean([loss_cv[s] for s in late]),
            "grad_norm_cv_mean_after_240": mean([grad_cv[s] for s in late if s in grad_cv]),
            "cos_weighted_mean_after_240": mean([cw[s] for s in late if s in cw]),
            "loss_mean_at_end": loss_mean.get(steps - 1),
        }
    record("silent_inconsistency", figures)
    # Healthy: silent.
    assert fired(collector.alerts("same-seeds"), "silent_inconsistency") == [], figures["same-seeds"]
    # A scaled gradient on rank 1: named within a few steps of the fault.
    scaled = fired(collector.alerts("grad-scale-r1"), "silent_inconsistency")
    assert scaled, figures["grad-scale-r1"]
    assert 1 in scaled[0]["outlier_ranks"], scaled
    assert 240 <= scaled[0]["first_step"] <= 245, scaled
    # Shuffled labels on rank 2: its loss and gradient leave the others'.
    labels = fired(collector.alerts("labels-r2"), "silent_inconsistency")
    assert labels and 2 in labels[0]["outlier_ranks"], figures["labels-r2"]
    assert labels[0]["first_step"] <= 250, labels
    # Seeds: the figures are recorded whatever they are (i.i.d. shards cannot differ
    # statistically at this scale); an alert there would have to name rank 0 in seed-rank0.
    for a in fired(collector.alerts("seed-rank0"), "silent_inconsistency"):
        assert a["outlier_ranks"] in ([], [0]), a
    # Every rank called finish(): nothing of a finished run is left open (before, its alerts
    # stayed firing until the engine's idle timeout, an hour).
    for name in runs:
        still = [a for a in collector.alerts(name) if a["state"] != "resolved"]
        assert still == [], (name, still)


TEXT_EXAMPLE = HERE.parent / "examples" / "train_text.py"
CORPUS = HERE.parent.parent / "target" / "corpus"


def train_text(collector: Collector, run: str, tmp: Path, *, steps: int, extra: tuple[str, ...] = (), nproc: int = 4) -> None:
    """The real-text harness (a byte-level GPT on the standard library's docstrings, 4 ranks,
    100-step learning-rate warm-up, cosine decay): what `cargo xtask bench detection` runs."""
    run_example([sys.executable, str(TEXT_EXAMPLE), "--nproc", str(nproc), "--steps", str(steps), "--run", run, "--collector", collector.url, "--result-dir", str(tmp / run), "--spool-dir", str(tmp / f"spool-{run}"), "--corpus-dir", str(CORPUS), *extra])


def test_real_text_healthy_run_is_silent_and_rank_faults_need_no_baseline(collector: Collector, tmp_path: Path) -> None:
    """The fast subset of the detection benchmark (docs/detection.md § Healthy runs): the
    healthy real-text run that raised 6 alerts under the first rules (token cosine's early
    transient, a C_w baseline learned inside it) raises none; a rank fed shuffled labels from
    step 0, which no run-level baseline can see, is named by its peers; ranks sharing a data
    seed are named by their bit-identical losses, the odd rank too."""
    train_text(collector, "text-healthy", tmp_path, steps=400)
    train_text(collector, "text-labels-r2", tmp_path, steps=400, extra=("--fault", "shuffle_labels@0:rank=2"))
    train_text(collector, "text-seed-rank0", tmp_path, steps=60, extra=("--seed-mode", "rank0", "--dropout", "0.1"))
    healthy = settle(collector, "text-healthy", 399)
    labels = fired(settle(collector, "text-labels-r2", 399), "silent_inconsistency")
    seeds = fired(settle(collector, "text-seed-rank0", 59), "silent_inconsistency")
    record("real_text", {n: [{k: a[k] for k in ("rule", "severity", "first_step", "fired_at_ms", "outlier_ranks", "explanation")} for a in alerts] for n, alerts in (("healthy", healthy), ("labels", labels), ("seed_rank0", seeds))})
    assert [a for a in healthy if a["fired_at_ms"] is not None] == [], healthy
    assert labels and labels[0]["outlier_ranks"] == [2] and "rank 2 stood out" in labels[0]["explanation"], labels
    assert labels[0]["first_step"] < 230, labels  # before the run-level rule judges anything
    assert seeds and seeds[0]["outlier_ranks"] == [1, 2, 3], seeds
    assert "ranks 1, 2, 3 computed the same loss and gradient norm" in seeds[0]["explanation"], seeds


def test_a_two_rank_job_names_the_rank_whose_labels_were_corrupted_within_20_steps(collector: Collector, tmp_path: Path) -> None:
    """Two ranks cannot out-vote each other: the stand-out test needs three, and the run-level
    test judges nothing before step 230. Each rank against its own history can (the `pair`
    test): rank 1 fed shuffled labels from step 50 of a 150-step job is named within 20 steps,
    and the same job without the fault raises nothing."""
    train(collector, "pair-labels-r1", tmp_path, steps=150, nproc=2, faults=("shuffle_labels@50:rank=1",))
    train(collector, "pair-healthy", tmp_path, steps=150, nproc=2)
    labels = fired(settle(collector, "pair-labels-r1", 149), "silent_inconsistency")
    healthy = [a for a in settle(collector, "pair-healthy", 149) if a.get("fired_at_ms") is not None]
    pick = ("rule", "first_step", "last_step", "outlier_ranks", "explanation")
    record("pair_labels", {"labels": [{k: a[k] for k in pick} for a in labels], "healthy": [{k: a[k] for k in pick} for a in healthy]})
    assert labels, "the corrupted rank was not caught"
    # Fired within 20 steps of the fault: its first breaching step plus the 3 steps pending.
    assert labels[0]["outlier_ranks"] == [1] and labels[0]["first_step"] + 3 <= 70, labels
    assert "the one whose own statistics changed is named" in labels[0]["explanation"], labels
    assert healthy == [], healthy


def test_ranks_reading_one_shard_under_dropout_are_named_though_they_never_agree_to_the_bit(collector: Collector, tmp_path: Path) -> None:
    """A duplicated shard with dropout on (docs/detection.md § 5d): rank 1 reads rank 0's
    batches from step 40 of a 2-rank real-text job, but each rank draws its own dropout masks,
    so no step agrees to the bit and the identical-batch test cannot see it. Their loss and
    gradient-norm gaps shrink far below the run's usual gap between ranks, and the pair is named
    within a window of the copy; the same job without the copy raises nothing."""
    args = ("--dropout", "0.1")
    with ThreadPoolExecutor(2) as pool:
        for done in [
            pool.submit(train_text, collector, "dropout-copy", tmp_path, steps=100, nproc=2, extra=(*args, "--fault", "duplicate_data@40:rank=1")),
            pool.submit(train_text, collector, "dropout-healthy", tmp_path, steps=100, nproc=2, extra=args),
        ]:
            done.result()
    copied = fired(settle(collector, "dropout-copy", 99), "silent_inconsistency")
    healthy = [a for a in settle(collector, "dropout-healthy", 99) if a.get("fired_at_ms") is not None]
    pick = ("rule", "first_step", "outlier_ranks", "explanation")
    record("same_batches", {"copied": [{k: a[k] for k in pick} for a in copied], "healthy": [{k: a[k] for k in pick} for a in healthy]})
    assert copied and copied[0]["outlier_ranks"] == [0, 1], copied
    assert 40 <= copied[0]["first_step"] <= 52, copied
    assert "ranks 0 and 1 agreed" in copied[0]["explanation"] and "likely fed the same batches" in copied[0]["explanation"], copied
    assert "to the bit, for" not in copied[0]["explanation"], copied  # not the identical test's
    assert healthy == [], healthy
    incidents = requests.get(f"{collector.url}/api/v1/incidents", params={"run": "dropout-copy"}, timeout=30)
    incidents.raise_for_status()
    incident = next(i for i in incidents.json()["incidents"] if "silent_inconsistency" in i["rules"])
    assert incident["action"].startswith("Ranks 0 and 1 read the same batches by step"), incident


def test_natural_collapse_is_caught_before_the_loss_diverges(collector: Collector, tmp_path: Path) -> None:
    """The fast subset of the natural-collapse benchmark (docs/detection.md § Collapse lead
    time, bench/detection_collapse.py, judged by its code): the 4-layer post-LN GPT whose
    learning rate rises ×100 from step 300 collapses on its own — the alert must be breaching
    by the step its loss diverges (its first breaching step: the firing step is converted from
    wall-clock time, and a loaded machine would move it; the benchmark reports it), and the
    data-free effective rank halves after the change; its healthy twin, whose token states sit
    at ~1 from step ~40 to ~150 (the early plateau of post-LN models), raises no `rank_collapse`
    alert at all. And the 8-layer post-LN GPT without warm-up, collapsed from step ~10 for
    good, is critical once its plateau outlasts a healthy one (300 steps), not before."""
    sys.path.insert(0, str(HERE.parent.parent / "bench"))
    import detection_collapse as bench

    # Three one-rank jobs at once: one after another, they kept one core busy for three minutes
    # while the test run's other lane had finished. Nothing here depends on time (the rules
    # count steps, and each job's numbers are its own).
    jobs = {f"natural-{kind}": (bench.STEPS, bench.KINDS[kind][0]) for kind in ("lr_ramp", "twin")}
    jobs["natural-no-warmup"] = (340, bench.KINDS["no_warmup"][0])
    with ThreadPoolExecutor(len(jobs)) as pool:
        for done in [pool.submit(train_text, collector, name, tmp_path, steps=steps, nproc=1, extra=(*args, *bench.PROBES)) for name, (steps, args) in jobs.items()]:
            done.result()
    deep_alerts = fired(settle(collector, "natural-no-warmup", 339), "rank_collapse")
    deep = [a for a in deep_alerts if a["severity"] == "critical"]
    judged = {}
    for kind in ("lr_ramp", "twin"):
        name = f"natural-{kind}"
        alerts = settle(collector, name, bench.STEPS - 1)
        export = requests.get(f"{collector.url}/api/v1/runs/{name}/export", params={"table": "samples"}, timeout=60)
        export.raise_for_status()
        (tmp_path / f"{name}.parquet").write_bytes(export.content)
        result = {"alerts": alerts, "final_loss": None}
        judged[kind] = bench.judge(bench.Run(name, kind, 0), result, bench.read_series(tmp_path / f"{name}.parquet"))
    record("natural_collapse", {**judged, "no_warmup": [{k: a[k] for k in ("layer", "first_step", "explanation")} for a in deep]})
    ramp, twin = judged["lr_ramp"], judged["twin"]
    assert ramp["onset"] is not None and ramp["onset_loss"] is not None, ramp  # it did collapse
    assert ramp["alert_step"] is not None and ramp["alert_first_step"] <= ramp["onset_loss"], ramp
    assert ramp["onset_rank"] is not None, ramp
    assert twin["false_alerts"] == 0 and twin["plateau_alerts"] == 0, twin
    assert deep and 305 <= min(a["first_step"] for a in deep) <= 330, deep
    assert all(a["first_step"] >= 300 for a in deep_alerts), deep_alerts
    assert "longer than a healthy early plateau" in min(deep, key=lambda a: a["first_step"])["explanation"], deep


def first_at_or_above(points: list[dict[str, Any]], level: float) -> int | None:
    return next((p["step"] for p in points if p["value"] >= level), None)


def collapse_figures(collector: Collector, run: str, alerts: list[dict[str, Any]]) -> dict[str, Any]:
    """Per layer: the ratio and token-cosine series (rank 0), and when token cosine first
    reached 0.2, 0.5 and 0.9."""
    layers: dict[int, dict[str, Any]] = {}
    for layer in sorted({r["layer"] for r in collector.sql(f"SELECT DISTINCT layer FROM samples WHERE run = '{run}' AND metric = 'token_cosine'")}):
        ratio = collector.sql(f"SELECT step, value FROM samples WHERE run = '{run}' AND metric = 'spectral.ratio' AND layer = {layer} AND rank IS NULL ORDER BY step")
        cosine = collector.sql(f"SELECT step, value FROM samples WHERE run = '{run}' AND metric = 'token_cosine' AND layer = {layer} AND rank = 0 ORDER BY step")
        layers[layer] = {
            "ratio": [(r["step"], round(r["value"], 4)) for r in ratio],
            "token_cosine": [(r["step"], round(r["value"], 4)) for r in cosine],
            "token_cosine_max": max(r["value"] for r in cosine),
            **{f"token_cosine_reached_{level}": first_at_or_above(cosine, level) for level in (0.2, 0.5, 0.9)},
        }
    loss = series(collector, run, "loss_mean")
    return {
        "alerts": [{k: a[k] for k in ("rule", "severity", "layer", "rank", "first_step", "last_step", "explanation")} for a in alerts],
        "final_loss_mean": loss[max(loss)],
        "layers": layers,
    }


def test_rank_collapse_is_caught_and_healthy_twins_are_silent(collector: Collector, tmp_path: Path) -> None:
    """Scenario 2, two ways, each with its healthy twin, all with the default rules and the
    spectral and activation probes every 5 steps:
    (a) layer 1 of the small GPT pushed toward attention-dominated collapse from step 80: the
        ratio alert must fire on layer 1, and before token cosine reaches 0.9 if it does;
    (b) a deep (8-layer) GPT with a learning rate 10× too high, whose token states collapse
        at step 3 and recover by step 9: a transient as short as the healthy ones of real
        text, so no critical alert (a collapse that stays is in the natural-collapse test)."""
    cadence = ("--cadence", "spectral=5", "--cadence", "activations=5")
    # Token cosine every step on the deep runs: their collapse comes within the first steps.
    deep = ("--layers", "8", "--cadence", "spectral=5", "--cadence", "activations=1")
    runs = {
        "pushed": dict(steps=200, faults=("collapse@80:layer=1",), extra=cadence),
        "pushed-twin": dict(steps=200, extra=cadence),
        "deep-hot": dict(steps=100, extra=(*deep, "--lr", "3e-2")),
        "deep-twin": dict(steps=100, extra=deep),
    }
    for name, kw in runs.items():
        train(collector, name, tmp_path, **kw)  # type: ignore[arg-type]
    alerts = {name: settle(collector, name, kw["steps"] - 1) for name, kw in runs.items()}  # type: ignore[operator]
    figures = {name: collapse_figures(collector, name, alerts[name]) for name in runs}
    pushed = fired(alerts["pushed"], "rank_collapse")
    crossed = figures["pushed"]["layers"][1]["token_cosine_reached_0.9"]
    figures["pushed"]["lead_over_token_cosine_0.9"] = None if not pushed or crossed is None else crossed - pushed[0]["first_step"]
    hot = fired(alerts["deep-hot"], "rank_collapse")
    figures["false_alerts_on_healthy_twins"] = {n: len(fired(alerts[n], "rank_collapse")) for n in ("pushed-twin", "deep-twin")}
    record("rank_collapse", figures)

    # The pushed layer is named first (layer 0 may follow as training compensates).
    assert pushed and min(pushed, key=lambda a: a["first_step"])["layer"] == 1, figures["pushed"]["alerts"]
    assert min(a["first_step"] for a in pushed) >= 80, pushed
    if crossed is not None:
        assert pushed[0]["first_step"] < crossed
    assert not any(a["severity"] == "critical" for a in hot), figures["deep-hot"]["alerts"]
    assert max(figures["deep-hot"]["layers"][7]["token_cosine"][:5], key=lambda p: p[1])[1] > 0.9  # it did collapse, briefly
    assert figures["false_alerts_on_healthy_twins"] == {"pushed-twin": 0, "deep-twin": 0}, {n: figures[n]["alerts"] for n in ("pushed-twin", "deep-twin")}


def test_nan_stale_rank_and_activation_growth(collector: Collector, tmp_path: Path) -> None:
    """Scenario 3: NaN injected at step 40 (a critical alert at 40, delivered to every rank's
    on_alert callback); a rank whose agent stops reporting (stale_rank, after the 60 s
    silence); a layer whose output grows a hundredfold from step 80 (activation_outlier)."""
    # Rank 1's agent goes quiet at step 20 while rank 0 trains on, paced at 0.5 s a step: the
    # default 60 s silence (not the 200-step lag, never reached here) makes rank 1 stale. The
    # job mostly sleeps, so it runs beside the other two scenarios rather than before them.
    stale_job: list[BaseException] = []

    def train_stale() -> None:
        try:
            train(collector, "stale", tmp_path, steps=160, nproc=2, faults=("stop_reporting@20:rank=1",), extra=("--step-sleep", "0.5"))
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread below
            stale_job.append(e)

    stale_thread = threading.Thread(target=train_stale, daemon=True)
    stale_thread.start()

    # Paced so the alert comes back while the job still runs (callbacks run inside log()).
    results = train(collector, "nan", tmp_path, steps=100, faults=("nan@40:rank=1",), extra=("--step-sleep", "0.05"))
    alerts = settle(collector, "nan", 99)
    nan = fired(alerts, "nonfinite")
    assert nan and nan[0]["first_step"] == 40 and nan[0]["severity"] == "critical", alerts
    assert all(40 in r["skipped_steps"] for r in results)
    # The training process heard it: every rank's callback received the firing alert.
    for r in results:
        assert any(a["rule"] == "nonfinite" and a["fired_at_ms"] is not None and a["first_step"] == 40 for a in r["alerts"]), r["alerts"]

    # After the warm-up (50 steps) and the baseline (5 probes): the fault at step 80.
    train(collector, "act-grow", tmp_path, steps=120, faults=("act_grow@80:layer=0:factor=100",), extra=("--cadence", "activations=5"))
    grow = fired(settle(collector, "act-grow", 119), "activation_outlier")
    assert grow and min(a["first_step"] for a in grow) == 80, collector.alerts("act-grow")
    assert {a["layer"] for a in grow if a["first_step"] == 80} >= {0}, grow

    stale_thread.join(timeout=660)  # train()'s own timeout is 600 s
    assert not stale_thread.is_alive(), "the stale-rank job did not finish"
    if stale_job:
        raise stale_job[0]
    stale = fired(settle(collector, "stale", 19), "stale_rank")
    assert stale and stale[0]["rank"] == 1, collector.alerts("stale")
    assert "silent for" in stale[0]["explanation"], stale
    last_report_ms = collector.sql("SELECT CAST(max(time) AS BIGINT) AS t FROM samples WHERE run = 'stale' AND rank = 1 AND metric <> 'finished'")[0]["t"]
    silence_s = (stale[0]["fired_at_ms"] - last_report_ms) / 1000
    assert silence_s >= 60, stale  # never before the timeout

    record(
        "faults",
        {
            "nan": [{k: a[k] for k in ("rule", "severity", "first_step", "rank", "explanation")} for a in nan],
            "stale": [{k: a[k] for k in ("rule", "first_step", "rank", "explanation")} for a in stale],
            "stale_silence_before_alert_s": silence_s,
            "act_grow": [{k: a[k] for k in ("rule", "first_step", "layer", "site", "explanation")} for a in grow],
        },
    )


@pytest.mark.skipif(shutil.which("prometheus-alertmanager") is None, reason="Debian's prometheus-alertmanager is installed by `cargo xtask test`")
def test_alertmanager_receives_the_firing_alert_and_its_resolution(tmp_path: Path) -> None:
    """Scenario 4: a real Alertmanager gets the NaN alert while it fires, then its end."""
    port = free_port()
    config = tmp_path / "alertmanager.yml"
    config.write_text("route:\n  receiver: devnull\nreceivers:\n  - name: devnull\n")
    am = subprocess.Popen(
        ["prometheus-alertmanager", f"--config.file={config}", f"--storage.path={tmp_path / 'am'}", f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    collector = Collector(tmp_path / "data", extra_args=["--alertmanager-url", f"http://127.0.0.1:{port}", "--alertmanager-resend", "1s"])
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if requests.get(f"http://127.0.0.1:{port}/-/ready", timeout=1).ok:
                    break
            except requests.ConnectionError:
                pass
            assert time.monotonic() < deadline, "alertmanager did not start"
            time.sleep(0.2)

        def am_alerts() -> list[dict[str, Any]]:
            return [a for a in requests.get(f"http://127.0.0.1:{port}/api/v2/alerts", timeout=5).json() if a["labels"].get("run") == "am-nan"]

        # What Alertmanager shows as active, watched while the job trains.
        seen: list[dict[str, Any]] = []
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                try:
                    seen.extend(x for x in am_alerts() if x["status"]["state"] == "active")
                except requests.RequestException:
                    pass
                stop.wait(0.2)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        # NaN at step 30, then clean steps (the bad step is skipped, as GradScaler does): the
        # alert resolves after its resolve_after (10) clean steps. --step-sleep paces the job so
        # the firing state lasts long enough to be watched.
        train(collector, "am-nan", tmp_path, steps=60, faults=("nan@30:rank=0",), extra=("--step-sleep", "0.1"))
        alerts = settle(collector, "am-nan", 59)
        time.sleep(2)
        stop.set()
        watcher.join()
        nan = fired(alerts, "nonfinite")
        assert nan and nan[0]["state"] == "resolved", alerts
        assert seen, "alertmanager never showed the alert as active"
        a = seen[0]
        assert a["labels"]["alertname"] == "rankwatch_nonfinite" and a["labels"]["severity"] == "critical", a
        # Resolved: Alertmanager holds it with endsAt set, no longer active.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(x["status"]["state"] == "active" for x in am_alerts()):
            time.sleep(0.5)
        assert all(x["status"]["state"] != "active" for x in am_alerts()), am_alerts()
        record("alertmanager", {"received": a["labels"], "annotations": a["annotations"]})
    finally:
        collector.stop()
        am.terminate()
        am.wait(timeout=30)


def test_a_bit_flip_in_one_replicas_weights_is_named_at_the_next_fingerprint(collector: Collector, tmp_path: Path) -> None:
    """Silent data corruption: one low mantissa bit of one weight of rank 2 flips at step 12 —
    the loss cannot show it — and stays. The replicas' fingerprints (every 10th step) differ
    from step 20: a critical `replica_divergence` at step 20 names rank 2 against the majority
    and the very tensor whose bit flipped (located from the ranks' `param_locator`s), and the
    blocks whose `layer_fingerprint` differs in the stored samples hold that tensor.
    With two replicas the same flip names both ranks, saying which changed cannot be told. The
    healthy run of the same job (the other tests' healthy runs too) raises none."""
    flipped = train(collector, "flip-r2", tmp_path, steps=30, faults=("weight_bit_flip@12:rank=2:bit=20",))[2]["flipped"]
    flipped_pair = train(collector, "flip-2-ranks", tmp_path, steps=30, nproc=2, faults=("weight_bit_flip@12:rank=1:bit=20",))[1]["flipped"]
    assert len(flipped) == 1 and len(flipped_pair) == 1, (flipped, flipped_pair)
    train(collector, "flip-healthy", tmp_path, steps=30)
    alerts = fired(settle(collector, "flip-r2", 29), "replica_divergence")
    assert len(alerts) == 1, alerts
    alert = alerts[0]
    assert alert["severity"] == "critical" and alert["first_step"] == 20 and alert["outlier_ranks"] == [2], alert
    assert f"rank 2's parameters differ from ranks 0, 1, 3 at step 20 in tensor {flipped[0]}: " in alert["explanation"], alert
    rows = collector.sql("SELECT rank, layer, value FROM samples WHERE run = 'flip-r2' AND metric = 'layer_fingerprint' AND step = 20")
    by_layer: dict[int, dict[int, float]] = {}
    for r in rows:
        by_layer.setdefault(r["layer"], {})[r["rank"]] = r["value"]
    assert sorted(by_layer) == [0, 1] and all(len(v) == 4 for v in by_layer.values()), rows
    differing = [layer for layer, values in sorted(by_layer.items()) if values[2] != values[0]]
    assert all(values[0] == values[1] == values[3] for values in by_layer.values()), "only rank 2 changed"
    # The blocks' digests agree with the locator: the flipped tensor's block alone differs.
    block = re.search(r"\.h\.(\d+)\.", f".{flipped[0]}")
    assert differing == ([int(block.group(1))] if block else []), (differing, flipped)
    before = collector.sql("SELECT count(DISTINCT value) AS n FROM samples WHERE run = 'flip-r2' AND metric = 'param_fingerprint' AND step = 10")
    assert before == [{"n": 1}], "at step 10, before the flip, every replica agreed"
    pair = fired(settle(collector, "flip-2-ranks", 29), "replica_divergence")
    assert len(pair) == 1 and pair[0]["outlier_ranks"] == [0, 1] and pair[0]["first_step"] == 20, pair
    assert "with two replicas, which one changed cannot be told" in pair[0]["explanation"], pair
    assert f"at step 20 in tensor {flipped_pair[0]};" in pair[0]["explanation"], (flipped_pair, pair)
    assert fired(settle(collector, "flip-healthy", 29), "replica_divergence") == []
    assert collector.sql("SELECT count(*) AS n FROM samples WHERE run = 'flip-healthy' AND metric = 'param_fingerprint'") == [{"n": 4 * 3}]
    # Adam's state is replicated too: its digest (every 100th step here: step 0) agrees.
    optimizer = collector.sql("SELECT count(*) AS n, count(DISTINCT value) AS d FROM samples WHERE run = 'flip-healthy' AND metric = 'optim_fingerprint'")
    assert optimizer == [{"n": 4, "d": 1}], optimizer
    record("replica_divergence", {"flip_r2": alert, "flip_2_ranks": pair[0], "differing_blocks": differing})
