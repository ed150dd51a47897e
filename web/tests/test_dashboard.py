"""The dashboard in a real headless Chromium, against a real collector fed by a real 4-rank
DDP training run (gloo, CPU) with one rank's gradient silently scaled from step 80.

Each page is checked for what it must show — the series per rank, one heatmap row per layer,
the cosine matrix with the outlier rank — and for how it behaves: the firing alert appears
while the run is live, its link leads to the worker view at its step, a drag zooms every chart,
the step cursor is shared, hostile text stays text, and the page survives a collector restart.
Screenshots of every page go to target/ui-screenshots/ (git-ignored).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from conftest import REPO, SHOTS, Collector, screenshot

EXAMPLE = REPO / "sdk-python" / "examples" / "train_ddp.py"
RUN = "ui-ddp"
STEPS = 400
RANKS = 4
LAYERS = 3
FAULT_STEP = 250
SMALL = ["--layers", str(LAYERS), "--width", "32", "--seq", "32", "--batch", "4", "--vocab", "64", "--corpus", "1024"]


@pytest.fixture(scope="module")
def live_run(tmp_module: Path):
    """The collector and the training job, started together; the job runs paced (~0.1 s a
    step) so the first test watches it live."""
    collector = Collector(tmp_module / "data")
    cmd = [sys.executable, str(EXAMPLE), "--nproc", str(RANKS), "--steps", str(STEPS), "--run", RUN, "--collector", collector.url,
           "--spool-dir", str(tmp_module / "spool"), "--step-sleep", "0.1", "--fault", f"grad_scale@{FAULT_STEP}:rank=1", *SMALL]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    job = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    yield collector, job
    if job.poll() is None:
        job.kill()
    job.wait()
    collector.stop()


@pytest.fixture(scope="module")
def finished_run(live_run):
    collector, job = live_run
    _, err = job.communicate(timeout=600)
    assert job.returncode == 0, err[-3000:]
    # The aligner closes the last steps on its timeout; wait until the run's statistics exist.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        rows = collector.sql(f"SELECT max(step) AS s FROM samples WHERE run = '{RUN}' AND metric = 'loss_cv'")
        if rows and rows[0]["s"] is not None and rows[0]["s"] >= STEPS - 1:
            break
        time.sleep(0.5)
    return collector


def api(collector: Collector, path: str, **params) -> dict:
    r = requests.get(f"{collector.url}{path}", params=params, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_firing_alert_appears_live_and_its_link_opens_the_worker_view(live_run, page) -> None:
    collector, job = live_run
    page.goto(f"{collector.url}/alerts")
    page.wait_for_selector("[data-link=live]", timeout=20_000)
    assert job.poll() is None, "the job finished before the page was watching"
    # Alerts come grouped into incidents; the one holding the silent-inconsistency alert.
    # (Firing: an incident shows its pending alerts too, before they fire.)
    incident = page.locator("section.incident", has=page.locator("article[data-rule=silent_inconsistency][data-state=firing]")).first
    # No reload: the incident must come through the live connection.
    incident.wait_for(timeout=120_000)
    seen_ms = time.time() * 1000
    alert = next(a for a in collector.alerts(RUN) if a["rule"] == "silent_inconsistency" and a["fired_at_ms"])
    # From here on, the incident that holds this alert, whatever its state becomes.
    incident = page.locator("section.incident", has=page.locator(f"article[data-alert='{alert['id']}']")).first
    latency_s = (seen_ms - alert["fired_at_ms"]) / 1000
    (REPO / "target").mkdir(exist_ok=True)
    (SHOTS.parent / "ui-alert-latency.json").write_text(json.dumps({"alert_to_page_s": latency_s}))
    print(f"alert on the page {latency_s:.2f} s after it fired")
    assert alert["first_step"] >= FAULT_STEP
    assert "rank 1" in incident.locator(".summary").inner_text()
    # Acknowledged from the page while it fires: the collector keeps who did.
    incident.locator("button.ack").click()
    page.wait_for_selector("section.incident[data-acknowledged=true]", timeout=20_000)
    acked = [i for i in api(collector, "/api/v1/incidents", run=RUN)["incidents"] if i["acknowledged"]]
    assert acked and acked[0]["acknowledged"]["by"] == "dashboard", acked
    screenshot(page, "alerts")
    if incident.locator("details").get_attribute("open") is None:
        incident.locator("details > summary").click()
    card = incident.locator(f"article[data-alert='{alert['id']}']")
    card.first.locator("a.goto").click()
    page.wait_for_url(f"**/runs/{RUN}/workers?step={alert['first_step']}*")
    table = page.locator("table.cosine")
    table.wait_for(timeout=20_000)
    rows = table.locator("tbody tr")
    assert rows.count() == RANKS
    # The outlier comes from the run's alerts, which arrive in their own request.
    outliers = page.locator("table.cosine tr[data-outlier=true]")
    outliers.first.wait_for(timeout=20_000)
    assert outliers.count() == 1 and outliers.first.get_attribute("data-rank") == "1"
    # The matrix is at the first step with gradient sketches at or after the alert's.
    step = int(table.get_attribute("data-step"))
    assert alert["first_step"] <= step < alert["first_step"] + 50


def test_runs_page_lists_the_run_and_filters_by_name(finished_run, page) -> None:
    collector = finished_run
    # Every rank called finish(): the run's alerts resolve then (the engine's next turn).
    deadline = time.monotonic() + 30
    while any(a["state"] != "resolved" for a in collector.alerts(RUN)) and time.monotonic() < deadline:
        time.sleep(0.2)
    page.goto(collector.url + "/")
    row = page.locator(f"tr[data-run={RUN}]")
    row.wait_for(timeout=20_000)
    cells = row.locator("td").all_inner_texts()
    assert cells[0] == RUN
    assert cells[1] in ("live", "finished")
    assert cells[2] == str(RANKS)
    assert cells[3] == str(LAYERS)
    assert cells[4] == f"0–{STEPS - 1}"
    alerts = collector.alerts(RUN)
    assert int(cells[6]) == 0 and alerts, alerts
    assert all(a["state"] == "resolved" for a in alerts), alerts
    assert any("the run finished" in a["explanation"] for a in alerts), alerts
    screenshot(page, "runs")
    page.fill("input.filter", "no-such-run")
    page.wait_for_selector("text=No run matches the filter.")
    assert page.locator(f"tr[data-run={RUN}]").count() == 0
    page.fill("input.filter", RUN[:4].upper())
    row.wait_for()
    row.locator("a").click()
    page.wait_for_url(f"**/runs/{RUN}")
    page.wait_for_selector("[data-chart=Loss][data-drawn]")


def fmt(v: float) -> str:
    """A number as the dashboard's `format::num` prints it (finite values)."""
    a = abs(v)
    if a == 0:
        return "0"
    if not 1e-3 <= a < 1e5:
        mantissa, exponent = f"{v:.2e}".split("e")
        return f"{mantissa}e{int(exponent)}"
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}" if a >= 1 else f"{v:.3f}"


def chart(page, name: str):
    loc = page.locator(f"[data-chart='{name}']")
    loc.wait_for(timeout=20_000)
    page.wait_for_function("el => el.dataset.drawn", arg=loc.element_handle(), timeout=20_000)
    return loc


def test_overview_draws_every_rank_zooms_and_shares_the_cursor(finished_run, page) -> None:
    collector = finished_run
    asked: list[str] = []
    page.on("request", lambda r: asked.append(r.url) if "/series?" in r.url else None)
    page.goto(f"{collector.url}/runs/{RUN}")
    loss = chart(page, "Loss")
    ppl = chart(page, "Perplexity")
    grad = chart(page, "Gradient norm (local, before averaging)")
    lr = chart(page, "Learning rate")
    # The learning rate charted is the agent's reading of the watched optimizer; the job's own
    # `lr` beside it is one more user scalar, under its name.
    chart(page, "lr")
    assert any("metric=learning_rate" in u for u in asked), asked
    # The loss and perplexity charts both draw `loss`; asked in the same turn, it is one request.
    loss_asked = [u for u in asked if "metric=loss&" in u]
    assert len(loss_asked) == 1, asked
    # One line per rank, plus the mean the aligner computed.
    assert loss.get_attribute("data-series") == str(RANKS + 1)
    assert ppl.get_attribute("data-series") == str(RANKS + 1)
    assert grad.get_attribute("data-series") == str(RANKS)
    assert int(lr.get_attribute("data-series")) >= 1
    assert int(loss.get_attribute("data-points")) == STEPS
    assert (loss.get_attribute("data-from"), loss.get_attribute("data-to")) == ("0", str(STEPS - 1))
    # The values drawn are the collector's: rank 0's loss at the last step.
    series = api(collector, f"/api/v1/runs/{RUN}/series", metric="loss", rank=0)
    last = series["series"][0]["buckets"][-1]["last"]
    legend_loss = page.evaluate("el => el.querySelector('.u-legend') !== null", loss.element_handle())
    assert legend_loss and last > 0
    screenshot(page, "overview")

    # The shared step cursor: hovering one chart shows values in the others' legends.
    box = loss.locator(".u-over").bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.5, box["y"] + box["height"] * 0.5)
    values = grad.locator(".u-legend .u-value").all_inner_texts()
    assert any(v not in ("–", "") for v in values[1:]), values

    # A click picks a step for every page of the run.
    page.mouse.click(box["x"] + box["width"] * 0.5, box["y"] + box["height"] * 0.5)
    selected = page.locator(".zoombar .selected")
    selected.wait_for()
    picked = int(selected.get_attribute("data-selected"))
    assert 0 < picked < STEPS - 1

    # A drag zooms: every chart is fetched again for the dragged range.
    drawn_before = grad.get_attribute("data-drawn")
    page.mouse.move(box["x"] + box["width"] * 0.25, box["y"] + 20)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 0.5, box["y"] + 20, steps=8)
    page.mouse.up()
    page.wait_for_function("([el, t]) => el.dataset.drawn !== t", arg=[grad.element_handle(), drawn_before], timeout=20_000)
    lo, hi = int(grad.get_attribute("data-from")), int(grad.get_attribute("data-to"))
    assert 0 < lo < hi < STEPS - 1 and hi - lo < STEPS / 2, (lo, hi)
    assert page.locator(".zoombar").inner_text().startswith(f"steps {lo}")
    page.click("button.reset")
    page.wait_for_function("el => el.dataset.from === '0'", arg=grad.element_handle(), timeout=20_000)


def test_chart_bands_are_incidents_whose_labels_never_overlap_with_details_on_hover(finished_run, page) -> None:
    """One band per incident (not per alert), labels in rows that never touch, and the
    incident's summary and suggested action on hover."""
    collector = finished_run
    incidents = [i for i in api(collector, "/api/v1/incidents", run=RUN)["incidents"] if i.get("fired_at_ms") is not None]
    alerts = [a for a in api(collector, "/api/v1/alerts", run=RUN)["alerts"] if a.get("fired_at_ms") is not None]
    assert incidents, "the scaled rank raised nothing"
    page.goto(f"{collector.url}/runs/{RUN}")
    loss = chart(page, "Loss")
    page.wait_for_function("el => el.dataset.bands !== undefined", arg=loss.element_handle(), timeout=20_000)
    # The overview's charts draw every incident of the run: one band each, however many alerts.
    assert int(loss.get_attribute("data-bands")) == len(incidents), (len(incidents), len(alerts))
    placed = json.loads(loss.get_attribute("data-band-labels"))
    ids = [p["id"] for p in placed]
    assert len(ids) == len(set(ids)) and set(ids) <= {i["id"] for i in incidents}, placed
    assert placed, "no band label was drawn"
    for a in placed:
        for b in placed:
            if a is not b and a["row"] == b["row"]:
                assert a["x1"] <= b["x0"] or b["x1"] <= a["x0"], (a, b)
    # Hovering the first incident's first step shows its summary and what to do.
    first = min(incidents, key=lambda i: i["first_step"])
    lo, hi = int(loss.get_attribute("data-from")), int(loss.get_attribute("data-to"))
    box = loss.locator(".u-over").bounding_box()
    step = min(max(first["first_step"] + 1, lo), hi)
    page.mouse.move(box["x"] + box["width"] * (step - lo) / (hi - lo), box["y"] + box["height"] * 0.5)
    title = loss.locator(".u-over").get_attribute("title") or ""
    assert first["summary"] in title and "What to do: " + first["action"] in title, title
    screenshot(page, "overview-incident-hover")


def test_layers_heatmap_has_one_row_per_layer_and_a_click_opens_the_layer(finished_run, page) -> None:
    collector = finished_run
    page.goto(f"{collector.url}/runs/{RUN}/layers")
    canvas = page.locator("canvas[data-heatmap]")
    page.wait_for_function("el => el.dataset.drawn", arg=canvas.element_handle(), timeout=20_000)
    heat = api(collector, f"/api/v1/runs/{RUN}/heatmap", metric="spectral.ratio")
    assert heat["layers"] == list(range(LAYERS))
    assert canvas.get_attribute("data-rows") == str(LAYERS)
    assert int(canvas.get_attribute("data-cols")) == len(heat["steps"])
    # The colour scale says what a colour means: the range drawn (the heatmap's own finite
    # extremes, on a log scale for a ratio), in words and units.
    scale = page.locator(".colour-scale")
    scale.wait_for(timeout=10_000)
    finite = [v for row in heat["last"] for v in row if isinstance(v, float | int)]
    assert scale.get_attribute("data-kind") == "log"
    lo, hi = float(scale.get_attribute("data-min")), float(scale.get_attribute("data-max"))
    assert abs(lo - min(finite)) <= 1e-9 * abs(lo) and abs(hi - max(finite)) <= 1e-9 * abs(hi), (lo, hi)
    text = scale.inner_text()
    assert "σ_MLP / σ_attention" in text and "log scale" in text and "non-finite" in text, text
    screenshot(page, "layers")
    # Click the middle of the last row: that layer's series open below.
    box = canvas.bounding_box()
    row_h = (box["height"] - 22) / LAYERS
    page.mouse.click(box["x"] + box["width"] * 0.6, box["y"] + row_h * (LAYERS - 0.5))
    page.wait_for_selector(f"h2[data-layer='{LAYERS - 1}']", timeout=10_000)
    ratio = chart(page, f"Layer {LAYERS - 1}: MLP / attention spectral-norm ratio")
    assert int(ratio.get_attribute("data-series")) >= 1
    sigma = chart(page, f"Layer {LAYERS - 1}: σ per matrix")
    assert int(sigma.get_attribute("data-series")) >= 4  # q, k, v, o, and the MLP's
    # Another metric with sites: activation maxima, one heatmap per site.
    page.select_option("select.metric", "act_max")
    page.wait_for_selector("select.site")
    page.wait_for_function("el => el.dataset.rows === String(%d)" % LAYERS, arg=canvas.element_handle(), timeout=20_000)
    screenshot(page, "layers-detail")


def test_workers_page_shows_each_rank_and_the_dispersion(finished_run, page) -> None:
    collector = finished_run
    page.goto(f"{collector.url}/runs/{RUN}/workers")
    table = page.locator("table.cosine")
    table.wait_for(timeout=20_000)
    assert table.locator("tbody tr").count() == RANKS
    # Every row of the per-rank values names what it is: one metric at two sites is two labels.
    labels = page.locator("table.values tbody th").all_inner_texts()
    assert labels and len(labels) == len(set(labels)), labels
    loss = chart(page, "Loss per rank")
    assert loss.get_attribute("data-series") == str(RANKS)
    disp = chart(page, "Dispersion across ranks (coefficient of variation)")
    assert disp.get_attribute("data-series") == "2"
    cos = chart(page, "Inter-worker gradient cosine")
    assert int(cos.get_attribute("data-series")) >= 1
    # What watching costs each rank, reported by the agent itself.
    cost = chart(page, "Monitoring cost per rank: gradient probe (ms per report)")
    assert cost.get_attribute("data-series") == str(RANKS)
    # The run's consistency, as the API reports it, over the zoomed steps: the whole run reads
    # as independent shards (its median step is before the fault); zoomed to the steps after
    # step 250, where rank 1's gradient is scaled ×8, it reads more dispersed, rank 1 apart.
    whole = api(collector, f"/api/v1/runs/{RUN}/consistency")
    panel = page.locator(".consistency")
    panel.wait_for(timeout=20_000)
    assert panel.get_attribute("data-verdict") == whole["verdict"] == "independent_shards", whole
    page.goto(f"{collector.url}/runs/{RUN}/workers?from={FAULT_STEP}&to={STEPS - 1}")
    report = api(collector, f"/api/v1/runs/{RUN}/consistency", **{"from": FAULT_STEP, "to": STEPS - 1})
    panel = page.locator(f".consistency[data-verdict='{report['verdict']}']")
    panel.wait_for(timeout=20_000)
    assert report["verdict"] == "more_dispersed", report
    ratio = panel.locator("tr[data-indicator='grad_norm'] td.ratio").inner_text()
    assert ratio == fmt(report["grad_norm"]["ratio"]), (ratio, report)
    standing = {r["rank"]: r["grad_norm_vs_others"] for r in report["ranks"]}
    assert max(standing, key=standing.get) == 1 and panel.locator("table.standing tbody tr").count() == RANKS, report
    screenshot(page, "workers")


def test_the_run_page_switches_a_runs_probes_through_the_collector(finished_run, page) -> None:
    collector = finished_run
    page.goto(f"{collector.url}/runs/{RUN}")
    switch = page.locator(".probe-switch")
    switch.wait_for(timeout=20_000)
    page.wait_for_selector('.probe-switch[data-probes="unset"]', timeout=20_000)
    page.click(".probe-switch button.attach")
    page.wait_for_selector('.probe-switch[data-probes="on"]', timeout=20_000)
    assert api(collector, f"/api/v1/runs/{RUN}/probes")["on"] is True
    assert page.locator(".probe-switch button.attach").is_disabled()
    page.click(".probe-switch button.detach")
    page.wait_for_selector('.probe-switch[data-probes="off"]', timeout=20_000)
    answer = api(collector, f"/api/v1/runs/{RUN}/probes")
    assert (answer["on"], answer["revision"]) == (False, 2), "two clicks, two revisions the agents can tell apart"
    screenshot(page, "probe-switch")


def test_a_run_whose_blocks_were_not_found_says_so_with_the_command_that_fixes_it(finished_run, page) -> None:
    """The SDK tags a run `layer_probes` when discovery could not read the model: the header of
    every page of that run says which probes are off and how to describe the blocks; a run whose
    layers were found has no such notice. The same for a run whose parameters are sharded
    (`replica_fingerprint`): the header says replica_divergence cannot judge it."""
    collector = finished_run
    body = {
        "run": "no-blocks",
        "info": {
            "world_size": 1,
            "tags": {
                "layer_probes": "off (spectral, activations): blocks not found",
                "replica_fingerprint": "off: sharded parameters (FSDP2, tensor parallel) have no replica in this run",
            },
        },
        "samples": [{"rank": 0, "step": 1, "metric": "loss", "value": 2.5}, {"rank": 0, "step": 1, "metric": "grad_norm", "value": 0.7}],
    }
    answer = requests.post(f"{collector.url}/api/v1/ingest", json=body, timeout=30)
    assert answer.status_code in (200, 202), answer.text
    for tail in ("", "/workers"):
        page.goto(f"{collector.url}/runs/no-blocks{tail}")
        notice = page.locator(".layer-probes-off")
        notice.wait_for(timeout=20_000)
        text = notice.inner_text()
        assert "layer probes off (spectral, activations): blocks not found" in text
        assert "rankwatch attach --pid PID --run no-blocks --mapping" in text and '"blocks"' in text
        fingerprint = page.locator(".replica-fingerprint-off").inner_text()
        assert "replica fingerprint off: sharded parameters" in fingerprint and "replica_divergence cannot judge this run" in fingerprint
    screenshot(page, "layer-probes-off")
    page.goto(f"{collector.url}/runs/{RUN}")
    page.locator(".probe-switch").wait_for(timeout=20_000)
    page.wait_for_timeout(1_000)  # the runs answer has arrived by then (same collector, loopback)
    assert page.locator(".layer-probes-off").count() == 0, "the layers of the demo's model were found"
    assert page.locator(".replica-fingerprint-off").count() == 0, "no notice where nothing turned the fingerprint off"


def test_bad_input_is_shown_as_text_never_a_blank_page(finished_run, page) -> None:
    collector = finished_run
    hostile = "<img src=x onerror=window.__pwned=1>"
    page.goto(f"{collector.url}/runs/{requests.utils.quote(hostile, safe='')}")
    page.wait_for_selector(".error", timeout=20_000)
    assert page.locator("h1").first.inner_text() == hostile
    assert "invalid run id" in page.locator(".error").first.inner_text()
    assert page.evaluate("window.__pwned") is None
    assert page.locator("main img").count() == 0
    page.goto(f"{collector.url}/runs/never-seen")
    page.wait_for_selector(".error")
    assert "not found" in page.locator(".error").first.inner_text()
    page.goto(f"{collector.url}/no/such/page")
    page.wait_for_selector("text=No such page.")
    screenshot(page, "not-found")


def test_the_page_says_when_the_collector_restarts_and_recovers(finished_run, page) -> None:
    collector = finished_run
    page.goto(f"{collector.url}/runs/{RUN}")
    loss = chart(page, "Loss")
    page.wait_for_selector("[data-link=live]", timeout=20_000)
    collector.kill()
    page.wait_for_selector("[data-link=reconnecting]", timeout=20_000)
    # The charts stay on the page while the collector is away.
    assert loss.get_attribute("data-series") == str(RANKS + 1)
    screenshot(page, "reconnecting")
    collector.start()
    page.wait_for_selector("[data-link=live]", timeout=30_000)
    assert loss.get_attribute("data-series") == str(RANKS + 1)
