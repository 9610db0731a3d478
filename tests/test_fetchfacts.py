"""What a page shows of an FR fetch (``frontend.fetchfacts.FetchFacts``) and the text it makes."""

from __future__ import annotations

from debug_server.fanout.reply import FrData
from debug_server.fanout.transport import GONE, OK, UNREACHABLE, RankResult
from debug_server.frontend.dumps import status_block
from debug_server.frontend.fetchfacts import FetchFacts


def _fetch() -> FrData:
    recs = [RankResult(0, "u0", OK, "{}"),
            RankResult(1, "u1", UNREACHABLE, None, "unreachable after 2.0 s"),
            RankResult(2, "u2", GONE, "", note="exited 1, data from 3 s ago")]
    return FrData(recs, {0: {"entries": []}, 2: {"entries": []}}, {"main": 4})


def test_a_gone_rank_counts_as_answered_and_as_a_failure_line() -> None:
    facts = FetchFacts.of(_fetch())
    assert (facts.asked, facts.answered, facts.window, facts.scope) == (3, 2, {"main": 4}, None)
    assert [line.split(":")[0] for line in facts.failures] == ["rank 1", "rank 2"]
    assert "unreachable after 2.0 s" in facts.failures[0]


def test_status_block_says_partial_data_with_one_line_per_failed_rank() -> None:
    lines = status_block(FetchFacts.of(_fetch())).splitlines()
    assert lines[0] == "PARTIAL DATA: 1/3 ranks answered"
    assert lines[1].startswith("  rank 1: unreachable after 2.0 s") and lines[2].startswith("  rank 2")


def test_status_block_is_empty_when_every_rank_answered() -> None:
    fr = FrData([RankResult(0, "u0", OK, "{}")], {0: {"entries": []}})
    assert status_block(FetchFacts.of(fr)) == ""
