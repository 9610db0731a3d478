"""The collector over workers that answer as PyTorch's own C++ worker: whole 2000-entry rings in
c10d's schema whatever the window asked for, cut by the frontend as each reply arrives."""

from __future__ import annotations

import collections
import json
from typing import Any

import aiohttp
import pytest
from fakefleet import c10d_dump, make_c10d_worker_app

from debug_server.analysis.core import analyze
from debug_server.fanout import reply
from debug_server.fanout.agents import AgentRoute, agent_route
from debug_server.fanout.leanhttp import LeanClient
from debug_server.fanout.live import LiveCollector
from debug_server.fanout.reply import FrData
from debug_server.frontend.dumps import analyze_fr
from debug_server.readers.storeview import StaticRegistry
from debug_server.tools import synthetic


@pytest.fixture
async def torch_workers(aiohttp_server: Any) -> tuple[list[str], dict[int, dict[str, Any]]]:
    """Three torch-like workers of a hang (rank 2 never issued all_reduce #1999), and their
    whole c10d dumps."""
    dumps = {r: c10d_dump(d) for r, d in synthetic.hang_job(3, n_entries=2000,
                                                           missing_rank=2).items()}
    urls = []
    for r in range(3):
        server = await aiohttp_server(make_c10d_worker_app(json.dumps(dumps[r]).encode()))
        urls.append(str(server.make_url("")).rstrip("/"))
    return urls, dumps


async def _fr(urls: list[str]) -> FrData:
    http = LeanClient()
    try:
        async with aiohttp.ClientSession() as session:
            return await LiveCollector(session, StaticRegistry(urls), timeout=10, http=http).fr()
    finally:
        http.close()


async def test_whole_c10d_rings_are_cut_to_the_window_as_they_arrive(torch_workers: Any) -> None:
    urls, whole = torch_workers
    assert len(json.dumps(whole[0])) > reply.CUT_ON_ARRIVAL_BYTES  # what makes them cut early
    fr = await _fr(urls)
    assert [r.status for r in fr.results] == ["ok", "ok", "ok"]
    assert all(len(r.body or "") < reply.CUT_ON_ARRIVAL_BYTES for r in fr.results)
    for r in range(3):
        seqs = [e["collective_seq_id"] for e in fr.dumps[r]["entries"]]
        assert seqs and min(seqs) >= fr.window["0"] and len(seqs) < 10
        assert fr.dumps[r]["fr_window"]["ring_entries"] == len(whole[r]["entries"])  # 2000, 1999


async def test_cut_c10d_rings_give_the_verdict_of_the_whole_rings(torch_workers: Any) -> None:
    urls, whole = torch_workers
    live = analyze_fr(await _fr(urls), None, 3)
    ref = analyze(whole, world_size=3)
    assert live["findings"] == ref["findings"] and live["verdict"] == ref["verdict"]
    assert [(f["kind"], f["seq"], f["ranks"]) for f in live["findings"]] == [
        ("missing_ranks", 1999, [2])]


class _NoAgents:
    """An agent directory in which no host has an agent (every rank is asked directly)."""

    async def lookup(self, ids: set[str]) -> dict[str, Any]:
        return {}

    async def groups(self) -> list[Any]:
        return []

    def forget(self, agent_id: str) -> None:
        pass


async def test_agent_collector_cuts_torch_rings_when_it_asks_the_ranks_directly(
        torch_workers: Any) -> None:
    urls, whole = torch_workers
    http = LeanClient()
    try:
        async with aiohttp.ClientSession() as session:
            collector = LiveCollector(session, StaticRegistry(urls), timeout=10, http=http,
                                      route=agent_route(_NoAgents()))  # type: ignore[arg-type]
            fr = await collector.fr()
            route = collector.route
            assert isinstance(route, AgentRoute)
    finally:
        http.close()
    assert sorted(fr.dumps) == [0, 1, 2] and route.agent_requests == 0
    assert all(len(d["entries"]) < 10 for d in fr.dumps.values())


async def test_a_hung_fleet_of_torch_workers_needs_one_request_per_rank_per_page(
        aiohttp_server: Any) -> None:
    # The first page learns that torch's worker has only c10d's handler (ours answers 404) and
    # no NCCL recorder (a CPU build: 404); from then on each page asks each rank once, and the
    # window is cut from the whole ring it gets.
    dumps = {r: c10d_dump(d) for r, d in synthetic.hang_job(3, n_entries=2000,
                                                           missing_rank=2).items()}
    asked: list[collections.Counter[str]] = [collections.Counter() for _ in range(3)]
    urls = []
    for r in range(3):
        server = await aiohttp_server(make_c10d_worker_app(json.dumps(dumps[r]).encode(),
                                                           asked=asked[r]))
        urls.append(str(server.make_url("")).rstrip("/"))
    http = LeanClient()
    try:
        async with aiohttp.ClientSession() as session:
            collector = LiveCollector(session, StaticRegistry(urls), timeout=10, http=http)
            await collector.fr()
            assert [dict(a) for a in asked] == [
                {"torchcomms_fr_trace_json": 1, "fr_trace_json": 1, "dump_nccl_trace_json": 1}] * 3
            for a in asked:
                a.clear()
            fr = await collector.fr()
    finally:
        http.close()
    assert [dict(a) for a in asked] == [{"fr_trace_json": 1}] * 3
    live = analyze_fr(fr, None, 3)
    assert [(f["kind"], f["seq"], f["ranks"]) for f in live["findings"]] == [
        ("missing_ranks", 1999, [2])]
