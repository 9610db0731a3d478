"""A test may skip only for what is outside the project: our own code failing to import fails.

``pytest.importorskip("debug_server...")`` (or any skip raised while importing a module of the
package) would turn a broken import into a quiet skip, and CI would pass with the tests unrun.
These hooks, which conftest imports, turn such a skip into a failure naming the import. Skips for
what the project does not control (GPUs, torch-private modules, network namespaces) stay skips,
and ``-ra`` prints their reasons.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest

OWN_PACKAGE = "debug_server"


def own_import_skip(excinfo: Any) -> str | None:
    """The skip's message when it is an ``importorskip`` of our own package, else None."""
    if excinfo is None or not excinfo.errisinstance(pytest.skip.Exception):
        return None
    msg = str(excinfo.value)
    return msg if f"could not import '{OWN_PACKAGE}" in msg else None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[
        None, pytest.TestReport, pytest.TestReport]:
    report = yield
    msg = own_import_skip(call.excinfo) if report.skipped else None
    if msg:
        report.outcome = "failed"
        report.longrepr = f"our own code failed to import (a failure, not a skip): {msg}"
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[
        None, pytest.CollectReport, pytest.CollectReport]:
    report = yield
    if report.skipped and isinstance(report.longrepr, tuple):
        msg = report.longrepr[2]
        if f"could not import '{OWN_PACKAGE}" in msg:
            report.outcome = "failed"
            report.longrepr = f"our own code failed to import (a failure, not a skip): {msg}"
    return report
