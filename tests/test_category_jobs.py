"""The root-cause category on real 2-rank gloo jobs, one per category that CPU can produce.

* ``cpu_divergence``: rank 1 sleeps outside any collective while rank 0 waits in all_reduce #3.
* ``misconfigured_collective``: at #3 rank 0 all_reduces 2048 float32 and rank 1 1024 float64
  (the same bytes, so gloo completes it with garbage: nothing hangs, the data is wrong).
* ``gpu_or_network``: rank 1 issues all_reduce #3 and is then frozen (SIGSTOP) before it can
  move any data, the closest CPU stand-in for a peer whose GPU or NIC stalls after the launch;
  rank 0 issues #3 and waits. A frozen process cannot answer its worker, so the evidence is
  its pickle written just before the freeze, and rank 0's, read by the analyzer CLI.

Each job runs the public API (``start_debug_server``, ``new_comm``, ``FlightRecorderHook``) in
real processes; every process is ended by its process group.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from httpget import get_json
from mpjob import REPO, free_port, rank_env
from rankprocs import RankProcs

pytestmark = pytest.mark.job

RANK = """
import datetime, os, signal, time
import torch
from debug_server import start_debug_server
from debug_server.recording.comms import new_comm
from debug_server.recording.hooks import FlightRecorderHook

rank, case = int(os.environ["RANK"]), os.environ["CASE"]
h = start_debug_server(port=0, fetch_timeout=2, dump_dir=os.environ["DUMP_DIR"],
                       dump_interval=3600)
comm = new_comm("gloo", torch.device("cpu"), "main_comm", timeout=datetime.timedelta(seconds=60))
hook = FlightRecorderHook(max_entries=100).register_with_comm(comm)
assert h.wait_registered(30)
t = torch.ones(1024)
for _ in range(3):
    comm.all_reduce(t)
print("READY", h.frontend_url, flush=True)
if case == "cpu_divergence":
    if rank == 1:
        time.sleep(120)  # SLEEP_LINE
    comm.all_reduce(t)
elif case == "misconfigured_collective":
    x = torch.ones(2048) if rank == 0 else torch.ones(1024, dtype=torch.float64)
    comm.all_reduce(x)  # MISMATCH_LINE
    print("DONE", flush=True)
elif case == "gpu_or_network":
    if rank == 1:
        work = comm.all_reduce(t, async_op=True)
        print("PICKLE", hook.dump_file(rank), flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen after issuing #3
    else:
        while not os.path.exists("go"):
            time.sleep(0.02)
        comm.all_reduce(t)
time.sleep(120)
"""


class GlooJob(RankProcs):
    """Two real gloo ranks running RANK for ``case``, with a dump dir."""

    def __init__(self, tmp: Path, case: str) -> None:
        self.dump_dir = tmp / "dumps"
        port = free_port()

        def env(r: int) -> dict[str, str]:
            e = rank_env(r, 2, port, {"CASE": case, "DUMP_DIR": str(self.dump_dir)})
            e.pop("TORCHCOMM_FR_DUMP_TEMP_FILE", None)
            return e

        super().__init__(tmp, RANK, 2, env)

    def frontend(self) -> str:
        return self.wait_for(0, r"^READY (\S+)", timeout=90).group(1)


def _live_category(job: GlooJob, want: str, timeout: float = 30) -> dict[str, Any]:
    """The frontend's ``/fr_trace?format=json`` once it names ``want`` (the job needs a moment
    to get there); fails with the verdict if it never does."""
    base = job.frontend()
    deadline = time.monotonic() + timeout
    while True:
        result = get_json(f"{base}/fr_trace?format=json")
        if result.get("category") == want or time.monotonic() > deadline:
            assert result.get("category") == want, result.get("verdict")
            return result
        time.sleep(0.5)


@pytest.mark.timeout(150)
def test_rank_sleeping_outside_the_collective_is_cpu_divergence(tmp_path: Path) -> None:
    with GlooJob(tmp_path, "cpu_divergence") as job:
        result = _live_category(job, "cpu_divergence")
        missing = [f for f in result["findings"] if f["kind"] == "missing_ranks"]
        assert [(f["seq"], f["ranks"]) for f in missing] == [(3, [1])]
        assert f"rank_script.py:{job.line_of('SLEEP_LINE')}" in result["next_step"]


@pytest.mark.timeout(150)
def test_mismatched_sizes_and_dtypes_are_a_misconfigured_collective(tmp_path: Path) -> None:
    with GlooJob(tmp_path, "misconfigured_collective") as job:
        job.wait_for(0, r"^DONE")
        job.wait_for(1, r"^DONE")
        result = _live_category(job, "misconfigured_collective")
        kinds = {(f["kind"], f["seq"]) for f in result["findings"] if f["severity"] == "error"}
        assert ("size_mismatch", 3) in kinds or ("dtype_mismatch", 3) in kinds, kinds
        assert f"rank_script.py:{job.line_of('MISMATCH_LINE')}" in result["next_step"]


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.timeout(150)
def test_collective_whose_peer_froze_after_issuing_it_is_gpu_or_network(tmp_path: Path) -> None:
    with GlooJob(tmp_path, "gpu_or_network") as job:
        base = job.frontend()
        job.wait_for(1, r"^PICKLE ")
        deadline = time.monotonic() + 30
        while not _stopped(job.procs[1].pid):
            assert time.monotonic() < deadline, "rank 1 never stopped"
            time.sleep(0.02)
        (tmp_path / "go").touch()  # rank 0 issues #3 only now: rank 1 cannot move data
        # Rank 0's worker still answers (gloo's wait releases the GIL): have it write its
        # pickle once it waits in #3, as the periodic dumper or the hang watch would.
        url = get_json(f"{base}/?format=json")["ranks"][0]["url"]
        deadline = time.monotonic() + 30
        while True:
            path = get_json(f"{url}/handler/torchcomms_fr_dump_file", "POST")["path"]
            out = subprocess.run([sys.executable, "-m", "debug_server.tools.fr_trace",
                                  str(Path(path).parent), "-p", "rank_", "--json"],
                                 capture_output=True, text=True, timeout=60,
                                 env={**os.environ, "PYTHONPATH": str(REPO)})
            result = json.loads(out.stdout) if out.stdout.strip() else {}
            if result.get("category") == "gpu_or_network" or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert out.returncode == 2, out.stderr[-2000:]
        assert result.get("category") == "gpu_or_network", result.get("verdict")
        stuck = [f for f in result["findings"] if f["kind"] == "stuck_everywhere"]
        assert [(f["seq"], sorted(f["ranks"])) for f in stuck] == [(3, [0, 1])]
        assert "preflight" in result["next_step"] or "nccl" in result["next_step"].lower()
