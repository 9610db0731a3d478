"""Load: 200 concurrent /fr_trace requests against 8 fake ranks, answered correctly, with no
leaked file descriptors and stable memory in the frontend process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import aiohttp
import pytest
from fakefleet import frontend_over, open_fds, status_kb

from debug_server.frontend.app import CONNECTIONS_PER_RANK
from debug_server.tools import synthetic

pytestmark = pytest.mark.job

RANKS = 8
CONCURRENT = 200


@pytest.fixture
def frontend() -> Iterator[tuple[int, int]]:
    """(pid, port) of a real frontend process over 8 fake ranks; rank 7 never joined seq 4."""
    dumps = synthetic.hang_job(RANKS, n_entries=5, missing_rank=RANKS - 1)
    with frontend_over(dumps, fetch_timeout=10.0) as (proc, port):
        yield proc.pid, port


async def _round(port: int) -> None:
    url = f"http://127.0.0.1:{port}/fr_trace"
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one() -> str:
            async with session.get(url, headers={"Accept": "*/*"},
                                   timeout=aiohttp.ClientTimeout(total=60)) as resp:
                assert resp.status == 200
                return await resp.text()

        texts = await asyncio.gather(*(one() for _ in range(CONCURRENT)))
    for text in texts:
        assert f"Rank {RANKS - 1} never joined all_reduce #4 on main_comm" in text
        assert "PARTIAL DATA" not in text  # every rank answered every one of them


async def _settled_fds(pid: int, at_most: int, wait_s: float = 5.0) -> int:
    deadline = time.monotonic() + wait_s
    while (n := open_fds(pid)) > at_most and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return n


@pytest.mark.timeout(120)
async def test_200_concurrent_fr_trace_requests_answered_without_leaks(
        frontend: tuple[int, int]) -> None:
    pid, port = frontend
    await _round(port)  # warm-up: imports, pooled connections to the workers, allocator arenas
    fds0, rss0 = await _settled_fds(pid, 0, 1.0), status_kb(pid)
    t0 = time.monotonic()
    for _ in range(2):
        await _round(port)
    took = time.monotonic() - t0
    fds1 = await _settled_fds(pid, fds0)
    rss1 = status_kb(pid)
    assert fds1 <= fds0 + 2, (fds0, fds1)
    # What it holds is the keep-alive pool to the workers, capped per rank, plus a handful.
    assert fds1 <= RANKS * CONNECTIONS_PER_RANK + 16, fds1
    assert rss1 <= rss0 * 1.15 + 4096, (rss0, rss1)
    assert took < 60
