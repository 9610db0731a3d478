"""An agent's unchanged replies give the frontend the same rank records again (issue 41: at
131072 ranks no record is made and freed per rank per page), never a stale one."""

from __future__ import annotations

import json
from typing import Any

from debug_server.fanout.agentreply import AgentAddr, parse_fr
from debug_server.fanout.transport import OK, RankResult
from debug_server.protocol.addrs import WorkerAddr

AG = AgentAddr("agg-0", "http://agg", frozenset(range(4)))
ADDRS = [WorkerAddr(r, f"http://w{r}") for r in range(4)]
STACK = 'Thread 0x1 (most recent call first):\n  File "/job/train.py", line 7 in step\n'


def _reply(rows: list[dict[str, Any]], stack_rows: list[dict[str, Any]] | None = None,
           stack: str = STACK) -> str:
    return json.dumps({
        "tag": "t1", "unchanged": True, "ranks": rows,
        "snap": {str(r): 1_000 + r for r in range(4)},
        "stacks": {"ranks": stack_rows if stack_rows is not None else rows_with_body(rows),
                   "bodies": [stack]}})


def rows_with_body(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**r, "body": 0} if r["status"] == OK else r for r in rows]


def _parse(body: str, addrs: list[WorkerAddr] = ADDRS) -> tuple[list[RankResult],
                                                                  list[RankResult]]:
    recs, dumps, tag, snap, parts = parse_fr(body, AG, addrs)
    assert tag == "t1" and dumps == {} and snap is not None and "stacks" in parts
    return recs, parts["stacks"]


def _row(ranks: str, elapsed: float = 0.1, **kw: Any) -> dict[str, Any]:
    return {"ranks": ranks, "status": OK, "elapsed_s": elapsed, "http_status": 200,
            "error": None, **kw}


def test_an_unchanged_row_gives_the_same_records_with_the_new_reply_time() -> None:
    first, first_stacks = _parse(_reply([_row("0-3", 0.1)]))
    again, again_stacks = _parse(_reply([_row("0-3", 0.4)]))
    assert [id(r) for r in again] == [id(r) for r in first]
    assert [id(r) for r in again_stacks] == [id(r) for r in first_stacks]
    # A text that reads as before keeps its object (ranks alike keep sharing one).
    assert all(r.body is first_stacks[0].body for r in again_stacks)
    assert [r.elapsed_s for r in again] == [0.4] * 4
    assert [(r.rank, r.url, r.status, r.body) for r in again] == \
        [(r, f"http://w{r}", OK, "") for r in range(4)]
    assert all(r.body == STACK for r in again_stacks)
    assert all(r.note == "via agent agg-0" for r in again)


def test_a_whole_reply_s_records_are_given_again_by_the_unchanged_one_after_it() -> None:
    """A new frontend's first page gets whole replies, its second unchanged ones: those give
    the first page's records again (not 131072 new ones), but for a row with a rank the whole
    reply failed (its dump missing), which is made anew."""
    ag = AgentAddr("agg-whole", "http://agg", frozenset(range(4)))
    dump = {"entries": [], "pg_config": {}, "version": "2.10"}
    whole = json.dumps({"tag": "t1", "ranks": [_row("0-1"), _row("2-3")],
                        "dumps": {"0": dump, "1": dump, "2": dump}})  # rank 3 sent none
    recs, dumps, tag, snap, _ = parse_fr(whole, ag, ADDRS)
    assert tag == "t1" and snap is None and sorted(dumps) == [0, 1, 2]
    assert [(r.status, r.body) for r in recs[:3]] == [(OK, "")] * 3 and recs[3].status != OK
    again, _, _, snap, _ = parse_fr(_reply([_row("0-1", 0.3), _row("2-3", 0.3)]), ag, ADDRS)
    assert snap is not None and [r is w for r, w in zip(again, recs, strict=True)] == [
        True, True, False, False]
    assert [(r.status, r.elapsed_s, r.body) for r in again] == [(OK, 0.3, "")] * 4


def test_a_row_that_reads_otherwise_gives_new_records() -> None:
    first, first_stacks = _parse(_reply([_row("0-3")]))
    # Another note, other ranks in the row, another stack text: new records each.
    noted, _ = _parse(_reply([_row("0-3", note="via its host's agent")]))
    assert not {id(r) for r in noted} & {id(r) for r in first}
    assert noted[0].note == "via its host's agent; via agent agg-0"
    split, _ = _parse(_reply([_row("0-1", note="via its host's agent"),
                              _row("2-3", note="via its host's agent")]))
    assert not {id(r) for r in split} & {id(r) for r in noted}
    _, other_stacks = _parse(_reply([_row("0-1", note="via its host's agent"),
                                     _row("2-3", note="via its host's agent")], stack="x\n"))
    assert not {id(r) for r in other_stacks} & {id(r) for r in first_stacks}
    assert all(r.body == "x\n" for r in other_stacks)


def test_a_row_whose_text_changed_gives_the_same_records_with_the_new_text() -> None:
    """The health part's texts change with every page (the ages in them): its rows give the
    same records again, each with this reply's text, not 131072 new records a page."""
    first, first_stacks = _parse(_reply([_row("0-3")], stack="stalled 3 s\n"))
    again, again_stacks = _parse(_reply([_row("0-3")], stack="stalled 4 s\n"))
    assert [id(r) for r in again_stacks] == [id(r) for r in first_stacks]
    assert [r.body for r in again_stacks] == ["stalled 4 s\n"] * 4
    # A row with a rank of its own text: the others' records stay, its own takes its text.
    rows = [{**_row("0-2"), "body": 0}, {**_row("3"), "body": 1}]
    body = json.dumps({**json.loads(_reply([_row("0-3")])), "stacks": {
        "ranks": rows, "bodies": ["stalled 4 s\n", "healthy\n"]}})
    _, split = _parse(body)
    assert [r.body for r in split] == ["stalled 4 s\n"] * 3 + ["healthy\n"]
    assert [id(r) for r in split[:3]] != [id(r) for r in again_stacks[:3]]  # another row


def test_a_failed_row_is_made_anew_every_time() -> None:
    failed = {"ranks": "2-3", "status": "timed out", "elapsed_s": 2.0, "http_status": None,
              "error": "timed out after 2.0 s"}
    first, _ = _parse(_reply([_row("0-1"), failed]))
    first[2].error = "relabelled by a page"  # as KeepLast._relabel does to a failed record
    again, _ = _parse(_reply([_row("0-1"), failed]))
    assert [id(r) for r in again[:2]] == [id(r) for r in first[:2]]
    assert again[2] is not first[2] and again[2].error == "timed out after 2.0 s"


def test_new_addresses_give_new_records() -> None:
    first, _ = _parse(_reply([_row("0-3")]))
    moved = [WorkerAddr(r, f"http://moved{r}") for r in range(4)]
    again, _ = _parse(_reply([_row("0-3")]), moved)
    assert again[0] is not first[0] and again[0].url == "http://moved0"
    # The same addresses in a new list (an aggregator makes its lists per ask): reused.
    same = [WorkerAddr(r, f"http://moved{r}") for r in range(4)]
    assert _parse(_reply([_row("0-3")]), same)[0][0] is again[0]


def test_held_lists_stay_within_their_rank_budget() -> None:
    """A value held per list keeps its list alive: lists no longer handed out (a new read of
    the registry, a new split) leave as new ones come (they had piled up to 8192 lists)."""
    from debug_server.fanout.agentreply import _PerList

    made: list[int] = []
    memo = _PerList(lambda rs: made.append(len(rs)) or len(rs), max_ranks=4096)
    lists = [[WorkerAddr(r, f"u{r}") for r in range(i * 1024, (i + 1) * 1024)] for i in range(10)]
    for rs in lists:
        assert memo(rs) == 1024
    assert memo(lists[-1]) == 1024 and len(made) == 10  # the newest is held
    assert memo._ranks <= 4096 and len(memo._held) == 4
    memo(lists[0])  # gone: made again
    assert len(made) == 11
    small = [WorkerAddr(0, "u0")]
    memo(small)
    memo(small)
    assert len(made) == 12  # a host's few ranks are held too (an aggregator asks 128 a page)


def _records_one_by_one(results: list[RankResult], with_body: bool,
                        ) -> tuple[list[dict[str, Any]], list[str]]:
    """``hostreply.records`` as it was first written: each rank's summary, keyed by its JSON."""
    from debug_server.protocol.addrs import format_ranks

    texts: list[str] = []
    rows: list[dict[str, Any]] = []
    alike: dict[str, tuple[dict[str, Any], list[int]]] = {}
    for r in results:
        row = r.summary()
        row.pop("url")
        if with_body and r.body is not None:
            if r.body not in texts:
                texts.append(r.body)
            row["body"] = texts.index(r.body)
        if "process" in row:
            rows.append(row)
            continue
        rank, elapsed = row.pop("rank"), row.pop("elapsed_s")
        held = alike.setdefault(json.dumps(row, sort_keys=True), ({**row, "elapsed_s": 0.0}, []))
        if not held[1]:
            rows.append(held[0])
        held[0]["elapsed_s"] = max(held[0]["elapsed_s"], elapsed)
        held[1].append(rank)
    for row, ranks in alike.values():
        row.update({"rank": ranks[0]} if len(ranks) == 1 else {"ranks": format_ranks(ranks)})
    return rows, texts


def test_an_agents_records_are_each_ranks_summary_in_rows_of_ranks_alike() -> None:
    """Random records of every status, body, note, HTTP status and process read: the rows and
    bodies an agent writes (``hostreply.records``, keyed without making each rank's summary)
    are the ones made rank by rank from each one's summary."""
    import random

    from debug_server.agent import hostreply

    rng = random.Random(3)
    for _ in range(1500):
        results = [RankResult(r, f"http://w{r}", rng.choice([OK, OK, "unreachable", "gone"]),
                              rng.choice([None, "", "a", "b"]), rng.choice([None, "boom"]),
                              rng.choice([0.0, 0.01, 0.012345, 1.5]), rng.choice([None, 200, 404]),
                              rng.choice([None, "", "via agent h1"]), 0, None,
                              rng.choice([None, None, {"state": "R"}]))
                   for r in rng.sample(range(64), rng.randint(0, 24))]
        for with_body in (False, True):
            got = hostreply.records(results, with_body)
            want = _records_one_by_one(results, with_body)
            assert json.dumps(got, sort_keys=True) == json.dumps(want, sort_keys=True)


async def test_a_route_splits_the_same_ranks_by_the_same_host_lists_while_nothing_changed(
        ) -> None:
    """An aggregator's route asked for the same list of ranks with the same host agents found
    hands the same lists again (``AgentRoute.plan``: what it made of them is held by
    identity); another list, another agent's address or an agent down makes the split anew."""
    import dataclasses

    from fakes import FakeDirectory

    from debug_server.fanout import agents as agents_mod

    hosts = {f"h{h}": AgentAddr(f"h{h}", f"http://a{h}", frozenset(range(4 * h, 4 * h + 4)))
             for h in range(3)}
    addrs = [WorkerAddr(r, f"http://w{r}", meta={"agent": f"h{r // 4}"}) for r in range(12)]
    addrs.append(WorkerAddr(12, "http://w12"))  # no agent: asked directly
    route = agents_mod.AgentRoute(FakeDirectory(dict(hosts)), None, None)  # type: ignore[arg-type]
    first = await route.plan(addrs, tree=False)
    again = await route.plan(addrs, tree=False)
    assert first is not None and again is not None
    assert [[a.rank for a in rs] for _, rs in first.groups] == [[0, 1, 2, 3], [4, 5, 6, 7],
                                                               [8, 9, 10, 11]]
    assert [a.rank for a in first.direct] == [12]
    assert all(a is b for (_, a), (_, b) in zip(first.groups, again.groups, strict=True))
    other = await route.plan(list(addrs), tree=False)
    assert other is not None and other.groups[0][1] is not first.groups[0][1]
    route.agents.agents["h1"] = dataclasses.replace(hosts["h1"], url="http://moved")
    moved = await route.plan(list(other.addrs), tree=False)
    assert moved is not None and [ag.url for ag, _ in moved.groups][1] == "http://moved"
    route._down["h2"] = float("inf")
    down = await route.plan(moved.addrs, tree=False)
    assert down is not None and [ag.id for ag, _ in down.groups] == ["h0", "h1"]
    assert [a.rank for a in down.direct] == [8, 9, 10, 11, 12]
