"""The DNS-rebinding attack, performed by a real headless Chromium against a real collector
started as the compose file started it before (every interface, no tokens, `--insecure`): the
browser resolves `evil.example` to the collector's address (as a rebound name does), loads the
page from it, and from that origin tries to read the runs and delete one. Every request is
refused (403) and the run is still there — before, the listing and the delete answered 200; the
same browser reaching the collector as 127.0.0.1 gets its dashboard."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import requests

from conftest import CHROMIUM, CHROMIUM_ARGS, free_port


def test_a_page_on_a_rebound_name_can_neither_read_nor_delete(tmp_path: Path, playwright) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [os.environ["RANKWATCH_BIN"], "serve", "--listen", f"0.0.0.0:{port}", "--insecure", "--data-dir", str(tmp_path / "data")],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env={**os.environ, "RANKWATCH_LOG": "warn"},
    )
    assert proc.stdout is not None and proc.stdout.readline().startswith("rankwatch listening on")
    url = f"http://127.0.0.1:{port}"
    try:
        run = "victim"
        body = {"run": run, "samples": [{"rank": 0, "step": s, "metric": "loss", "value": 2.0} for s in range(3)]}
        stored = requests.post(f"{url}/api/v1/ingest", json=body, timeout=30)
        assert stored.status_code == 200, stored.text
        # A browser of its own: the rebinding rule is a launch argument.
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=[*CHROMIUM_ARGS, "--host-resolver-rules=MAP evil.example 127.0.0.1"],
            headless=True,
        )
        try:
            page = browser.new_page()
            evil = f"http://evil.example:{port}"
            loaded = page.goto(f"{evil}/runs/{run}")
            assert loaded is not None and loaded.status == 403, loaded and loaded.text()
            assert "DNS rebinding" in loaded.text()
            # Same-origin to the browser: it sends the rebound name as Host, and Origin on
            # the delete.
            answers = page.evaluate(
                """async (run) => {
                    const read = await fetch('/api/v1/runs');
                    const del = await fetch('/api/v1/runs/' + run, {method: 'DELETE'});
                    return {read: read.status, readBody: await read.text(), delete: del.status};
                }""",
                run,
            )
            assert answers["read"] == 403 and answers["delete"] == 403, answers
            assert run not in answers["readBody"], answers
            # The same browser on the collector's own address: the dashboard.
            own = page.goto(f"{url}/runs/{run}")
            assert own is not None and own.status == 200
        finally:
            browser.close()
        runs = requests.get(f"{url}/api/v1/runs", timeout=10).json()["runs"]
        assert [r["run"] for r in runs] == [run], runs
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
