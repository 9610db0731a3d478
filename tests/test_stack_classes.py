"""Stacks alike but for thread ids are one class (issue 41).

Each process prints its own thread ids (``Thread 0x00007f3c...``), so no two ranks' stack texts
are equal, even where every rank waits at one line. Grouped by text, 131072 ranks were 131072
texts on the way up, 131072 parses at the frontend and a group each on ``/stacks``.
"""

from __future__ import annotations

from typing import Any

from debug_server.agent import hostreply
from debug_server.analysis import stackgroups, stackparse
from debug_server.fanout.transport import OK, UNREACHABLE, RankResult
from debug_server.frontend import render
from debug_server.protocol.agentwire import stack_class

WAITING = ("Current thread 0x{a} (most recent call first):\n"
           '  File "/srv/worker.py", line 12 in serve\n'
           "\n"
           "Thread 0x{b} (most recent call first):\n"
           '  File "/torch/distributed/distributed_c10d.py", line 2806 in all_reduce\n'
           '  File "/job/train.py", line 95 in step\n'
           '  File "/job/train.py", line 120 in <module>\n')
SLEEPING = WAITING.replace('  File "/torch/distributed/distributed_c10d.py", line 2806 in '
                           'all_reduce\n  File "/job/train.py", line 95 in step\n',
                           '  File "/job/train.py", line 88 in hang_phase\n')


def _text(rank: int, odd: int = -1) -> str:
    base = 0x7F0000000000 + rank * 0x100000
    return (SLEEPING if rank == odd else WAITING).format(a=f"{base:016x}",
                                                         b=f"{base + 0x1000:016x}")


def test_a_class_is_the_text_less_its_thread_ids() -> None:
    assert _text(1) != _text(2) and stack_class(_text(1)) == stack_class(_text(2))
    assert stack_class(_text(3, odd=3)) != stack_class(_text(2))
    assert stack_class("Thread 12345 (idle): MainThread\n") == "Thread <id> (idle): MainThread"


def test_an_aggregator_sends_ranks_alike_as_one_text_and_one_row() -> None:
    results = [RankResult(r, f"http://h:{r}", OK, _text(r, odd=5), None, 0.01, 200)
               for r in range(8)]
    results.append(RankResult(8, "http://h:8", UNREACHABLE, error="unreachable after 2.0 s"))
    hostreply.fold_stacks(results)
    assert all(r.body is results[0].body for r in results[:8] if r.rank != 5)
    assert results[5].body == _text(5, odd=5) and results[8].body is None
    rows, texts = hostreply.records(results, with_body=True)
    assert len(texts) == 2 and sorted(str(row.get("ranks", row.get("rank"))) for row in rows
                                      if "body" in row) == ["0-4,6-7", "5"]


def test_the_analysis_and_the_stacks_page_parse_each_class_once(monkeypatch: Any) -> None:
    texts = {r: _text(r, odd=77) for r in range(4096)}
    parsed: list[str] = []
    summarize = stackparse.summarize_text
    monkeypatch.setattr(stackparse, "summarize_text",
                        lambda t: parsed.append(t) or summarize(t))
    groups = stackgroups.stack_groups(texts)
    assert [(g["ranks"][:2], len(g["ranks"]), g["summary"]) for g in groups] == [
        ([77], 1, "hang_phase at train.py:88"), ([0, 1], 4095, "all_reduce at train.py:95")]
    assert len(parsed) == 2
    keys: list[str] = []
    stack_key = render._stack_key
    monkeypatch.setattr(render, "_stack_key", lambda t: keys.append(t) or stack_key(t))
    model = render.stacks_model([RankResult(r, f"http://h:{r}", OK, t) for r, t in texts.items()])
    assert [g["label"] for g in model["groups"]] == ["rank 77", "4095 ranks"]
    assert len(keys) == 2


def test_the_class_is_the_thread_id_substitution_exactly() -> None:
    import re

    ref = re.compile(r"\b([Tt]hread) (0x[0-9a-fA-F]+|\d+)\b")
    for text in [_text(3), _text(4, odd=4), "Thread 12345 (idle): MainThread\n", "xThread 0x1 a",
                 "thread 0x12g", "Thread 0x1f_x", "_thread 5 b", "Current thread 0xabc (most",
                 "Thread  0x1", "Thread 99", "hread 5", "T hread 5", "Thread 0x", "éThread 5",
                 " Thread 0xAbC\nThread 7\n\n", ""]:
        assert stack_class(text) == ref.sub(r"\1 <id>", text.rstrip("\n")), text


def test_the_banner_places_ranks_by_group_as_it_does_rank_by_rank(monkeypatch: Any) -> None:
    """``render._where`` over many sorted ranks goes by stack group (set intersections), and
    must say what the rank-by-rank way says: the same positions, ranks and order."""
    import random

    rnd = random.Random(41)
    for trial in range(60):
        world = rnd.choice([300, 1000, 5000])
        summaries = [f"f{i} at train.py:{80 + i}" for i in range(rnd.randint(1, 5))]
        groups: list[dict[str, Any]] = [
            {"summary": rnd.choice(summaries), "in_collective": rnd.random() < 0.5, "ranks": []}
            for _ in range(rnd.randint(1, 6))]
        for r in range(world):
            if rnd.random() < 0.97:
                rnd.choice(groups)["ranks"].append(r)
        result = {"stack_groups": groups}
        pos = render._positions(result)
        ranks = sorted(rnd.sample(range(world + 10), rnd.randint(257, world)))
        fast = render._where(ranks, pos)
        monkeypatch.setattr(render, "BY_GROUP_ABOVE", 10 ** 9)
        slow = render._where(ranks, pos)
        monkeypatch.undo()
        assert fast == slow, trial
