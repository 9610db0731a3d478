"""The analyzer's grace for collectives issued just before a rank's snapshot (``dump_time_ns``).

The ranks' rings are never read at one instant. A rank read a moment before the others issued a
collective does not hold it yet; a rank read a moment after the others, once its ring wrapped, no
longer holds their oldest op. Neither is a finding. The same shapes read seconds later, or dumps
that do not say when they were taken, keep their findings.
"""

from __future__ import annotations

from typing import Any

from debug_server.analysis.core import analyze
from debug_server.analysis.digest import SNAPSHOT_TIME_KEY
from debug_server.analysis.skew import IN_FLIGHT_GRACE_NS
from debug_server.tools.synthetic import make_dump, make_entry

T = 1_800_000_000_000_000_000  # when seq NEWEST was issued (wall clock, ns)
STEP = 100_000  # one all_reduce every 0.1 ms
NEWEST = 10
MS = 1_000_000
GROUPS = {"main_comm": [0, 1]}


def _rank(first: int, last: int, snap: int | None, done_through: int) -> dict[str, Any]:
    """One rank's dump holding seqs ``first..last`` (issued STEP apart, ``last`` at the latest)
    of a loop, completed through ``done_through``, read at ``snap`` (None: no time in the dump)."""
    entries = [make_entry(record_id=s, seq=s, state="completed" if s <= done_through else "started",
                          time_created_ns=T + (s - NEWEST) * STEP)
               for s in range(first, last + 1)]
    dump = make_dump(entries, GROUPS)
    if snap is not None:
        dump[SNAPSHOT_TIME_KEY] = snap
    return dump


def _kinds(result: dict[str, Any]) -> list[tuple[str, int | None, list[int]]]:
    return [(f["kind"], f["seq"], f["ranks"]) for f in result["findings"]]


def test_rank_read_just_before_the_others_issued_the_op_is_not_missing() -> None:
    # Rank 1 was read 1 ms before rank 0 issued #10; rank 0 was read 2 ms after issuing it.
    dumps = {0: _rank(0, NEWEST, T + 2 * MS, NEWEST - 1), 1: _rank(0, NEWEST - 1, T - MS, NEWEST - 1)}
    result = analyze(dumps)
    assert result["findings"] == []
    assert "category" not in result
    row = next(c for c in result["collectives"] if c["seq"] == NEWEST)
    assert (row["pass_check"], row["missing_ranks"], row["in_flight_ranks"]) == (True, [], [1])
    assert result["verdict"].startswith("No hang or mismatch found")


def test_op_older_than_the_grace_at_every_read_is_a_missing_rank() -> None:
    late = T + 3 * IN_FLIGHT_GRACE_NS  # a page read three grace periods into the hang
    dumps = {0: _rank(0, NEWEST, late, NEWEST - 1), 1: _rank(0, NEWEST - 1, late, NEWEST - 1)}
    result = analyze(dumps)
    assert _kinds(result) == [("missing_ranks", NEWEST, [1])]
    row = next(c for c in result["collectives"] if c["seq"] == NEWEST)
    assert (row["pass_check"], row["missing_ranks"], row["in_flight_ranks"]) == (False, [1], [])
    assert result["category"] == "cpu_divergence"


def test_dumps_without_a_snapshot_time_keep_the_missing_rank() -> None:
    dumps = {0: _rank(0, NEWEST, None, NEWEST - 1), 1: _rank(0, NEWEST - 1, None, NEWEST - 1)}
    assert _kinds(analyze(dumps)) == [("missing_ranks", NEWEST, [1])]


def test_missing_rank_whose_dump_has_no_time_gets_no_grace() -> None:
    dumps = {0: _rank(0, NEWEST, T + 2 * MS, NEWEST - 1), 1: _rank(0, NEWEST - 1, None, NEWEST - 1)}
    assert _kinds(analyze(dumps)) == [("missing_ranks", NEWEST, [1])]


def test_rank_read_seconds_after_the_op_is_missing_even_if_the_issuers_dump_is_older() -> None:
    # Rank 0 wrote its dump 2 ms after issuing #10 and froze; rank 1 was read 3 s later.
    dumps = {0: _rank(0, NEWEST, T + 2 * MS, NEWEST - 1),
             1: _rank(0, NEWEST - 1, T + 3 * IN_FLIGHT_GRACE_NS, NEWEST - 1)}
    assert _kinds(analyze(dumps)) == [("missing_ranks", NEWEST, [1])]


def test_op_nobody_completed_yet_read_just_after_issue_is_not_stuck_everywhere() -> None:
    dumps = {r: _rank(0, NEWEST, T + MS, NEWEST - 1) for r in (0, 1)}
    result = analyze(dumps)
    assert result["findings"] == []
    assert "category" not in result


def test_op_nobody_completed_for_longer_than_the_grace_is_stuck_everywhere() -> None:
    dumps = {r: _rank(0, NEWEST, T + 3 * IN_FLIGHT_GRACE_NS, NEWEST - 1) for r in (0, 1)}
    assert _kinds(analyze(dumps)) == [("stuck_everywhere", NEWEST, [0, 1])]


def test_op_whose_first_issuer_froze_just_after_issuing_it_is_stuck_once_the_last_read_is_old(
        ) -> None:
    # Rank 1 issued #10 and its dump was written 1 ms later, then it froze; rank 0 issued #10
    # 100 ms later and was read 3 s after that. Nobody completed it.
    dumps = {0: _rank(0, NEWEST, T + 3 * IN_FLIGHT_GRACE_NS, NEWEST - 1),
             1: _rank(0, NEWEST, T + MS - 100 * MS, NEWEST - 1)}
    for e in dumps[1]["entries"]:
        e["time_created_ns"] -= 100 * MS
    assert _kinds(analyze(dumps)) == [("stuck_everywhere", NEWEST, [0, 1])]


def test_wrapped_ring_read_two_ops_later_is_not_history_lost() -> None:
    # 8-entry rings. Rank 0 read at T + 1 ms holds #3-#10; rank 1 issued #11 and #12 after that
    # instant (each pushing one old entry out) and was read then: it holds #5-#12.
    dumps = {0: _rank(NEWEST - 7, NEWEST, T + MS, NEWEST),
             1: _rank(NEWEST - 5, NEWEST + 2, T + 3 * MS, NEWEST + 1)}
    for e in dumps[1]["entries"][-2:]:  # #11 and #12: issued after rank 0's read
        e["time_created_ns"] += 2 * MS
    result = analyze(dumps)
    assert result["findings"] == []
    rows = {c["seq"]: c for c in result["collectives"]}
    assert [rows[s]["history_lost_ranks"] for s in (3, 4)] == [[1], [1]]  # the rows stay exact
    assert [rows[s]["in_flight_ranks"] for s in (11, 12)] == [[0], [0]]


def test_ring_that_lost_more_ops_than_it_issued_since_the_others_read_is_history_lost() -> None:
    # Rank 1's ring is 4 entries: #9-#12. Only 2 of the 6 ops rank 0 holds and rank 1 lacks at
    # the old end can have been pushed out since rank 0 was read.
    dumps = {0: _rank(NEWEST - 7, NEWEST, T + MS, NEWEST),
             1: _rank(NEWEST - 1, NEWEST + 2, T + 3 * MS, NEWEST + 1)}
    for e in dumps[1]["entries"][-2:]:
        e["time_created_ns"] += 2 * MS
    assert _kinds(analyze(dumps)) == [("history_lost", NEWEST - 4, [1])]  # #3-#6 really lost


def test_wrapped_rings_without_snapshot_times_keep_history_lost() -> None:
    dumps = {0: _rank(NEWEST - 7, NEWEST, None, NEWEST),
             1: _rank(NEWEST - 5, NEWEST + 2, None, NEWEST + 1)}
    assert _kinds(analyze(dumps)) == [("missing_ranks", NEWEST + 1, [0]),
                                      ("history_lost", NEWEST - 6, [1])]


def _sender_and_reader(peer_read: int | None) -> dict[int, dict[str, Any]]:
    """Rank 0 posted send #1 to rank 1 at T and was read 2 ms later; rank 1, read at
    ``peer_read``, holds no receive for it."""
    send = make_entry(record_id=NEWEST + 1, seq=NEWEST, p2p_seq=1, op="send", is_p2p=True,
                      peer_desc="0->1", state="started", time_created_ns=T)
    dumps = {0: _rank(0, NEWEST - 1, T + 2 * MS, NEWEST - 1),
             1: _rank(0, NEWEST - 1, peer_read, NEWEST - 1)}
    dumps[0]["entries"].append(send)
    return dumps


def test_send_posted_after_its_peer_was_read_is_not_unmatched() -> None:
    result = analyze(_sender_and_reader(T - MS))
    assert result["findings"] == []
    row = next(c for c in result["collectives"] if c["p2p_seq"] == 1)
    assert (row["pass_check"], row["missing_ranks"], row["in_flight_ranks"]) == (True, [], [1])


def test_send_unmatched_at_a_read_seconds_later_is_unmatched_p2p() -> None:
    result = analyze(_sender_and_reader(T + 3 * IN_FLIGHT_GRACE_NS))
    assert _kinds(result) == [("unmatched_p2p", None, [1])]  # the peer that posted no recv


def test_send_unmatched_at_a_peer_read_without_time_is_unmatched_p2p() -> None:
    assert _kinds(analyze(_sender_and_reader(None))) == [("unmatched_p2p", None, [1])]


def test_rank_read_before_its_first_op_in_a_group_is_not_missing() -> None:
    dumps = {0: _rank(NEWEST, NEWEST, T + 2 * MS, NEWEST - 1), 1: make_dump([], GROUPS)}
    dumps[1][SNAPSHOT_TIME_KEY] = T - MS
    result = analyze(dumps)
    assert result["findings"] == []
    assert result["collectives"][0]["in_flight_ranks"] == [1]
