"""A worker's 404 to a handler stands for asking it again for a while (``fanout.absent``):
torch's own C++ workers have none of our handlers, and were asked the health check (and the
straggler watch's clock read) on every poll. Real worker apps on 127.0.0.1 answer as torch's
do (``fakefleet.make_c10d_worker_app``), each request counted."""

from __future__ import annotations

import collections
import json
from typing import Any

import aiohttp
import pytest
from fakefleet import c10d_empty_dump, make_c10d_worker_app

from debug_server.fanout import absent
from debug_server.fanout.leanhttp import LeanClient
from debug_server.fanout.live import LiveCollector
from debug_server.frontend.hangreport import HEALTH_HANDLER, parse_health
from debug_server.protocol.names import STACKS_HANDLER
from debug_server.readers.storeview import StaticRegistry

EMPTY = json.dumps(c10d_empty_dump()).encode()


async def _torch_workers(aiohttp_server: Any, n: int) -> tuple[list[str],
                                                               list[collections.Counter[str]]]:
    asked = [collections.Counter[str]() for _ in range(n)]
    urls = []
    for r in range(n):
        server = await aiohttp_server(make_c10d_worker_app(EMPTY, asked=asked[r]))
        urls.append(str(server.make_url("")).rstrip("/"))
    return urls, asked


async def _fetches(urls: list[str], handler: str, times: int) -> list[list[Any]]:
    http = LeanClient()
    try:
        async with aiohttp.ClientSession() as session:
            c = LiveCollector(session, StaticRegistry(urls), timeout=10, http=http)
            return [await c.fetch(handler) for _ in range(times)]
    finally:
        http.close()


async def test_torchs_workers_are_asked_our_health_check_once_and_read_the_same(
        aiohttp_server: Any) -> None:
    urls, asked = await _torch_workers(aiohttp_server, 3)
    first, second, third = await _fetches(urls, HEALTH_HANDLER, 3)
    assert [a[HEALTH_HANDLER] for a in asked] == [1, 1, 1]
    assert [(r.rank, r.status, r.http_status, r.error) for r in third] == \
        [(r.rank, r.status, r.http_status, r.error) for r in first]
    assert [h.text() for h in parse_health(second)] == ["health unknown (no health check)"] * 3


async def test_a_404_is_asked_again_once_its_time_is_up(aiohttp_server: Any,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(absent, "ABSENT_TTL_S", 0.0)
    urls, asked = await _torch_workers(aiohttp_server, 2)
    await _fetches(urls, HEALTH_HANDLER, 2)
    assert [a[HEALTH_HANDLER] for a in asked] == [2, 2]


async def test_a_handler_the_worker_has_is_asked_every_time(aiohttp_server: Any) -> None:
    urls, asked = await _torch_workers(aiohttp_server, 2)
    results = await _fetches(urls, STACKS_HANDLER, 2)
    assert [a[STACKS_HANDLER] for a in asked] == [2, 2]
    assert all(r.ok for rs in results for r in rs)
