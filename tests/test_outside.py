"""Quiet ranks (``fanout.outside``): a rank whose worker timed out is asked briefly on the next
pages, which reuse its last outside read marked with its age, and it is asked as any other as
soon as it answers again. Real worker apps on port 0; one of them stops answering on cue."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from debug_server.fanout import outside
from debug_server.fanout.live import LiveCollector
from debug_server.fanout.transport import OK, TIMED_OUT
from debug_server.rank.worker import StaticProvider, make_worker_app
from debug_server.readers.storeview import StaticRegistry

TIMEOUT = 1.5


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def _gated_worker(aiohttp_server: Any, gate: asyncio.Event) -> str:
    """A worker whose every request waits until ``gate`` is set (a stopped rank, then resumed)."""
    @web.middleware
    async def wait(request: web.Request, handler: Any) -> web.StreamResponse:
        await gate.wait()
        return await handler(request)

    app = make_worker_app(StaticProvider({}))
    app.middlewares.append(wait)
    return str((await aiohttp_server(app)).make_url("")).rstrip("/")


async def _timed(c: LiveCollector) -> tuple[float, Any]:
    t0 = time.monotonic()
    results = await c.stacks()
    return time.monotonic() - t0, results


@pytest.mark.timeout(30)
async def test_quiet_rank_is_asked_briefly_until_it_answers_again(
        aiohttp_server: Any, fake_rank: Any, session: aiohttp.ClientSession) -> None:
    gate = asyncio.Event()
    ok_url = await fake_rank({})
    c = LiveCollector(session, StaticRegistry([ok_url, await _gated_worker(aiohttp_server, gate)]),
                      timeout=TIMEOUT)
    try:
        took, first = await _timed(c)
        assert first[1].status == TIMED_OUT and took >= TIMEOUT, (took, first[1])
        assert 1 in c.outside.quiet
        took, again = await _timed(c)
        print(f"first page {TIMEOUT:.1f} s timeout; next page {took:.3f} s")
        assert took < outside.QUIET_ASK_S + 0.5 and again[1].status == TIMED_OUT
        assert "not answering since" in (again[1].error or ""), again[1].error
        assert again[0].status == OK
        gate.set()  # it answers again: asked as any other from the next page on
        took, back = await _timed(c)
        assert back[1].status == OK and 1 not in c.outside.quiet, back[1]
    finally:
        gate.set()
        c.close()


@pytest.mark.timeout(30)
async def test_quiet_rank_slower_than_the_brief_ask_is_probed_back(
        aiohttp_server: Any, fake_rank: Any, session: aiohttp.ClientSession) -> None:
    gate = asyncio.Event()
    c = LiveCollector(session, StaticRegistry([await _gated_worker(aiohttp_server, gate)]),
                      timeout=TIMEOUT)
    try:
        await c.fetch("ping")
        assert 0 in c.outside.quiet
        await c.fetch("ping")  # asked briefly: times out again, and probes it in the background
        probe = c.outside.quiet[0].probe
        assert probe is not None and not probe.done()
        gate.set()  # it answers now, but (say) slower than the brief ask: the probe sees it
        await asyncio.wait_for(asyncio.shield(probe), TIMEOUT + 1)
        assert 0 not in c.outside.quiet
    finally:
        gate.set()
        c.close()
