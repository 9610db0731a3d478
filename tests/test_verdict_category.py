"""Verdict precedence and the root-cause category: mismatch, then missing ranks, then GPU/network.

Each scenario is the rings of fake ranks (``synthetic``); the page and report tests serve them
from real worker apps behind a real frontend app.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import _scenarios as S
from fakes import closed_port_url

from debug_server.analysis import core as analysis
from debug_server.analysis import report
from debug_server.config import ServerConfig
from debug_server.fanout.live import LiveCollector
from debug_server.frontend import render
from debug_server.frontend.app import make_frontend_app
from debug_server.frontend.hangreport import HangWatch, RankHealth
from debug_server.readers.storeview import StaticRegistry
from debug_server.tools.synthetic import make_dump, make_entry

LINE = "/job/train.py"


def _frames(line: int) -> list[dict[str, Any]]:
    return [{"name": "train_step", "filename": LINE, "line": line},
            {"name": "<module>", "filename": LINE, "line": 200}]


def _issue_case(kind: str) -> dict[int, dict[str, Any]]:
    """Three good all_reduces, then #3: size (rank 0 1024 completed, rank 1 2048 stuck) or
    type (rank 0 all_reduce, rank 1 broadcast, both stuck), each from its own line."""
    dumps = {}
    for r in (0, 1):
        ents = [make_entry(record_id=s, seq=s) for s in range(3)]
        if kind == "size":
            ents.append(make_entry(record_id=3, seq=3, input_sizes=((1024 * (r + 1),),),
                                   state="completed" if r == 0 else "started",
                                   frames=_frames(40 + r)))
        else:
            ents.append(make_entry(record_id=3, seq=3, op="broadcast" if r else "all_reduce",
                                   state="started", frames=_frames(40 + r)))
        dumps[r] = make_dump(ents, {"main_comm": [0, 1]})
    return dumps


def test_type_mismatch_explains_the_stuck_everywhere_and_gets_no_gpu_advice() -> None:
    r = analysis.analyze(_issue_case("type"))
    assert [(f["kind"], f["seq"]) for f in r["findings"]] == [("type_mismatch", 3),
                                                              ("stuck_everywhere", 3)]
    assert r["category"] == "misconfigured_collective"
    assert r["verdict"].startswith("Mismatch in all_reduce #3 on main_comm: type mismatch")
    assert "The mismatch is why no rank completes all_reduce #3" in r["verdict"]
    assert "suspect the GPU" not in r["verdict"] and "preflight" not in r["verdict"]


def test_mismatch_next_step_gives_both_signatures_and_lines() -> None:
    r = analysis.analyze(_issue_case("size"))
    assert r["next_step"] == (
        "make the calls of all_reduce #3 on main_comm agree: "
        f"rank 0 issues all_reduce [[1024]] Float at {LINE}:40 in train_step; "
        f"rank 1 issues all_reduce [[2048]] Float at {LINE}:41 in train_step.")
    assert r["verdict"].endswith("Next step: " + r["next_step"])


def test_minority_rank_of_a_mismatch_comes_first_in_the_next_step() -> None:
    r = analysis.analyze(S.type_mismatch())  # rank 2 of 4 broadcasts where the others all_reduce
    assert r["next_step"].startswith("make the calls of all_reduce #2 on main_comm agree: "
                                     "rank 2 issues broadcast")
    assert "ranks 0-1, 3 issue all_reduce" in r["next_step"]


def test_missing_rank_is_cpu_divergence_with_its_line_as_next_step() -> None:
    stacks = {0: S.stack_in_all_reduce(), 1: S.stack_sleeping(LINE, 66)}
    r = analysis.analyze(S.missing_rank(), stacks=stacks)
    assert r["category"] == "cpu_divergence"
    assert r["next_step"] == ("find out why rank 1 never reached all_reduce #4 on main_comm: its "
                              "main thread is at train.py:66 in hang_phase (/stacks shows every rank).")
    assert r["verdict"].startswith("Rank 1 never joined all_reduce #4 on main_comm")


def test_unexplained_stuck_everywhere_points_at_gpu_network_with_preflight_and_nccl_log() -> None:
    r = analysis.analyze(S.stuck_everywhere())
    assert r["category"] == "gpu_or_network"
    assert "`python -m debug_server.preflight`" in r["next_step"]
    assert "`python -m debug_server.nccl_log`" in r["next_step"]
    assert "no rank is missing and no mismatch explains it" in r["verdict"]


def test_rank_missing_because_it_waits_in_a_stuck_group_is_not_the_root() -> None:
    # sub_a (ranks 0, 1): #1 issued by both, completed by neither. Rank 1 is therefore missing
    # from main_comm #2, which rank 0... no: rank 2 waits in it. The root is sub_a's stuck op.
    groups = {"main_comm": [0, 1, 2], "sub_a": [0, 1]}
    dumps = {}
    for r in (0, 1, 2):
        ents = [make_entry(record_id=s, seq=s) for s in range(2)]
        if r in (0, 1):
            ents.append(make_entry(record_id=2, comm="sub_a", seq=0, state="started"))
        else:
            ents.append(make_entry(record_id=2, seq=2, state="started"))
        dumps[r] = make_dump(ents, groups if r < 2 else {"main_comm": [0, 1, 2]})
    stacks = {r: S.stack_in_all_reduce() for r in (0, 1, 2)}
    r = analysis.analyze(dumps, stacks=stacks)
    kinds = [(f["kind"], f["group"]) for f in r["findings"]]
    assert ("missing_ranks", "main_comm") in kinds and ("stuck_everywhere", "sub_a") in kinds
    assert r["category"] == "gpu_or_network"
    first = r["findings"][r["finding_order"][0]]
    assert (first["kind"], first["group"]) == ("stuck_everywhere", "sub_a")
    assert r["verdict"].startswith("All 2 ranks of sub_a issued all_reduce #0 and none completed it")


def test_clean_trace_has_no_category() -> None:
    r = analysis.analyze(S.clean())
    assert "category" not in r and "next_step" not in r


def test_waiting_ranks_with_a_silent_rank_is_unknown() -> None:
    dumps = {0: S.missing_rank()[0]}
    r = analysis.analyze(dumps, world_size=2, unavailable={1: "unreachable after 2.0 s"})
    assert r["findings"] == [] and r["category"] == "unknown"
    assert r["next_step"].startswith("find out why rank 1 gave no Flight Recorder data")


def test_banner_follows_the_analysis_order_mismatch_before_missing() -> None:
    # Rank 0 completed the size-mismatched #3 and went on to #4; rank 1 still waits in #3.
    dumps = _issue_case("size")
    dumps[0]["entries"].append(make_entry(record_id=4, seq=4, state="started"))
    r = analysis.analyze(dumps)
    assert [f["kind"] for f in r["findings"]] == ["missing_ranks", "size_mismatch"]
    b = render.banner(r, 2)
    assert b.headlines[0]["who"] == "Size mismatch:" and "is missing from" in b.headlines[1]["what"]
    assert (b.category, b.next_step) == ("misconfigured_collective", r["next_step"])
    assert r["verdict"].index("Mismatch in") < r["verdict"].index("never joined")


def test_text_report_shows_category_and_next_step_under_the_verdict() -> None:
    r = analysis.analyze(_issue_case("type"))
    lines = report.fr_trace_text(r).splitlines()
    assert lines[0] == "=== Verdict ==="
    assert lines[2] == ("Category: misconfigured_collective (the ranks issued different ops, "
                        "sizes or dtypes).")
    assert lines[1].endswith("Next step: " + r["next_step"])


async def test_fr_trace_page_shows_the_category_in_html_and_json(aiohttp_client: Any,
                                                                 fake_job: Any) -> None:
    urls = await fake_job(_issue_case("size"))
    client = await aiohttp_client(make_frontend_app(ServerConfig(port=0, fetch_timeout=2.0),
                                                    StaticRegistry(urls)))
    body = await (await client.get("/fr_trace?format=json")).json()
    assert (body["category"], body["findings"][0]["kind"]) == ("misconfigured_collective",
                                                               "size_mismatch")
    html = await (await client.get("/fr_trace", headers={"Accept": "text/html"})).text()
    assert 'id="category">Category: <strong>misconfigured_collective</strong> (the ranks' in html
    assert "Next step: make" in html
    text = await (await client.get("/fr_trace", headers={"Accept": "*/*"})).text()
    assert "\nCategory: misconfigured_collective (the ranks issued" in text
    assert "Next step: make the calls" in text


async def test_hang_report_json_and_text_carry_the_category(fake_job: Any, tmp_path: Path) -> None:
    import aiohttp

    urls = await fake_job(_issue_case("size"))
    async with aiohttp.ClientSession() as session:
        collector = LiveCollector(session, StaticRegistry([*urls, closed_port_url()]), timeout=2)
        watch = HangWatch(collector, str(tmp_path), interval=1.0, per_rank=False)
        rep = await watch.write_report([RankHealth(1, True, False)], [])
    (path,) = tmp_path.glob("hang_report_*.json")
    saved = json.loads(path.read_text())
    assert saved["category"] == "misconfigured_collective"
    assert saved["next_step"] == rep.result["next_step"]
    assert saved["fr_window"] == {}
    assert "Category: misconfigured_collective (the ranks issued" in rep.text
    assert f"Next step: {rep.result['next_step']}" in rep.text


def test_headlines_keep_three_missing_rank_findings_and_four_in_all() -> None:
    from debug_server.analysis.verdict import headlines
    kinds = ["size_mismatch", *["missing_ranks"] * 5, "unmatched_p2p", "stuck_everywhere",
             "history_lost"]
    findings = [{"kind": k, "severity": "info" if k == "history_lost" else "error"} for k in kinds]
    order = list(range(len(findings)))[::-1]  # the verdict's order, not the list's
    assert headlines(findings, order) == [7, 6, 5, 4, 3]


def test_banner_names_exactly_the_findings_the_analysis_picked() -> None:
    dumps = _issue_case("size")
    dumps[0]["entries"].append(make_entry(record_id=4, seq=4, state="started"))
    r = analysis.analyze(dumps)
    assert r["headline_findings"] == [1, 0]
    b = render.banner({**r, "headline_findings": [0]}, 2)
    assert [h["what"] for h in b.headlines] == ["is missing from all_reduce #4 on main_comm"]
