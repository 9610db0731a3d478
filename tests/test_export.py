"""The Chrome trace-event (Perfetto) export of FR entries."""

from __future__ import annotations

import json
from typing import Any

from debug_server.frontend.export import IN_FLIGHT_SUFFIX, chrome_trace
from debug_server.tools import synthetic


def _hang() -> dict[str, Any]:
    return chrome_trace(synthetic.hang_job(2, n_entries=5, missing_rank=1))


def test_every_event_has_the_trace_event_fields() -> None:
    trace = json.loads(json.dumps(_hang()))  # round-trips as JSON
    assert trace["displayTimeUnit"] == "ms"
    for ev in trace["traceEvents"]:
        assert {"ph", "pid", "tid", "ts", "name"} <= set(ev), ev
        if ev["ph"] == "X":
            assert isinstance(ev["dur"], int | float) and ev["dur"] >= 0, ev


def test_metadata_names_ranks_and_communicators() -> None:
    meta = [e for e in _hang()["traceEvents"] if e["ph"] == "M"]
    procs = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert procs == {0: "rank 0", 1: "rank 1"}
    assert threads == {(0, 1): "main_comm (gloo)", (1, 1): "main_comm (gloo)"}


def test_rank_0_stuck_all_reduce_is_in_flight_to_the_end() -> None:
    events = _hang()["traceEvents"]
    xs = [e for e in events if e["ph"] == "X"]
    stuck = [e for e in xs if e["args"]["in_flight"]]
    assert [(e["pid"], e["name"], e["args"]["state"]) for e in stuck] == [
        (0, "all_reduce #4" + IN_FLIGHT_SUFFIX, "started")]
    assert stuck[0]["args"]["collective_seq_id"] == 4
    assert stuck[0]["ts"] + stuck[0]["dur"] >= max(e["ts"] + e["dur"] for e in xs)
    # Rank 1 never issued #4: its track ends with #3, completed.
    assert [e["name"] for e in xs if e["pid"] == 1] == [f"all_reduce #{i}" for i in range(4)]
    assert any(e["ph"] == "i" and e["pid"] == 0 and "all_reduce #4" in e["name"] for e in events)


def test_in_flight_op_extends_to_the_given_dump_time() -> None:
    dumps = synthetic.hang_job(2, n_entries=5, missing_rank=1)
    start = dumps[0]["entries"][-1]["time_discovered_started_ns"]
    trace = chrome_trace(dumps, end_ns=start + 30_000_000_000)  # 30 s later
    (stuck,) = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["args"]["in_flight"]]
    assert stuck["dur"] == 30_000_000.0  # µs


def test_communicator_tid_is_stable_across_ranks() -> None:
    a = synthetic.make_entry(record_id=0, comm="b_comm", seq=0)
    b = synthetic.make_entry(record_id=1, comm="a_comm", seq=0)
    dumps = {0: synthetic.make_dump([a, b], {"a_comm": [0, 1], "b_comm": [0, 1]}),
             1: synthetic.make_dump([a], {"b_comm": [0, 1]})}
    xs = [e for e in chrome_trace(dumps)["traceEvents"] if e["ph"] == "X"]
    tids = {(e["pid"], e["args"]["communicator"]): e["tid"] for e in xs}
    assert tids == {(0, "b_comm"): 2, (0, "a_comm"): 1, (1, "b_comm"): 2}


def test_overlapping_async_ops_go_to_an_extra_track() -> None:
    e1 = synthetic.make_entry(record_id=0, seq=0, state="started", time_created_ns=1000)
    e2 = synthetic.make_entry(record_id=1, seq=1, state="completed", time_created_ns=2000)
    trace = chrome_trace({0: synthetic.make_dump([e1, e2], {"main_comm": [0]})}, end_ns=10_000)
    xs = {e["name"]: e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert xs == {"all_reduce #0" + IN_FLIGHT_SUFFIX: 1, "all_reduce #1": 1001}


def test_empty_input_is_an_empty_trace() -> None:
    assert chrome_trace({})["traceEvents"] == []


def test_cli_writes_the_chrome_trace(tmp_path: Any) -> None:
    from debug_server.dumpio import write_dump_atomic
    from debug_server.tools import fr_trace

    for rank, dump in synthetic.hang_job(2, n_entries=5, missing_rank=1).items():
        write_dump_atomic(str(tmp_path / f"rank_{rank}"), dump)
    out = tmp_path / "trace.json"
    assert fr_trace.main([str(tmp_path), "-p", "rank_", "--json", "--chrome-trace", str(out)]) == 2
    trace = json.loads(out.read_text())
    stuck = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["args"]["in_flight"]]
    assert [(e["pid"], e["args"]["collective_seq_id"]) for e in stuck] == [(0, 4)]
