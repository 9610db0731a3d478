"""The straggler rule over synthetic rings: who is named, with what lag, and who never is."""

from __future__ import annotations

import random

import pytest
from _scenarios import MS, T0, lagged_rings

from debug_server.analysis import stragglers
from debug_server.analysis.stragglers import Clock, Rule


def test_rank_sleeping_40_ms_is_named_with_its_lag() -> None:
    rnd = random.Random(1)
    dumps = lagged_rings(4, 200, lambda r, s: rnd.uniform(0, 2) + (40 if r == 2 else 0))
    res = stragglers.analyze(dumps)
    assert [(s["rank"], s["group"], s["side"]) for s in res["stragglers"]] == [(2, "main_comm", "host")]
    s = res["stragglers"][0]
    assert 36 <= s["median_lag_ms"] <= 44
    assert s["last_share"] == 1.0
    assert stragglers.public(res) == {"stragglers": res["stragglers"],
                                      "groups_checked": ["main_comm"], "window_ops": 200}
    assert stragglers.sentence(s, res).startswith(
        "Slow: rank 2 arrives last at 100 % of all_reduce on main_comm, median")


@pytest.mark.parametrize("m", [2, 4, 8, 64])
def test_uniform_traffic_names_nobody_in_many_runs(m: int) -> None:
    # 50 runs per size, jitter up to 50 ms: the false-positive claim (a uniform job is never
    # flagged) over far more than 20 runs; the jitter is wide so the lag floor is not what saves it.
    rnd = random.Random(m)
    for run in range(50 if m < 64 else 20):
        dumps = lagged_rings(m, 200, lambda r, s: rnd.expovariate(1 / 10) if rnd.random() < 0.5
                       else rnd.uniform(0, 50))
        res = stragglers.analyze(dumps)
        assert res["stragglers"] == [], (m, run, res["stragglers"])
        assert res["groups_checked"] == ["main_comm"]


def test_rank_always_last_by_microseconds_is_not_slow() -> None:
    dumps = lagged_rings(4, 200, lambda r, s: 0.05 if r == 3 else 0.0)
    res = stragglers.analyze(dumps)
    assert res["stragglers"] == []
    row = next(r for r in res["groups"][0]["rows"] if r["rank"] == 3)
    assert row["last_share"] == 1.0 and not row["slow"]


def test_rank_slow_only_on_one_of_two_groups() -> None:
    rnd = random.Random(3)
    dumps = lagged_rings(4, 100, lambda r, s: rnd.uniform(0, 2), group="dp", members=[0, 1, 2, 3])
    lagged_rings(2, 100, lambda r, s: rnd.uniform(0, 2) + (30 if r == 1 else 0), group="tp",
           members=[0, 1], into=dumps)
    res = stragglers.analyze(dumps)
    assert [(s["rank"], s["group"]) for s in res["stragglers"]] == [(1, "tp")]
    assert res["groups_checked"] == ["dp", "tp"]


def test_clock_offset_corrected_creates_no_straggler() -> None:
    rnd = random.Random(4)
    skew = {2: 5_000 * MS, 3: 5_000 * MS}  # ranks 2-3 on a host whose clock is 5 s ahead
    dumps = lagged_rings(4, 200, lambda r, s: rnd.uniform(0, 2), skew_ns=skew)
    assert {s["rank"] for s in stragglers.analyze(dumps)["stragglers"]} == {2, 3}
    clocks = {r: stragglers.best_clock([Clock(skew.get(r, 0) + 300_000, 2 * MS)])
              for r in range(4)}
    assert clocks[0] == Clock(0, 4 * MS)  # within its error of zero: the same clock
    assert stragglers.analyze(dumps, clocks)["stragglers"] == []


def test_lag_below_the_clock_error_is_not_reported() -> None:
    dumps = lagged_rings(4, 200, lambda r, s: 15.0 if r == 1 else 0.0)
    assert [s["rank"] for s in stragglers.analyze(dumps)["stragglers"]] == [1]
    clocks = {r: Clock(0, 10 * MS) for r in range(4)}  # +-10 ms each: 20 ms between two ranks
    res = stragglers.analyze(dumps, clocks)
    assert res["stragglers"] == []
    assert next(r for r in res["groups"][0]["rows"] if r["rank"] == 1)["within_clock_error"]


def test_estimate_takes_the_midpoint_and_the_shortest_round_trip() -> None:
    # The rank read its clock (10 s ahead) in the middle of a 4 ms round trip ending at T0.
    c = stragglers.estimate(T0 - 2 * MS + 10_000 * MS, T0, 0.004)
    assert abs(c.offset_ns - 10_000 * MS) <= 1 and c.error_ns == 2 * MS + 1
    assert stragglers.best_clock([Clock(5, 9 * MS), c, Clock(1, 50 * MS)]) == c


def test_too_few_ops_names_nobody() -> None:
    # 4 members: last 9 times in 9 happens by chance with p = 4**-9 > 1e-6, so 10 are needed.
    assert stragglers.needed_ops(Rule(), 4) == 10 and stragglers.needed_ops(Rule(), 2) == 20
    assert stragglers.needed_ops(Rule(), 4096) == 8
    dumps = lagged_rings(4, 9, lambda r, s: 40.0 if r == 2 else 0.0)
    res = stragglers.analyze(dumps)
    assert res["stragglers"] == [] and res["groups_checked"] == []
    dumps = lagged_rings(4, 10, lambda r, s: 40.0 if r == 2 else 0.0)
    assert [s["rank"] for s in stragglers.analyze(dumps)["stragglers"]] == [2]


def test_device_side_when_issued_on_time_but_started_late() -> None:
    rnd = random.Random(5)
    dumps = lagged_rings(4, 100, lambda r, s: rnd.uniform(0, 1),
                   start_lag=lambda r, s: 5 + rnd.uniform(0, 1) + (25 if r == 0 else 0))
    res = stragglers.analyze(dumps)
    assert [(s["rank"], s["side"]) for s in res["stragglers"]] == [(0, "device")]
    assert 24 <= res["stragglers"][0]["median_lag_ms"] <= 27
    assert "device side" in stragglers.sentence(res["stragglers"][0], res)


def test_window_keeps_the_newest_ops_and_trend_rises() -> None:
    # Rank 1 turned slow at seq 350: a quarter of the 200-op window, the newest quarter.
    dumps = lagged_rings(4, 400, lambda r, s: 40.0 if r == 1 and s >= 350 else 0.0)
    res = stragglers.analyze(dumps, rule=Rule(window_ops=200))
    row = next(r for r in res["groups"][0]["rows"] if r["rank"] == 1)
    assert row["trend_ms"] == 20.0 and len(row["spark"]) == stragglers.SPARK_POINTS
    assert res["stragglers"] == []  # a quarter of the window: its median lag is still 0
    res = stragglers.analyze(dumps, rule=Rule(window_ops=40))
    assert [s["rank"] for s in res["stragglers"]] == [1]


def test_incomplete_collectives_are_left_out() -> None:
    dumps = lagged_rings(4, 60, lambda r, s: 40.0 if r == 2 else 0.0)
    dumps[2]["entries"] = dumps[2]["entries"][:30]  # rank 2 stopped at seq 30 (a hang)
    res = stragglers.analyze(dumps)
    assert res["groups"][0]["ops"] == 30
    assert [s["rank"] for s in res["stragglers"]] == [2]


def test_binomial_tail() -> None:
    assert stragglers.binom_tail(0, 10, 0.5) == 1.0
    assert stragglers.binom_tail(10, 10, 0.5) == pytest.approx(2**-10)
    assert stragglers.binom_tail(11, 10, 0.5) == 0.0


def test_compact_dumps_give_what_whole_ones_give() -> None:
    """What the straggler poll keeps of each reply (``compact``: the entries' times in arrays,
    the rest of the dump as it came) reads as the whole dump, over fleets with two groups,
    start times, clock offsets and damaged entries; the entries themselves are not kept."""
    rnd = random.Random(5)
    named = 0
    for _ in range(60):
        m, slow = rnd.choice((2, 4, 8)), rnd.randrange(8)
        dumps = lagged_rings(m, rnd.choice((12, 40)),
                             lambda r, s, slow=slow: rnd.uniform(0, 2) + (40 if r == slow else 0),
                             start_lag=(lambda r, s, slow=slow: rnd.uniform(0, 50 if r == slow else 1))
                             if rnd.random() < 0.5 else None)
        lagged_rings(m, 30, lambda r, s: rnd.uniform(0, 20), group="tp",
                     members=sorted(rnd.sample(range(m), 2)), into=dumps)
        for d in dumps.values():  # a dropped entry, a P2P one, one without a time, a repeat
            es = d["entries"]
            k = rnd.randrange(len(es))
            es[k] = rnd.choice(({**es[k], "is_p2p": True}, {**es[k], "time_created_ns": None},
                                {**es[k], "time_created_ns": es[k]["time_created_ns"] + 9}))
            if rnd.random() < 0.3:
                es.pop(rnd.randrange(len(es)))
        clocks = {r: Clock(rnd.choice((0, 2 * MS)), rnd.choice((1000, 3 * MS))) for r in dumps}
        rule = Rule(window_ops=rnd.choice((8, 200)))
        kept = {r: stragglers.compact(d) for r, d in dumps.items()}
        assert all("entries" not in d and d["pg_config"] is dumps[r]["pg_config"]
                   for r, d in kept.items())
        whole = stragglers.analyze(dumps, clocks, rule)
        assert stragglers.analyze(kept, clocks, rule) == whole
        named += len(whole["stragglers"])
    assert named >= 10  # fleets where someone is named, not only quiet ones


def test_malformed_entries_and_dumps_are_skipped_not_raised() -> None:
    """What the poll keeps of a reply is made as the reply arrives (``compact``): entries that
    are not objects, a process group that is not a list, entries that are not a list, are
    skipped there, and the others still name the slow rank."""
    rnd = random.Random(2)
    dumps = lagged_rings(4, 40, lambda r, s: rnd.uniform(0, 2) + (40 if r == 2 else 0))
    dumps[0]["entries"][5:5] = ["x", None, 3, [1, 2], {"process_group": "main_comm",
                                                       "collective_seq_id": 5,
                                                       "time_created_ns": 7}]
    kept = {r: stragglers.compact(d) for r, d in dumps.items()}
    kept[4] = stragglers.compact({"entries": {"not": "a list"}, "pg_config": "nor this"})
    assert kept[4][stragglers.TIMINGS] == {}
    assert [s["rank"] for s in stragglers.analyze(kept)["stragglers"]] == [2]


def test_ranks_alike_share_their_window_s_seqs_and_ops() -> None:
    dumps = lagged_rings(64, 16, lambda r, s: 0.0)
    runs = [stragglers.timings(d)["main_comm"] for d in dumps.values()]
    assert len({id(run.seqs) for run in runs}) == 1 and len({id(run.ops) for run in runs}) == 1
    assert runs[5].seqs == tuple(range(16)) and runs[5].ops == ("all_reduce",) * 16
    assert runs[5].issued[3] == T0 + 3 * 100 * MS and runs[5].started is None


def test_past_the_rows_a_page_shows_a_member_s_row_is_what_metrics_reads() -> None:
    """200 members: the slowest ``SPARK_ROWS`` and the slow one carry every figure, the others
    only what ``/metrics`` reads of every member (a lighter result to hold at 131072)."""
    rnd = random.Random(9)
    dumps = lagged_rings(200, 30, lambda r, s: rnd.uniform(0, 2) + (40 if r == 150 else 0))
    rows = stragglers.analyze(dumps)["groups"][0]["rows"]
    assert [r["rank"] for r in rows][0] == 150 and rows[0]["slow"] and "spark" in rows[0]
    assert len(rows) == 200 and sorted(r["rank"] for r in rows) == list(range(200))
    full, light = rows[:stragglers.SPARK_ROWS], rows[stragglers.SPARK_ROWS:]
    assert all(len(r["spark"]) == 30 and r["p_value"] <= 1.0 for r in full)
    assert all(set(r) == {"rank", "median_lag_ms", "last_share", "last", "slow", "side"}
               and not r["slow"] for r in light)
    assert [r["median_lag_ms"] for r in rows] == sorted((r["median_lag_ms"] for r in rows),
                                                       reverse=True)


def test_dumps_without_pg_config_are_read_by_the_ranks_in_their_entries() -> None:
    """A group no ``pg_config`` names has the ranks seen in its entries as members (before,
    that raised ``FrozenInstanceError`` and the poll failed)."""
    dumps = lagged_rings(4, 40, lambda r, s: 40.0 if r == 2 else 0.0)
    for d in dumps.values():
        d["pg_config"] = {}
    res = stragglers.analyze(dumps)
    assert [s["rank"] for s in res["stragglers"]] == [2]
    assert res["groups"][0]["size"] == 4
