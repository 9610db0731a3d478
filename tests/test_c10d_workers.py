"""Merging c10d's CPU and NCCL recorder dumps of one rank (``fanout.c10d_workers``)."""

from __future__ import annotations

from typing import Any

from debug_server.fanout import c10d_workers


def _entry(group: str, seq: int, t: int, rid: int, op: str = "nccl:all_reduce") -> dict[str, Any]:
    return {"process_group": [group, "default_pg"], "collective_seq_id": seq,
            "time_created_ns": t, "record_id": rid, "profiling_name": op}


def _dump(entries: list[dict[str, Any]], groups: list[str]) -> dict[str, Any]:
    return {"version": "2.10", "entries": entries,
            "pg_config": {g: {"name": g, "desc": "default_pg", "ranks": "[0, 1]"} for g in groups},
            "pg_status": {g: {"last_completed_collective": "1"} for g in groups}}


def test_nccl_handler_is_asked_only_for_onlyactive() -> None:
    assert c10d_workers.nccl_params({"window": "4"}) == {}
    assert c10d_workers.nccl_params({"since": '{"0":3}'}) == {}
    assert c10d_workers.nccl_params({"onlyactive": "true"}) == {"onlyactive": "true"}


def test_a_group_both_recorders_name_is_renamed_on_the_gloo_side_only() -> None:
    cpu = _dump([_entry("0", 1, 10, 0, "gloo:barrier"), _entry("5", 1, 30, 1, "gloo:broadcast")],
                ["0", "5"])
    nccl = _dump([_entry("0", 1, 20, 0), _entry("0", 2, 40, 1)], ["0"])
    merged, renamed = c10d_workers.merge(cpu, nccl)
    assert renamed == frozenset({"0"})
    assert [(e["process_group"][0], e["collective_seq_id"], e["record_id"])
            for e in merged["entries"]] == [("0:gloo", 1, 0), ("0", 1, 1), ("5", 1, 2), ("0", 2, 3)]
    assert sorted(merged["pg_config"]) == ["0", "0:gloo", "5"]
    assert merged["pg_config"]["0:gloo"]["name"] == "0:gloo"
    assert sorted(merged["pg_status"]) == ["0", "0:gloo", "5"]


def test_an_empty_cpu_recorder_leaves_the_nccl_dump_as_it_is() -> None:
    nccl = _dump([_entry("0", 1, 20, 7)], ["0"])
    merged, renamed = c10d_workers.merge({"version": "2.10", "pg_config": {}, "pg_status": {}},
                                         nccl)
    assert renamed == frozenset() and merged["entries"] == nccl["entries"]
    assert merged["entries"][0]["record_id"] == 7 and "fr_window" not in merged


def test_window_facts_of_two_cut_rings_are_their_union() -> None:
    cpu = {**_dump([], ["0"]), "fr_window": {"since": {"0": 3}, "ring_entries": 5,
                                             "ring_oldest_ns": 100}}
    nccl = {**_dump([_entry("0", 9, 50, 0)], ["0"]),
            "fr_window": {"since": {"0": 8}, "ring_entries": 2000, "ring_oldest_ns": 40}}
    merged, _ = c10d_workers.merge(cpu, nccl)
    assert merged["fr_window"] == {"since": {"0:gloo": 3, "0": 8}, "ring_entries": 2005,
                                   "ring_oldest_ns": 40}


def test_a_whole_ring_next_to_a_cut_one_counts_all_its_entries() -> None:
    cpu = _dump([_entry("1", 1, 10, 0, "gloo:barrier")], ["1"])
    nccl = {**_dump([], ["0"]), "fr_window": {"since": {"0": 8}, "ring_entries": 2000,
                                              "ring_oldest_ns": 40}}
    merged, renamed = c10d_workers.merge(cpu, nccl)
    assert renamed == frozenset()
    assert merged["fr_window"] == {"since": {"0": 8}, "ring_entries": 2001, "ring_oldest_ns": 10}


def test_an_nccl_recorder_without_groups_has_none() -> None:
    assert not c10d_workers.has_groups({"version": "2.10", "pg_config": {}, "pg_status": {}})
    assert c10d_workers.has_groups(_dump([], ["0"]))
