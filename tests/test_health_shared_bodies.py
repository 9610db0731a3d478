"""``parse_health`` over replies that share one body text, as agents send them (each distinct
body once, referenced by index): every rank still gets its own record."""

from __future__ import annotations

import json

from debug_server.fanout.transport import RankResult
from debug_server.frontend.hangreport import parse_health


def _reply(rank: int, body: str | None, status: str = "ok", code: int | None = 200) -> RankResult:
    return RankResult(rank, f"http://127.0.0.1:{30000 + rank}", status, body, None, 0.01, code,
                      "via agent h0")


def test_ranks_sharing_one_health_text_each_get_a_record_with_their_own_rank() -> None:
    healthy = json.dumps({"healthy": True, "in_flight": 2, "oldest_in_flight_s": 3.0})
    stalled = json.dumps({"healthy": False, "stalled_op": {"group": "main_comm", "seq": 7,
                                                           "op": "all_reduce", "age_s": 42.0}})
    got = parse_health([_reply(0, healthy), _reply(1, stalled), _reply(2, healthy),
                        _reply(3, stalled)])
    assert [(h.rank, h.text()) for h in got] == [
        (0, "healthy (2 ops in flight, oldest 3 s)"),
        (1, "UNHEALTHY: main_comm seq 7 all_reduce in flight for 42.0 s"),
        (2, "healthy (2 ops in flight, oldest 3 s)"),
        (3, "UNHEALTHY: main_comm seq 7 all_reduce in flight for 42.0 s")]


def test_a_shared_unreadable_health_text_is_not_understood_for_every_rank_that_sent_it() -> None:
    got = parse_health([_reply(4, "not json"), _reply(5, "not json"), _reply(6, None)])
    assert [(h.rank, h.answered, h.healthy, h.error) for h in got] == [
        (4, False, None, "health reply is not understood"),
        (5, False, None, "health reply is not understood"),
        (6, False, None, "health reply is not understood")]
