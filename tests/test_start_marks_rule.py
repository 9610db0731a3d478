"""Which collectives get a start mark (``groups.MARKS_ENV``), through the real op path.

A start mark is a CUDA event; this box has no GPU, so the job below runs a c10d-backed gloo
communicator (``DEBUG_SERVER_RECORDER=c10d``) whose mark slots are turned on by hand, records
each mark into a list instead of a CUDA stream, and drives the op path's clock. Everything else
(``Comm._issue``, the sequence numbers, c10d's calls) is the real thing.
"""

from __future__ import annotations

import pytest
from mpjob import rank0_result, run_job

pytestmark = pytest.mark.job

JOB = r'''
import json, os
import torch
from debug_server.recording import comms
from debug_server.recording.comms import new_comm
from debug_server.recording.groups import _mark_gap_ns

comm = new_comm("gloo", torch.device("cpu"), "main_comm")
assert comm.c10d_backed
gap = _mark_gap_ns()
# As __init__ does for a c10d-backed CUDA communicator (gloo has no stream to mark).
comm._marks = gap is not None
comm._mark_gap = gap or 0
comm._mark_seq = [-1] * comms._SLOTS
comm._starts = [None] * comms._SLOTS
comm._streams = {0: "stream"}
comm._dev_idx = 0
marked = []
comms._raw_stream = lambda dev: 0
comms._record_event = lambda ev, stream: marked.append(comm.next_seq - 1)
clock = [comms.time.time_ns()]
comms.time.time_ns = lambda: clock[0]  # the whole process's clock: advanced only by op() below
t = torch.ones(4)

def op(after_us):
    clock[0] += int(after_us * 1000)
    comm.all_reduce(t)

op(0)                 # seq 0: the first collective ever
for _ in range(20):   # seqs 1-20: a burst, 30 us apart
    op(30)
op(600)               # seq 21: after a 0.6 ms pause
op(499)               # seq 22: 0.499 ms later
for _ in range(5):    # seqs 23-27: 0.2 ms apart (1 ms after the last mark by the end)
    op(200)
op(500)               # seq 28: exactly the gap
print("RESULT " + json.dumps({"marked": marked, "slots": [s for s in comm._mark_seq if s >= 0],
                              "seq": comm.next_seq}))
'''


@pytest.mark.parametrize(("setting", "expected"), [
    (None, [0, 21, 28]),
    ("1", [0, 21, 28]),
    ("all", list(range(29))),
    ("0", []),
])
def test_start_marks_fall_on_the_first_collective_after_each_pause(tmp_path, setting: str | None,
                                                                  expected: list[int]) -> None:
    env = {"DEBUG_SERVER_RECORDER": "c10d"}
    if setting is not None:
        env["DEBUG_SERVER_START_MARKS"] = setting
    out = rank0_result(run_job(JOB, 1, tmp_path, timeout=60, extra_env=env))
    assert out["seq"] == 29
    assert out["marked"] == expected
    assert out["slots"] == expected  # each mark's slot names the collective it marks
