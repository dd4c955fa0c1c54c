"""End to end: `kvplane dashboard` as a subprocess on a free port, on a store of real runs,
opened in a real headless Chromium (Debian's, driven by Playwright), clicked through page by
page. Screenshots go to artifacts/dashboard/ (gitignored).

Needs /usr/bin/chromium and the playwright package (`scripts/install_browser.sh`); without
them the test FAILS saying so, it is never skipped.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "dashboard"))
from see_store import build_store

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
SHOTS = ROOT / "artifacts" / "dashboard"

pytestmark = [pytest.mark.browser, pytest.mark.timeout(600)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _dashboard_command() -> list[str]:
    """`kvplane dashboard`, or the same command through kvplane.cli_see until kvplane/cli.py
    registers it."""
    from kvplane.cli import app

    names = {c.name or (c.callback.__name__ if c.callback else "")
             for c in app.registered_commands}
    if "dashboard" in names:
        return [sys.executable, "-m", "kvplane", "dashboard"]
    return [sys.executable, "-m", "kvplane.cli_see", "dashboard"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    store = build_store(tmp_path_factory.mktemp("browser") / "see.db")
    port = _free_port()
    log = tmp_path_factory.mktemp("log") / "dashboard.log"
    cmd = [*_dashboard_command(), "--db", store.url, "--port", str(port)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                pytest.fail(f"`{' '.join(cmd)}` exited {proc.returncode}:\n{log.read_text()}")
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                    if r.read().strip() == b"ok":
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the dashboard did not come up in 90 s:\n{log.read_text()}")
            time.sleep(0.5)
        yield SimpleNamespace(url=url, store=store, log=log)
    finally:  # the whole process group: the server and anything it started
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: run scripts/install_browser.sh", pytrace=False)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the playwright package is missing: run scripts/install_browser.sh",
                    pytrace=False)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


def _go(page: Any, title: str) -> None:
    """Click a page in the sidebar and wait until it has drawn."""
    page.locator('[data-testid="stSidebar"]').get_by_text(title, exact=True).click()
    page.get_by_role("heading", name=title, exact=True).wait_for(timeout=60_000)
    _settle(page)


def _settle(page: Any) -> None:
    """Wait for the script run to finish (Streamlit shows a 'Running' status meanwhile)."""
    page.wait_for_timeout(300)
    page.locator('[data-testid="stStatusWidget"]').wait_for(state="hidden", timeout=120_000)
    page.wait_for_timeout(500)


def _legend(page: Any, nth: int = 0) -> list[str]:
    plot = page.locator(".js-plotly-plot").nth(nth)
    plot.wait_for(timeout=60_000)
    return [t.strip() for t in plot.locator(".legendtext").all_text_contents()]


def _shot(page: Any, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def test_click_through_every_page(server: SimpleNamespace, browser: Any) -> None:
    page = browser.new_page(viewport={"width": 1500, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(server.url, wait_until="domcontentloaded")
    page.get_by_role("heading", name="Runs", exact=True).wait_for(timeout=90_000)
    _settle(page)
    runs = server.store.runs
    page.get_by_text(f"{runs} of {runs} runs").wait_for()
    _shot(page, "1-runs")

    _go(page, "Request timeline")
    legend = _legend(page)
    assert {"queue", "prefill", "transfer (P->D)", "first decode step", "decode"} <= set(legend)
    bar = page.locator(".js-plotly-plot .barlayer .point path").first
    box = bar.bounding_box()
    assert box is not None
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    hover = page.locator(".js-plotly-plot .hoverlayer .hovertext").first
    hover.wait_for(timeout=10_000)
    assert "req-" in (hover.text_content() or "")  # the events behind the bar
    _shot(page, "2-timeline")

    _go(page, "Push vs pull")
    legend = _legend(page)
    assert {"push · 1 QPS", "pull · 4 QPS", "published"} <= set(legend)
    page.get_by_role("heading", name="Published figures").wait_for()
    _shot(page, "3-push-vs-pull")

    _go(page, "Reuse")
    assert {"reuse off", "reuse on"} <= set(_legend(page))
    page.get_by_role("heading", name="Outcomes").wait_for()
    _shot(page, "4-reuse")

    _go(page, "Leases")
    assert "decode-0" in _legend(page) and "LeaseGranted" in _legend(page)
    _shot(page, "5-leases")

    _go(page, "Sim vs live")
    page.get_by_role("heading", name="Error per percentile").wait_for()
    assert {"measured", "twin"} <= set(_legend(page))
    page.get_by_text("16 requests in both runs", exact=False).wait_for()
    _shot(page, "6-sim-vs-live")

    _go(page, "What-if")
    form = page.locator('[data-testid="stForm"]')
    requests = form.get_by_label("Requests")
    requests.fill("8")
    requests.press("Tab")
    form.get_by_role("button", name="Run the simulator").click()
    page.get_by_text("what-if recorded as run").wait_for(timeout=120_000)
    _settle(page)
    page.get_by_role("heading", name="Result beside the baseline").wait_for()
    assert {"baseline", "what-if"} <= set(_legend(page))
    _shot(page, "7-what-if")
    assert not errors, errors
    page.close()
