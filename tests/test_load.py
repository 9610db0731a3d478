"""Load: 200 concurrent /fr_trace requests against 8 fake ranks, answered correctly, with no
leaked file descriptors and stable memory in the frontend process."""

from __future__ import annotations

import asyncio
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from debug_server.frontend.app import CONNECTIONS_PER_RANK
from debug_server.rank.worker import StaticProvider, WorkerThread, start_worker_thread
from debug_server.tools import synthetic

REPO = Path(__file__).resolve().parent.parent
RANKS = 8
CONCURRENT = 200


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture
def frontend() -> Iterator[tuple[int, int]]:
    """(pid, port) of a real frontend process over 8 fake ranks; rank 7 never joined seq 4."""
    dumps = synthetic.hang_job(RANKS, n_entries=5, missing_rank=RANKS - 1)
    workers: list[WorkerThread] = []
    proc = None
    try:
        workers = [start_worker_thread(StaticProvider(dumps[r])) for r in range(RANKS)]
        urls = ",".join(f"http://127.0.0.1:{w.port}" for w in workers)
        read_fd, write_fd = os.pipe()
        proc = subprocess.Popen(
            [sys.executable, "-m", "debug_server.frontend.app", "--port", "0", "--host", "127.0.0.1",
             "--world-size", str(RANKS), "--worker-urls", urls, "--fetch-timeout", "10",
             "--ready-fd", str(write_fd)],
            env={**os.environ, "PYTHONPATH": str(REPO)}, pass_fds=(write_fd,),
            stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(write_fd)
        ready, _, _ = select.select([read_fd], [], [], 60)
        line = os.read(read_fd, 4096).decode() if ready else ""
        os.close(read_fd)
        assert line.startswith("ready "), line
        yield proc.pid, int(line.split()[1])
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        for w in workers:
            w.stop()


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
    while (n := _fds(pid)) > at_most and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return n


@pytest.mark.timeout(120)
async def test_200_concurrent_fr_trace_requests_answered_without_leaks(
        frontend: tuple[int, int]) -> None:
    pid, port = frontend
    await _round(port)  # warm-up: imports, pooled connections to the workers, allocator arenas
    fds0, rss0 = await _settled_fds(pid, 0, 1.0), _rss_kb(pid)
    t0 = time.monotonic()
    for _ in range(2):
        await _round(port)
    took = time.monotonic() - t0
    fds1 = await _settled_fds(pid, fds0)
    rss1 = _rss_kb(pid)
    assert fds1 <= fds0 + 2, (fds0, fds1)
    # What it holds is the keep-alive pool to the workers, capped per rank, plus a handful.
    assert fds1 <= RANKS * CONNECTIONS_PER_RANK + 16, fds1
    assert rss1 <= rss0 * 1.15 + 4096, (rss0, rss1)
    assert took < 60
