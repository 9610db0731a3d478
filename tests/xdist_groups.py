"""Which tests share one pytest-xdist worker: groups decided at collection, honoured by the
scheduler.

pytest-xdist's own ``--dist loadgroup`` reads ``xdist_group`` marks by renaming each test's node
id, which no longer takes effect on pytest 9.2 (pytest-xdist issue 1386: the groups are silently
ignored). Here the workers write the groups that conftest computes (``nodeid -> group``) to a
folder the controller hands them, and the controller's scheduler, a ``LoadScopeScheduling``
whose scope is that group, reads them: a test in a group runs on the worker that runs the rest
of its group, in collection order; a test in no group is a unit of its own.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from xdist.scheduler.loadscope import LoadScopeScheduling

DIR_KEY = "debug_server_test_groups"
"""The ``workerinput`` key naming the folder where workers leave their groups."""


def hand_to_worker(node: Any, folder: Path) -> None:
    """Controller side (``pytest_configure_node``): tell a worker where to write its groups."""
    node.workerinput[DIR_KEY] = str(folder)


def publish(config: pytest.Config, groups: Mapping[str, str]) -> None:
    """Worker side (at collection): write ``nodeid -> group`` for the controller's scheduler.

    The worker sends its collection to the controller only after this returns, so the file is
    complete when the scheduler first reads it.
    """
    workerinput = getattr(config, "workerinput", None)
    if not workerinput or DIR_KEY not in workerinput:
        return  # not an xdist worker of a run that groups
    path = Path(workerinput[DIR_KEY]) / f"{workerinput['workerid']}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(dict(groups)))
    os.replace(tmp, path)


class GroupScheduling(LoadScopeScheduling):
    """Load scheduling whose unit is a group of tests (see the module docstring)."""

    def __init__(self, config: pytest.Config, log: Any, folder: Path) -> None:
        super().__init__(config, log)
        self._folder = folder
        self._groups: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._groups is None:
            # Every worker collects the same tests (xdist checks), so any one file will do.
            files = sorted(self._folder.glob("*.json"))
            if not files:
                # Ungrouped, the demo would start once per worker: say so instead.
                raise RuntimeError(f"no xdist worker wrote its test groups into {self._folder}")
            self._groups = json.loads(files[0].read_text())
        group = self._groups.get(nodeid)
        return f"group:{group}" if group else nodeid
