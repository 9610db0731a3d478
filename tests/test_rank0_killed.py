"""Rank 0 killed (the OOM killer takes it first) while ranks 1-2 hang on a subgroup: the pages
outlive it, name the rank that is missing, show rank 0 as gone with its last data; and the
frontend exits by itself once the rest of the job is gone too.

The job is launched the way ``srun`` launches one: one process per rank, none the others'
parent (a dead task does not end the others), and rank 0 hosting the job's TCPStore
(``MASTER_ADDR:MASTER_PORT``), so the store dies with rank 0.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from httpget import timed_get
from mpjob import REPO, descendants, free_port
from rankprocs import RankProcs

from debug_server.readers.jobpids import fate

pytestmark = pytest.mark.job

ORPHAN_EXIT_S = 3.0

RANK = """
import os, time
from datetime import timedelta
import torch
from debug_server import start_debug_server
from debug_server.recording import comms, hooks

rank = int(os.environ["RANK"])
h = start_debug_server(port=0, fetch_timeout=2.0, dump_dir="dumps", dump_interval=2.0)
comm = comms.new_comm("gloo", torch.device("cpu"), "main_comm", timeout=timedelta(seconds=90))
hooks.FlightRecorderHook(max_entries=100).register_with_comm(comm)
t = torch.ones(16)
comm.all_reduce(t)
if rank in (1, 2):
    sub = comm.split([1, 2], "sub")
    sub.all_reduce(t)
print("READY", rank, os.getpid(), h.frontend_url, flush=True)
if rank == 1:
    sub.all_reduce(t)  # WAIT_LINE
elif rank == 2:
    time.sleep(90)  # SLEEP_LINE
else:
    time.sleep(90)
"""


def _gone(pid: int) -> bool:
    """Ended (a zombie counts: its parent has not reaped it yet)."""
    return fate(pid, None) is not None


def _json(url: str) -> Any:
    status, text, _ = timed_get(url, accept="application/json", timeout=30)
    assert status == 200, text
    return json.loads(text)


def _missing_rank_2(base: str) -> bool:
    fr = _json(f"{base}/fr_trace?format=json")
    return any(f["kind"] == "missing_ranks" and f["ranks"] == [2] and f["op"] == "all_reduce"
               for f in fr["findings"])


@pytest.mark.timeout(150)
def test_pages_outlive_rank_0_and_the_frontend_exits_once_the_job_is_gone(tmp_path: Path) -> None:
    port = free_port()

    def env(r: int) -> dict[str, str]:
        return {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "3",
                "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
                "DEBUG_SERVER_ORPHAN_EXIT_S": str(ORPHAN_EXIT_S)}

    job = RankProcs(tmp_path, RANK, 3, env)
    frontend = None
    try:
        ready = {r: job.wait_for(r, r"^READY (\d+) (\d+) (\S+)", timeout=90) for r in range(3)}
        base = ready[0].group(3)
        rank0 = int(ready[0].group(2))
        frontend = next(p for p in descendants(rank0) if p != rank0)
        # Before the kill: the verdict is right, and the pages hold every rank's data.
        deadline = time.monotonic() + 60
        while not _missing_rank_2(base):
            assert time.monotonic() < deadline, _json(f"{base}/fr_trace?format=json")
            time.sleep(0.5)
        # Every rank reachable (a loaded box may time one rank's stacks out on one page: the
        # claim is that all three answer, not that each page's fetch beats the load).
        while (overview := _json(f"{base}/?format=json"))["reachable"] != 3:
            assert time.monotonic() < deadline, overview["ranks"]
            time.sleep(0.5)

        os.kill(rank0, signal.SIGKILL)  # the OOM killer; the store it hosted goes with it
        killed_at, killed_wall = time.monotonic(), time.time()
        time.sleep(8.0)  # the claim: the pages still answer 8 s after rank 0 is gone
        assert job.procs[1].poll() is None and job.procs[2].poll() is None
        assert _missing_rank_2(base)
        fr = _json(f"{base}/fr_trace?format=json")
        assert 0 in fr["ranks_with_data"], fr  # rank 0's last FR data stays in the verdict
        overview = _json(f"{base}/?format=json")
        row0 = next(r for r in overview["ranks"] if r["rank"] == 0)
        # The test has not reaped rank 0: /proc still tells how it ended.
        assert row0["status"] == "gone" and "gone (killed by SIGKILL at " in row0["line"], row0
        assert "its FR data and stacks are from " in row0["line"], row0
        status, stacks, _ = timed_get(f"{base}/stacks")
        assert status == 200
        section1 = stacks.split("=== Rank 1 ===", 1)[1].split("=== Rank 2", 1)[0]
        assert f"line {job.line_of('WAIT_LINE')}" in section1, section1
        assert "gone (killed by SIGKILL" in stacks.split("=== Rank 0 ===", 1)[1].split(
            "=== Rank 1", 1)[0]
        # The dumper kept writing cycles (every 2 s), rank 0 in them as gone.
        after = sorted(p for p in (tmp_path / "dumps").glob("stacks_*.txt")
                       if p.stat().st_mtime > killed_wall + 1)
        assert after and "rank 0: gone (" in after[-1].read_text(), after
        print(f"pages answered {time.monotonic() - killed_at:.1f} s after rank 0 was killed")

        # The rest of the job ends: the frontend follows within its bound, by itself.
        for r in (1, 2):
            os.killpg(job.procs[r].pid, signal.SIGKILL)
            job.procs[r].wait(10)
        ended = time.monotonic()
        while not _gone(frontend):
            assert time.monotonic() - ended < ORPHAN_EXIT_S + 30, "the frontend did not exit"
            time.sleep(0.2)
        print(f"frontend exited {time.monotonic() - ended:.1f} s after the last ranks ended "
              f"(setting {ORPHAN_EXIT_S} s)")
    finally:
        job.close()
        if frontend is not None and not _gone(frontend):
            os.kill(frontend, signal.SIGKILL)
