"""c10d's own Flight Recorder merged into ours, on dumps captured from a real gloo job.

tests/data/c10d_merge_gloo.json (scripts/capture_c10d_fixture.py) holds, per rank, what the
worker merges: our hooks' snapshot (``main_comm``: all_reduce #0, #1), c10d's recorders as read
in-process (the same two all_reduce on ``main_comm``'s own c10d group ``1``, then 2 all_reduce
and a broadcast on ``default_pg``, an all_reduce on ``dp_shard``, and on rank 0 alone an
all_reduce #4 on ``default_pg``), the process groups and the owned c10d names.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _scenarios import C10D_CAPTURE, c10d_capture

from debug_server.analysis.core import analyze
from debug_server.config import Settings
from debug_server.dumpio import write_dump_atomic
from debug_server.recording.c10d_fr import (
    BUFFER_ENV,
    GroupInfo,
    merge_c10d,
    turn_on_env,
    turn_on_timing,
)
from debug_server.recording.stall import StallWatch


def torch_version() -> tuple[int, int]:
    import torch

    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)

def merged(rank: int, **kw: Any) -> dict[str, Any]:
    c = c10d_capture()[rank]
    groups = {k: GroupInfo(g["name"], g["desc"], tuple(g["ranks"]), g["backend"])
              for k, g in c["groups"].items()}
    return merge_c10d(c["ours"], [tuple(r) for r in c["recorders"]], owned=c["owned"],
                      groups=groups, **kw)


def ops(dump: dict[str, Any], group: str) -> list[tuple[int, str]]:
    return [(e["collective_seq_id"], e["profiling_name"]) for e in dump["entries"]
            if e["process_group"][0] == group]


def test_communicator_op_recorded_by_both_appears_once_under_its_name():
    d = merged(0)
    assert ops(d, "main_comm") == [(0, "nccl:all_reduce"), (1, "nccl:all_reduce")]
    assert ops(d, "1") == []  # c10d's copies on main_comm's own group are dropped
    assert "1" not in d["pg_config"] and "1" not in d["pg_status"]


def test_default_pg_and_subgroup_keep_c10d_names_and_seqs():
    d = merged(0)
    assert ops(d, "0") == [(1, "nccl:all_reduce"), (2, "nccl:all_reduce"), (3, "nccl:broadcast"),
                           (4, "nccl:all_reduce")]
    assert ops(d, "2") == [(1, "nccl:all_reduce")]
    assert {e["process_group"][1] for e in d["entries"] if e["process_group"][0] == "2"} == {
        "dp_shard"}


def test_pg_config_is_rebuilt_from_the_process_groups():
    d = merged(1)
    # torch's gloo recorder wrote {"": {"name": "", "ranks": "[]"}}.
    assert d["pg_config"]["0"] == {"name": "0", "desc": "default_pg", "ranks": "[0, 1]",
                                   "backend": "gloo"}
    assert d["pg_config"]["2"]["desc"] == "dp_shard"
    assert "" not in d["pg_config"]
    assert d["pg_config"]["main_comm"]["ranks"] == "[0, 1]"


def test_pg_status_values_become_ints():
    assert merged(0)["pg_status"]["0"] == {
        "last_enqueued_collective": 4, "last_started_collective": -1,
        "last_completed_collective": 3}


def test_gloo_state_is_left_as_written_and_retired_marks_the_finished_ops():
    d = merged(0)
    default = [e for e in d["entries"] if e["process_group"][0] == "0"]
    assert {e["state"] for e in default} == {"scheduled"}
    assert [e["retired"] for e in default] == [True, True, True, False]
    assert all(e["time_discovered_completed_ns"] is None for e in default)  # JSON wrote 0


def test_only_active_keeps_the_unretired_c10d_op_and_our_filtered_entries():
    c = c10d_capture()[0]
    ours_active = {**c["ours"], "entries": []}  # hooks.snapshot(only_active=True): all done
    groups = {k: GroupInfo(g["name"], g["desc"], tuple(g["ranks"]), g["backend"])
              for k, g in c["groups"].items()}
    d = merge_c10d(ours_active, [tuple(r) for r in c["recorders"]], owned=c["owned"],
                   groups=groups, only_active=True)
    assert [(e["process_group"][0], e["collective_seq_id"]) for e in d["entries"]] == [("0", 4)]
    assert d["pg_status"]["0"]["last_completed_collective"] == 3


def test_record_ids_follow_the_merged_timeline():
    d = merged(0)
    times = [e["time_created_ns"] for e in d["entries"]]
    assert times == sorted(times)
    assert [e["record_id"] for e in d["entries"]] == list(range(len(d["entries"])))


def test_without_collectives_only_config_and_status_are_merged():
    d = merged(0, include_collectives=False)
    assert d["entries"] == c10d_capture()[0]["ours"]["entries"]
    assert set(d["pg_status"]) == {"main_comm", "0", "2"}


def test_job_without_hooks_serves_c10d_entries_alone():
    c = c10d_capture()[1]
    empty = {"version": "2.10", "comm_lib_version": "x", "pg_config": {}, "pg_status": {},
             "entries": []}
    d = merge_c10d(empty, [tuple(r) for r in c["recorders"]], owned=[], groups={})
    # No hook: nothing owns c10d's group 1, so main_comm's ops show under c10d's name.
    assert ops(d, "1") == [(1, "nccl:all_reduce"), (2, "nccl:all_reduce")]
    assert d["pg_config"]["1"]["desc"] == "main_comm"
    # No process group info either: ranks fall back to c10d's own (empty) config.
    assert d["pg_config"]["0"]["ranks"] == "[]"


def test_c10d_group_named_like_a_communicator_is_renamed_not_merged():
    c = c10d_capture()[0]
    ours = json.loads(json.dumps(c["ours"]).replace("main_comm", "0"))
    d = merge_c10d(ours, [tuple(r) for r in c["recorders"]], owned=c["owned"], groups={})
    assert ops(d, "0") == [(0, "nccl:all_reduce"), (1, "nccl:all_reduce")]
    assert [s for s, _ in ops(d, "c10d_0")] == [1, 2, 3, 4]
    assert d["pg_config"]["c10d_0"]["name"] == "c10d_0"


def test_group_with_gloo_and_nccl_backends_keeps_their_collectives_apart():
    # "cpu:gloo,cuda:nccl" (init_process_group() on a CUDA host): each backend counts its own
    # seqs. The NCCL recorder cannot run here; its dump is the CPU one's entries renamed.
    c = c10d_capture()[0]
    [(_, cpu)] = c["recorders"]
    nccl = {"pg_config": {}, "pg_status": {"0": {"last_enqueued_collective": 1,
                                                 "last_completed_collective": 1}},
            "entries": [{**e, "time_created_ns": e["time_created_ns"] + 1}
                        for e in cpu["entries"][2:3]]}
    groups = {"0": GroupInfo("0", "default_pg", (0, 1), "cpu:gloo,cuda:nccl")}
    d = merge_c10d(c["ours"], [("cpu", cpu), ("nccl", nccl)], owned=c["owned"], groups=groups)
    assert [s for s, _ in ops(d, "0:gloo")] == [1, 2, 3, 4]
    assert [s for s, _ in ops(d, "0")] == [1]
    assert d["pg_config"]["0:gloo"]["backend"] == "gloo"
    assert d["pg_config"]["0"]["backend"] == "nccl"
    assert d["pg_status"]["0:gloo"]["last_enqueued_collective"] == 4


def test_verdict_names_the_gloo_side_of_a_mixed_group_with_its_description():
    groups = {"0": GroupInfo("0", "default_pg", (0, 1), "cpu:gloo,cuda:nccl")}
    dumps = {r: merge_c10d(c["ours"], [tuple(x) for x in c["recorders"]], owned=c["owned"],
                           groups=groups) for r, c in c10d_capture().items()}
    assert "Rank 1 never joined all_reduce #4 on pg 0:gloo (default_pg)" in analyze(dumps)["verdict"]


def test_entries_c10d_never_writes_are_skipped_and_the_rest_merged():
    c = c10d_capture()[0]
    [(_, cpu)] = c["recorders"]
    odd = {**cpu, "entries": ["junk", {"state": "scheduled"}, {"process_group": 7}, *cpu["entries"]]}
    d = merge_c10d(c["ours"], [("cpu", odd)], owned=c["owned"])
    assert [s for s, _ in ops(d, "0")] == [1, 2, 3, 4]


def test_nothing_from_c10d_leaves_our_dump_unchanged():
    ours = c10d_capture()[0]["ours"]
    assert merge_c10d(ours, []) == ours


def test_analyzer_finds_rank_1_missing_from_all_reduce_4_on_default_pg():
    r = analyze({0: merged(0), 1: merged(1)})
    assert [(f["kind"], f["group"], f["seq"], f["op"], f["ranks"]) for f in r["findings"]] == [
        ("missing_ranks", "0", 4, "all_reduce", [1])]
    assert "default_pg" in r["verdict"] and "#4" in r["verdict"]
    assert {(c["group"], c["seq"]) for c in r["collectives"] if c["pass_check"]} == {
        ("main_comm", 0), ("main_comm", 1), ("0", 1), ("0", 2), ("0", 3), ("2", 1)}


@pytest.mark.job
@pytest.mark.timeout(180)
def test_pytorch_fr_trace_reads_the_merged_pickles(tmp_path: Path):
    for r in (0, 1):
        write_dump_atomic(str(tmp_path / f"rank_{r}"), merged(r))
    base = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(tmp_path),
            "-p", "rank_"]
    proc = subprocess.run(base, capture_output=True, text=True, timeout=120)
    text = proc.stdout + proc.stderr
    assert "Not all ranks joining collective, sequence number: 4" in text
    assert "group info: 0:default_pg" in text and "missing ranks: {1}" in text
    proc = subprocess.run(base + ["-j"], capture_output=True, text=True, timeout=120)
    rows = [ln for ln in (proc.stdout + proc.stderr).splitlines()
            if "all_reduce(" in ln or "broadcast(" in ln]
    # rank 0: 2 main_comm + 4 default_pg + 1 dp_shard entries; rank 1: one fewer.
    assert [ln.count("(") for ln in rows] == [2] * 6 + [1]


def _default_pg_entries(rank: int) -> list[dict[str, Any]]:
    [(_, cpu)] = c10d_capture()[rank]["recorders"]
    return [e for e in cpu["entries"] if e["process_group"][0] == "0"]


S0 = 1_000_000_000_000


def test_stall_watch_names_the_oldest_unretired_op_once_its_status_stops_moving():
    # Rank 0 of the capture: default_pg status (4 enqueued, 3 completed), all_reduce #4 unretired.
    entries = _default_pg_entries(0)
    created = entries[-1]["time_created_ns"]
    st = {"0": {"last_enqueued_collective": "4", "last_completed_collective": "3"}}
    w = StallWatch()
    assert w.update(st, created + 10**9) == []  # first sight: no entries read
    assert w.update(st, created + 2 * 10**9) == ["0"]  # unchanged: read them, once
    w.resolve("0", entries)
    assert w.stalled(5.0, created + 2 * 10**9) == []
    [(group, age, p)] = w.stalled(5.0, created + 6 * 10**9)
    assert (group, round(age, 3), p.seq, p.op, p.desc) == ("0", 6.0, 4, "all_reduce", "default_pg")
    assert w.update(st, created + 7 * 10**9) == []  # already read for this status


def test_stall_watch_ignores_a_status_that_lags_behind_retired_ops():
    # gloo's last_completed can stay one behind after every op finished: no op is unretired.
    done = [e for e in _default_pg_entries(1) if e["retired"]]
    st = {"0": {"last_enqueued_collective": 3, "last_completed_collective": 2}}
    w = StallWatch()
    w.update(st, S0)
    assert w.update(st, S0 + 10**9) == ["0"]
    w.resolve("0", done)
    assert w.stalled(5.0, S0 + 10**12) == []
    assert w.update(st, S0 + 10**12) == []  # and it is not read again


def test_stall_watch_starts_over_when_the_status_moves():
    entries = _default_pg_entries(0)
    created = entries[-1]["time_created_ns"]
    w = StallWatch()
    w.update({"0": {"last_enqueued_collective": 4, "last_completed_collective": 3}}, created)
    w.update({"0": {"last_enqueued_collective": 4, "last_completed_collective": 3}}, created + 1)
    w.resolve("0", entries)
    assert w.update({"0": {"last_enqueued_collective": 5, "last_completed_collective": 3}},
                    created + 100 * 10**9) == []
    assert w.stalled(5.0, created + 100 * 10**9) == []  # a new status is not read yet
    w.update({"0": {"last_enqueued_collective": 5, "last_completed_collective": 5}},
             created + 200 * 10**9)
    assert w.stalled(5.0, created + 300 * 10**9) == []


def test_turn_on_env_sets_only_the_name_this_torch_reads():
    # torch >= 2.8 reads TORCH_FR_BUFFER_SIZE and warns on every rank when the old name is set.
    env: dict[str, str] = {}
    name = "TORCH_FR_BUFFER_SIZE" if torch_version() >= (2, 8) else "TORCH_NCCL_TRACE_BUFFER_SIZE"
    assert turn_on_env(Settings.from_env(env), env) == {name: "2000"}
    assert env == {name: "2000"}


@pytest.mark.parametrize("name", BUFFER_ENV)
def test_turn_on_env_leaves_a_users_setting_alone(name: str):
    env = {name: "0"}
    assert turn_on_env(Settings.from_env(env), env) == {}
    assert env == {name: "0"}


def test_fixture_is_a_real_capture():
    # Guards the tests above against a hand-edited fixture: torch's own quirks are all there.
    c = c10d_capture()[0]
    [(recorder, dump)] = c["recorders"]
    assert recorder == "cpu" and dump["pg_config"] == {"": {"desc": "", "name": "", "ranks": "[]"}}
    assert all(e["state"] == "scheduled" and "frames" not in e for e in dump["entries"])
    assert os.path.basename(C10D_CAPTURE) == "c10d_merge_gloo.json"


def test_turn_on_timing_sets_the_variable_unless_the_user_chose() -> None:
    env: dict[str, str] = {}
    assert turn_on_timing(Settings.from_env(env), env) == {"TORCH_NCCL_ENABLE_TIMING": "1"}
    assert env == {"TORCH_NCCL_ENABLE_TIMING": "1"}
    mine = {"TORCH_NCCL_ENABLE_TIMING": "0"}
    assert turn_on_timing(Settings.from_env(mine), mine) == {} and mine == {"TORCH_NCCL_ENABLE_TIMING": "0"}
    off = {"DEBUG_SERVER_C10D_TIMING": "0"}
    assert turn_on_timing(Settings.from_env(off), off) == {} and "TORCH_NCCL_ENABLE_TIMING" not in off
