"""The UI in a real headless Chromium against the hung 2-rank reference demo.

The demo is the session's one run, read live while rank 1 is missing from all_reduce #4
(conftest's ``demo_live``); Chromium and its driver come from Debian (``chromium``,
``chromium-driver``; scripts/_venv.sh installs them), never a browser download (conftest's
``browser``). Screenshots go to ``$DEBUG_SERVER_SCREENSHOTS`` (for example
``/work/screenshots``, git-ignored) or, when unset, the test's temp dir.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from mpjob import DEMO

pytestmark = [pytest.mark.job, pytest.mark.timeout(120)]


def test_overview_banner_names_rank_1_in_a_real_browser(demo_live: str, browser: Any,
                                                          screenshot: Callable[[str], Path]) -> None:
    from selenium.webdriver.common.by import By

    browser.get(f"{demo_live}/")
    banner = browser.find_element(By.CSS_SELECTOR, ".banner.bad")
    assert "Rank 1 is missing from all_reduce #4 on main_comm" in banner.text
    assert f"{DEMO.name}:" in banner.text  # where rank 1 is stuck
    cell = browser.find_element(By.CSS_SELECTOR, '.grid a[href="/stacks#rank-1"]')
    assert cell.get_attribute("class") == "s-behind"
    assert screenshot("overview.png").stat().st_size > 10_000


def test_fr_trace_highlights_seq_4_all_reduce_in_a_real_browser(demo_live: str, browser: Any,
                                                                 screenshot: Callable[[str], Path]) -> None:
    from selenium.webdriver.common.by import By

    browser.get(f"{demo_live}/fr_trace")
    rows = browser.find_elements(By.CSS_SELECTOR, "tr.fail")
    hits = [r for r in rows if "nccl:all_reduce" in r.text
            and [td.text for td in r.find_elements(By.TAG_NAME, "td")][3:4] == ["4"]]
    assert hits, [r.text for r in rows]
    bg = hits[0].find_element(By.TAG_NAME, "td").value_of_css_property("background-color")
    assert bg not in ("rgba(0, 0, 0, 0)", "rgb(255, 255, 255)"), bg  # the highlight is drawn
    link = hits[0].find_element(By.CSS_SELECTOR, 'a[href="/stacks#rank-1"]')
    assert screenshot("fr_trace.png").stat().st_size > 10_000
    link.click()
    assert browser.current_url.endswith("/stacks#rank-1")
    assert "hang_phase" in browser.find_element(By.ID, "rank-1").find_element(
        By.XPATH, "ancestor::section").text
    screenshot("stacks.png")
