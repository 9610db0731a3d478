"""The Flight Recorder hook on real multi-process gloo jobs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from mpjob import assert_ok, run_job

pytestmark = pytest.mark.job

# A 3-rank job issuing every op kind; each call line carries a "# L:<name>" marker so the test
# can assert that the recorded frames point at it.
ALL_OPS_SCRIPT = r'''
import json, os, sys, datetime
import torch
from debug_server.recording.comms import new_comm, ReduceOp
from debug_server.recording.hooks import FlightRecorderHook

comm = new_comm("gloo", torch.device("cpu"), "main_comm", timeout=datetime.timedelta(seconds=30))
hook = FlightRecorderHook(max_entries=200).register_with_comm(comm)
small = FlightRecorderHook(max_entries=4).register_with_comm(comm)
rank, size = comm.get_rank(), comm.get_size()
t = torch.ones(8)
comm.all_reduce(t)  # L:all_reduce
comm.broadcast(t, root=0)  # L:broadcast
comm.reduce(t, root=1, op=ReduceOp.SUM)  # L:reduce
outs = [torch.zeros(8) for _ in range(size)]
comm.all_gather(outs, t)  # L:all_gather
big = torch.zeros(8 * size)
comm.all_gather_single(big, t)  # L:all_gather_single
a2a_out = torch.zeros(2 * size, dtype=torch.int64)
comm.all_to_all_single(a2a_out, torch.arange(2 * size))  # L:all_to_all_single
rs_out = torch.zeros(2)
comm.reduce_scatter(rs_out, [torch.ones(2) for _ in range(size)])  # L:reduce_scatter
comm.barrier()  # L:barrier
if rank == 0:
    comm.send(torch.ones(3), dst=1)  # L:send
elif rank == 1:
    comm.recv(torch.zeros(3), src=0)  # L:recv
work = comm.all_reduce(torch.ones(4, dtype=torch.float64), async_op=True)  # L:async
before = [e for e in hook.dump_json()["entries"] if e["profiling_name"] == "nccl:all_reduce"][-1]["state"]
work.wait()
after_done = work.is_completed()
sub = None
if rank in (0, 1):
    sub = comm.split([0, 1], "sub_comm")
    sub.all_reduce(torch.ones(2))  # L:sub
comm.all_reduce(t)  # L:last
out = {
    "rank": rank,
    "dump": hook.dump_json(),
    "small": small.dump_json(),
    "async_state_before_wait": before,
    "async_completed": after_done,
}
with open(f"out_{rank}.json", "w") as f:
    json.dump(out, f)
# An orderly teardown: exiting with live gloo groups can abort in C++ at interpreter exit.
torch.distributed.barrier()
torch.distributed.destroy_process_group()
'''


@pytest.fixture(scope="module")
def all_ops(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, dict[str, Any]], dict[str, int]]:
    work = tmp_path_factory.mktemp("all_ops")
    # Its own pickle path: the default (~/.cache/torch/...) is shared by every job on the box.
    results = run_job(ALL_OPS_SCRIPT, 3, work, timeout=90,
                      extra_env={"TORCHCOMM_FR_DUMP_TEMP_FILE": str(work / "rank_")})
    assert_ok(results)
    outs = {r: json.loads((work / f"out_{r}.json").read_text()) for r in range(3)}
    lines = {}
    for i, line in enumerate(ALL_OPS_SCRIPT.splitlines(), start=1):
        m = re.search(r"# L:(\w+)", line)
        if m:
            lines[m.group(1)] = i
    return outs, lines


def _entries(out: dict[str, Any], group: str = "main_comm") -> list[dict[str, Any]]:
    return [e for e in out["dump"]["entries"] if e["process_group"][0] == group]


def test_every_op_kind_recorded_with_sequence_ids(all_ops):
    outs, _ = all_ops
    names = [e["profiling_name"] for e in _entries(outs[2]) if not e["is_p2p"]]
    assert names == [
        "nccl:all_reduce",
        "nccl:broadcast",
        "nccl:reduce",
        "nccl:all_gather",
        "nccl:all_gather_single",
        "nccl:all_to_all_single",
        "nccl:reduce_scatter",
        "nccl:barrier",
        "nccl:all_reduce",
        "nccl:all_reduce",
    ]
    assert [e["collective_seq_id"] for e in _entries(outs[2])] == list(range(10))


def test_p2p_ops_have_their_own_sequence_and_peer_names(all_ops):
    outs, _ = all_ops
    send = [e for e in _entries(outs[0]) if e["is_p2p"]]
    recv = [e for e in _entries(outs[1]) if e["is_p2p"]]
    assert [e["profiling_name"] for e in send] == ["nccl:send 0->1"]
    assert [e["profiling_name"] for e in recv] == ["nccl:recv 1<-0"]
    assert send[0]["p2p_seq_id"] == recv[0]["p2p_seq_id"] == 0
    # The collective after the send keeps counting collectives, unaffected by the P2P op.
    after = [e for e in _entries(outs[0]) if not e["is_p2p"]]
    assert [e["collective_seq_id"] for e in after] == list(range(10))


def test_sizes_and_dtypes_are_recorded(all_ops):
    outs, _ = all_ops
    by_name = {e["profiling_name"]: e for e in _entries(outs[0])}
    assert by_name["nccl:broadcast"]["input_sizes"] == [[8]]
    assert by_name["nccl:broadcast"]["input_dtypes"] == ["Float"]
    # all_gather outputs as one flattened tensor (c10d's convention): input numel x group size.
    assert by_name["nccl:all_gather"]["output_sizes"] == [[24]]
    assert by_name["nccl:all_gather_single"]["output_sizes"] == [[24]]
    assert by_name["nccl:all_to_all_single"]["input_dtypes"] == ["Long"]
    assert by_name["nccl:barrier"]["input_sizes"] == []
    # reduce_scatter inputs as one flattened tensor: output numel x group size.
    assert by_name["nccl:reduce_scatter"]["input_sizes"] == [[6]]
    assert by_name["nccl:reduce_scatter"]["output_sizes"] == [[2]]
    async_entry = [e for e in _entries(outs[0]) if e["input_dtypes"] == ["Double"]]
    assert async_entry[0]["input_sizes"] == [[4]]


def test_states_are_completed_after_sync_ops(all_ops):
    outs, _ = all_ops
    for r in range(3):
        assert {e["state"] for e in outs[r]["dump"]["entries"]} == {"completed"}
        for e in outs[r]["dump"]["entries"]:
            assert e["retired"] is True
            assert e["time_discovered_completed_ns"] >= e["time_discovered_started_ns"] >= e["time_created_ns"]


def test_async_op_changes_state_when_it_completes(all_ops):
    outs, _ = all_ops
    for r in range(3):
        assert outs[r]["async_state_before_wait"] in ("started", "completed")
        assert outs[r]["async_completed"] is True
        async_entry = [e for e in _entries(outs[r]) if e["input_dtypes"] == ["Double"]][0]
        assert async_entry["state"] == "completed"


def test_frames_point_at_the_callers_line(all_ops):
    outs, lines = all_ops
    for e in _entries(outs[1]):
        top = e["frames"][0]
        assert top["filename"].endswith("rank_script.py")
        assert top["name"] == "<module>"
    by_name = {e["profiling_name"]: e for e in _entries(outs[1])}
    assert by_name["nccl:broadcast"]["frames"][0]["line"] == lines["broadcast"]
    assert by_name["nccl:recv 1<-0"]["frames"][0]["line"] == lines["recv"]
    assert by_name["nccl:barrier"]["frames"][0]["line"] == lines["barrier"]


def test_split_communicator_has_own_sequence_and_pg_config(all_ops):
    outs, lines = all_ops
    for r in (0, 1):
        cfg = outs[r]["dump"]["pg_config"]
        assert cfg["sub_comm"] == {"name": "sub_comm", "desc": "gloo", "ranks": "[0, 1]"}
        assert cfg["main_comm"]["ranks"] == "[0, 1, 2]"
        sub = _entries(outs[r], "sub_comm")
        assert [(e["collective_seq_id"], e["profiling_name"]) for e in sub] == [(0, "nccl:all_reduce")]
        assert sub[0]["frames"][0]["line"] == lines["sub"]
    assert "sub_comm" not in outs[2]["dump"]["pg_config"]


def test_wrapped_ring_keeps_newest_entries(all_ops):
    outs, _ = all_ops
    full = outs[0]["dump"]["entries"]
    small = outs[0]["small"]["entries"]
    assert len(small) == 4
    assert [e["record_id"] for e in small] == [e["record_id"] for e in full[-4:]]


def test_pg_status_tracks_last_sequence_numbers(all_ops):
    outs, _ = all_ops
    status = outs[2]["dump"]["pg_status"]["main_comm"]
    assert status == {"last_enqueued_collective": 9, "last_started_collective": 9, "last_completed_collective": 9}


# Rank 1 skips the fifth collective; rank 0 times out in it, its abort hook dumps.
HANG_SCRIPT = r'''
import datetime, os, sys, time
import torch
from debug_server.recording.comms import new_comm
from debug_server.recording.hooks import FlightRecorderHook

comm = new_comm("gloo", torch.device("cpu"), "main_comm", timeout=datetime.timedelta(seconds=2))
hook = FlightRecorderHook(max_entries=100).register_with_comm(comm)
aborts = []
comm.register_abort_hook(lambda rec, err: aborts.append((rec.op, rec.seq, os.path.exists(os.environ["TORCHCOMM_FR_DUMP_TEMP_FILE"] + "0"))))
t = torch.ones(1024)
for _ in range(3):
    comm.all_reduce(t)
comm.broadcast(t, root=0)
store = torch.distributed.distributed_c10d._get_default_store()
if comm.get_rank() == 0:
    try:
        comm.all_reduce(t)
    except RuntimeError as e:
        print("CAUGHT", e)
        print("ABORTS", aborts)
    store.set("rank0_timed_out", "1")
else:
    # Alive (its end of the pair open) until rank 0 has timed out: an exit would fail rank
    # 0's op with a closed connection instead.
    try:
        store.wait(["rank0_timed_out"], datetime.timedelta(seconds=60))
    except Exception:  # the store went with rank 0 (it hosts it): it is done
        pass
    hook.dump_file(comm.get_rank())
'''


@pytest.fixture(scope="module")
def hang_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    work = tmp_path_factory.mktemp("hang")
    dump_dir = work / "per_rank"
    results = run_job(
        HANG_SCRIPT, 2, work, timeout=90, extra_env={"TORCHCOMM_FR_DUMP_TEMP_FILE": str(dump_dir / "rank_")}
    )
    assert_ok(results)
    return dump_dir, results


def test_timeout_runs_abort_hooks_then_raises_a_clear_error(hang_job):
    _, results = hang_job
    out = results[0].stdout
    assert "CAUGHT all_reduce #4 on communicator 'main_comm' (gloo, rank 0 of 2) timed out after 2 s" in out
    # The recorder's abort hook ran before ours (registered first), so the dump already existed.
    assert "ABORTS [('all_reduce', 4, True)]" in out


def test_dump_files_written_atomically_with_rank_suffix(hang_job):
    dump_dir, _ = hang_job
    assert sorted(p.name for p in dump_dir.iterdir()) == ["rank_0", "rank_1"]


def test_pytorch_fr_trace_reports_rank_1_missing(hang_job):
    dump_dir, _ = hang_job
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(dump_dir), "-p", "rank_"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    text = proc.stdout + proc.stderr
    assert "Not all ranks joining collective, sequence number: 4" in text
    assert "missing ranks: {1}" in text
    assert "group info: main_comm:gloo" in text


def test_pytorch_fr_trace_j_lists_5_and_4_entries(hang_job):
    dump_dir, _ = hang_job
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(dump_dir), "-p", "rank_", "-j"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    text = proc.stdout + proc.stderr
    rows = [ln for ln in text.splitlines() if "all_reduce(" in ln or "broadcast(" in ln]
    assert len(rows) == 5
    # Each row is "rank0-op  rank1-op"; the fifth has only rank 0's entry.
    assert [ln.count("(") for ln in rows] == [2, 2, 2, 2, 1]
    assert "state=started" in rows[4]


# Rank 1 is late; rank 0's all_reduce is in flight longer than stall_timeout, so the watchdog
# dumps the pickle and the stacks at once, long before the communicator's timeout.
STALL_SCRIPT = r'''
import datetime, os, time
import torch
from debug_server.recording.comms import new_comm
from debug_server.recording.hooks import FlightRecorderHook, health

comm = new_comm("gloo", torch.device("cpu"), "main_comm", timeout=datetime.timedelta(seconds=30))
hook = FlightRecorderHook(max_entries=10, stall_timeout=0.5).register_with_comm(comm)
t = torch.ones(4)
comm.all_reduce(t)
print("HEALTHY_BEFORE", health()["healthy"])
store = torch.distributed.distributed_c10d._get_default_store()
if comm.get_rank() == 1:
    store.wait(["stall_seen"], datetime.timedelta(seconds=60))  # joins once rank 0 has looked
    comm.all_reduce(t)
else:
    t0 = time.monotonic()
    work = comm.all_reduce(t, async_op=True)
    pickle_path = os.environ["TORCHCOMM_FR_DUMP_TEMP_FILE"] + "0"
    # The stacks are written after the pickle: wait for them too, so they show this loop (on a
    # loaded box the main thread once reached work.wait() before they were taken).
    stacks_path = os.path.join(os.path.dirname(pickle_path), "stalled_stacks_r0.txt")
    while not os.path.exists(stacks_path) and time.monotonic() - t0 < 30:
        time.sleep(0.05)
    h = health()
    # Seen while the op still waits for rank 1, which joins only once this line is printed.
    print("STALL_SEEN", os.path.exists(pickle_path), not work.is_completed(), h["healthy"], h["stalled_op"]["seq"], h["stalled_op"]["op"])
    store.set("stall_seen", "1")
    work.wait()
    print("HEALTHY_AFTER", health()["healthy"])
torch.distributed.barrier()
torch.distributed.destroy_process_group()
'''


def test_stall_watchdog_dumps_before_the_timeout_and_reports_unhealthy(tmp_path):
    dump_dir = tmp_path / "per_rank"
    results = run_job(
        STALL_SCRIPT, 2, tmp_path, timeout=60, extra_env={"TORCHCOMM_FR_DUMP_TEMP_FILE": str(dump_dir / "rank_")}
    )
    assert_ok(results)
    out = results[0].stdout
    assert "HEALTHY_BEFORE True" in out
    assert "STALL_SEEN True True False 1 all_reduce" in out
    assert "HEALTHY_AFTER True" in out
    stacks = (dump_dir / "stalled_stacks_r0.txt").read_text()
    # Each frame with its source line under it, as /stacks shows them (the main thread waits in
    # the loop above for the pickle).
    assert re.search(r'File ".*rank_script\.py", line \d+ in <module>\n    (time\.sleep\(0\.05\)|while not os)',
                     stacks), stacks
