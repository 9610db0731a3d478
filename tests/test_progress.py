"""Per-communicator progress and ranks behind: computed once by the analysis, read by renderers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from debug_server.analysis.core import analyze
from debug_server.dumpio import write_dump_atomic
from debug_server.tools import synthetic

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ring(states: list[str], **extra: object) -> list[dict[str, object]]:
    entries = [synthetic.make_entry(record_id=s, seq=s, state=st) for s, st in enumerate(states)]
    for e in entries:
        e.update(extra)
    return entries


def _row(result: dict, name: str = "main_comm") -> dict:
    (row,) = [c for c in result["communicators"] if c["name"] == name]
    return row


def test_rank_that_never_issued_the_last_all_reduce_is_behind_on_main_comm() -> None:
    result = analyze(synthetic.hang_job(3, n_entries=5, missing_rank=1))
    row = _row(result)
    assert (row["last_issued"], row["behind_ranks"], row["size"], row["desc"]) == (
        4, [1], 3, "gloo")
    assert result["behind"] == [{"rank": 1, "groups": ["main_comm"]}]


def test_retired_gloo_entries_count_as_completed() -> None:
    # PyTorch's gloo recorder leaves state at "scheduled"; retirement is the evidence.
    ring = _ring(["scheduled"] * 4, retired=True)
    groups = {"main_comm": [0, 1]}
    status = {"main_comm": {"last_enqueued_collective": 3, "last_completed_collective": -1}}
    dumps = {r: synthetic.make_dump(ring, groups, status=status) for r in (0, 1)}
    row = _row(analyze(dumps))
    assert (row["last_completed_min"], row["last_completed_max"]) == (3, 3)


def test_pg_status_counter_beyond_the_ring_marks_the_other_rank_behind() -> None:
    groups = {"main_comm": [0, 1]}
    ring = _ring(["completed"] * 10)
    ahead = {"main_comm": {"last_enqueued_collective": 40, "last_completed_collective": 40}}
    dumps = {0: synthetic.make_dump(ring, groups, status=ahead),
             1: synthetic.make_dump(ring, groups)}
    result = analyze(dumps)
    row = _row(result)
    assert (row["last_issued"], row["last_completed_max"], row["last_completed_min"]) == (40, 40, 9)
    assert result["behind"] == [{"rank": 1, "groups": ["main_comm"]}]


@pytest.mark.job
def test_cli_worker_pool_keeps_each_ranks_own_pg_status(tmp_path: Path) -> None:
    # Eight ranks with identical rings share one digest across the pool; rank 6's pg_status
    # (completed up to 8, its ring says 5) must survive that sharing.
    groups = {"main_comm": list(range(8))}
    ring = _ring(["completed"] * 6 + ["started"] * 4)
    ahead = {"main_comm": {"last_enqueued_collective": 9, "last_completed_collective": 8}}
    dumps = {r: synthetic.make_dump(ring, groups, status=ahead if r == 6 else None)
             for r in range(8)}
    for r, d in dumps.items():
        write_dump_atomic(str(tmp_path / f"rank_{r}"), d)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, "-m", "debug_server.tools.fr_trace", str(tmp_path), "-p", "rank_",
         "--json", "--jobs", "2"],
        capture_output=True, text=True, timeout=60, cwd=REPO, env=env)
    row = _row(json.loads(out.stdout))
    assert (row["last_completed_max"], row["last_completed_min"]) == (8, 5)
    assert row == _row(analyze(dumps))
