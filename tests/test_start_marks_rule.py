"""Which collectives get a start mark (``groups.MARKS_ENV``): the first after each pause.

A start mark is a CUDA event; this box has no GPU. The rule is tested as a unit on the op path
itself (``Comm._issue`` of a c10d-backed CUDA communicator, its clock and its event record
replaced), once per setting; one job runs the real op path end to end (a c10d-backed gloo
communicator whose mark slots are turned on by hand, ``comm.all_reduce`` through c10d).
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
from mpjob import rank0_result, run_job

from debug_server.config import Settings
from debug_server.recording import comms
from debug_server.recording.groups import MARKS_ENV, _mark_gap_ns
from debug_server.recording.records import _SLOTS

PAUSES_US = [0] + [30] * 20 + [600, 499] + [200] * 5 + [500]
"""Microseconds before each collective: seq 0 the first ever, seqs 1-20 a burst 30 us apart,
seq 21 after a 0.6 ms pause, seq 22 0.499 ms later, seqs 23-27 0.2 ms apart (1 ms after the last
mark by the end), seq 28 exactly the gap (0.5 ms) after the one before."""

EXPECTED = [
    (None, [0, 21, 28]),
    ("1", [0, 21, 28]),
    ("all", list(range(29))),
    ("0", []),
]


def _cuda_backed_comm(gap: int | None) -> Any:
    """A c10d-backed CUDA communicator as far as ``_issue`` reads it (``__init__`` needs a
    process group and a GPU): its marks as ``__init__`` sets them for ``gap``."""
    comm = comms.Comm.__new__(comms.Comm)
    fields = dict(_broken=None, _finalized=False, _lock=threading.Lock(), _seq=0, _p2p_seq=0,
                  _is_cuda=True, _had_p2p=False, _pend=[], _host={}, _streams={0: "stream"},
                  _dev_idx=0, _marks=gap is not None, _mark_gap=gap or 0, _last_ns=0,
                  _starts=[None] * _SLOTS, _mark_seq=[-1] * _SLOTS)
    for name, value in fields.items():
        setattr(comm, name, value)
    return comm


@pytest.mark.parametrize(("setting", "expected"), EXPECTED)
def test_start_marks_fall_on_the_first_collective_after_each_pause(
        monkeypatch: pytest.MonkeyPatch, setting: str | None, expected: list[int]) -> None:
    if setting is None:
        monkeypatch.delenv(MARKS_ENV, raising=False)
    else:
        monkeypatch.setenv(MARKS_ENV, setting)
    comm = _cuda_backed_comm(_mark_gap_ns(Settings.from_env()))
    clock = [1_700_000_000_000_000_000]
    marked: list[int] = []
    monkeypatch.setattr(comms, "time", SimpleNamespace(time_ns=lambda: clock[0]))
    monkeypatch.setattr(comms, "_raw_stream", lambda dev: 0)
    monkeypatch.setattr(comms, "_record_event", lambda ev, stream: marked.append(comm._seq - 1))
    for after_us in PAUSES_US:
        clock[0] += after_us * 1000
        assert comm._issue("all_reduce", (lambda: None, (), {}), async_op=False) is None
    assert comm._seq == 29
    assert marked == expected
    assert [s for s in comm._mark_seq if s >= 0] == expected  # each slot names its collective


JOB = r'''
import json, os
import torch
from debug_server.recording import comms
from debug_server.recording.comms import new_comm
from debug_server.recording.groups import _mark_gap_ns

comm = new_comm("gloo", torch.device("cpu"), "main_comm")
assert comm.c10d_backed
gap = _mark_gap_ns(comm.settings)  # what new_comm read from the job's environment
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


@pytest.mark.job
def test_real_op_path_marks_the_first_collective_after_each_pause(tmp_path: Any) -> None:
    out = rank0_result(run_job(JOB, 1, tmp_path, timeout=60,
                               extra_env={"DEBUG_SERVER_RECORDER": "c10d"}))
    assert out["seq"] == 29
    assert out["marked"] == [0, 21, 28]
    assert out["slots"] == [0, 21, 28]
