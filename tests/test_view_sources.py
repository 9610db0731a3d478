"""The post-mortem viewer reads every source in a dump dir: a cycle without an FR snapshot (or
with ranks the snapshot lacks) takes their FR data from the per-rank dumps and says so, and the
default cycle is the one with the most complete data about the hang."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import _scenarios as S
from fakes import NEW, OLD, RANK0_STACK, RANK1_STACK, write_cycle

from debug_server.dumpio import write_dump_atomic
from debug_server.fanout.reply import FrData
from debug_server.fanout.transport import OK, TIMED_OUT, RankResult
from debug_server.frontend.dumps import snapshot_json, stacks_report
from debug_server.tools.view import make_view_app

LATER = "20240101_100030"


def _age(d: Path, seconds: float) -> None:
    t = time.time() - seconds
    for p in d.rglob("*"):
        os.utime(p, (t, t))


def _per_rank(d: Path, ranks: tuple[int, ...] = (0, 1)) -> None:
    """The pickles each rank writes on its way out (the reference hang: rank 1 never joined
    all_reduce #4)."""
    (d / "per_rank").mkdir()
    dumps = S.missing_rank()
    for r in ranks:
        write_dump_atomic(str(d / "per_rank" / f"rank_{r}"), dumps[r])


def _stacks(d: Path, stamp: str) -> None:
    (d / f"stacks_{stamp}.txt").write_text(stacks_report(
        [RankResult(0, "u0", OK, RANK0_STACK), RankResult(1, "u1", OK, RANK1_STACK)]))


async def _get(aiohttp_client: Any, d: Path, path: str, **params: str) -> Any:
    client = await aiohttp_client(make_view_app(str(d)))
    resp = await client.get(path, params={"format": "json", **params})
    assert resp.status == 200, await resp.text()
    return await resp.json()


def _missing(body: Any) -> list[tuple[str, int, list[int]]]:
    return [(f["kind"], f["seq"], f["ranks"]) for f in body["findings"]]


async def test_pickles_and_a_stacks_file_name_the_missing_rank(aiohttp_client: Any,
                                                               tmp_path: Path) -> None:
    # The frontend could not fetch FR (wedged ranks) or died before the snapshot: a stacks
    # file newer than the ranks' pickles.
    _per_rank(tmp_path)
    _age(tmp_path, 100)
    _stacks(tmp_path, NEW)
    body = await _get(aiohttp_client, tmp_path, "/fr_trace")
    pm = body["postmortem"]
    assert pm["cycle"] == NEW
    assert _missing(body) == [("missing_ranks", 4, [1])]
    assert pm["sources"] == {"fr": "per-rank dumps (rank 0-1)", "stacks": f"stacks_{NEW}.txt"}
    assert f"cycle {NEW}: no usable fr_snapshot_{NEW}.json; Flight Recorder data of rank 0-1 " \
           "taken from the per-rank dumps in per_rank (written " in pm["problems"][0]
    stacks = await _get(aiohttp_client, tmp_path, "/stacks")
    assert "line 66 in hang_phase" in stacks["ranks"][1]["stacks"]


async def test_pickles_only_name_the_missing_rank(aiohttp_client: Any, tmp_path: Path) -> None:
    _per_rank(tmp_path)
    body = await _get(aiohttp_client, tmp_path, "/fr_trace")
    assert body["postmortem"]["cycle"] == "per_rank"
    assert _missing(body) == [("missing_ranks", 4, [1])]


async def test_snapshots_only_are_read_as_the_dumper_wrote_them(aiohttp_client: Any,
                                                                tmp_path: Path) -> None:
    write_cycle(tmp_path, OLD, S.clean(2, 4), {0: RANK0_STACK, 1: RANK0_STACK})
    write_cycle(tmp_path, NEW, S.missing_rank(), {0: RANK0_STACK, 1: RANK1_STACK})
    body = await _get(aiohttp_client, tmp_path, "/fr_trace")
    assert body["postmortem"]["cycle"] == NEW and body["postmortem"]["problems"] == []
    assert body["postmortem"]["sources"]["fr"] == f"fr_snapshot_{NEW}.json"
    assert _missing(body) == [("missing_ranks", 4, [1])]


async def test_a_rank_the_snapshot_lacks_comes_from_its_pickle(aiohttp_client: Any,
                                                               tmp_path: Path) -> None:
    _per_rank(tmp_path, ranks=(1,))
    dumps = S.missing_rank()
    fr = FrData([RankResult(0, "u0", OK, json.dumps(dumps[0])),
                 RankResult(1, "u1", TIMED_OUT, error="rank 1: timed out after 2.0 s")],
                {0: dumps[0]})
    (tmp_path / f"fr_snapshot_{NEW}.json").write_text(snapshot_json(fr))
    _stacks(tmp_path, NEW)
    body = await _get(aiohttp_client, tmp_path, "/fr_trace")
    assert body["postmortem"]["sources"]["fr"] == f"fr_snapshot_{NEW}.json + per-rank dumps (rank 1)"
    assert body["postmortem"]["problems"][0].startswith(
        f"cycle {NEW}: ranks its snapshot lacks; Flight Recorder data of rank 1 taken from")
    assert _missing(body) == [("missing_ranks", 4, [1])]


async def test_a_cycle_cut_short_by_a_killed_frontend_is_passed_over(aiohttp_client: Any,
                                                                     tmp_path: Path) -> None:
    write_cycle(tmp_path, NEW, S.missing_rank(), {0: RANK0_STACK, 1: RANK1_STACK})
    _age(tmp_path, 100)
    # Killed mid-cycle: half a snapshot (a copy, or a filesystem without atomic rename), no
    # stacks file yet.
    whole = (tmp_path / f"fr_snapshot_{NEW}.json").read_text()
    (tmp_path / f"fr_snapshot_{LATER}.json").write_text(whole[: len(whole) // 2])
    body = await _get(aiohttp_client, tmp_path, "/fr_trace")
    assert body["postmortem"]["cycle"] == NEW
    assert _missing(body) == [("missing_ranks", 4, [1])]
    # Asked for, the cut cycle says what is wrong with it in one line, and per-rank pickles
    # written later fill it in.
    _per_rank(tmp_path)
    cut = await _get(aiohttp_client, tmp_path, "/fr_trace", cycle=LATER)
    problems = cut["postmortem"]["problems"]
    assert problems[0].startswith(f"fr_snapshot_{LATER}.json: unusable (")
    assert problems[1].startswith(f"cycle {LATER}: no usable fr_snapshot_{LATER}.json; "
                                  "Flight Recorder data of rank 0-1 taken from the per-rank dumps")
    assert _missing(cut) == [("missing_ranks", 4, [1])]
