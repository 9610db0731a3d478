"""Health at scale: ranks whose health reads alike but for its age are one class (issue 41).

A real hang polled at 131072 ranks gives 131071 different replies: each stalled rank's op has
its own age, to the ms. Taken rank by rank, the overview's runs of ranks alike were one row per
rank, and the hang report listed 131072 health lines, a trigger line naming 131071 ranks and
131071 stack sections. By class, each is a few lines whatever the job size, and a small job's
report reads as it always did.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from debug_server.analysis.digest import DigestMemo
from debug_server.fanout.reply import FrData
from debug_server.fanout.transport import OK, RankResult
from debug_server.frontend import render
from debug_server.frontend.hangreport import (
    HangWatch,
    RankHealth,
    class_texts,
    health_json,
    health_lines,
    parse_health,
)
from debug_server.frontend.health_held import column_texts
from debug_server.tools import synthetic

STACK = ('Thread 0x00007f0000000001 (most recent call first):\n'
         '  File "/torch/distributed/distributed_c10d.py", line 2806 in all_reduce\n'
         '  File "/job/train.py", line 50 in step\n')
SLEEPING = ('Thread 0x00007f0000000002 (most recent call first):\n'
            '  File "/job/train.py", line 88 in hang_phase\n')


def _stalled(rank: int, age: float) -> RankHealth:
    op = {"group": "main_comm", "seq": 1999, "op": "all_reduce", "age_s": age}
    return RankHealth(rank, True, False, op, {"healthy": False, "stalled_op": op, "in_flight": 1,
                                               "oldest_in_flight_s": age})


def _job(world: int, missing: int) -> list[RankHealth]:
    """A hang polled: every rank stalled with its own age (ms apart), but ``missing``."""
    return [RankHealth(r, True, True, None, {"healthy": True, "in_flight": 0}) if r == missing
            else _stalled(r, 120.0 + r / 1000) for r in range(world)]


def test_a_ranks_words_are_unchanged() -> None:
    assert _stalled(3, 612.4).line() == "rank 3: UNHEALTHY: main_comm seq 1999 all_reduce in " \
                                        "flight for 612.4 s"
    busy = RankHealth(1, True, True, None, {"in_flight": 2, "oldest_in_flight_s": 3.2})
    assert busy.text() == "healthy (2 ops in flight, oldest 3 s)"
    assert RankHealth(1, True, True, None, {"in_flight": 1}).text() == "healthy (1 op in flight)"
    assert RankHealth(2, False, None, error="unreachable").text() == "health unknown (unreachable)"
    assert RankHealth(2, True, False).text() == "UNHEALTHY: stalled"


def test_ranks_alike_but_for_their_ages_share_one_text_with_the_range() -> None:
    texts = class_texts([_stalled(0, 120.04), _stalled(1, 122.0), _stalled(2, 121.5),
                         RankHealth(3, True, True, None, {"in_flight": 0})])
    assert texts == {r: "UNHEALTHY: main_comm seq 1999 all_reduce in flight for 120.0-122.0 s"
                     for r in range(3)} | {3: "healthy"}
    # One text object for the class, not one per rank.
    assert texts[0] is texts[1] is texts[2]
    # Ages that read the same once formatted read as one age.
    assert class_texts([_stalled(0, 120.01), _stalled(1, 120.04)])[0].endswith("for 120.0 s")


def test_the_overview_column_is_per_rank_up_to_cells_max_and_by_class_above() -> None:
    small = column_texts(_job(8, 5), 8)
    assert small[0].endswith("for 120.0 s") and small[7].endswith("for 120.0 s")
    assert small[5] == "healthy"
    world = render.CELLS_MAX + 904
    big = column_texts(_job(world, 77), world)
    assert len(set(big.values())) == 2 and big[77] == "healthy"
    assert big[0] == f"UNHEALTHY: main_comm seq 1999 all_reduce in flight for 120.0-" \
                     f"{120 + (world - 1) / 1000:.1f} s"


def test_the_overview_of_a_big_hung_job_is_three_runs_not_one_row_per_rank() -> None:
    world, missing = render.CELLS_MAX + 904, 77
    stacks = [RankResult(r, f"http://h:{r}", OK, SLEEPING if r == missing else STACK)
              for r in range(world)]
    model = render.overview_model({"verdict": "v"}, stacks, column_texts(_job(world, missing),
                                                                          world), world)
    assert [c.get("label") for c in model["cells"]] == ["0-76", "77", f"78-{world - 1}"]
    assert model["ranks_table"].count("<tr") == 4  # the header and three runs


def test_report_lines_per_rank_in_a_small_job_and_by_class_in_a_big_one() -> None:
    assert health_lines(_job(3, 1)) == [
        "rank 0: UNHEALTHY: main_comm seq 1999 all_reduce in flight for 120.0 s",
        "rank 1: healthy",
        "rank 2: UNHEALTHY: main_comm seq 1999 all_reduce in flight for 120.0 s"]
    assert health_lines(_job(131072, 77777)) == [
        "ranks 0-77776, 77778-131071 (131071 ranks): UNHEALTHY: main_comm seq 1999 all_reduce "
        "in flight for 120.0-251.1 s",
        "rank 77777: healthy"]


def test_report_json_per_rank_in_a_small_job_and_by_class_in_a_big_one() -> None:
    small = health_json(_job(2, 1))
    assert [e["rank"] for e in small] == [0, 1] and small[0]["stalled_op"]["age_s"] == 120.0
    big = health_json(_job(4096, 7))
    assert big == [
        {"ranks": "0-6, 8-4095", "count": 4095, "healthy": False,
         "text": "UNHEALTHY: main_comm seq 1999 all_reduce in flight for 120.0-124.1 s",
         "stalled_op": {"group": "main_comm", "seq": 1999, "op": "all_reduce"},
         "in_flight": 1, "age_s": [120.0, 124.095], "error": None},
        {"rank": 7, "healthy": True, "stalled_op": None, "in_flight": 0,
         "oldest_in_flight_s": None, "error": None}]


def test_report_json_keeps_within_its_rows() -> None:
    # Every rank stalled in its own op: no two alike.
    health = [RankHealth(r, True, False, {"group": "g", "seq": r, "op": "all_reduce"})
              for r in range(1000)]
    out = health_json(health)
    assert len(out) == 201 and out[-1] == {"ranks": "200-999", "count": 800, "left_out": True}


class _Fleet:
    """The watch's collector over a hung job of ``world`` ranks (rank ``missing`` sleeps)."""

    def __init__(self, world: int, missing: int) -> None:
        self.world_size = world
        self.registry = self
        self.digest_memo = DigestMemo()
        self.missing = missing
        self.dumps = synthetic.hang_job(world, n_entries=4, missing_rank=missing)

    async def lookup(self) -> None:
        return None

    async def fetch(self, handler: str, params: Mapping[str, str] | None = None,
                    addrs: Any = None) -> list[RankResult]:
        return [RankResult(h.rank, f"http://h:{h.rank}", OK, json.dumps(h.info))
                for h in _job(self.world_size, self.missing)]

    async def fr_stacks(self, addrs: Any = None) -> tuple[FrData, Sequence[RankResult]]:
        fr = [RankResult(r, f"http://h:{r}", OK, "") for r in self.dumps]
        return FrData(fr, dict(self.dumps)), [
            RankResult(r, f"http://h:{r}", OK, SLEEPING if r == self.missing else STACK)
            for r in self.dumps]


async def test_a_big_jobs_hang_report_is_bounded_and_names_the_missing_rank() -> None:
    world, missing = 2048, 777
    watch = HangWatch(_Fleet(world, missing), None, interval=1.0)  # type: ignore[arg-type]
    rep = await watch.poll()
    assert rep is not None
    assert parse_health(await _Fleet(2, 1).fetch("h"))[1].healthy is True
    lines = rep.text.splitlines()
    assert lines[2] == ("Trigger: ranks 0-776, 778-2047 (2047 ranks): UNHEALTHY: main_comm seq "
                        "1999 all_reduce in flight for 120.0-122.0 s")
    health = lines[lines.index("=== Health ===") + 1:lines.index("=== Verdict ===") - 1]
    assert health == [lines[2].removeprefix("Trigger: "), "rank 777: healthy"]
    assert "Rank 777" in rep.text and "=== Ranks 0-776, 778-2047 (2047 ranks) ===" in rep.text
    assert rep.text.count("in all_reduce") == 1  # the waiting ranks' stack: once
    assert "777" in rep.result["verdict"]
    assert len(rep.text) < 64 * 1024
    assert [e.get("rank", e.get("ranks")) for e in rep.to_json()["health"]] == \
        ["0-776, 778-2047", 777]
    # Its .json: compact at this size (json's indented text was 28 MB and seconds at 131072
    # ranks), the same document as a small job's indented one.
    from debug_server.frontend.fetchfacts import FetchFacts
    from debug_server.frontend.hangreport import report_json

    fr, _ = await _Fleet(world, missing).fr_stacks()
    body = report_json(rep, FetchFacts.of(fr), None)
    assert "\n" not in body and json.loads(body)["verdict"] == rep.result["verdict"]
    small = await HangWatch(_Fleet(8, 3), None, interval=1.0).poll()  # type: ignore[arg-type]
    assert small is not None
    text = report_json(small, FetchFacts.of((await _Fleet(8, 3).fr_stacks())[0]), None)
    assert text.startswith('{\n "version"') and json.loads(text)["verdict"] == small.result["verdict"]


def test_replies_alike_but_for_their_ages_share_their_dicts_and_keep_their_own_ages() -> None:
    bodies = [json.dumps(h.info) for h in _job(4, 2)] + ['{"healthy": false, "x": [1]}']
    got = parse_health([RankResult(r, f"http://h:{r}", OK, b) for r, b in enumerate(bodies)])
    assert got[0].info is got[1].info is got[3].info and got[0].stalled_op is got[3].stalled_op
    assert [h.op_age_s for h in got] == [120.0, 120.001, None, 120.003, None]
    assert [h.oldest_s for h in got] == [120.0, 120.001, None, 120.003, None]
    assert got[3].text().endswith("in flight for 120.0 s") and got[2].text() == "healthy"
    assert health_json(got[:4])[3]["stalled_op"]["age_s"] == 120.003
    assert health_json(got[:4])[3]["oldest_in_flight_s"] == 120.003
    # A reply with an unhashable value is its own, and still read.
    assert got[4].healthy is False and got[4].info == {"healthy": False, "x": [1]}


def test_a_reply_without_an_age_does_not_take_the_age_of_one_it_shares_dicts_with() -> None:
    bodies = ['{"healthy": true, "in_flight": 2, "oldest_in_flight_s": 3.2}',
              '{"healthy": true, "in_flight": 2}',
              '{"healthy": false, "in_flight": 1, "stalled_op": {"group": "g", "seq": 7, '
              '"op": "all_reduce", "age_s": 61.5}}',
              '{"healthy": false, "in_flight": 1, "stalled_op": {"group": "g", "seq": 7, '
              '"op": "all_reduce"}}']
    got = parse_health([RankResult(r, f"http://h:{r}", OK, b) for r, b in enumerate(bodies)])
    assert got[0].info is got[1].info and got[2].stalled_op is got[3].stalled_op
    assert [(h.op_age_s, h.oldest_s) for h in got] == [(None, 3.2), (None, None), (61.5, None),
                                                        (None, None)]
    assert [h.text() for h in got] == [
        "healthy (2 ops in flight, oldest 3 s)", "healthy (2 ops in flight)",
        "UNHEALTHY: g seq 7 all_reduce in flight for 61.5 s", "UNHEALTHY: g seq 7 all_reduce"]
    assert health_json(got)[3]["stalled_op"] == {"group": "g", "seq": 7, "op": "all_reduce",
                                                 "age_s": None}
