"""The dashboard in a real browser: ``hfzero dashboard`` serving a profile, opened in headless Chromium.

Needs the Debian packages ``chromium`` and ``chromium-driver`` (and the ``selenium`` Python package);
without them the test is skipped with the reason. Run it with ``pytest -m browser``.

``python tests/test_dashboard_browser.py RUN_DIR [RUN_DIR ...] OUT_DIR`` saves one screenshot per view
into OUT_DIR (how ``docs/screenshots/*.png`` were made).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

VIEW_MARKERS: dict[str, str] = {
    "Memory by role": "Bytes by role, stage",
    "Timeline": "Memory over steps and phases",
    "Fragmentation": "Fragmentation over time",
    "Communication": "Communication per step",
    "Pipeline stages": "Pipeline stages",
    "Compare runs": "Runs side by side",
    "Estimator": "Per-device model-state memory by data-parallel degree",
    "Planner": "Plan: configurations by estimated throughput",
}
"""Each sidebar view and a plot title that shows it has rendered."""

SCREENSHOT_NAMES: dict[str, str] = {
    "Memory by role": "memory_by_role", "Timeline": "timeline", "Fragmentation": "fragmentation",
    "Communication": "communication", "Pipeline stages": "pipeline_stages", "Compare runs": "compare_runs",
    "Estimator": "estimator", "Planner": "planner",
}

VIEW_HEIGHTS: dict[str, int] = {"Timeline": 1900, "Fragmentation": 1300, "Pipeline stages": 1700, "Compare runs": 1500,
                                "Estimator": 1900, "Planner": 1900}
"""Window heights for the screenshots (Streamlit scrolls inside its own container, so the window sets
how much of a view a screenshot holds)."""

ERROR_TEXT = ("Traceback", "Error:", "Exception", "Cannot show this run")
SERVER_START_TIMEOUT = 60.0
RENDER_TIMEOUT = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def browser_tools() -> tuple[str, str] | str:
    """(chromium binary, chromedriver) or the reason they cannot be used."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "the selenium Python package is not installed (pip install selenium)"
    binary = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
    driver = shutil.which("chromedriver")
    if binary is None or driver is None:
        return "chromium / chromedriver not found (apt-get install -y chromium chromium-driver)"
    return binary, driver


@contextlib.contextmanager
def serve(run_dirs: list[str]) -> Iterator[str]:
    """Start ``hfzero dashboard`` on a free port; yield its URL; always stop the server."""
    port = _free_port()
    process = subprocess.Popen([sys.executable, "-m", "hfzero", "dashboard", *run_dirs, "--port", str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT
        while True:
            if process.poll() is not None:
                output = process.stdout.read().decode(errors="replace") if process.stdout else ""
                raise RuntimeError(f"hfzero dashboard exited with {process.returncode}:\n{output}")
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the dashboard did not answer on {url} within {SERVER_START_TIMEOUT:.0f}s")
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(process.pid, signal.SIGTERM)  # the whole session: nothing may outlive the test
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@contextlib.contextmanager
def chromium(tools: tuple[str, str], width: int = 1500, height: int = 1300) -> Iterator[Any]:
    """A headless Chromium driven by selenium (``--no-sandbox``: CI runs as root); always quits."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = tools[0]
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 f"--window-size={width},{height}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(tools[1]), options=options)
    try:
        driver.set_page_load_timeout(RENDER_TIMEOUT)
        yield driver
    finally:
        driver.quit()


def show_view(driver: Any, view: str) -> None:
    """Click ``view`` in the sidebar and wait until its plot is drawn and the script is idle."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(driver, RENDER_TIMEOUT, ignored_exceptions=(StaleElementReferenceException,))
    label = wait.until(lambda d: d.find_element(
        By.XPATH, f"//section[@data-testid='stSidebar']//label[.//p[normalize-space()='{view}']]"))
    label.click()

    def rendered(d: Any) -> bool:
        titles = d.execute_script(
            "return Array.from(document.querySelectorAll('.js-plotly-plot .gtitle')).map(e => e.textContent).join(' ')")
        running = d.find_elements(By.CSS_SELECTOR, "[data-testid='stStatusWidget']")
        return VIEW_MARKERS[view] in titles and not running

    wait.until(rendered)
    time.sleep(1.0)  # let plotly finish its transition before a screenshot


def page_problems(driver: Any) -> list[str]:
    """Exception boxes and error text on the page."""
    from selenium.webdriver.common.by import By

    problems = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "[data-testid='stException']")]
    text = driver.find_element(By.TAG_NAME, "body").text
    problems += [f"page text contains {word!r}" for word in ERROR_TEXT if word in text]
    return problems


def capture(run_dirs: list[str], out_dir: Path, tools: tuple[str, str],
            views: list[str] | None = None) -> dict[str, list[str]]:
    """Serve ``run_dirs``, visit every view (or ``views``), save ``<view>.png`` into ``out_dir``; problems
    per view."""
    out_dir.mkdir(parents=True, exist_ok=True)
    found: dict[str, list[str]] = {}
    with serve(run_dirs) as url, chromium(tools) as driver:
        driver.get(url)
        for view, name in SCREENSHOT_NAMES.items():
            if views is not None and view not in views:
                continue
            driver.set_window_size(1500, VIEW_HEIGHTS.get(view, 1200))
            show_view(driver, view)
            found[view] = page_problems(driver)
            driver.save_screenshot(str(out_dir / f"{name}.png"))
    return found


@pytest.mark.browser
def test_every_view_renders_in_chromium(tmp_path: Path) -> None:
    tools = browser_tools()
    if isinstance(tools, str):
        pytest.skip(tools)
    from tests.test_dashboard import write_pp_run, write_run

    parent = tmp_path / "runs"
    for stage in (0, 1, 2):
        write_run(parent / f"stage{stage}", stage=stage, world_size=2, steps=5)
    problems = capture([str(parent)], tmp_path / "shots", tools)
    assert problems == {view: [] for view in SCREENSHOT_NAMES}
    for name in SCREENSHOT_NAMES.values():
        assert (tmp_path / "shots" / f"{name}.png").stat().st_size > 10_000
    # a pipeline-parallel run: the pipeline view's four panels and its schedule chart
    pp = write_pp_run(tmp_path / "pp")
    assert capture([str(pp)], tmp_path / "pp_shots", tools, views=["Pipeline stages"]) == {"Pipeline stages": []}
    assert (tmp_path / "pp_shots" / "pipeline_stages.png").stat().st_size > 10_000


CUT_LABELS_JS = """
const plot = document.querySelector('.js-plotly-plot');
const svg = plot.querySelector('.main-svg').getBoundingClientRect();
const inside = r => r.left >= svg.left - 1 && r.right <= svg.right + 1 && r.top >= svg.top - 1 && r.bottom <= svg.bottom + 1;
const overlap = (a, b) => a.left < b.right && b.left < a.right && a.top < b.bottom && b.top < a.bottom;
const legend = plot.querySelector('.legend');  // none in the first view (its legend is HTML under it)
const legendBox = legend ? legend.getBoundingClientRect() : null;
const problems = [];
const ticks = Array.from(plot.querySelectorAll('.xtick text, .ytick text, .xtick2 text, .ytick2 text, .multicategory text'));
for (const t of ticks) {
  const r = t.getBoundingClientRect();
  if (!t.textContent) continue;
  if (!inside(r)) problems.push('axis label cut by the figure edge: ' + t.textContent);
  if (legendBox && overlap(r, legendBox)) problems.push('axis label under the legend: ' + t.textContent);
}
for (const t of plot.querySelectorAll('.legendtext, .legendtitletext, .gtitle, .annotation-text')) {
  if (!inside(t.getBoundingClientRect())) problems.push('text cut: ' + t.textContent);
}
const groups = {};
for (const t of ticks) {
  const axis = t.closest('.xaxislayer-above, .yaxislayer-above, .multicategory, g');
  const key = (t.closest('g[class*="tick"]') || t).getAttribute('class') + ':' + (axis ? axis.getAttribute('class') : '');
  (groups[key] = groups[key] || []).push(t.getBoundingClientRect());
}
for (const [key, boxes] of Object.entries(groups)) {
  for (let i = 0; i < boxes.length; i++) for (let j = i + 1; j < boxes.length; j++)
    if (overlap(boxes[i], boxes[j])) problems.push('axis labels overlap on ' + key);
}
const titles = Array.from(plot.querySelectorAll('.annotation-text')).map(t => t.getBoundingClientRect());
for (let i = 0; i < titles.length; i++) for (let j = i + 1; j < titles.length; j++)
  if (overlap(titles[i], titles[j])) problems.push('subplot titles overlap');
return {problems: problems, ticks: ticks.map(t => t.textContent)};
"""
"""Every axis tick label of the first plot (category labels, the rank row, bytes), its titles and any legend
text lie inside the figure, tick labels off the legend and off each other, subplot titles off each other:
plotly's text bounding boxes as the browser lays them out."""


def first_view_problems(driver: Any) -> tuple[list[str], list[str]]:
    """(cut or covered labels of the first plot, its tick label texts)."""
    result = driver.execute_script(CUT_LABELS_JS)
    return result["problems"], result["ticks"]


@pytest.mark.browser
def test_first_view_of_the_main_job_has_no_cut_label() -> None:
    """The first view (Memory by role) of the main job's profile (MiniLM encoder classifier, stage 2, 2 ranks;
    ``tests/data/main_job_profile``): no axis label cut or under the legend at widths 900, 1500 and 2400 (one
    server, one browser, resized), the one-sentence summary under the chart, and the activation estimate
    within 10% of the measurement."""
    tools = browser_tools()
    if isinstance(tools, str):
        pytest.skip(tools)
    from selenium.webdriver.common.by import By

    from dashboard import data, figures

    run_dir = Path(__file__).parent / "data" / "main_job_profile"
    loaded = data.load(run_dir)
    predicted = data.activation_prediction(loaded.run)["saved"]
    for measured in data.activation_peaks(loaded.run).values():
        assert sum(measured.values()) == pytest.approx(predicted, rel=0.10)
    sentence = figures.peak_sentence(loaded)
    assert sentence.startswith("Within its prediction")
    with serve([str(run_dir)]) as url, chromium(tools, width=1500, height=1200) as driver:
        driver.get(url)
        show_view(driver, "Memory by role")
        for width in (900, 1500, 2400):
            driver.set_window_size(width, 1200)
            time.sleep(2.0)  # streamlit and plotly re-lay the chart out for the new width
            assert page_problems(driver) == []
            problems, ticks = first_view_problems(driver)
            assert problems == [], (width, problems)
            for label in ("model states", "formula", "transient", "activations", "estimate"):
                assert ticks.count(label) == 2, (width, label, ticks)  # one per rank: none skipped
            assert {"rank 0", "rank 1"} <= set(ticks)
            body = driver.find_element(By.TAG_NAME, "body").text
            assert sentence.split(";")[0] in body
            assert all(f"{group}:" in body for group in ("measured, by role", "predicted", "whole peak"))


if __name__ == "__main__":
    found_tools = browser_tools()
    if isinstance(found_tools, str):
        sys.exit(found_tools)
    print(capture(sys.argv[1:-1], Path(sys.argv[-1]), found_tools))
