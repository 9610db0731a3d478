"""``fetchfacts.rank_rows``: the JSON pages' per-rank rows, made once per kind of record, read
exactly as each record's ``summary()`` and ``line()`` (and its process from the stacks)."""

from __future__ import annotations

import random

from debug_server.fanout.transport import GONE, OK, TIMED_OUT, UNREACHABLE, RankResult
from debug_server.frontend.fetchfacts import rank_rows, stack_rows
from debug_server.protocol.addrs import parse_ranks


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


def test_above_the_limit_ranks_alike_are_one_row_that_says_what_each_record_says() -> None:
    """Above the limit, every rank is in exactly one row; a class row says what each of its
    ranks' records says but for URL and time (the longest time), and a rank read from outside
    keeps its own row, as below the limit."""
    rnd = random.Random(5)
    for _ in range(100):
        results, stacks = [], []
        for rank in range(rnd.randrange(2, 60)):
            status = rnd.choice((OK, OK, OK, TIMED_OUT, UNREACHABLE, GONE))
            results.append(RankResult(
                rank, f"http://h:{rank}", status, None, rnd.choice((None, "refused")),
                rnd.choice((0.01, 0.25, 0.012345)), rnd.choice((None, 200)),
                rnd.choice((None, "via agent agg-0", "gone at 03:00")), 0, None,
                rnd.choice((None,) * 5 + ({"state": "D", "rank": rank},))))
            if rnd.random() < 0.1:
                stacks.append(RankResult(rank, None, OK, "", process={"state": "R"}))
        rows = rank_rows(results, stacks, limit=1)
        full = {r["rank"]: r for r in rank_rows(results, stacks)}
        seen: list[int] = []
        for row in rows:
            ranks = parse_ranks(row["global_ranks"]) if "global_ranks" in row else [row["rank"]]
            seen += ranks
            if "global_ranks" not in row:
                assert row == full[row["rank"]]
                continue
            assert row["rank"] == ranks[0] and len(ranks) > 1 and row["url"] is None
            assert [k for k in row if k != "global_ranks"] == list(full[ranks[0]])
            for r in ranks:
                each = full[r]
                assert "process" not in each
                assert {k: v for k, v in each.items() if k not in ("rank", "url", "elapsed_s",
                                                                   "line")} == \
                    {k: v for k, v in row.items() if k not in ("rank", "url", "elapsed_s",
                                                              "line", "global_ranks")}
                assert each["elapsed_s"] <= row["elapsed_s"]
            assert row["elapsed_s"] == max(full[r]["elapsed_s"] for r in ranks)
            assert row["line"].startswith(f"ranks {row['global_ranks']}: ")
        assert sorted(seen) == sorted(r.rank for r in results)
        assert [r["rank"] for r in rows] == sorted(r["rank"] for r in rows)


def test_stack_rows_read_as_each_record_and_its_text_below_and_above_the_limit() -> None:
    """``/stacks?format=json``: one row per rank (its summary and text) up to the limit; above
    it, ranks whose records and texts agree are one row with that text, every rank in one."""
    rnd = random.Random(7)
    texts = ["at train.py:88\n", "at train.py:90\n", "Thread 0x1\n"]
    for _ in range(100):
        results = [RankResult(rank, f"http://h:{rank}", rnd.choice((OK, OK, TIMED_OUT)),
                              rnd.choice(texts), rnd.choice((None, "refused")),
                              rnd.choice((0.01, 0.25)), 200, rnd.choice((None, "via agent a")),
                              0, None, rnd.choice((None,) * 6 + ({"state": "D"},)))
                   for rank in range(rnd.randrange(2, 50))]
        full = {r.rank: r.summary() | {"stacks": r.body if r.ok else None} for r in results}
        assert stack_rows(results) == [full[r.rank] for r in results]
        seen: list[int] = []
        for row in stack_rows(results, limit=1):
            ranks = parse_ranks(row["global_ranks"]) if "global_ranks" in row else [row["rank"]]
            seen += ranks
            if "global_ranks" not in row:
                assert row == full[row["rank"]]
                continue
            assert row["url"] is None and row["rank"] == ranks[0] and len(ranks) > 1
            for r in ranks:
                assert {k: v for k, v in full[r].items() if k not in ("rank", "url", "elapsed_s")} \
                    == {k: v for k, v in row.items()
                        if k not in ("rank", "url", "elapsed_s", "global_ranks")}
        assert sorted(seen) == sorted(r.rank for r in results)
