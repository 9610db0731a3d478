"""The post-mortem viewer in a real headless Chromium, on the dumps a real demo run left behind.

The reference demo (the session's one run, conftest's ``reference_demo``) runs to its end
(rank 1 sleeps instead of joining all_reduce #4; rank 0 times out); then
``python -m debug_server.view`` serves its dump dir with no job left. Chromium comes from Debian
(conftest's ``browser``, shared with ``test_browser.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from httpget import get_json
from mpjob import REPO, ReferenceDemo, free_port

pytestmark = [pytest.mark.job, pytest.mark.timeout(180)]
# A page load in headless Chromium waits on the viewer, which shares the box with the rest of
# the suite: 10 s was once too short on a loaded 2-core box.
BROWSER_WAIT_S = 30


@pytest.fixture(scope="module")
def viewer(reference_demo: ReferenceDemo,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The demo's dump dir after the demo ended, served by the viewer; yields its base URL."""
    reference_demo.wait_done()
    dump_dir = reference_demo.dump_dir
    port = free_port()
    log = open(tmp_path_factory.mktemp("view_log") / "view.log", "w")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "debug_server.tools.view", str(dump_dir),
                             "--port", str(port)], env=dict(os.environ, PYTHONPATH=str(REPO)),
                            stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == f"ready {port}"
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.communicate(timeout=10)
        log.close()


def _hang_cycle(base: str, other_than: str | None = None) -> str:
    """A dated cycle taken during the hang: rank 1's stacks are in hang_phase and the FR data
    has it missing from all_reduce #4 (the first cycles of the hang may predate the verdict);
    not ``other_than`` (the cycle the page shows already: picking it changes nothing)."""
    cycles = get_json(f"{base}/stacks?format=json")["postmortem"]["cycles"]
    for c in cycles:
        if c["cycle"] in ("per_rank", other_than):
            continue
        body = get_json(f"{base}/stacks?format=json&cycle={c['cycle']}")
        fr = get_json(f"{base}/fr_trace?format=json&cycle={c['cycle']}")
        if "hang_phase" in (body["ranks"][1]["stacks"] or "") and any(
                f["kind"] == "missing_ranks" and f["seq"] == 4 for f in fr["findings"]):
            return str(c["cycle"])
    raise AssertionError(f"no cycle during the hang among {[c['cycle'] for c in cycles]}")


def test_overview_says_post_mortem_and_names_rank_1(viewer: str, browser: Any,
                                                    screenshot: Callable[[str], Path]) -> None:
    from selenium.webdriver.common.by import By

    browser.get(f"{viewer}/")
    pm = browser.find_element(By.ID, "postmortem")
    assert pm.text.startswith("Post-mortem: job ended; data from ")
    options = browser.find_elements(By.CSS_SELECTOR, "#cycle-picker option")
    selected = [o.get_attribute("value") for o in options if o.get_attribute("selected")]
    assert len(options) >= 3 and len(selected) == 1 and selected[0] != options[-1].get_attribute("value")
    # By default the cycle of the hang report, the job as it was seen hung: rank 1 in hang_phase
    # (the demo's later cycles have it past the timeout).
    assert "as it was seen hung" in pm.text
    stacks = get_json(f"{viewer}/stacks?format=json&cycle={selected[0]}")["ranks"][1]["stacks"]
    assert "hang_phase" in (stacks or "")
    banner = browser.find_element(By.CSS_SELECTOR, ".banner.bad")
    assert "Rank 1 is missing from all_reduce #4 on main_comm" in banner.text
    screenshot("view_overview.png")


def test_picking_a_cycle_in_the_hang_shows_it_on_every_page(viewer: str, browser: Any,
                                                           screenshot: Callable[[str], Path]) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    browser.get(f"{viewer}/")
    shown = Select(browser.find_element(By.ID, "cycle-picker")).first_selected_option
    stamp = _hang_cycle(viewer, other_than=shown.get_attribute("value"))
    Select(browser.find_element(By.ID, "cycle-picker")).select_by_value(stamp)
    WebDriverWait(browser, BROWSER_WAIT_S).until(lambda d: f"cycle={stamp}" in d.current_url)
    # Follow the nav link: the choice stays (cookie), the FR table highlights seq 4.
    browser.find_element(By.CSS_SELECTOR, 'nav a[href="/fr_trace"]').click()
    WebDriverWait(browser, BROWSER_WAIT_S).until(lambda d: d.current_url.endswith("/fr_trace"))
    picked = Select(browser.find_element(By.ID, "cycle-picker")).first_selected_option
    assert picked.get_attribute("value") == stamp
    rows = browser.find_elements(By.CSS_SELECTOR, "tr.fail")
    hit = [r for r in rows if "nccl:all_reduce" in r.text
           and [td.text for td in r.find_elements(By.TAG_NAME, "td")][3:4] == ["4"]]
    assert hit, [r.text for r in rows]
    screenshot("view_fr_trace.png")
    hit[0].find_element(By.CSS_SELECTOR, 'a[href="/stacks#rank-1"]').click()
    section = browser.find_element(By.ID, "rank-1").find_element(By.XPATH, "ancestor::section")
    assert "hang_phase" in section.text
    screenshot("view_stacks.png")
