"""Dashboard load benchmark (run by `cargo xtask bench ui`), printed as a table.

A run of 100,000 steps x 64 layers x 8 ranks is ingested into a release collector (Arrow IPC):
spectral.ratio for every layer, rank and step (51.2 M rows), per-rank loss, grad_norm and lr,
and the cross-rank loss_mean and perplexity. Then Debian's headless Chromium (Playwright)
loads the run page and measures, from the navigation's start:

- interactive: every chart of the overview drawn with the server's downsampled data;
- zoom: a drag on the loss chart, until every chart is redrawn with the finer buckets, and the
  longest main-thread task meanwhile (a stall over ~100 ms is visible);
- the layers page: the 64-row heatmap drawn;
- the same overview over an emulated 100 Mbit/s link with 20 ms round trips (Chrome DevTools'
  network emulation), where the bytes matter: a collector on another machine;
- the bytes one load moves: each response's encoded size beside the same URL uncompressed.

The issue's anchors: interactive within 1 s, a zoom without visible stall. Numbers are
printed, not asserted; the machine is shared and noisy.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from collector_bench import ARROW, ipc_bytes, post_all, start_collector, stop

if TYPE_CHECKING:
    from collections.abc import Iterator

    from playwright.sync_api import Browser, Page, Request

RUN = "big"
STEPS = int(os.environ.get("RANKWATCH_BENCH_UI_STEPS", "100000"))
LAYERS = 64
RANKS = 8
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def table(metric: str, steps: np.ndarray, ranks: np.ndarray | None, layers: np.ndarray | None, values: np.ndarray) -> pa.Table:
    n = len(steps)
    return pa.table({
        "run": pa.DictionaryArray.from_arrays(np.zeros(n, np.int32), [RUN]).cast(pa.string()),
        "rank": pa.array(ranks, pa.uint32()) if ranks is not None else pa.nulls(n, pa.uint32()),
        "step": pa.array(steps, pa.uint64()),
        "time": pa.array(1_700_000_000_000 + steps.astype(np.int64) * 1000, pa.timestamp("ms", tz="UTC")),
        "metric": pa.DictionaryArray.from_arrays(np.zeros(n, np.int32), [metric]).cast(pa.string()),
        "layer": pa.array(layers, pa.uint32()) if layers is not None else pa.nulls(n, pa.uint32()),
        "site": pa.nulls(n, pa.string()),
        "value": pa.array(values, pa.float64()),
    })


def batches() -> Iterator[pa.Table]:
    """The run's rows in Arrow batches of at most ~256 k rows, step-ordered."""
    rng = np.random.default_rng(0)
    chunk = 500  # steps per layer batch: 500 x 64 x 8 = 256,000 rows
    for s0 in range(0, STEPS, chunk):
        steps = np.arange(s0, min(s0 + chunk, STEPS))
        n = len(steps)
        st = np.repeat(steps, RANKS * LAYERS)
        rk = np.tile(np.repeat(np.arange(RANKS), LAYERS), n)
        ly = np.tile(np.arange(LAYERS), n * RANKS)
        ratio = 2.0 + np.log1p(st / 1000.0) * (1 + ly / LAYERS) + rng.normal(0, 0.05, len(st))
        yield table("spectral.ratio", st, rk, ly, ratio)
        st = np.repeat(steps, RANKS)
        rk = np.tile(np.arange(RANKS), n)
        loss = 4.0 * np.exp(-st / 20000.0) + 1.0 + rng.normal(0, 0.05, len(st))
        yield table("loss", st, rk, None, loss)
        yield table("grad_norm", st, rk, None, 1.0 + rng.gamma(2.0, 0.2, len(st)))
        yield table("user/lr", st, rk, None, 3e-4 * np.minimum(1.0, st / 2000.0))
        mean = loss.reshape(n, RANKS).mean(axis=1)
        yield table("loss_mean", steps, None, None, mean)
        yield table("perplexity", steps, None, None, np.exp(mean))


def ingest(url: str) -> tuple[int, float]:
    """Sends the batches in groups of 12 (the run does not fit in memory at once as bodies)."""
    rows = 0
    elapsed = 0.0
    group: list[tuple[bytes, dict[str, str]]] = []

    def flush() -> float:
        secs = post_all(f"{url}/api/v1/ingest", group, clients=3)
        group.clear()
        return secs

    for t in batches():
        rows += t.num_rows
        group.append((ipc_bytes(t), {"content-type": ARROW}))
        if len(group) == 12:
            elapsed += flush()
    if group:
        elapsed += flush()
    return rows, elapsed


CHARTS = "[data-chart]"


def load_overview(page: Page, url: str) -> float:
    page.goto(f"{url}/runs/{RUN}", wait_until="commit")
    page.wait_for_function(
        """() => { const c = [...document.querySelectorAll('[data-chart]')];
                   return c.length >= 4 && c.every(e => e.dataset.drawn && Number(e.dataset.points) > 0); }""",
        timeout=60_000,
    )
    return page.evaluate("() => Math.max(...[...document.querySelectorAll('[data-chart]')].map(e => Number(e.dataset.drawn)))")


def zoom(page: Page) -> tuple[float, float, int]:
    page.evaluate("""() => { window.__long = 0; new PerformanceObserver(l => { for (const e of l.getEntries())
                     window.__long = Math.max(window.__long, e.duration); }).observe({ type: 'longtask' }); }""")
    loss = page.locator("[data-chart=Loss] .u-over")
    box = loss.bounding_box()
    assert box is not None  # the chart is on the page
    before = page.evaluate("() => [...document.querySelectorAll('[data-chart]')].map(e => e.dataset.drawn)")
    page.mouse.move(box["x"] + box["width"] * 0.40, box["y"] + 30)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 0.45, box["y"] + 30, steps=5)
    t0 = page.evaluate("() => performance.now()")
    page.mouse.up()
    page.wait_for_function(
        "(before) => [...document.querySelectorAll('[data-chart]')].every((e, i) => e.dataset.drawn !== before[i])",
        arg=before, timeout=60_000)
    t1 = page.evaluate("() => Math.max(...[...document.querySelectorAll('[data-chart]')].map(e => Number(e.dataset.drawn)))")
    span = page.evaluate("() => { const e = document.querySelector('[data-chart=Loss]'); return Number(e.dataset.to) - Number(e.dataset.from); }")
    return t1 - t0, page.evaluate("() => window.__long"), span


def load_layers(page: Page, url: str) -> float:
    page.goto(f"{url}/runs/{RUN}/layers", wait_until="commit")
    page.wait_for_function("() => { const c = document.querySelector('canvas[data-heatmap]'); return c && c.dataset.drawn && c.dataset.rows === '64'; }",
                           timeout=120_000)
    return page.evaluate("() => Number(document.querySelector('canvas[data-heatmap]').dataset.drawn)")


def transfer(browser: Browser, url: str) -> list[tuple[str, str, int, int]]:
    """What one load of the run page and its layers page moves over the wire: per response, its
    Content-Encoding, the encoded bytes Chromium received, and the bytes of the same URL asked
    for with `Accept-Encoding: identity`."""
    import urllib.request

    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    seen: list[Request] = []
    page.on("requestfinished", lambda request: seen.append(request))
    load_overview(page, url)
    load_layers(page, url)
    rows = []
    for request in seen:
        response = request.response()
        if response is None or request.method != "GET" or "/api/v1/events" in request.url:
            continue
        encoding = response.headers.get("content-encoding", "identity")
        wire = request.sizes()["responseBodySize"]
        plain = urllib.request.Request(request.url, headers={"Accept-Encoding": "identity"})
        with urllib.request.urlopen(plain, timeout=120) as answer:
            identity = len(answer.read())
        rows.append((request.url.removeprefix(url), encoding, wire, identity))
    context.close()
    return rows


def throttled_load(browser: Browser, url: str, mbit: float | None, rtt_ms: float, identity: bool = False) -> tuple[float, int]:
    """The overview's time to interactive over an emulated link (a collector on another
    machine), and how many responses came compressed. `identity` asks for every response
    uncompressed (`Accept-Encoding: identity`), the collector's behaviour before it compressed."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    cdp = context.new_cdp_session(page)
    cdp.send("Network.enable")
    if mbit is not None:  # None: loopback as it is
        rate = mbit * 1e6 / 8
        cdp.send("Network.emulateNetworkConditions", {"offline": False, "latency": rtt_ms, "downloadThroughput": rate, "uploadThroughput": rate})
    if identity:
        cdp.send("Network.setExtraHTTPHeaders", {"headers": {"Accept-Encoding": "identity"}})
    encoded = []
    page.on("response", lambda r: encoded.append(r.headers.get("content-encoding") is not None))
    t = load_overview(page, url)
    context.close()
    return t, sum(encoded)


def main() -> None:
    from playwright.sync_api import sync_playwright

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}")
    with tempfile.TemporaryDirectory() as tmp:
        # Not pinned to one core: this measures the page, not the collector's ingest.
        proc, url = start_collector(Path(tmp) / "data", "--no-alert-engine", cpus=None)
        try:
            rows, secs = ingest(url)
            print(f"\n# run {RUN!r}: {STEPS:,} steps x {LAYERS} layers x {RANKS} ranks = {rows:,} rows ingested in {secs:.1f} s")
            # Let the hot buffer reach Parquet, as on a run that has been going for a while.
            time.sleep(5)
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=os.environ.get("CHROMIUM_BIN", "/usr/bin/chromium"), args=CHROMIUM_ARGS)
                moved = transfer(browser, url)
                remote = [throttled_load(browser, url, 100, 20) for _ in range(3)]
                remote_plain = [throttled_load(browser, url, 100, 20, identity=True) for _ in range(3)]
                local = [throttled_load(browser, url, None, 0) for _ in range(5)]
                local_plain = [throttled_load(browser, url, None, 0, identity=True) for _ in range(5)]
                loads, zooms, stalls, layer_loads = [], [], [], []
                for i in range(6):
                    context = browser.new_context(viewport={"width": 1400, "height": 1000})
                    page = context.new_page()
                    t = load_overview(page, url)
                    if i > 0:  # the first load also warms the collector's file cache
                        loads.append(t)
                        z, longest, span = zoom(page)
                        zooms.append(z)
                        stalls.append(longest)
                        layer_loads.append(load_layers(page, url))
                    context.close()
                browser.close()
        finally:
            stop(proc)
    med = statistics.median
    print(f"\n# the run page in headless Chromium, 5 loads (after one warm-up); zoom to ~{span:,} steps\n")
    print("| measurement | median | worst | anchor | |")
    print("|---|---|---|---|---|")
    print(f"| overview interactive (4 charts drawn, from navigation start) | {med(loads):.0f} ms | {max(loads):.0f} ms | ≤ 1,000 ms | {'met' if max(loads) <= 1000 else 'NOT met'} |")
    print(f"| zoom: drag released → every chart redrawn with finer buckets | {med(zooms):.0f} ms | {max(zooms):.0f} ms | no visible stall | |")
    print(f"| zoom: longest main-thread task | {med(stalls):.0f} ms | {max(stalls):.0f} ms | < 100 ms | {'met' if max(stalls) < 100 else 'NOT met'} |")
    print(f"| layers page: 64-row heatmap drawn (51.2 M rows pooled) | {med(layer_loads):.0f} ms | {max(layer_loads):.0f} ms | (none) | |")
    for link, label, loads_ in (
        ("over an emulated 100 Mbit/s link, 20 ms RTT", "compressed", remote),
        ("over an emulated 100 Mbit/s link, 20 ms RTT", "uncompressed, `Accept-Encoding: identity`", remote_plain),
        ("on loopback", "compressed", local),
        ("on loopback", "uncompressed, `Accept-Encoding: identity`", local_plain),
    ):
        times = [t for t, _ in loads_]
        compressed = max(n for _, n in loads_)
        print(f"| overview interactive {link}, {label} ({len(times)} loads, {compressed} responses encoded) | {med(times):.0f} ms | {max(times):.0f} ms | ≤ 1,000 ms | {'met' if max(times) <= 1000 else 'NOT met'} |")
    print("\n# bytes over the wire for one load of the run page and its layers page (Chromium's encoded body sizes)\n")
    print("| resource | content-encoding | on the wire | identity | ratio |")
    print("|---|---|---|---|---|")
    for path, encoding, wire, identity in moved:
        print(f"| `{path[:70]}` | {encoding} | {wire:,} B | {identity:,} B | {identity / max(wire, 1):.1f}x |")
    wire_total, identity_total = sum(r[2] for r in moved), sum(r[3] for r in moved)
    print(f"| **all {len(moved)} responses** | | **{wire_total:,} B** | **{identity_total:,} B** | **{identity_total / max(wire_total, 1):.1f}x** |")


if __name__ == "__main__":
    sys.exit(main())  # type: ignore[func-returns-value]  # None: exit status 0
