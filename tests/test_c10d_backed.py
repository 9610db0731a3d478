"""The c10d-backed recording mode: c10d's own Flight Recorder records a communicator's ops.

On NCCL (when c10d's recorder is on) the communicator's op path builds no record: c10d's recorder
has each op with its stack, and the dumps map c10d's entries of the communicator's own process
group to the communicator (its name, seqs from 0). On gloo that mode can be forced with
``DEBUG_SERVER_RECORDER=c10d``, which is what the real 2-rank jobs here do; c10d's CPU recorder
never moves an op past ``scheduled``, so the states seen here are c10d's gloo ones.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from _scenarios import c10d_capture
from mpjob import assert_ok, rank0_result, run_job

from debug_server.config import Settings
from debug_server.recording import comms
from debug_server.recording.c10d_fr import Backed, GroupInfo, merge_c10d

MAIN = Backed("main_comm", "gloo", (0, 1), 7, 30000)


def merged_backed(rank: int, **kw: Any) -> dict[str, Any]:
    c = c10d_capture()[rank]
    groups = {k: GroupInfo(g["name"], g["desc"], tuple(g["ranks"]), g["backend"])
              for k, g in c["groups"].items()}
    # Our hook recorded nothing for a backed communicator: its entries come from c10d alone.
    ours = {**c["ours"], "entries": []}
    return merge_c10d(ours, [tuple(r) for r in c["recorders"]], owned=c["owned"], groups=groups,
                      backed={"1": MAIN}, **kw)


def test_c10d_entries_of_a_backed_communicator_take_its_name_and_count_from_zero():
    d = merged_backed(0)
    mine = [e for e in d["entries"] if e["process_group"][0] == "main_comm"]
    assert [(e["collective_seq_id"], e["profiling_name"], e["process_group"]) for e in mine] == [
        (0, "nccl:all_reduce", ("main_comm", "gloo")), (1, "nccl:all_reduce", ("main_comm", "gloo"))]
    assert {e["pg_id"] for e in mine} == {7}
    assert {e["timeout_ms"] for e in mine} == {30000}


def test_backed_communicator_status_counts_from_zero_and_keeps_its_config():
    d = merged_backed(0)
    # c10d wrote last enqueued/completed 2 and started -1 for group "1".
    assert d["pg_status"]["main_comm"] == {
        "last_enqueued_collective": 1, "last_started_collective": -1, "last_completed_collective": 1}
    assert d["pg_config"]["main_comm"] == {"name": "main_comm", "desc": "gloo", "ranks": "[0, 1]"}
    assert "1" not in d["pg_config"]


def test_other_c10d_groups_stay_beside_a_backed_communicator_unless_left_out():
    d = merged_backed(0)
    assert [e["collective_seq_id"] for e in d["entries"] if e["process_group"][0] == "0"] == [1, 2, 3, 4]
    alone = merged_backed(0, others=False)
    assert {e["process_group"][0] for e in alone["entries"]} == {"main_comm"}
    assert set(alone["pg_config"]) == {"main_comm"}


def test_backed_entries_are_numbered_along_the_timeline_once():
    d = merged_backed(1)
    assert [e["record_id"] for e in d["entries"]] == list(range(len(d["entries"])))
    times = [e["time_created_ns"] for e in d["entries"]]
    assert times == sorted(times)


def test_c10d_stack_starts_at_the_users_call_site():
    user = {"name": "train_step", "filename": "/job/train.py", "line": 42}
    caller = {"name": "<module>", "filename": "/job/train.py", "line": 90}
    frames = [
        {"name": "all_reduce", "filename": "/venv/torch/distributed/distributed_c10d.py", "line": 3245},
        {"name": "wrapper", "filename": "/venv/torch/distributed/c10d_logger.py", "line": 83},
        {"name": "_issue", "filename": comms.__file__, "line": 1},
        {"name": "all_reduce", "filename": comms.__file__, "line": 2},
        user, caller,
    ]
    entry = {**c10d_capture()[0]["recorders"][0][1]["entries"][0], "frames": frames}
    d = merge_c10d({"pg_config": {}, "pg_status": {}, "entries": []}, [("cpu", {"entries": [entry]})],
                   backed={"1": MAIN})
    assert d["entries"][0]["frames"] == [user, caller]


def test_p2p_entries_of_a_backed_communicator_count_p2p_from_zero_and_keep_the_collective_count():
    base = c10d_capture()[0]["recorders"][0][1]["entries"][0]
    send = {**base, "is_p2p": True, "p2p_seq_id": 1, "collective_seq_id": 2, "profiling_name": "nccl:send 0->1"}
    d = merge_c10d({"pg_config": {}, "pg_status": {}, "entries": []}, [("nccl", {"entries": [send]})],
                   backed={"1": MAIN})
    e = d["entries"][0]
    # c10d's p2p counter is 1-based; its collective counter on a P2P entry is the number of
    # collectives issued so far, which is already our "next collective" number.
    assert (e["p2p_seq_id"], e["collective_seq_id"], e["profiling_name"]) == (0, 2, "nccl:send 0->1")


def test_recorder_mode_follows_the_environment(monkeypatch: pytest.MonkeyPatch):
    for k in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", comms.RECORDER_ENV):
        monkeypatch.delenv(k, raising=False)
    assert comms._c10d_backed("gloo", Settings.from_env()) is False  # auto: ours on gloo
    monkeypatch.setenv(comms.RECORDER_ENV, "c10d")
    assert comms._c10d_backed("gloo", Settings.from_env()) is True
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")  # c10d's recorder off: ours, whatever is asked
    assert comms._c10d_backed("gloo", Settings.from_env()) is False
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")
    monkeypatch.setenv(comms.RECORDER_ENV, "python")
    assert comms._c10d_backed("gloo", Settings.from_env()) is False
    monkeypatch.setenv(comms.RECORDER_ENV, "bogus")
    with pytest.raises(ValueError, match="DEBUG_SERVER_RECORDER='bogus': expected auto, c10d or python"):
        comms._c10d_backed("gloo", Settings.from_env())


# A real 2-rank gloo job with the c10d-backed mode forced: the demo's phase 1 and its dump, then
# an async op that rank 1 joins late (in flight, then gone). test_comms_watchdog runs its timeout
# job in this mode too.
BACKED_JOB = r"""
import datetime, json, os, time
import torch
from debug_server.recording.comms import new_comm
from debug_server.recording.hooks import FlightRecorderHook

comm = new_comm("gloo", torch.device("cpu"), "main_comm", timeout=datetime.timedelta(seconds=20))
hook = FlightRecorderHook(max_entries=100).register_with_comm(comm)
print("BACKED", comm.c10d_backed, "PRE_HOOKS", len(comm._pre_hooks), flush=True)
t = torch.ones(16)
def phase1():
    for _ in range(3):
        comm.all_reduce(t)  # CALL SITE
    comm.broadcast(t, root=0)
    comm.all_reduce(t, async_op=True).wait()
phase1()
d = hook.dump_json()
print("ENTRIES", json.dumps([(e["collective_seq_id"], e["profiling_name"], e["process_group"],
                              (e["frames"] or [{}])[0].get("line")) for e in d["entries"]]), flush=True)
print("SUM", t[0].item(), flush=True)
store = torch.distributed.distributed_c10d._get_default_store()
if comm.get_rank() == 1:
    store.wait(["in_flight_read"])  # rank 0's op waits for this rank until it has looked
work = comm.all_reduce(t, async_op=True)  # seq 5
deadline = time.monotonic() + 30  # until a watchdog pass has seen #4 (waited above) complete
while any(x.seq < 5 for x in hook.in_flight()) and time.monotonic() < deadline:
    time.sleep(0.01)
print("IN_FLIGHT", [(x.op, x.seq) for x in hook.in_flight()], flush=True)
if comm.get_rank() == 0:
    store.set("in_flight_read", "1")
work.wait()
deadline = time.monotonic() + 30
while hook.in_flight() and time.monotonic() < deadline:  # until a watchdog pass saw it end
    time.sleep(0.01)
print("AFTER", [(x.op, x.seq) for x in hook.in_flight()], flush=True)
seen = []
handle = comm.register_pre_hook(lambda rec: seen.append((rec.op, rec.seq)))  # records again
comm.all_reduce(t)  # seq 6
handle.remove()
comm.all_reduce(t)  # seq 7, the lean path again
d = hook.dump_json()
print("USER_HOOK", json.dumps([seen, [e["collective_seq_id"] for e in d["entries"]][-3:]]), flush=True)
comm.finalize()
"""


@pytest.fixture(scope="module")
def backed_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    work = tmp_path_factory.mktemp("backed")
    results = run_job(BACKED_JOB, 2, work, timeout=90, extra_env={
        "DEBUG_SERVER_RECORDER": "c10d", "TORCH_FR_BUFFER_SIZE": "2000"})
    assert_ok(results)
    return results[0].stdout, results[1].stdout


def call_site_line() -> int:
    lines = BACKED_JOB.splitlines()
    return 1 + next(i for i, ln in enumerate(lines) if ln.endswith("# CALL SITE"))


@pytest.mark.job
def test_forced_c10d_mode_registers_no_per_op_hook(backed_job: tuple[str, str]) -> None:
    out0, out1 = backed_job
    assert "BACKED True PRE_HOOKS 0" in out0 and "BACKED True PRE_HOOKS 0" in out1


@pytest.mark.job
def test_hook_dump_holds_c10d_entries_under_the_communicator_with_seqs_from_zero(backed_job: tuple[str, str]) -> None:
    out0, _ = backed_job
    entries = json.loads(re.search(r"^ENTRIES (.*)$", out0, re.M).group(1))
    line = call_site_line()
    assert entries == [
        [0, "nccl:all_reduce", ["main_comm", "gloo"], line],
        [1, "nccl:all_reduce", ["main_comm", "gloo"], line],
        [2, "nccl:all_reduce", ["main_comm", "gloo"], line],
        [3, "nccl:broadcast", ["main_comm", "gloo"], line + 1],
        [4, "nccl:all_reduce", ["main_comm", "gloo"], line + 2],
    ]


@pytest.mark.job
def test_ops_really_ran_through_torch(backed_job: tuple[str, str]) -> None:
    out0, out1 = backed_job
    # 1 -> 2 -> 4 -> 8 (all_reduce x3), broadcast, -> 16 (async all_reduce)
    assert "SUM 16.0" in out0 and "SUM 16.0" in out1


@pytest.mark.job
def test_op_waiting_for_a_late_rank_is_in_flight_then_gone(backed_job: tuple[str, str]) -> None:
    out0, _ = backed_job
    assert "IN_FLIGHT [('all_reduce', 5)]" in out0
    assert "AFTER []" in out0


@pytest.mark.job
def test_users_own_pre_hook_gets_records_and_the_numbering_stays_one(backed_job: tuple[str, str]) -> None:
    out0, _ = backed_job
    # The hook's op goes through the recording path, the next one through the lean path again;
    # c10d has all three, once each, numbered as one sequence.
    assert 'USER_HOOK [[["all_reduce", 6]], [5, 6, 7]]' in out0


def test_after_an_abort_the_states_c10d_gave_before_it_stand():
    base = c10d_capture()[0]["recorders"][0][1]["entries"][1]  # c10d seq 2 on group "1": our seq 1
    done = {**base, "state": "completed", "retired": True, "time_discovered_completed_ns": 5}
    failed = Backed(*MAIN[:5], frozen={1: "started"})
    d = merge_c10d({"pg_config": {}, "pg_status": {}, "entries": []}, [("nccl", {"entries": [done]})],
                   backed={"1": failed})
    e = d["entries"][0]
    # Aborting the NCCL communicator ends the stuck kernel, so c10d reads it "completed" later.
    assert (e["collective_seq_id"], e["state"], e["retired"], e["time_discovered_completed_ns"]) == (
        1, "started", False, None)


def _marked(states: list[str], last_completed: int, fired: set[int]) -> list[tuple[int, str]]:
    """c10d entries (seq from 1) of group "1" in ``states``, merged for a communicator whose
    start marks fired for our seqs ``fired``; c10d's status says ``last_completed``."""
    base = c10d_capture()[0]["recorders"][0][1]["entries"][0]
    entries = [{**base, "collective_seq_id": i + 1, "state": s, "time_created_ns": 10 + i,
                "retired": s == "completed"} for i, s in enumerate(states)]
    status = {"1": {"last_enqueued_collective": len(states), "last_started_collective": -1,
                    "last_completed_collective": last_completed}}
    marks = Backed(*MAIN[:5], started=lambda seq: seq in fired)
    d = merge_c10d({"pg_config": {}, "pg_status": {}, "entries": []},
                   [("nccl", {"entries": entries, "pg_status": status})], backed={"1": marks})
    return [(e["collective_seq_id"], e["state"]) for e in d["entries"]]


def test_the_oldest_uncompleted_collective_whose_start_mark_fired_is_started():
    # Ours 0 and 1 completed (c10d's last completed 2); 2 reached its stream; 3 queued behind it.
    assert _marked(["completed", "completed", "scheduled", "scheduled"], 2, {0, 1, 2}) == [
        (0, "completed"), (1, "completed"), (2, "started"), (3, "scheduled")]


def test_a_collective_whose_mark_has_not_fired_stays_scheduled():
    # The stream is still busy before it (a matmul, or a collective of another communicator).
    assert _marked(["completed", "scheduled"], 1, {0}) == [(0, "completed"), (1, "scheduled")]


def test_a_fired_mark_behind_an_uncompleted_collective_is_not_started():
    # 3's stream reached it, but 2 has not completed: on one NCCL stream 3 cannot run yet.
    assert _marked(["completed", "completed", "scheduled", "scheduled"], 2, {0, 1, 2, 3})[3] == (
        3, "scheduled")
    assert _marked(["completed", "scheduled", "scheduled"], 1, {2})[1:] == [
        (1, "scheduled"), (2, "scheduled")]


def test_without_c10d_status_no_collective_is_claimed_started():
    base = c10d_capture()[0]["recorders"][0][1]["entries"][0]
    marks = Backed(*MAIN[:5], started=lambda seq: True)
    d = merge_c10d({"pg_config": {}, "pg_status": {}, "entries": []},
                   [("nccl", {"entries": [{**base, "collective_seq_id": 1, "state": "scheduled"}]})],
                   backed={"1": marks})
    assert [e["state"] for e in d["entries"]] == ["scheduled"]


# The NCCL branch of the c10d-backed watchdog on a CPU box: a 1-rank gloo communicator made to
# take the CUDA branch, with c10d's pg_status replaced by one the job controls (c10d writes it
# only for NCCL groups; the one stand-in here). Ops are real gloo all_reduces.
STATUS_JOB = r"""
import datetime, json, os, threading, time
import torch
from debug_server.recording import comms, watchdog
from debug_server.recording.hooks import FlightRecorderHook

comm = comms.new_comm("gloo", torch.device("cpu"), "main_comm", timeout=datetime.timedelta(seconds=2))
FlightRecorderHook(max_entries=100).register_with_comm(comm)
comm._is_cuda = True  # the NCCL branch: collectives wait for c10d's status, no work is kept
status = {comm.c10d_group_name: {"last_completed_collective": "-1"}}
watchdog._c10d_nccl_status = lambda now: status
aborts = []
comm.register_abort_hook(lambda rec, err: aborts.append((rec.op, rec.seq, threading.current_thread().name)))
passes = []
watchdog.add_watchdog_check(lambda: passes.append(time.monotonic()))  # runs after each pass


def a_pass_after(t):
    # Until a whole watchdog pass began after t (a check runs at the end of each pass).
    deadline = time.monotonic() + 30
    while sum(p > t for p in passes) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)


out = {}
t = torch.ones(4)
for _ in range(100):
    comm.all_reduce(t)
out["kept_works"] = len(comm._pend_w)
a_pass_after(time.monotonic())
out["watched_before"] = len(comm._pend)
status[comm.c10d_group_name] = {"last_completed_collective": "60"}  # c10d's 60 = our #59
a_pass_after(time.monotonic())
out["first_in_flight"] = [(x.op, x.seq) for x in comm.in_flight()[:1]]
out["watched_mid"] = len(comm._pend)
status[comm.c10d_group_name] = {"last_completed_collective": "100"}
a_pass_after(time.monotonic())
out["watched_after"] = len(comm._pend)
t0 = time.monotonic()
comm.all_reduce(t)  # #100; c10d's status never says it completed
while not aborts and time.monotonic() - t0 < 10:
    time.sleep(0.05)
out["aborts"] = aborts
out["abort_after_s"] = round(time.monotonic() - t0)
try:
    comm.all_reduce(t)
    out["next_op"] = "returned"
except RuntimeError as e:
    out["next_op"] = str(e).split(":")[0]
status.clear()  # unreadable from now on: nothing can time out, nothing is kept
other = comms.new_comm("gloo", torch.device("cpu"), "other_comm", timeout=datetime.timedelta(seconds=1))
other._is_cuda = True
other.all_reduce(t)
a_pass_after(time.monotonic() + 1.5)  # its 1 s timeout is over by then: had it timed out...
out["unreadable"] = [len(other._pend), other._broken]
print("RESULT " + json.dumps(out), flush=True)
os._exit(0)
"""


@pytest.fixture(scope="module")
def status_job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("backed_status")
    return rank0_result(run_job(STATUS_JOB, 1, work, timeout=60, extra_env={
        "TORCHCOMM_FR_DUMP_TEMP_FILE": str(Path(work) / "rank_"), "DEBUG_SERVER_RECORDER": "c10d",
        "TORCH_FR_BUFFER_SIZE": "2000"}))


@pytest.mark.job
@pytest.mark.timeout(90)
def test_nccl_collectives_keep_no_work_and_wait_for_c10ds_status(status_job):
    assert status_job["kept_works"] == 0
    assert status_job["watched_before"] == 100


@pytest.mark.job
@pytest.mark.timeout(90)
def test_c10d_status_counting_from_one_releases_our_ops_counting_from_zero(status_job):
    assert status_job["watched_mid"] == 40
    assert status_job["first_in_flight"] == [["all_reduce", 60]]
    assert status_job["watched_after"] == 0


@pytest.mark.job
@pytest.mark.timeout(90)
def test_op_c10d_never_completes_times_out_in_the_watchdog_and_the_next_op_raises(status_job):
    assert status_job["aborts"] == [["all_reduce", 100, "debug-server-watchdog"]]
    assert status_job["abort_after_s"] == 2
    assert status_job["next_op"] == (
        "all_reduce #100 on communicator 'main_comm' (gloo, rank 0 of 1) timed out after 2 s")


@pytest.mark.job
@pytest.mark.timeout(90)
def test_unreadable_status_times_nothing_out_and_keeps_nothing(status_job):
    assert status_job["unreadable"] == [0, None]
