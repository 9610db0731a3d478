"""torch's own C++ workers on a CUDA build: the collector reads c10d's NCCL recorder
(``dump_nccl_trace_json``) next to its CPU recorder (``fr_trace_json``), one dump per rank
(``fanout.c10d_workers``). The fake workers answer as ``FlightRecorderCuda.cpp`` says torch's
do (``fakefleet.make_c10d_worker_app(nccl=...)``); a real NCCL job is checked on GPUs
(``scripts/gpu/check_c10d_workers.py``)."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
from aiohttp import web
from fakefleet import c10d_dump, c10d_empty_dump, c10d_nccl_dump, make_c10d_worker_app

from debug_server.fanout import c10d_workers
from debug_server.fanout.leanhttp import LeanClient
from debug_server.fanout.live import LiveCollector
from debug_server.fanout.reply import FrData
from debug_server.frontend.dumps import analyze_fr
from debug_server.protocol import fastjson, members
from debug_server.readers.storeview import StaticRegistry
from debug_server.tools import synthetic

EMPTY = json.dumps(c10d_empty_dump()).encode()


async def _serve(aiohttp_server: Any, apps: list[web.Application]) -> list[str]:
    urls = []
    for app in apps:
        server = await aiohttp_server(app)
        urls.append(str(server.make_url("")).rstrip("/"))
    return urls


async def _pages(urls: list[str], n: int = 1) -> FrData:
    http = LeanClient()
    try:
        async with aiohttp.ClientSession() as session:
            collector = LiveCollector(session, StaticRegistry(urls), timeout=10, http=http)
            for _ in range(n):
                fr = await collector.fr()
            return fr
    finally:
        http.close()


def _findings(fr: FrData, world: int) -> list[tuple[str, int, list[int]]]:
    return [(f["kind"], f["seq"], f["ranks"]) for f in analyze_fr(fr, None, world)["findings"]]


async def test_an_nccl_hang_of_torchs_workers_is_found_in_their_nccl_recorder(
        aiohttp_server: Any) -> None:
    # An NCCL-only job: the CPU recorder is empty; only the NCCL one says rank 2 never issued
    # all_reduce #1999 (asking fr_trace_json alone found nothing).
    nccl = {r: c10d_nccl_dump(d) for r, d in synthetic.hang_job(3, n_entries=2000,
                                                               missing_rank=2).items()}
    urls = await _serve(aiohttp_server, [make_c10d_worker_app(EMPTY, nccl=nccl[r])
                                         for r in range(3)])
    fr = await _pages(urls)
    assert [r.status for r in fr.results] == ["ok"] * 3
    # Read active-only (analysis.activecover): c10d writes no "entries" when none is active.
    assert [len(fr.dumps[r].get("entries", [])) for r in range(3)] == [1, 1, 0]
    assert _findings(fr, 3) == [("missing_ranks", 1999, [2])]


async def test_the_gloo_and_nccl_sides_of_one_group_stay_two_groups(aiohttp_server: Any) -> None:
    # The default group with a gloo and an NCCL backend: both recorders name it "0" and count
    # their own seqs. The gloo side (3 ops, all done) becomes "0:gloo"; the NCCL hang is found.
    gloo_job = synthetic.hang_job(3, n_entries=3)
    for d in gloo_job.values():
        for e in d["entries"]:
            e["state"] = "completed"
    nccl = synthetic.hang_job(3, n_entries=2000, missing_rank=2)
    urls = await _serve(aiohttp_server, [
        make_c10d_worker_app(json.dumps(c10d_dump(gloo_job[r])).encode(),
                             nccl=c10d_nccl_dump(nccl[r])) for r in range(3)])
    fr = await _pages(urls, n=2)  # the second page cuts the gloo ring under its new name
    d0 = fr.dumps[0]
    assert {"0", "0:gloo"} <= set(d0["pg_status"])
    assert d0["pg_status"]["0:gloo"] == c10d_dump(gloo_job[0])["pg_status"]["0"]
    assert d0["pg_status"]["0"] == c10d_nccl_dump(nccl[0])["pg_status"]["0"]
    # The gloo side has no frontier (c10d's own counters: last completed 1, its ring 0..2), so
    # it is kept whole; the NCCL side, read active-only, from the first seq some member has not
    # completed (analysis.activecover).
    assert [(e["collective_seq_id"], e["profiling_name"]) for e in d0["entries"]
            if e["process_group"][0] == "0:gloo"] == [(s, "gloo:all_reduce") for s in range(3)]
    assert [e["collective_seq_id"] for e in d0["entries"] if e["process_group"][0] == "0"] == [1999]
    assert _findings(fr, 3) == [("missing_ranks", 1999, [2])]


async def test_the_gloo_side_is_cut_at_its_own_frontier_page_after_page(
        aiohttp_server: Any) -> None:
    # Both sides of group "0" are long rings, cut as they arrive. On gloo, rank 1 is 10 ops
    # behind rank 0, so the job's gloo frontier (1989 - 2) lies below rank 0's own cut and rank 0
    # is asked again for its window from there: under c10d's own name "0", not the NCCL side's.
    gloo = synthetic.hang_job(2, n_entries=2000)
    for d in gloo.values():
        for e in d["entries"]:
            e["state"] = "completed"
    gloo[1]["entries"] = gloo[1]["entries"][:1990]
    gloo[0]["pg_status"]["main_comm"]["last_completed_collective"] = 1999
    gloo[1]["pg_status"]["main_comm"].update(last_enqueued_collective=1989,
                                             last_completed_collective=1989)
    nccl = synthetic.hang_job(2, n_entries=2000, missing_rank=1)
    urls = await _serve(aiohttp_server, [
        make_c10d_worker_app(json.dumps(c10d_dump(gloo[r])).encode(),
                             nccl=c10d_nccl_dump(nccl[r])) for r in range(2)])
    http = LeanClient()
    try:
        async with aiohttp.ClientSession() as session:
            collector = LiveCollector(session, StaticRegistry(urls), timeout=10, http=http)
            for _ in range(3):
                fr = await collector.fr()
                assert fr.window == {"0:gloo": 1987, "0": 1999}  # NCCL read active-only
                for r, last in ((0, 2000), (1, 1990)):
                    got = {g: [e["collective_seq_id"] for e in fr.dumps[r]["entries"]
                               if e["process_group"][0] == g] for g in ("0:gloo", "0")}
                    assert got["0:gloo"] == list(range(1987, last)), r
                    assert got["0"] == ([1999] if r == 0 else []), r
                # Rank 1 stopped at gloo's 1989 too: both sides are read.
                assert sorted(_findings(fr, 2)) == [("missing_ranks", 1990, [1]),
                                                    ("missing_ranks", 1999, [1])]
    finally:
        http.close()


async def test_a_rank_whose_nccl_recorder_fails_reads_failed_not_ok(aiohttp_server: Any) -> None:
    async def handler(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name == "fr_trace_json":
            return web.Response(body=EMPTY, content_type="application/json")
        if name == c10d_workers.NCCL_HANDLER:
            return web.Response(status=500, text="watchdog is gone")
        return web.Response(status=404, text=f"Handler {name} not found")

    broken = web.Application()
    broken.router.add_post("/handler/{name}", handler)
    nccl = c10d_nccl_dump(synthetic.hang_job(2, n_entries=20)[0])
    urls = await _serve(aiohttp_server, [make_c10d_worker_app(EMPTY, nccl=nccl), broken])
    fr = await _pages(urls)
    assert sorted(fr.dumps) == [0]
    assert fr.results[1].status == "failed"
    assert fr.results[1].line() == ("rank 1: NCCL recorder (dump_nccl_trace_json): "
                                    "HTTP 500: watchdog is gone")



async def test_torchs_replies_arrive_with_the_world_list_as_one_shared_copy(
        aiohttp_server: Any, fresh_members: None, monkeypatch: Any) -> None:
    # Each rank's NCCL reply writes the world's member list (96 % of an onlyactive reply at
    # 4096 ranks); on arrival it becomes a reference and the parsed dumps share one copy.
    world = 24
    nccl = {r: c10d_nccl_dump(d) for r, d in synthetic.hang_job(
        world, n_entries=20, missing_rank=world - 1).items()}
    text = nccl[0]["pg_config"]["0"]["ranks"]
    assert len(text) > members.MIN_CHARS
    urls = await _serve(aiohttp_server, [make_c10d_worker_app(EMPTY, nccl=nccl[r])
                                         for r in range(world)])
    parsed: list[str] = []
    loads = fastjson.loads
    monkeypatch.setattr(fastjson, "loads", lambda t: parsed.append(t) or loads(t))
    fr = await _pages(urls)
    # The world's list is parsed at most once, not once per reply: every other reply the
    # frontend parsed carried it as a reference.
    with_list = [t for t in parsed if text in t]
    assert len(parsed) >= world and len(with_list) <= 1, (len(parsed), len(with_list))
    lists = [fr.dumps[r]["pg_config"]["0"]["ranks"] for r in range(world)]
    assert lists[0] == text and all(x is lists[0] for x in lists)
    assert _findings(fr, world) == [("missing_ranks", 19, [world - 1])]
