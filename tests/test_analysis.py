"""Analyzer scenarios: each asserts the exact findings a case must (and must not) produce."""

from __future__ import annotations

import copy
import json

import _scenarios as S
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from debug_server.analysis.core import analyze
from debug_server.analysis.digest import digest_dump
from debug_server.analysis.ranks import format_ranks
from debug_server.dumpio import write_dump_atomic
from debug_server.tools import fr_trace
from debug_server.tools.synthetic import hang_job, make_dump, make_entry


def kinds(result: dict) -> list[tuple]:
    return [(f["kind"], f["group"], f["seq"], f["op"], f["ranks"]) for f in result["findings"]]


def test_clean_run_has_no_findings_and_says_so():
    r = analyze(S.clean())
    assert r["findings"] == []
    assert r["verdict"].startswith("No hang or mismatch found")
    assert all(c["pass_check"] for c in r["collectives"])
    assert [c["seq"] for c in r["collectives"]] == [0, 1, 2, 3, 4]


def test_missing_rank_reported_for_seq_4():
    r = analyze(S.missing_rank())
    assert kinds(r) == [("missing_ranks", "main_comm", 4, "all_reduce", [1])]
    row = r["collectives"][-1]
    assert (row["seq"], row["profiling_name"], row["missing_ranks"], row["state"]) == (
        4,
        "nccl:all_reduce",
        [1],
        "started",
    )
    assert row["present_ranks"] == [0] and row["pass_check"] is False
    assert r["verdict"].startswith(
        "Rank 1 never joined all_reduce #4 on main_comm (rank 0 waits in it)."
    )


def test_result_has_contract_keys_and_is_json():
    r = analyze(S.missing_rank())
    for key in ("world_size", "ranks_with_data", "ranks_without_data", "groups", "collectives",
                "nccl_calls", "findings", "verdict", "stack_groups"):  # fmt: skip
        assert key in r
    row = r["collectives"][0]
    for key in ("id", "group", "group_desc", "group_ranks", "seq", "p2p_seq", "op", "profiling_name",
                "state", "pass_check", "missing_ranks", "present_ranks", "expected_ranks", "input_sizes",
                "output_sizes", "input_dtypes", "output_dtypes", "mismatch", "frames"):  # fmt: skip
        assert key in row
    call = r["nccl_calls"][0]
    assert set(call) >= {
        "id",
        "collective_id",
        "group",
        "global_rank",
        "collective_type",
        "sizes",
        "state",
    }
    assert json.loads(json.dumps(r)) == r  # only JSON types: no sets or tuples survive
    assert r["groups"][0] | {"name": "main_comm", "desc": "gloo", "ranks": [0, 1]} == r["groups"][0]


def test_later_collectives_missing_only_first_is_a_finding():
    dumps = hang_job(2, 8, missing_rank=None)
    dumps[1]["entries"] = dumps[1]["entries"][:5]  # rank 1 stopped after #4; rank 0 went to #7
    r = analyze(dumps)
    assert kinds(r) == [("missing_ranks", "main_comm", 5, "all_reduce", [1])]
    assert [c["missing_ranks"] for c in r["collectives"][5:]] == [[1], [1], [1]]


def test_type_mismatch_names_the_minority_rank():
    r = analyze(S.type_mismatch())
    assert kinds(r) == [("type_mismatch", "main_comm", 2, "all_reduce", [2])]
    row = r["collectives"][2]
    assert row["pass_check"] is False and "broadcast" in row["mismatch"]
    assert all(c["pass_check"] for c in r["collectives"][3:])  # one mismatch does not fail the rest


def test_size_mismatch_names_the_minority_rank():
    r = analyze(S.size_mismatch())
    assert kinds(r) == [("size_mismatch", "main_comm", 2, "all_reduce", [1])]
    assert "[[512]]" in r["collectives"][2]["mismatch"]


def test_dtype_mismatch_names_the_minority_rank():
    r = analyze(S.dtype_mismatch())
    assert kinds(r) == [("dtype_mismatch", "main_comm", 3, "all_reduce", [3])]
    assert "Half" in r["findings"][0]["detail"]


def test_two_way_mismatch_blames_both_ranks():
    dumps = S.clean(2)
    dumps[1]["entries"][2] = make_entry(record_id=2, seq=2, input_sizes=((7,),))
    r = analyze(dumps)
    assert kinds(r) == [("size_mismatch", "main_comm", 2, "all_reduce", [0, 1])]


def test_all_gather_output_not_group_size_times_input_is_size_mismatch():
    r = analyze(S.all_gather_bad_output())
    assert kinds(r) == [("size_mismatch", "main_comm", 0, "all_gather", [1])]


def test_all_gather_with_correct_sizes_passes():
    dumps = {
        r: make_dump(
            [make_entry(record_id=0, op="all_gather", input_sizes=((8,),), output_sizes=((2, 8),))],
            {"g": [0, 1]},
        )
        for r in range(2)
    }
    for d in dumps.values():
        d["entries"][0]["process_group"] = ["g", "gloo"]
    assert analyze(dumps)["findings"] == []


def test_reduce_scatter_input_must_be_output_times_group_size():
    def dump(in_numel: int) -> dict:
        e = make_entry(
            record_id=0, op="reduce_scatter", input_sizes=((in_numel,),), output_sizes=((4,),)
        )
        return make_dump([e], {"main_comm": [0, 1]})

    assert analyze({0: dump(8), 1: dump(8)})["findings"] == []
    assert kinds(analyze({0: dump(8), 1: dump(6)}))[0][0] == "size_mismatch"


def test_all_to_all_single_with_uneven_splits_is_fine_when_totals_agree():
    def dump(i: int, o: int) -> dict:
        e = make_entry(
            record_id=0, op="all_to_all_single", input_sizes=((i,),), output_sizes=((o,),)
        )
        return make_dump([e], {"main_comm": [0, 1]})

    assert analyze({0: dump(6, 10), 1: dump(10, 6)})["findings"] == []
    bad = analyze({0: dump(6, 10), 1: dump(10, 7)})
    assert kinds(bad) == [("size_mismatch", "main_comm", 0, "all_to_all_single", [0, 1])]


def test_rank_hanging_in_one_sub_communicator_names_only_that_group_and_rank():
    r = analyze(S.two_subcomms())
    assert kinds(r) == [("missing_ranks", "sub_b", 2, "all_reduce", [3])]
    sub_a = [c for c in r["collectives"] if c["group"] == "sub_a"]
    assert len(sub_a) == 3 and all(c["pass_check"] for c in sub_a)
    assert {g["name"]: g["ranks"] for g in r["groups"]} == {
        "main_comm": [0, 1, 2, 3],
        "sub_a": [0, 1],
        "sub_b": [2, 3],
    }
    assert "Rank 3 never joined all_reduce #2 on sub_b (rank 2 waits in it)." in r["verdict"]


def test_wrapped_ring_is_history_lost_not_missing():
    r = analyze(S.wrapped_ring())
    assert kinds(r) == [("history_lost", "main_comm", 9, None, [0])]
    assert r["findings"][0]["severity"] == "info"
    early = [c for c in r["collectives"] if c["seq"] < 10]
    assert all(
        c["pass_check"] and c["missing_ranks"] == [] and c["history_lost_ranks"] == [0]
        for c in early
    )
    assert r["verdict"].startswith("No hang or mismatch found")


def test_wrapped_ring_with_a_hang_still_finds_the_missing_rank():
    r = analyze(S.wrapped_ring(hang=True))
    assert kinds(r) == [
        ("missing_ranks", "main_comm", 29, "all_reduce", [1]),
        ("history_lost", "main_comm", 9, None, [0]),
    ]


def test_all_ranks_wrapped_at_the_same_point_is_quiet():
    dumps = S.clean(2, 30)
    for d in dumps.values():
        d["entries"] = d["entries"][10:]
    assert analyze(dumps)["findings"] == []


def test_a_ring_one_collective_ahead_lost_nothing_the_others_kept():
    # Equal rings read while rank 1 was one all_reduce further on:
    # its ring no longer holds #10 because it recorded #30, not because history was lost.
    # Rank 1 issued #30 just before rank 0's read (which #30 had not reached yet) and was read
    # a moment later: seen in the test suite under load (tests/test_snapshot_skew.py).
    dumps = S.clean(2, 31)
    dumps[0]["entries"] = dumps[0]["entries"][10:30]
    dumps[1]["entries"] = dumps[1]["entries"][11:31]
    t30 = dumps[1]["entries"][-1]["time_created_ns"]
    dumps[0]["dump_time_ns"] = t30 + 100
    dumps[1]["dump_time_ns"] = t30 + 1_000_000
    assert analyze(dumps)["findings"] == []


def test_a_ring_ahead_but_shorter_than_the_holders_still_lost_history():
    dumps = S.clean(2, 31)
    dumps[0]["entries"] = dumps[0]["entries"][10:30]
    dumps[1]["entries"] = dumps[1]["entries"][15:31]  # 16 entries against rank 0's 20
    t30 = dumps[1]["entries"][-1]["time_created_ns"]
    dumps[0]["dump_time_ns"] = t30 + 100
    dumps[1]["dump_time_ns"] = t30 + 1_000_000
    assert kinds(analyze(dumps)) == [("history_lost", "main_comm", 14, None, [1])]


def test_entries_without_a_group_description_are_still_matched():
    # The entries say ("main_comm", "") while pg_config describes the group: before, the
    # entries were keyed apart from their group and the missing rank went unseen.
    dumps = S.missing_rank()
    for d in dumps.values():
        for e in d["entries"]:
            e["process_group"] = ("main_comm", "")
    r = analyze(dumps)
    assert kinds(r) == [("missing_ranks", "main_comm", 4, "all_reduce", [1])]
    assert [g["desc"] for g in r["groups"]] == [dumps[0]["pg_config"]["main_comm"]["desc"]]


def test_rank_without_any_group_entry_but_pg_status_covering_it_is_history_lost():
    dumps = S.clean(2, 5)
    dumps[1]["entries"] = [make_entry(record_id=99, comm="other", seq=0)]
    dumps[1]["pg_config"]["other"] = {"name": "other", "desc": "gloo", "ranks": "[1]"}
    dumps[1]["pg_status"]["main_comm"]["last_enqueued_collective"] = 4
    assert kinds(analyze(dumps)) == [("history_lost", "main_comm", 4, None, [1])]


def test_p2p_deadlock_both_ranks_receiving_is_unmatched_p2p():
    r = analyze(S.p2p_deadlock())
    assert kinds(r) == [("unmatched_p2p", "main_comm", None, "recv", [0, 1])]
    assert r["findings"][0]["p2p_seq"] == 1
    detail = r["findings"][0]["detail"]
    assert (
        "rank 0 waits in recv from rank 1" in detail
        and "rank 1 waits in recv from rank 0" in detail
    )
    p2p_rows = [c for c in r["collectives"] if c["p2p_seq"] is not None]
    assert [(c["op"], c["seq"], c["missing_ranks"]) for c in p2p_rows] == [
        ("recv", None, [0]),
        ("recv", None, [1]),
    ]


def test_send_and_collective_sharing_a_number_do_not_mix():
    r = analyze(S.send_and_collective_share_number())
    assert r["findings"] == []
    assert [(c["seq"], c["op"]) for c in r["collectives"]] == [
        (0, "all_reduce"),
        (1, "all_reduce"),
        (2, "all_reduce"),
        (3, "all_reduce"),
        (4, "all_reduce"),
    ]


def test_pending_send_without_receive_is_unmatched():
    dumps = S.clean(2, 3)
    dumps[0]["entries"].append(
        make_entry(
            record_id=3, seq=3, p2p_seq=1, op="send", is_p2p=True, peer_desc="0->1", state="started"
        )
    )
    r = analyze(dumps)
    # ranks: the peer at fault (rank 1 posted no recv); waiting: the rank left in its send.
    assert kinds(r) == [("unmatched_p2p", "main_comm", None, "send", [1])]
    assert r["findings"][0]["waiting"] == [0]


def test_matched_pending_send_and_recv_is_not_a_finding():
    dumps = S.clean(2, 3)
    dumps[0]["entries"].append(
        make_entry(
            record_id=3, seq=3, p2p_seq=1, op="send", is_p2p=True, peer_desc="0->1", state="started"
        )
    )
    dumps[1]["entries"].append(
        make_entry(
            record_id=3, seq=3, p2p_seq=1, op="recv", is_p2p=True, peer_desc="1<-0", state="started"
        )
    )
    assert analyze(dumps)["findings"] == []


def test_record_id_misalignment_across_groups_is_not_a_missing_rank():
    assert analyze(S.record_id_misaligned())["findings"] == []


def test_record_id_misalignment_with_wrapped_ring_reports_only_history_lost():
    r = analyze(S.record_id_misaligned(ring=60))
    assert kinds(r) == [("history_lost", "main_comm", 1, None, [0])]


def test_state_difference_between_ranks_is_not_a_mismatch():
    r = analyze(S.state_difference())
    assert r["findings"] == []
    assert r["collectives"][-1]["state"] == "started"  # least advanced among the issuers


def test_stuck_everywhere_points_at_gpu_or_network():
    r = analyze(S.stuck_everywhere())
    assert kinds(r) == [("stuck_everywhere", "main_comm", 4, "all_reduce", [0, 1])]
    assert "nccl-tests" in r["verdict"] and "network" in r["verdict"]


def test_pytorch_gloo_dump_with_empty_pg_config_is_repaired():
    r = analyze(S.load_fixture("c10d_gloo_hang.json"))
    assert kinds(r) == [("missing_ranks", "0", 5, "all_reduce", [1])]
    assert r["groups"] == [
        {"id": "0", "name": "0", "desc": "default_pg", "ranks": [0, 1], "inferred": True,
         "label": "pg 0 (default_pg)"}
    ]
    # gloo never leaves "scheduled": retired entries count as completed.
    assert [c["state"] for c in r["collectives"]] == ["completed"] * 4 + ["scheduled"]
    assert "on pg 0 (default_pg)" in r["verdict"]


def test_pytorch_gloo_clean_dump_with_subgroup_and_all_gather_passes():
    r = analyze(S.load_fixture("c10d_gloo_clean.json"))
    assert r["findings"] == []
    assert {c["op"] for c in r["collectives"]} == {
        "all_reduce",
        "broadcast",
        "all_gather",
        "barrier",
    }
    assert sorted(g["name"] for g in r["groups"]) == ["0", "1"]


def test_gloo_op_finished_by_later_sequence_is_not_stuck():
    dumps = S.load_fixture("c10d_gloo_hang.json")
    for d in dumps.values():
        for e in d["entries"]:
            e["retired"] = False  # no completion evidence at all but the later sequence numbers
    dumps[1]["entries"].append(copy.deepcopy(dumps[0]["entries"][-1]))
    r = analyze(dumps)
    assert kinds(r) == [("stuck_everywhere", "0", 5, "all_reduce", [0, 1])]


def test_tuple_process_group_is_accepted():
    dumps = S.missing_rank()
    for d in dumps.values():
        for e in d["entries"]:
            e["process_group"] = tuple(e["process_group"])
    assert kinds(analyze(dumps)) == [("missing_ranks", "main_comm", 4, "all_reduce", [1])]


def test_malformed_entries_are_skipped_with_a_note_not_an_exception():
    dumps = S.clean(2, 5)
    dumps[0]["entries"].insert(2, {"garbage": True})
    dumps[0]["entries"].insert(3, "not even a dict")
    dumps[1]["pg_config"] = "nonsense"
    r = analyze(dumps)
    assert r["findings"] == []
    assert any("rank 0: skipped 2 malformed entries" in n for n in r["notes"])


def test_unusable_dump_object_becomes_a_note():
    r = analyze({0: S.clean(2)[0], 1: None})  # type: ignore[dict-item]
    assert any(n.startswith("rank 1: dump unusable") for n in r["notes"])


def test_hostile_ranks_string_is_not_evaluated(tmp_path):
    target = tmp_path / "pwned"
    dumps = S.clean(2)
    for d in dumps.values():
        d["pg_config"]["main_comm"]["ranks"] = f"__import__('os').system('touch {target}')"
    r = analyze(dumps)
    assert not target.exists()
    assert any("refused pg_config ranks" in n for n in r["notes"])
    assert r["groups"][0]["ranks"] == [0, 1]  # inferred from the entries instead


def test_unavailable_ranks_are_listed_and_named_in_verdict():
    dumps = S.missing_rank()
    del dumps[1]
    r = analyze(dumps, world_size=2, unavailable={1: "unreachable after 2.0 s"})
    assert r["ranks_without_data"] == [1]
    assert r["unavailable"] == [{"rank": 1, "reason": "unreachable after 2.0 s"}]
    assert "rank 1 (unreachable after 2.0 s)" in r["verdict"]
    # Never "No hang" while a rank waits and another gave no data (issue 33).
    assert r["verdict"].startswith("Rank 0 waits in all_reduce #4 on main_comm and rank 1 gave "
                                   "no data: it may be the one missing.")
    assert "No hang" not in r["verdict"]
    assert r["findings"] == []  # absence of data is not evidence of absence


def test_world_size_defaults_to_max_rank_plus_one():
    r = analyze({0: S.clean(3)[0]})
    assert r["world_size"] == 3 and r["ranks_without_data"] == [1, 2]


def test_pg_filters_restrict_groups():
    r = analyze(S.two_subcomms(), pg_filters=["sub_a"])
    assert [g["name"] for g in r["groups"]] == ["sub_a"]
    assert r["findings"] == []


def test_verdict_joins_stacks_with_the_missing_rank(tmp_path):
    demo = tmp_path / "demo.py"
    lines = ["import time"] + ["pass"] * 86 + ["    time.sleep(30)"]
    demo.write_text("\n".join(lines) + "\n")
    stacks = {0: S.stack_in_all_reduce(), 1: S.stack_sleeping(str(demo), 88)}
    r = analyze(S.missing_rank(), stacks=stacks)
    assert (
        "Rank 1's main thread is at demo.py:88 in hang_phase (time.sleep), not in a collective."
        in r["verdict"]
    )
    assert r["stack_groups"] == [
        {"ranks": [0], "summary": "all_reduce at train.py:148", "in_collective": True},
        {"ranks": [1], "summary": "time.sleep at demo.py:88", "in_collective": False},
    ]


def test_identical_stacks_are_grouped_odd_ones_first(tmp_path):
    train = tmp_path / "train.py"
    train.write_text("\n".join(["pass"] * 139 + ["        time.sleep(600)"]) + "\n")
    stacks = {r: S.stack_in_all_reduce(str(train), 148) for r in range(63)}
    stacks[63] = S.stack_sleeping(str(train), 140)
    r = analyze(hang_job(64, 5, missing_rank=63), stacks=stacks)
    assert r["stack_groups"][0] == {
        "ranks": [63],
        "summary": "time.sleep at train.py:140",
        "in_collective": False,
    }
    assert r["stack_groups"][1]["ranks"] == list(range(63))
    assert "ranks 0-62: all_reduce at train.py:148" in r["verdict"]
    assert "rank 63: time.sleep at train.py:140" in r["verdict"]
    assert r["verdict"].startswith(
        "Rank 63 never joined all_reduce #4 on main_comm (ranks 0-62 wait in it)."
    )


def test_identical_ranks_are_merged_into_one_class():
    dumps = hang_job(16, 50, missing_rank=5)
    digests = [digest_dump(r, d) for r, d in dumps.items()]
    assert len({d.key() for d in digests}) == 2
    r = analyze(dumps)
    assert kinds(r) == [("missing_ranks", "main_comm", 49, "all_reduce", [5])]
    assert r["collectives"][-1]["present_ranks"] == [r_ for r_ in range(16) if r_ != 5]


def test_coalesced_ops_sharing_a_sequence_number_compare_as_one():
    def dump(second: int) -> dict:
        ents = [make_entry(record_id=0, seq=0), make_entry(record_id=1, seq=0, input_sizes=((second,),)),
                make_entry(record_id=2, seq=1)]  # fmt: skip
        return make_dump(ents, {"main_comm": [0, 1]})

    assert analyze({0: dump(8), 1: dump(8)})["findings"] == []
    assert kinds(analyze({0: dump(8), 1: dump(9)}))[0][:3] == ("size_mismatch", "main_comm", 0)


@pytest.mark.parametrize("ranks,expected", [([0, 1, 2, 5], "0-2, 5"), ([], ""), ([3], "3")])
def test_format_ranks(ranks, expected):
    assert format_ranks(ranks) == expected


_junk = st.one_of(
    st.none(), st.integers(-3, 3), st.text(max_size=5), st.lists(st.integers(0, 4), max_size=3)
)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.dictionaries(
            st.sampled_from(
                [
                    "process_group",
                    "profiling_name",
                    "collective_seq_id",
                    "p2p_seq_id",
                    "input_sizes",
                    "output_sizes",
                    "input_dtypes",
                    "output_dtypes",
                    "state",
                    "is_p2p",
                    "frames",
                    "retired",
                ]
            ),  # fmt: skip
            _junk,
        ),
        max_size=6,
    )
)
def test_analyze_never_raises_on_junk_entries(junk):
    dumps = S.missing_rank()
    dumps[0]["entries"] = dumps[0]["entries"][:2] + junk + dumps[0]["entries"][2:]
    r = analyze(dumps)
    json.dumps(r)
    assert ("missing_ranks", "main_comm", 4, "all_reduce", [1]) in kinds(r)


def test_analysis_and_cli_loading_leave_the_garbage_collector_alone(tmp_path, monkeypatch, capsys):
    # The frontend analyses on executor threads: switching the process-wide GC there would
    # change every other thread's collections too.
    import gc

    def refuse(*_a):
        raise AssertionError("the analysis switched the process-wide garbage collector")

    for name in ("disable", "enable", "freeze", "set_threshold"):
        monkeypatch.setattr(gc, name, refuse)
    dumps = hang_job(3, n_entries=50, missing_rank=1)
    assert analyze(dumps)["findings"][0]["ranks"] == [1]
    for r, d in dumps.items():
        write_dump_atomic(str(tmp_path / f"rank_{r}"), d)
    assert fr_trace.main([str(tmp_path), "-p", "rank_", "--json", "--jobs", "1"]) == 2
    assert json.loads(capsys.readouterr().out)["findings"][0]["ranks"] == [1]
