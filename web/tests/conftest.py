"""Fixtures of the dashboard's browser tests: a real collector (the SDK suite's helper), a real
multi-rank training run feeding it, and Debian's headless Chromium driven by Playwright."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from typing import Iterator

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
SHOTS = REPO / "target" / "ui-screenshots"

# The SDK suite's collector helper, loaded under another name (two conftest modules clash).
_spec = importlib.util.spec_from_file_location("sdk_conftest", REPO / "sdk-python" / "tests" / "conftest.py")
assert _spec is not None and _spec.loader is not None
sdk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sdk)
Collector = sdk.Collector
free_port = sdk.free_port

CHROMIUM = os.environ.get("CHROMIUM_BIN", "/usr/bin/chromium")
# What this machine's Chromium needs headless: no sandbox as root, no GPU, and no
# background connections to hosts the closed network refuses.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="session")
def playwright():
    """One Playwright per session: its sync API cannot be started twice in one process."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"Chromium is not installed at {CHROMIUM} (cargo xtask test installs Debian's chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        yield p


@pytest.fixture(scope="session")
def browser(playwright):
    b = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
    yield b
    b.close()


@pytest.fixture
def page(browser) -> Iterator:
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.errors = errors  # type: ignore[attr-defined]
    yield page
    context.close()
    # A panic in the wasm or an exception in the chart code is a failure even when the
    # assertions passed.
    assert not errors, errors


def screenshot(page, name: str) -> Path:
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = SHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


@pytest.fixture(scope="module")
def tmp_module(tmp_path_factory) -> Iterator[Path]:
    d = tmp_path_factory.mktemp("ui")
    yield d
    shutil.rmtree(d, ignore_errors=True)
