"""``parse_health`` over replies that share one body text, as agents send them (each distinct
body once, referenced by index): every rank still gets its own record."""

from __future__ import annotations

import json
from typing import Any

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


def test_replies_read_together_give_what_each_read_alone_gives() -> None:
    """Each distinct text is read once and its ranks share its dicts (``parse_health``), and a
    class's kind is read once per pair of dicts (``health_classes``): the same records, texts
    and classes as reading every reply alone, over random mixes of shared and own texts."""
    import random

    from debug_server.frontend.hangreport import health_classes

    rng = random.Random(7)
    bodies = [json.dumps({"healthy": False, "stalled_op": {"group": "g", "seq": 3, "op": "x",
                                                           "age_s": a},
                          "in_flight": 1, "oldest_in_flight_s": b})
              for a in (1.0, 2.5, None) for b in (3.0, None)]
    bodies += [json.dumps({"healthy": True, "stalled_op": None, "in_flight": n,
                           "oldest_in_flight_s": 1.5}) for n in (0, 2)]
    bodies += ["not json", json.dumps({"healthy": "x"}), json.dumps({"healthy": True,
                                                                     "l": [1, 2]})]
    runs = 0
    for _ in range(100):
        replies: list[RankResult] = []
        while len(replies) < 40:  # runs of ranks that answered alike, as an agent's rows come
            k, body = rng.random(), rng.choice(bodies)
            for _ in range(rng.choice((1, 1, 2, 5))):
                r = len(replies)
                replies.append(_reply(r, None, "failed", None) if k < 0.1 else
                               _reply(r, None, "failed", 404) if k < 0.15 else _reply(r, body))
        # Ranks the watch counts unhealthy for their timeouts, amid their runs.
        errors = {r: "health check timed out 3 times in a row"
                  for r in rng.sample(range(len(replies)), 3)}
        together = parse_health(replies, errors)
        runs += len(together.runs)
        alone = [parse_health([r], errors)[0] for r in replies]
        assert [_seen(h) for h in together] == [_seen(h) for h in alone]
        assert sum(h.error == errors[h.rank] for h in together if h.rank in errors) == 3
        # Per run, per record of the set, and per record read alone: the same classes.
        classes = [(c.kind, c.ranks, c.lo, c.hi) for c in health_classes(alone)]
        assert [(c.kind, c.ranks, c.lo, c.hi) for c in health_classes(together)] == classes
        assert [(c.kind, c.ranks, c.lo, c.hi) for c in health_classes(list(together))] == classes
        assert [c.first for c in health_classes(together)] == [
            together[c.ranks[0]] for c in health_classes(alone)]
    assert runs < 100 * 40 * 0.7  # runs were read as runs, not rank by rank


def _seen(h: Any) -> tuple[Any, ...]:
    """A record as read: its own ages (``op_now``, ``oldest_s``), the shared dicts less theirs."""
    rest = {k: v for k, v in h.info.items() if k not in ("stalled_op", "oldest_in_flight_s")}
    return (h.rank, h.answered, h.healthy, h.error, h.op_age_s, h.oldest_s, h.op_now(), rest,
            h.text())
