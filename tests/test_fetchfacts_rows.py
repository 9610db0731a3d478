"""``fetchfacts.rank_rows``: the JSON pages' per-rank rows, made once per kind of record, read
exactly as each record's ``summary()`` and ``line()`` (and its process from the stacks)."""

from __future__ import annotations

import random

from debug_server.fanout.transport import GONE, OK, TIMED_OUT, UNREACHABLE, RankResult
from debug_server.frontend.fetchfacts import rank_rows


def _old(results: list[RankResult], stacks: list[RankResult]) -> list[dict[str, object]]:
    procs = {r.rank: r.process for r in stacks if r.process is not None}
    return [r.summary() | {"line": r.line()}
            | ({"process": procs[r.rank]} if r.rank in procs else {}) for r in results]


def test_rows_read_as_each_record_s_summary_and_line() -> None:
    rnd = random.Random(3)
    shared_proc = {"state": "S"}
    for _ in range(200):
        results, stacks = [], []
        for rank in range(rnd.randrange(1, 40)):
            status = rnd.choice((OK, OK, OK, TIMED_OUT, UNREACHABLE, GONE))
            results.append(RankResult(
                rank, rnd.choice((None, f"http://h:{rank}")), status, None,
                rnd.choice((None, "refused", "timed out after 2.0 s")),
                rnd.choice((0.01, 0.25, 0.012345)), rnd.choice((None, 200, 500)),
                rnd.choice((None, "via agent h0", "gone at 03:00")), 0, None,
                rnd.choice((None, None, shared_proc, {"state": "D", "rank": rank}))))
            if rnd.random() < 0.3:
                stacks.append(RankResult(rank, None, OK, "", process={"state": "R"}))
        rows = rank_rows(results, stacks)
        assert rows == _old(results, stacks)
        assert [list(r) for r in rows] == [list(r) for r in _old(results, stacks)]  # key order
        assert len({id(r) for r in rows}) == len(rows)  # each row its own dict
