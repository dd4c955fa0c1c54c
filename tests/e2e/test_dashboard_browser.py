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
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]
SHOTS = ROOT / "artifacts" / "dashboard"
#: how long to wait for a state (a page drawn, a legend filled): generous, since a loaded
#: machine can take a while; the test checks what the page shows, not how fast
WAIT_MS = 240_000

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
    page.get_by_role("heading", name=title, exact=True).wait_for(timeout=WAIT_MS)
    _settle(page)


def _settle(page: Any) -> None:
    """Wait until the script run has finished and nothing on the page is stale (Streamlit
    marks the elements of the previous run `data-stale` while a run is under way, and shows
    its status widget)."""
    page.wait_for_function(
        """() => !document.querySelector('[data-testid="stStatusWidget"]')
                 && !document.querySelector('[data-stale="true"]')""",
        timeout=WAIT_MS, polling=100)


def _legend(page: Any, key: str, want: set[str]) -> list[str]:
    """The legend of the chart with widget key `key`, once it holds every name in `want`
    (polled: a chart re-renders after the script run that changed it)."""
    sel = f".st-key-{key} .js-plotly-plot"
    page.wait_for_function(
        """([sel, want]) => {
            const p = document.querySelector(sel);
            if (!p) return false;
            const got = new Set([...p.querySelectorAll('.legendtext')]
                                .map(t => t.textContent.trim()));
            return want.every(w => got.has(w));
        }""", arg=[sel, sorted(want)], timeout=WAIT_MS, polling=100)
    return [t.strip() for t in page.locator(sel).first.locator(".legendtext")
            .all_text_contents()]


def _shot(page: Any, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    # the viewport only: a full-page bitmap of a long page is large, and a renderer that runs
    # out of memory on a busy machine crashes the page
    page.screenshot(path=str(SHOTS / f"{name}.png"))


def test_click_through_every_page(server: SimpleNamespace, browser: Any) -> None:
    page = browser.new_page(viewport={"width": 1500, "height": 1000})
    page.set_default_timeout(WAIT_MS)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        _click_through(page, server, errors)
    except Exception as exc:  # any failure: say where it stood, then raise it
        try:
            _shot(page, "failure")
        except Exception:  # noqa: BLE001, S110 - a crashed page takes no screenshot
            pass
        tail = server.log.read_text(errors="replace")[-4000:]
        raise AssertionError(f"{type(exc).__name__}: {exc}\n(screenshot: "
                             f"{SHOTS / 'failure.png'}); dashboard log:\n{tail}") from exc
    finally:
        page.close()


def _click_through(page: Any, server: SimpleNamespace, errors: list[str]) -> None:
    page.goto(server.url, wait_until="domcontentloaded")
    page.get_by_role("heading", name="Runs", exact=True).wait_for(timeout=WAIT_MS)
    _settle(page)
    runs = server.store.runs
    page.get_by_text(f"{runs} of {runs} runs").wait_for()
    _shot(page, "1-runs")

    _go(page, "Operations")
    _legend(page, "ops_occupancy", {"prefill · waiting", "decode · running"})
    _legend(page, "ops_leases", {"decode · retained", "decode pool capacity"})
    _shot(page, "2-operations")

    _go(page, "Request timeline")
    # (a "queue" bar shows only when a request waited: the light runs need not)
    _legend(page, "timeline_chart", {"prefill", "transfer (P->D)", "first decode step", "decode"})
    bar = page.locator(".st-key-timeline_chart .js-plotly-plot .barlayer .point path").first
    bar.wait_for(timeout=WAIT_MS)
    box = bar.bounding_box()
    assert box is not None
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    hover = page.locator(".js-plotly-plot .hoverlayer .hovertext").first
    hover.wait_for(timeout=60_000)
    assert "req-" in (hover.text_content() or "")  # the events behind the bar
    _shot(page, "3-timeline")

    _go(page, "Push vs pull")
    _legend(page, "pp_chart", {"push · 1 QPS", "pull · 4 QPS", "published"})
    page.get_by_role("heading", name="Published figures").wait_for()
    _shot(page, "4-push-vs-pull")

    _go(page, "Reuse")
    _legend(page, "reuse_scatter", {"reuse off", "reuse on"})
    page.get_by_role("heading", name="Outcomes").wait_for()
    _shot(page, "5-reuse")

    _go(page, "Leases")
    _legend(page, "leases_chart", {"decode-0", "LeaseGranted"})
    _shot(page, "6-leases")

    _go(page, "Sim vs live")  # out of the box: the recorded live run and its twin
    page.get_by_role("heading", name="Error per percentile").wait_for()
    _legend(page, "twin_cdfs", {"measured", "twin"})
    page.get_by_text("6 requests in both runs", exact=False).wait_for()
    _shot(page, "7-sim-vs-live")

    _go(page, "What-if")
    form = page.locator('[data-testid="stForm"]')
    requests = form.get_by_label("Requests (both arms)")
    requests.fill("8")
    requests.press("Tab")
    seeds = form.get_by_label("Seeds (per arm)")
    seeds.fill("2")
    seeds.press("Tab")
    form.get_by_role("button", name="Run the simulator").click()
    page.get_by_text("what-if recorded as run").wait_for(timeout=WAIT_MS)
    page.get_by_role("heading", name="Result beside the control").wait_for()
    _settle(page)
    _legend(page, "whatif_cdfs", {"control", "what-if"})
    _shot(page, "8-what-if")

    _go(page, "Plan")
    page.get_by_text("Workload planned for", exact=False).wait_for()
    page.locator(".st-key-plan_grid .js-plotly-plot").wait_for(timeout=WAIT_MS)
    _shot(page, "9-plan")
    assert not errors, errors
