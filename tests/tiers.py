"""The two tiers: ``job`` tests start processes, every other test runs in this one.

A test is in the ``job`` tier when it carries the ``job`` mark (its own, or its module's
``pytestmark``) or uses a fixture in ``JOB_FIXTURES``. ``scripts/run_tests.sh --fast`` deselects
the tier (``-m "not job"``): what is left is the in-process suite (analysis, protocol, render,
config, recording, aiohttp apps on port 0).

The rule cannot rot silently: ``ProcessGuard`` (registered by conftest) watches every way a test
starts a process (``subprocess``, ``asyncio``'s subprocesses, ``os.fork``, ``os.posix_spawn``,
``multiprocessing``) and fails a test outside the ``job`` tier that starts one, naming the
command, in every run, the full one included.
"""

from __future__ import annotations

import multiprocessing.util
import os
import subprocess
from collections.abc import Callable, Generator
from typing import Any

import pytest

JOB = "job"
"""The mark of a test that starts processes (ranks, torchrun, a frontend, ``python -m``, a browser)."""

JOB_FIXTURES = frozenset({"reference_demo", "demo_live", "demo_done", "browser"})
"""conftest's fixtures that start processes: a test that uses one is in the job tier."""


def in_job_tier(item: pytest.Item) -> bool:
    """Whether ``item`` is marked ``job`` or uses a fixture that starts processes."""
    if item.get_closest_marker(JOB) is not None:
        return True
    return not JOB_FIXTURES.isdisjoint(getattr(item, "fixturenames", ()))


def mark_jobs(items: list[pytest.Item]) -> None:
    """Marks ``job`` on every test that uses a process-starting fixture, so ``-m`` sees it."""
    for item in items:
        if item.get_closest_marker(JOB) is None and in_job_tier(item):
            item.add_marker(JOB)


class ProcessGuard:
    """A pytest plugin: a test outside the job tier that starts a process fails, naming it."""

    def __init__(self) -> None:
        self._item: pytest.Item | None = None
        self._started: list[str] = []
        self._undo: list[Callable[[], None]] = []

    def _note(self, what: str) -> None:
        if self._item is not None and not in_job_tier(self._item):
            self._started.append(what)

    def _wrap(self, owner: Any, name: str, describe: Callable[..., str]) -> None:
        original = getattr(owner, name)

        def watched(*args: Any, **kwargs: Any) -> Any:
            try:
                what = describe(*args, **kwargs)
            except Exception:  # a call shaped otherwise: still noted, never stopped
                what = name
            self._note(what)
            return original(*args, **kwargs)

        setattr(owner, name, watched)
        self._undo.append(lambda: setattr(owner, name, original))

    def pytest_configure(self, config: pytest.Config) -> None:
        def argv(_popen: Any, args: Any, *rest: Any, **kw: Any) -> str:
            return " ".join(map(str, args)) if isinstance(args, (list, tuple)) else str(args)

        # Popen's one path to a child covers subprocess.run/check_output and asyncio's
        # subprocesses; multiprocessing's spawn and forkserver start theirs through
        # spawnv_passfds, its fork context through os.fork.
        self._wrap(subprocess.Popen, "_execute_child", argv)
        self._wrap(multiprocessing.util, "spawnv_passfds",
                   lambda path, args, passfds: " ".join(map(str, args)))
        self._wrap(os, "fork", lambda: "os.fork()")
        for name in ("posix_spawn", "posix_spawnp"):
            if hasattr(os, name):
                self._wrap(os, name, lambda path, args, *rest, **kw: " ".join(map(str, args)))

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        while self._undo:
            self._undo.pop()()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item,
                                nextitem: pytest.Item | None) -> Generator[None, Any, Any]:
        self._item, self._started = item, []
        try:
            return (yield)
        finally:
            self._item = None

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]
                                  ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        report = yield
        if self._started and call.when in ("call", "teardown") and not report.failed:
            first = self._started[0][:300]
            report.outcome = "failed"
            report.longrepr = (
                f"this test started {len(self._started)} process(es) but is not in the job "
                f"tier (first: {first}); mark it @pytest.mark.{JOB} (or its module: "
                f"pytestmark), so `scripts/run_tests.sh --fast` leaves it out (tests/tiers.py)")
            self._started = []
        return report
