"""A healthy job is never reported as hung because the ranks' snapshots are taken apart.

The frontend asks every rank for its Flight Recorder at about the same time, never at the same
instant: on a job that loops all_reduce as fast as it can, the rank asked first has issued one or
two ops fewer than the other when its ring is read. Before each dump carried the time it was
taken (``dump_time_ns``), that rank was reported "never issued all_reduce #N". Here a real 2-rank
gloo job loops all_reduce for a few seconds while the test reads ``/fr_trace?format=json`` and
``/metrics`` of its real frontend again and again: no read may find anything.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from httpget import request
from mpjob import REPO, free_port, rank_env
from rankprocs import RankProcs

pytestmark = pytest.mark.job

RANK = """
import datetime, os
import torch
from debug_server import start_debug_server
from debug_server.recording.comms import new_comm
from debug_server.recording.hooks import FlightRecorderHook

rank = int(os.environ["RANK"])
h = start_debug_server(port=0, fetch_timeout=5, dump_dir=os.environ["DUMP_DIR"],
                       dump_interval=float(os.environ["DUMP_INTERVAL"]))
comm = new_comm("gloo", torch.device("cpu"), "main_comm", timeout=datetime.timedelta(seconds=60))
FlightRecorderHook(max_entries=2000).register_with_comm(comm)
assert h.wait_registered(30)
t = torch.ones(16)
comm.all_reduce(t)
print("READY", h.frontend_url, flush=True)
while True:  # as fast as it can, until the test ends the process
    comm.all_reduce(t)
"""


class LoopJob(RankProcs):
    """Two real gloo ranks looping all_reduce; the periodic dumper every ``dump_interval`` s."""

    def __init__(self, tmp: Path, dump_interval: float) -> None:
        self.dump_dir = tmp / "dumps"
        port = free_port()

        def env(r: int) -> dict[str, str]:
            e = rank_env(r, 2, port, {"DUMP_DIR": str(self.dump_dir),
                                      "DUMP_INTERVAL": str(dump_interval)})
            e.pop("TORCHCOMM_FR_DUMP_TEMP_FILE", None)
            return e

        super().__init__(tmp, RANK, 2, env)

    def frontend(self) -> str:
        return self.wait_for(0, r"^READY (\S+)", timeout=90).group(1)


def _get(url: str) -> str:
    status, body = request(url, timeout=30)
    assert status == 200, (url, status, body[:500])
    return body


@pytest.mark.timeout(240)
def test_healthy_all_reduce_loop_never_shows_a_finding_live_or_in_metrics(tmp_path: Path) -> None:
    job = LoopJob(tmp_path, dump_interval=3600)
    try:
        base = job.frontend()
        reads = 0
        newest: list[int] = []
        # Read until the job has visibly run on between reads (at least 5 reads, 100 newer
        # collectives): every read on the way must be clean. A deadline, not a window: a loaded
        # box makes reads slow, not wrong.
        deadline = time.monotonic() + 120
        while reads < 5 or newest[-1] - newest[0] < 100:
            assert time.monotonic() < deadline, (reads, newest)
            result = json.loads(_get(f"{base}/fr_trace?format=json"))
            assert result["ranks_with_data"] == [0, 1], result["verdict"]
            assert result["findings"] == [], (reads, result["verdict"])
            assert "category" not in result, result["verdict"]
            newest.append(max(c["seq"] for c in result["collectives"]))
            metrics = _get(f"{base}/metrics")
            bad = [ln for ln in metrics.splitlines()
                   if ln.startswith(("debug_server_missing_ranks", "debug_server_findings{",
                                     "debug_server_stuck_seq"))]
            assert bad == [], (reads, bad)
            reads += 1
    finally:
        job.close()


@pytest.mark.timeout(150)
def test_dumps_of_a_healthy_all_reduce_loop_have_no_finding_in_the_report_or_the_cli(
        tmp_path: Path) -> None:
    # The ranks write their whole rings (2000 entries, wrapped many times over) one after the
    # other: the ring read later has moved on at both ends.
    job = LoopJob(tmp_path, dump_interval=1)
    try:
        base = job.frontend()
        deadline = time.monotonic() + 90
        while max(c["seq"] for c in json.loads(_get(f"{base}/fr_trace?format=json"))[
                "collectives"]) < 2500:  # until the 2000-entry rings wrapped
            assert time.monotonic() < deadline, [job.log(r) for r in (0, 1)]
            time.sleep(0.5)
        wrapped = len(list(job.dump_dir.glob("torchcomms_fr_trace_*.txt")))
        while len(reports := sorted(job.dump_dir.glob("torchcomms_fr_trace_*.txt"))) < wrapped + 3:
            assert time.monotonic() < deadline, [job.log(r) for r in (0, 1)]
            time.sleep(0.2)
    finally:
        job.close()
    for report in reports[-3:]:
        text = report.read_text()
        assert "No hang or mismatch found" in text, text[-3000:]
    per_rank = job.dump_dir / "per_rank"
    ours = subprocess.run([sys.executable, "-m", "debug_server.tools.fr_trace", str(per_rank),
                           "-p", "rank_", "--json"], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    result = json.loads(ours.stdout)
    assert (ours.returncode, result["findings"]) == (0, []), result["verdict"]
    assert result["ranks_with_data"] == [0, 1]
    # The rings really wrapped: #0 is gone from both (a 2000-entry ring read at #2500 or later
    # starts at #500 or later; how much later depends on when the last pickles were written).
    assert min(c["seq"] for c in result["collectives"]) >= 500
    # PyTorch's own analyzer still reads pickles that say when they were taken.
    theirs = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
                             str(per_rank), "-p", "rank_"], capture_output=True, text=True,
                            timeout=120)
    assert theirs.returncode == 0, theirs.stderr[-2000:]
    assert "Traceback" not in theirs.stderr
