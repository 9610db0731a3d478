"""The right culprit on real layouts (issue 33): 2-D meshes, pipelines, FSDP, batched P2P,
split groups with equal names; cause before consequence across groups.

Each job is modelled by ``_jobsim`` (one stream per rank: an op completes only when every rank
it needs issued it and their earlier ops completed), read as the CLI reads c10d's dumps (true
states) and as the live pages read them (every unfinished op ``scheduled``, stacks joined).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import _scenarios as S
import pytest
from _jobsim import JobSim

from debug_server.analysis import report
from debug_server.analysis.core import analyze
from debug_server.dumpio import write_dump_atomic
from debug_server.protocol import frwindow
from debug_server.tools import fr_trace
from debug_server.tools.synthetic import make_dump, make_entry

HEX = re.compile(r"[0-9a-f]{16,}")


def _first(r: dict[str, Any]) -> dict[str, Any]:
    return r["findings"][r["finding_order"][0]]


def _order(r: dict[str, Any]) -> list[tuple[str, str, int | None]]:
    return [(r["findings"][i]["kind"], r["findings"][i]["group_label"], r["findings"][i]["seq"])
            for i in r["finding_order"]]


@pytest.mark.parametrize("states", ["true", "scheduled"])
@pytest.mark.parametrize("with_stacks", [False, True])
def test_mesh_tp_skip_leads_with_rank_2_on_mesh_tp_24_in_every_reading(states: str,
                                                                       with_stacks: bool) -> None:
    sim = S.mesh_tp_skip(hashed=True)
    r = analyze(sim.dumps(states=states), stacks=sim.stacks() if with_stacks else None)
    f = _first(r)
    assert (f["kind"], f["ranks"], f["group_label"], f["seq"]) == (
        "missing_ranks", [2], "mesh_tp [2, 3]", 24)
    assert r["category"] == "cpu_divergence"
    assert r["verdict"].startswith("Rank 2 never joined all_reduce #24 on mesh_tp [2, 3] "
                                   "(rank 3 waits in it).")
    # The dp all_reduce and the barrier are consequences, listed after their cause.
    assert _order(r)[1:] == [("stuck_everywhere", "mesh_dp [1, 3]", 6),
                             ("stuck_everywhere", "default_pg [0, 1, 2, 3]", 0)]
    assert "suspect the GPU" not in r["verdict"] and "preflight" not in r["next_step"]
    assert "rank 2" in r["next_step"] and "mesh_tp [2, 3]" in r["next_step"]
    assert r["findings"][r["finding_order"][1]]["explained_by"]["rank"] == 3
    assert not HEX.search(r["verdict"]), r["verdict"]  # hashes only in the JSON ids


def test_mesh_tp_skip_with_c10d_numbered_groups_names_them_by_desc_and_ranks() -> None:
    r = analyze(S.mesh_tp_skip(hashed=False).dumps())
    assert r["verdict"].startswith("Rank 2 never joined all_reduce #24 on pg 2 (mesh_tp [2, 3])")
    assert _first(r)["group"] == "2"


def test_mesh_tp_skip_cli_text_and_exit_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for rank, d in S.mesh_tp_skip(hashed=True).dumps(states="scheduled").items():
        write_dump_atomic(str(tmp_path / f"rank_{rank}"), d)
    assert fr_trace.main([str(tmp_path), "-p", "rank_"]) == 2
    out = capsys.readouterr().out
    verdict, findings = out.split("--- Findings ---")[0], out.split("--- Findings ---")[1]
    assert "Rank 2 never joined all_reduce #24 on mesh_tp [2, 3]" in verdict
    assert findings.splitlines()[1].startswith("[missing_ranks] mesh_tp [2, 3] #24 all_reduce")
    assert not HEX.search(verdict + findings.split("--- Groups ---")[0])


def test_healthy_mesh_has_no_finding() -> None:
    r = analyze(S.mesh_tp_skip(skip=None).dumps())
    assert r["findings"] == [] and "category" not in r


@pytest.mark.parametrize("states", ["true", "scheduled"])
@pytest.mark.parametrize("with_stacks", [False, True])
def test_pipeline_skipped_send_leads_with_rank_2_and_what_rank_3_waits_for(states: str,
                                                                           with_stacks: bool) -> None:
    sim = S.pipeline_skip()
    r = analyze(sim.dumps(states=states), stacks=sim.stacks() if with_stacks else None)
    f = _first(r)
    assert (f["kind"], f["ranks"], f["group_label"]) == ("unmatched_p2p", [2], "pg 0 (pp)")
    assert r["verdict"].startswith("Rank 2 never posted the send that rank 3 waits for "
                                   "(recv from rank 2, p2p #3 on pg 0 (pp)).")
    assert r["category"] == "cpu_divergence"
    assert r["next_step"].startswith("find out why rank 2 never posted its send for rank 3")
    # The dp all_reduce rank 3 never joined comes after, explained by its recv.
    dp = next(x for x in r["findings"] if x["kind"] == "missing_ranks")
    assert (dp["ranks"], dp["group_label"], dp["explained_by"]["op"]) == ([3], "pg 2 (dp [2, 3])", "recv")
    assert r["finding_order"].index(r["findings"].index(dp)) > 0


def test_healthy_pipeline_has_no_finding() -> None:
    assert analyze(S.pipeline_skip(skip_step=None).dumps())["findings"] == []


def test_fsdp_healthy_has_no_finding() -> None:
    assert analyze(S.fsdp().dumps())["findings"] == []


def test_fsdp_stalled_rank_is_missing_from_the_all_gather_with_its_data_loader_line() -> None:
    sim = S.fsdp(stall=2)
    r = analyze(sim.dumps(states="scheduled"), stacks=sim.stacks())
    assert [(f["kind"], f["op"], f["seq"], f["ranks"]) for f in r["findings"]] == [
        ("missing_ranks", "_all_gather_base", 16, [2])]
    assert r["verdict"].startswith("Rank 2 never joined _all_gather_base #16 on pg 0 (default_pg)")
    assert "train.py:77 in load_batch" in r["next_step"]


def test_batched_p2p_ring_is_clean_and_a_rank_without_its_batch_is_named() -> None:
    assert analyze(S.batched_p2p().dumps())["findings"] == []
    r = analyze(S.batched_p2p(skip=2).dumps())
    f = _first(r)
    assert (f["kind"], f["ranks"], sorted(f["waiting"])) == ("unmatched_p2p", [2], [1, 3])
    assert r["verdict"].startswith("Rank 2 never posted the")
    assert [x["kind"] for x in r["findings"]] == ["unmatched_p2p", "stuck_everywhere"]


def test_split_groups_with_equal_names_are_told_apart_by_their_ranks() -> None:
    r = analyze(S.split_equal_names())
    assert [(f["kind"], f["group"], f["ranks"]) for f in r["findings"]] == [
        ("missing_ranks", "sub[2-3]", [3])]
    assert r["verdict"].startswith("Rank 3 never joined all_reduce #2 on sub [2, 3] (rank 2 waits in it)")
    assert "sub [0, 1]" not in r["verdict"]
    text = report.fr_trace_text(r)
    assert "[missing_ranks] sub [2, 3] #2 all_reduce" in text


def test_chain_of_missing_ranks_leads_with_the_one_nothing_explains() -> None:
    # Rank 0 is idle. Rank 1 waits in A #5 ([1, 2]) for rank 2, issued first; rank 2 waits in
    # B #3 ([0, 2]) for rank 0. B is the root although A was issued earlier.
    groups = {"A": [1, 2], "B": [0, 2]}
    t = 1_700_000_000_000_000_000
    a = [make_entry(record_id=s, comm="A", seq=s, time_created_ns=t + s) for s in range(5)]
    b = [make_entry(record_id=10 + s, comm="B", seq=s, time_created_ns=t + 10 + s) for s in range(3)]
    dumps = {
        0: make_dump(list(b), {"B": [0, 2]}),
        1: make_dump([*a, make_entry(record_id=5, comm="A", seq=5, state="started",
                                     time_created_ns=t + 100)], {"A": [1, 2]}),
        2: make_dump([*a, *b, make_entry(record_id=13, comm="B", seq=3, state="started",
                                         time_created_ns=t + 200)], groups),
    }
    r = analyze(dumps)
    assert _order(r) == [("missing_ranks", "B", 3), ("missing_ranks", "A", 5)]
    assert r["verdict"].startswith("Rank 0 never joined all_reduce #3 on B (rank 2 waits in it).")
    assert "rank 2 never joined all_reduce #5 on A (rank 2 waits in all_reduce #3 on B)" in r["verdict"]


def test_stuck_with_no_earlier_blocked_op_anywhere_is_gpu_or_network() -> None:
    r = analyze(S.mesh_tp_skip(skip=None).dumps())
    assert "category" not in r
    sim = S.mesh_tp_skip(skip=None)
    sim.coll("dp1", line=61)  # ranks 1, 3 issue dp #7; model a transport that never finishes it
    dumps = sim.dumps()
    for rank in (1, 3):
        dumps[rank]["entries"][-1]["state"] = "started"
        dumps[rank]["entries"][-1]["retired"] = False
        dumps[rank]["entries"][-1]["time_discovered_completed_ns"] = None
    r = analyze(dumps)
    assert [(f["kind"], f["group_label"]) for f in r["findings"]] == [
        ("stuck_everywhere", "mesh_dp [1, 3]")]
    assert r["category"] == "gpu_or_network"


@pytest.mark.parametrize("scenario", ["mesh", "pipeline"])
def test_live_window_cut_keeps_the_same_root(scenario: str) -> None:
    # The live pages analyse each ring cut at the job's frontier (analysis.frwindow), with
    # stacks and every unfinished op "scheduled": the root must not move.
    sim = S.mesh_tp_skip(hashed=True) if scenario == "mesh" else S.pipeline_skip()
    dumps = sim.dumps(states="scheduled")
    since = frwindow.frontier(dumps)
    assert since, "the cut must really drop entries for this test to mean anything"
    cut = {r: frwindow.window(d, since) for r, d in dumps.items()}
    assert sum(len(d["entries"]) for d in cut.values()) < sum(len(d["entries"]) for d in dumps.values())
    full, live = analyze(dumps), analyze(cut, stacks=sim.stacks())
    for r in (full, live):
        f = _first(r)
        assert (f["kind"], f["ranks"], f["group"], f["seq"], f.get("p2p_seq")) == (
            _first(full)["kind"], [2], _first(full)["group"], _first(full)["seq"],
            _first(full).get("p2p_seq"))
    assert live["category"] == full["category"] == "cpu_divergence"


@pytest.mark.parametrize("delay_ms", [0, 5])
def test_mesh_tp_skip_on_gloo_leads_with_rank_2_even_when_rank_3_runs_late(delay_ms: int) -> None:
    # gloo: every op blocks the CPU, so rank 1 waits in dp #6 for rank 3 (in tp #24) and ranks
    # 1, 3 never reach the barrier; with rank 3 late, rank 1's dp #6 is issued before rank 3's
    # tp #24: the root is still the op the others end up behind.
    sim = S.mesh_tp_skip(blocking=True, delay_ns={3: delay_ms * 1_000_000})
    for states in ("true", "scheduled"):
        r = analyze(sim.dumps(states=states), stacks=sim.stacks())
        f = _first(r)
        assert (f["kind"], f["ranks"], f["group_label"], f["seq"]) == (
            "missing_ranks", [2], "mesh_tp [2, 3]", 24), r["verdict"]
        assert r["category"] == "cpu_divergence"


def test_hang_report_lists_the_root_culprit_first_by_group_label() -> None:
    from debug_server.frontend.hangreport import culprits_of

    sim = S.mesh_tp_skip(blocking=True)
    rows = culprits_of(analyze(sim.dumps(), stacks=sim.stacks()), sim.stacks())
    assert [(c["rank"], c["group_label"], c["seq"]) for c in rows][:1] == [(2, "mesh_tp [2, 3]", 24)]
    assert rows[0]["where"]["line"] == 90  # rank 2 waits in the final barrier


def test_batch_closer_without_is_p2p_is_not_taken_for_a_collective() -> None:
    # Older dumps carry no is_p2p: the closer right after the batch's sends/recvs is still
    # the batch's, not a collective sharing an all_reduce's number (rank 2, which posted no
    # batch, would otherwise disagree with the others about that all_reduce).
    dumps = S.batched_p2p(skip=2).dumps()
    for d in dumps.values():
        for e in d["entries"]:
            e.pop("is_p2p", None)
    r = analyze(dumps)
    assert [(f["kind"], f["ranks"]) for f in r["findings"]] == [
        ("unmatched_p2p", [2]), ("stuck_everywhere", [0, 1, 2, 3])]


def test_ranks_that_each_skipped_their_own_groups_op_are_independent_roots() -> None:
    # Four pairs; in each the odd rank skips the pair's all_reduce #1 and goes on to the world
    # all_reduce, which its partner issued after the pair's op: each skip is its own root, the
    # world op (stuck behind all four) is their consequence.
    groups = {"world": ("default_pg", list(range(8))),
              **{f"p{i}": ("pair", [2 * i, 2 * i + 1]) for i in range(4)}}
    sim = JobSim(8, groups)
    for i in range(4):
        sim.coll(f"p{i}", line=10)
    for i in range(4):
        sim.coll(f"p{i}", line=11, skip=[2 * i + 1])
    sim.coll("world", line=12)
    r = analyze(sim.dumps(states="scheduled"))
    missing = [f for f in r["findings"] if f["kind"] == "missing_ranks"]
    assert sorted(f["ranks"][0] for f in missing) == [1, 3, 5, 7]
    assert all("explained_by" not in f for f in missing)
    stuck = next(f for f in r["findings"] if f["kind"] == "stuck_everywhere")
    assert stuck["explained_by"]["kind"] == "missing_ranks"
    assert r["verdict"].startswith("Rank 1 never joined all_reduce #1 on pg 1 (pair [0, 1])")
    assert "Rank 3 never joined all_reduce #1 on pg 2 (pair [2, 3])" in r["verdict"]
    assert r["category"] == "cpu_divergence"
