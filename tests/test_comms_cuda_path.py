"""The communicator's CUDA code path on a CPU box: stand-in events, real ops on a 1-rank gloo group.

A CUDA event cannot exist without a GPU, so these tests give a communicator stand-in events
whose ``query()`` the test controls (the one fake here) and run its CUDA branch: states from the
events, the completion watermark the watchdog keeps, and a stuck op found by the watchdog, after
which the next op raises. ``scripts/gpu/check_cuda_semantics.py`` checks the same on real GPUs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mpjob import rank0_result, run_job

pytestmark = pytest.mark.job

CUDA_PATH_JOB = r'''
import datetime, json, os, threading, time
import torch
from debug_server.recording import comms, work
from debug_server.recording.hooks import FlightRecorderHook

unfired = set()  # (kind, slot) of events that have not fired


class StandInEvent:
    def __init__(self, key):
        self.key = key

    def query(self):
        return self.key not in unfired


comms._raw_stream = lambda idx: 0
comms._record_event = work._record_event = lambda ev, stream: None
comm = comms.new_comm("gloo", torch.device("cpu"), "cuda_like", timeout=datetime.timedelta(seconds=1))
comm._is_cuda, comm._dev_idx, comm._streams = True, 0, {0: "stream"}
comm._starts = [StandInEvent(("start", i)) for i in range(comms._SLOTS)]
comm._ends = [StandInEvent(("end", i)) for i in range(comms._SLOTS)]
hook = FlightRecorderHook(max_entries=500).register_with_comm(comm)
aborts = []
comm.register_abort_hook(lambda rec, err: aborts.append([rec.seq, threading.current_thread().name]))
out = {}
t = torch.ones(4)
for _ in range(100):
    comm.all_reduce(t)
comm.all_reduce(t, async_op=True).wait()
out["watched_before_pass"] = len(comm._inflight)
time.sleep(0.4)
out["watched_after_pass"] = len(comm._inflight)
out["watermark"] = comm._done_op_id
out["states"] = sorted({e["state"] for e in hook.dump_json()["entries"]})

# seq 101: its stream reached it (start fired) but it never completes; seq 102 queues behind it.
stuck = comm._op_id
unfired.update({("end", stuck), ("end", stuck + 1), ("start", stuck + 1)})
comm.all_reduce(t)
comm.all_reduce(t)
out["stuck_states"] = [e["state"] for e in hook.dump_json()["entries"][-2:]]
t0 = time.monotonic()
while not aborts and time.monotonic() - t0 < 5:
    time.sleep(0.05)
out["aborts"] = aborts
out["abort_after_s"] = round(time.monotonic() - t0, 1)
try:
    comm.all_reduce(t)
    out["next_op"] = "returned"
except RuntimeError as e:
    out["next_op"] = str(e)
print("RESULT " + json.dumps(out), flush=True)
os._exit(0)
'''


@pytest.fixture(scope="module")
def cuda_path(tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("cuda_path")
    return rank0_result(run_job(CUDA_PATH_JOB, 1, work, timeout=60,
                                extra_env={"TORCHCOMM_FR_DUMP_TEMP_FILE": str(Path(work) / "rank_")}))


@pytest.mark.timeout(90)
def test_watchdog_pass_advances_the_watermark_and_stops_watching_completed_ops(cuda_path):
    assert cuda_path["watched_before_pass"] == 101
    assert cuda_path["watched_after_pass"] == 0
    assert cuda_path["watermark"] == 100
    assert cuda_path["states"] == ["completed"]


@pytest.mark.timeout(90)
def test_stuck_op_reads_started_and_the_one_behind_it_scheduled(cuda_path):
    assert cuda_path["stuck_states"] == ["started", "scheduled"]


@pytest.mark.timeout(90)
def test_watchdog_runs_abort_hooks_for_the_stuck_op_and_the_next_op_raises(cuda_path):
    assert cuda_path["aborts"] == [[101, "debug-server-watchdog"]]
    assert cuda_path["next_op"].startswith(
        "all_reduce #101 on communicator 'cuda_like' (gloo, rank 0 of 1) timed out after 1 s: in flight for 1.")
