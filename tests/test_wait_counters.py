"""wait_counters and outliers: the per-rank table, what stands out, malformed replies."""

from __future__ import annotations

import json

import pytest

from debug_server.analysis import wait_counters as wc
from debug_server.analysis.outliers import outliers


def _counters(total_time_us: float, active: int = 0, calls: int = 4) -> wc.Counters:
    return {"pytorch.wait_counter.TCPStore__wait": {
        "active_count": active, "total_calls": calls, "total_time_us": total_time_us,
        "max_time_us": total_time_us / calls}}


def test_outliers_flag_high_and_low_values_beyond_factor_and_floor() -> None:
    values = {0: 10.0, 1: 11.0, 2: 10.0, 3: 40.0, 4: 2.0}
    assert [(o.rank, o.direction) for o in outliers(values, floor=5.0)] == [(3, "high"), (4, "low")]


def test_outliers_ignore_differences_below_the_floor() -> None:
    assert outliers({0: 1.0, 1: 1.0, 2: 4.0}, floor=5.0) == []


def test_two_ranks_flag_nothing() -> None:
    assert outliers({0: 1.0, 1: 1000.0}, floor=1.0) == []


def test_table_has_a_column_per_rank_and_marks_the_slow_rank() -> None:
    per_rank = {r: _counters(5_000_000 if r == 2 else 100_000) for r in range(4)}
    t = wc.table(per_rank)
    assert t["ranks"] == [0, 1, 2, 3]
    row = next(r for r in t["rows"] if r["field"] == "total_time_us")
    assert row["values"] == {0: 100_000, 1: 100_000, 2: 5_000_000, 3: 100_000}
    assert row["marks"] == {2: "high"}
    assert {(m["rank"], m["field"]) for m in t["marked"]} == {(2, "total_time_us"),
                                                              (2, "max_time_us")}


def test_the_one_rank_still_waiting_is_marked() -> None:
    per_rank = {r: _counters(100, active=1 if r == 0 else 0) for r in range(4)}
    row = next(r for r in wc.table(per_rank)["rows"] if r["field"] == "active_count")
    assert row["marks"] == {0: "high"}


def test_rows_zero_on_every_rank_are_left_out() -> None:
    t = wc.table({r: _counters(100) for r in range(3)})
    assert "active_count" not in {r["field"] for r in t["rows"]}


def test_a_counter_missing_on_one_rank_shows_as_none() -> None:
    t = wc.table({0: _counters(100), 1: {}})
    assert t["rows"][0]["values"][1] is None


@pytest.mark.parametrize("body", ['["a"]', '{"c": 3}', "not json"])
def test_malformed_replies_are_refused(body: str) -> None:
    with pytest.raises(ValueError):
        wc.parse_counters(body)


def test_non_numeric_fields_are_left_out() -> None:
    got = wc.parse_counters(json.dumps({"c": {"total_calls": 2, "x": "<b>", "y": True}}))
    assert got == {"c": {"total_calls": 2.0}}
