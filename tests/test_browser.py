"""The UI in a real headless Chromium against the hung 2-rank reference demo.

Chromium and its driver come from Debian (``chromium``, ``chromium-driver``; scripts/_venv.sh
installs them), never a browser download. Screenshots go to ``$DEBUG_SERVER_SCREENSHOTS`` (for
example ``/work/screenshots``, git-ignored) or, when unset, the test's temp dir.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mpjob import free_port, kill_tree, start_demo

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
pytestmark = pytest.mark.timeout(90)

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed "
                                "(pip install -e '.[test]')")
if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
    # In CI a missing browser is a broken install step, not something outside our control:
    # scripts/_venv.sh installs it, so fail loudly instead of passing with the UI untested.
    if os.environ.get("CI"):
        raise RuntimeError(f"CI: {CHROMIUM} or {CHROMEDRIVER} is missing; scripts/_venv.sh "
                           "should have installed chromium chromium-driver")
    pytest.skip("chromium/chromium-driver are not installed and could not be "
                "(scripts/_venv.sh: apt-get install chromium chromium-driver)",
                allow_module_level=True)


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def hung_demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The reference demo under torchrun, yielded once rank 1 is missing from all_reduce #4."""
    port = free_port()
    dump_dir = tmp_path_factory.mktemp("browser") / "dumps"
    log = tmp_path_factory.mktemp("browser_log") / "demo.log"
    with open(log, "w") as out:
        proc = start_demo(dump_dir, port, out, FR_DUMP_INTERVAL="1", COMM_TIMEOUT="20",
                          HANG_SECONDS="25")
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 45
        while True:
            assert proc.poll() is None, f"demo exited early:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no hang seen:\n{log.read_text()[-3000:]}"
            try:
                body = _get_json(f"{base}/fr_trace?format=json")
                if any(f["kind"] == "missing_ranks" and f["seq"] == 4 for f in body["findings"]):
                    break
            except (OSError, urllib.error.URLError, ValueError):
                pass
            time.sleep(0.5)
        yield base
    finally:
        if proc.poll() is None:
            kill_tree(proc)  # torchrun, both ranks (own sessions), the frontend
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="debug_server_chromium_")
    opts = Options()
    opts.binary_location = CHROMIUM
    # No outside network here (and none needed): keep Chromium from trying to phone home.
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
                 "--window-size=1400,1100", f"--user-data-dir={profile}"):
        opts.add_argument(flag)
    service = Service(executable_path=CHROMEDRIVER)
    driver = webdriver.Chrome(service=service, options=opts)
    try:
        driver.set_page_load_timeout(30)
        yield driver
    finally:
        driver.quit()
        if service.process is not None and service.process.poll() is None:
            service.process.kill()
        shutil.rmtree(profile, ignore_errors=True)


def _shot(driver: Any, name: str, tmp_path: Path) -> Path:
    out = Path(os.environ.get("DEBUG_SERVER_SCREENSHOTS") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    # Tall enough for the whole page (selenium's Chrome driver shoots the viewport only).
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1400, min(max(int(height) + 120, 800), 4000))
    path = out / name
    assert driver.save_screenshot(str(path)), path
    return path


def test_overview_banner_names_rank_1_in_a_real_browser(hung_demo: str, browser: Any, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    browser.get(f"{hung_demo}/")
    banner = browser.find_element(By.CSS_SELECTOR, ".banner.bad")
    assert "Rank 1 is missing from all_reduce #4 on main_comm" in banner.text
    assert "verify_flight_recorder.py:" in banner.text  # where rank 1 is stuck
    cell = browser.find_element(By.CSS_SELECTOR, '.grid a[href="/stacks#rank-1"]')
    assert cell.get_attribute("class") == "s-behind"
    assert _shot(browser, "overview.png", tmp_path).stat().st_size > 10_000


def test_fr_trace_highlights_seq_4_all_reduce_in_a_real_browser(hung_demo: str, browser: Any, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    browser.get(f"{hung_demo}/fr_trace")
    rows = browser.find_elements(By.CSS_SELECTOR, "tr.fail")
    hits = [r for r in rows if "nccl:all_reduce" in r.text
            and [td.text for td in r.find_elements(By.TAG_NAME, "td")][3:4] == ["4"]]
    assert hits, [r.text for r in rows]
    bg = hits[0].find_element(By.TAG_NAME, "td").value_of_css_property("background-color")
    assert bg not in ("rgba(0, 0, 0, 0)", "rgb(255, 255, 255)"), bg  # the highlight is drawn
    link = hits[0].find_element(By.CSS_SELECTOR, 'a[href="/stacks#rank-1"]')
    assert _shot(browser, "fr_trace.png", tmp_path).stat().st_size > 10_000
    link.click()
    assert browser.current_url.endswith("/stacks#rank-1")
    assert "hang_phase" in browser.find_element(By.ID, "rank-1").find_element(
        By.XPATH, "ancestor::section").text
    _shot(browser, "stacks.png", tmp_path)
