from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from fakes import closed_port_url

from debug_server.fanout.live import LiveCollector
from debug_server.fanout.pagefirst import PageFirstSemaphore
from debug_server.fanout.reply import parse_dumps
from debug_server.fanout.transport import RankResult, fan_out
from debug_server.protocol.addrs import WorkerAddr
from debug_server.readers.storeview import StaticRegistry
from debug_server.tools import synthetic


@pytest.fixture
async def session() -> Any:
    async with aiohttp.ClientSession() as s:
        yield s


def _dumps(n: int = 2) -> dict[int, dict[str, Any]]:
    return synthetic.hang_job(n, n_entries=5, missing_rank=n - 1)


async def _slow_server(aiohttp_server: Any, delay: float, track: list[int] | None = None) -> str:
    inflight = [0]

    async def slow(request: web.Request) -> web.Response:
        inflight[0] += 1
        if track is not None:
            track.append(inflight[0])
        try:
            await asyncio.sleep(delay)
        finally:
            inflight[0] -= 1
        return web.Response(text="late")

    app = web.Application()
    app.router.add_post("/handler/{name}", slow)
    server = await aiohttp_server(app)
    return str(server.make_url("")).rstrip("/")


async def test_fanout_returns_one_ok_record_per_rank_in_rank_order(fake_job: Any, session: Any) -> None:
    urls = await fake_job(_dumps(3))
    addrs = [WorkerAddr(r, u) for r, u in reversed(list(enumerate(urls)))]
    results = await fan_out(session, addrs, "ping", timeout=2)
    assert [(r.rank, r.status, r.body) for r in results] == [(0, "ok", "pong"), (1, "ok", "pong"), (2, "ok", "pong")]
    assert all(r.elapsed_s > 0 and r.url == urls[r.rank] for r in results)


async def test_fanout_marks_unreachable_rank(session: Any) -> None:
    results = await fan_out(session, [WorkerAddr(3, closed_port_url())], "ping", timeout=2)
    (r,) = results
    assert r.status == "unreachable"
    assert r.line().startswith("rank 3: unreachable after ")
    assert "\n" not in r.line()


async def test_fanout_marks_not_registered_rank_without_a_request(session: Any) -> None:
    (r,) = await fan_out(session, [WorkerAddr(2, None, "not registered")], "ping", timeout=2)
    assert (r.status, r.line(), r.elapsed_s) == ("not registered", "rank 2: not registered", 0.0)


async def test_fanout_marks_slow_rank_timed_out_within_the_timeout(aiohttp_server: Any, fake_rank: Any, session: Any) -> None:
    slow = await _slow_server(aiohttp_server, 5.0)
    fast = await fake_rank(_dumps()[0])
    t0 = time.monotonic()
    results = await fan_out(session, [WorkerAddr(0, fast), WorkerAddr(1, slow)], "ping", timeout=0.3)
    assert time.monotonic() - t0 < 2
    assert [r.status for r in results] == ["ok", "timed out"]
    assert results[1].line() == "rank 1: timed out after 0.3 s"


async def test_fanout_reports_http_errors_as_one_line(fake_rank: Any, session: Any) -> None:
    url = await fake_rank(_dumps()[0])
    (r,) = await fan_out(session, [WorkerAddr(0, url)], "nope", timeout=2)
    assert (r.status, r.http_status, r.line()) == ("failed", 404, "rank 0: HTTP 404: Handler nope not found")


async def test_fanout_never_raises_on_a_malformed_url(session: Any) -> None:
    (r,) = await fan_out(session, [WorkerAddr(0, "http://[not-a-host")], "ping", timeout=2)
    assert r.status in ("failed", "unreachable") and r.line().startswith("rank 0: ")


async def test_fanout_passes_query_parameters(fake_rank: Any, session: Any) -> None:
    url = await fake_rank(_dumps()[0])
    (r,) = await fan_out(session, [WorkerAddr(0, url)], "torchcomms_fr_trace_json",
                         {"onlyactive": "true"}, timeout=2)
    assert [e["state"] for e in r.json()["entries"]] == ["started"]


async def test_semaphore_bounds_requests_in_flight(aiohttp_server: Any, session: Any) -> None:
    track: list[int] = []
    url = await _slow_server(aiohttp_server, 0.05, track)
    addrs = [WorkerAddr(r, url) for r in range(8)]
    results = await fan_out(session, addrs, "x", timeout=5, semaphore=asyncio.Semaphore(2))
    assert all(r.ok for r in results)
    assert max(track) == 2


def test_parse_dumps_turns_non_json_body_into_a_failure() -> None:
    good = RankResult(0, "u", "ok", '{"version": "2.10", "entries": []}')
    bad = RankResult(1, "u", "ok", "<html>")
    assert list(parse_dumps([good, bad])) == [0]
    assert bad.status == "failed" and bad.line().startswith("rank 1: reply is not JSON")


async def test_collector_falls_back_to_c10d_fr_for_torch_workers(aiohttp_server: Any, fake_rank: Any, session: Any) -> None:
    # torch's C++ worker: no torchcomms_fr_trace_json, but c10d's fr_trace_json.
    async def c10d(request: web.Request) -> web.Response:
        return web.json_response({"version": "2.10", "pg_config": {}, "pg_status": {}})

    app = web.Application()
    app.router.add_post("/handler/fr_trace_json", c10d)
    torch_worker = str((await aiohttp_server(app)).make_url("")).rstrip("/")
    ours = await fake_rank(_dumps()[0])
    collector = LiveCollector(session, StaticRegistry([ours, torch_worker]), timeout=2)
    fr = await collector.fr(only_active=False)
    assert sorted(fr.dumps) == [0, 1]
    assert "entries" not in fr.dumps[1] and fr.unavailable() == {}


def test_every_collector_answers_the_collector_protocol() -> None:
    """The live collector (plain and through agents), ``KeepLast`` around it and the viewer's
    ``DiskCollector`` all answer every method of ``collector.Collector`` with its parameters,
    so a page, the dumper or the hang watch takes any of them."""
    import inspect

    from debug_server.fanout.agents import AgentDirectory, agent_route
    from debug_server.fanout.collector import Collector
    from debug_server.frontend.departed import Departures, KeepLast
    from debug_server.tools.view_collector import DiskCollector

    registry = StaticRegistry([None, None])
    live = LiveCollector(None, registry, timeout=1.0)  # type: ignore[arg-type]
    directory = AgentDirectory("127.0.0.1", 1, 0)
    through = LiveCollector(None, registry, timeout=1.0,  # type: ignore[arg-type]
                            route=agent_route(directory))
    try:
        for c in (live, through, KeepLast(live, Departures()), DiskCollector()):
            assert isinstance(c, Collector), type(c)
            for name in ("fetch", "fr", "stacks", "fr_stacks", "fr_stacks_health", "data_time_ns"):
                want = inspect.signature(getattr(Collector, name)).parameters
                have = inspect.signature(getattr(c, name)).parameters
                takes_any = any(p.kind is p.VAR_KEYWORD for p in have.values())
                missing = [p for p in want if p != "self" and p not in have and not takes_any]
                assert missing == [], (type(c).__name__, name, missing)
    finally:
        directory.close()


async def test_a_fan_out_runs_no_more_tasks_than_its_semaphore_has_slots(
        aiohttp_server: Any, session: Any) -> None:
    # 40 ranks through 4 slots: 4 workers take the ranks in turn, not a task per rank (issue 31:
    # at 4096 ranks the tasks' own cost was a third of the frontend's CPU per request).
    track: list[int] = []
    url = await _slow_server(aiohttp_server, 0.01, track)
    loop = asyncio.get_running_loop()
    made: list[str] = []

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kw: Any) -> asyncio.Task[Any]:
        made.append(getattr(coro, "__qualname__", ""))
        return asyncio.Task(coro, loop=loop, **kw)

    loop.set_task_factory(factory)
    try:
        results = await fan_out(session, [WorkerAddr(r, url) for r in range(40)], "x",
                                timeout=5, semaphore=PageFirstSemaphore(4))
    finally:
        loop.set_task_factory(None)
    assert [r.rank for r in results if r.ok] == list(range(40))
    assert max(track) <= 4
    assert len([m for m in made if m.startswith("fan_out.")]) == 4, made
