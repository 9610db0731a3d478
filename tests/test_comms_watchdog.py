"""The communicator's watchdog and ring on real gloo jobs: timeouts found off the hot path.

An async all_reduce that nobody waits on and a peer never joins: the per-process watchdog thread
runs the abort hooks (the recorder's pickle is on disk first), and the next op and ``wait()``
raise the error naming the op, the communicator and the sequence number, under our recorder and
under c10d's (the c10d-backed mode, forced on gloo); with
``abort_process_on_timeout_or_error=True`` the process aborts after the dump. And ops issued from
two threads at once each get their own ring entry.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from jobscripts import ABORT_JOB as SYNC_ABORT_JOB
from mpjob import assert_ok, rank0_result, run_job

from debug_server.dumpio import load_dump

pytestmark = pytest.mark.job

TIMEOUT_JOB = r'''
import datetime, json, os, threading, time
import torch
from debug_server.recording.comms import new_comm
from debug_server.dumpio import load_dump
from debug_server.recording.hooks import FlightRecorderHook

pickle = os.environ["TORCHCOMM_FR_DUMP_TEMP_FILE"] + "0"
comm = new_comm("gloo", torch.device("cpu"), "main_comm", timeout=datetime.timedelta(seconds=2))
FlightRecorderHook(max_entries=100).register_with_comm(comm)
aborts = []
comm.register_abort_hook(lambda rec, err: aborts.append(
    (rec.op, rec.seq, threading.current_thread().name, os.path.exists(pickle))))
t = torch.ones(16)
comm.all_reduce(t)
comm.all_reduce(t)
store = torch.distributed.distributed_c10d._get_default_store()
if comm.get_rank() == 0:
    t0 = time.monotonic()
    work = comm.all_reduce(t, async_op=True)  # seq 2; rank 1 never joins; nobody waits
    while not aborts and time.monotonic() - t0 < 15:
        time.sleep(0.05)
    print("ABORTS", aborts, "AFTER_S", round(time.monotonic() - t0), flush=True)
    for name, call in (("NEXT_OP", lambda: comm.broadcast(t, root=0)), ("WAIT", work.wait)):
        try:
            call()
            print(name, "returned", flush=True)
        except RuntimeError as e:
            print(name, "raised", e, flush=True)
    print("STATE", json.dumps(load_dump(pickle)["entries"][-1]["state"]) if os.path.exists(pickle) else None, flush=True)
    store.set("rank0_done", "1")
else:
    try:  # its end of the pair open until rank 0 is done (rank 0 hosts the store)
        store.wait(["rank0_done"], datetime.timedelta(seconds=60))
    except Exception:  # the store went with rank 0: it is done
        pass
os._exit(0)  # the gloo pair is broken after the timeout: no orderly teardown
'''


# The timeout job under both recorders: ours (the default on gloo) and c10d's own Flight Recorder
# (the c10d-backed mode, forced), with the state each leaves the stuck op in: c10d's gloo recorder
# never moves an op past "scheduled".
RECORDERS = {
    "python": ({}, "started"),
    "c10d": ({"DEBUG_SERVER_RECORDER": "c10d", "TORCH_FR_BUFFER_SIZE": "2000"}, "scheduled"),
}


@pytest.fixture(scope="module", params=sorted(RECORDERS))
def timeout_job(request: pytest.FixtureRequest,
                tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """(pickle prefix, rank 0's output, the stuck op's expected state) for one recorder."""
    env, state = RECORDERS[request.param]
    work = tmp_path_factory.mktemp(f"wd_timeout_{request.param}")
    prefix = work / "per_rank" / "rank_"
    results = run_job(TIMEOUT_JOB, 2, work, timeout=90,
                      extra_env={"TORCHCOMM_FR_DUMP_TEMP_FILE": str(prefix), **env})
    assert_ok(results)
    return prefix, results[0].stdout, state


@pytest.mark.timeout(120)
def test_watchdog_thread_runs_the_abort_hooks_after_the_pickle_for_an_unwaited_op(timeout_job):
    _, out, _ = timeout_job
    # (op, seq, thread, pickle already on disk): the recorder's abort hook ran first, in the
    # watchdog thread, about the communicator's 2 s after the op was issued.
    assert "ABORTS [('all_reduce', 2, 'debug-server-watchdog', True)] AFTER_S 2" in out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("call", ["NEXT_OP", "WAIT"])
def test_next_op_and_wait_on_the_timed_out_op_raise_the_timeout_naming_op_communicator_and_seq(
        timeout_job, call: str):
    _, out, _ = timeout_job
    assert f"{call} raised all_reduce #2 on communicator 'main_comm' (gloo, rank 0 of 2) timed out after 2 s" in out


@pytest.mark.timeout(120)
def test_pickle_written_by_the_watchdog_ends_with_the_stuck_op_not_completed(timeout_job):
    prefix, out, state = timeout_job
    assert f'STATE "{state}"' in out
    entries = load_dump(f"{prefix}0")["entries"]
    assert [(e["collective_seq_id"], e["profiling_name"]) for e in entries] == [
        (0, "nccl:all_reduce"), (1, "nccl:all_reduce"), (2, "nccl:all_reduce")]


# jobscripts' ABORT_JOB (a sync op times out on the host), with the op made async and never waited
# on: only the watchdog can find the timeout.
ABORT_JOB = SYNC_ABORT_JOB.replace(
    "    comm.all_reduce(t)  # rank 1 never joins: times out, dumps, aborts\n",
    "    comm.all_reduce(t, async_op=True)  # rank 1 never joins; this thread never waits\n    time.sleep(10)\n",
)
assert ABORT_JOB != SYNC_ABORT_JOB


@pytest.mark.timeout(90)
def test_abort_process_from_the_watchdog_comes_after_the_pickle(tmp_path: Path) -> None:
    prefix = tmp_path / "per_rank" / "rank_"
    results = run_job(ABORT_JOB, 2, tmp_path, timeout=60, extra_env={"TORCHCOMM_FR_DUMP_TEMP_FILE": str(prefix)})
    r0 = results[0]
    assert r0.returncode == -signal.SIGABRT, (r0.returncode, r0.stderr[-3000:])
    assert "NOT_REACHED" not in r0.stdout
    assert "all_reduce #1 on communicator 'main_comm' (gloo, rank 0 of 2) timed out after 2 s" in r0.stderr
    last = load_dump(f"{prefix}0")["entries"][-1]
    assert (last["collective_seq_id"], last["state"]) == (1, "started")


# Two threads issue 1500 ops each on one communicator, with thread switches as frequent as the
# interpreter allows; every op must keep its own ring entry and sequence number. (The ring's old
# read-then-store of its counter has no switch point between the two statements on CPython 3.11,
# so it did not lose entries here either; this guards the property for any implementation.)
THREADS_JOB = r'''
import json, sys, threading
import torch
from debug_server.recording.comms import new_comm
from debug_server.recording.hooks import FlightRecorderHook

sys.setswitchinterval(1e-6)
comm = new_comm("gloo", torch.device("cpu"), "main_comm")
hook = FlightRecorderHook(max_entries=5000).register_with_comm(comm)

def issue(n):
    t = torch.ones(1)
    for _ in range(n):
        comm.all_reduce(t, async_op=True).wait()

threads = [threading.Thread(target=issue, args=(1500,)) for _ in range(2)]
for th in threads:
    th.start()
for th in threads:
    th.join()
recs = hook.records()
print("RESULT", json.dumps({"n": len(recs), "seqs": len({r.seq for r in recs}),
                            "next_seq": comm.next_seq}), flush=True)
torch.distributed.destroy_process_group()
'''


@pytest.mark.timeout(120)
def test_ops_from_two_threads_each_get_a_ring_entry(tmp_path: Path) -> None:
    results = run_job(THREADS_JOB, 1, tmp_path, timeout=100)
    assert rank0_result(results) == {"n": 3000, "seqs": 3000, "next_seq": 3000}
