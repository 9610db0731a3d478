"""Shared fixtures: fake ranks (real worker apps on port 0), a real TCPStore, a frontend client."""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import pytest

from debug_server.config import JobEnv
from debug_server.rank.worker import StaticProvider, make_worker_app

MAIN_STACK = """Thread 0x00007f0000000001 (most recent call first):
  File "/job/train.py", line 88 in hang_phase
  File "/job/train.py", line 120 in <module>
"""


def closed_port_url() -> str:
    """A URL nothing listens on (the port was bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_job(rank: int, world_size: int, master_port: int, restart: int = 0) -> JobEnv:
    """A single-host job's environment as torchrun would describe it."""
    return JobEnv(rank=rank, world_size=world_size, local_world_size=world_size,
                  master_addr="127.0.0.1", master_port=master_port, restart_count=restart,
                  run_id="job")


FakeRank = Callable[..., Awaitable[str]]


@pytest.fixture
def fake_rank(aiohttp_server: Any) -> FakeRank:
    """``await fake_rank(dump, stacks=..., health=..., dump_path=...)`` -> base URL of a worker."""

    async def make(dump: Mapping[str, Any], *, stacks: str = MAIN_STACK,
                   health: Mapping[str, Any] | None = None, dump_path: str | None = None,
                   provider: Any = None) -> str:
        provider = provider or StaticProvider(dump, stacks=stacks, health=health,
                                              dump_path=dump_path)
        server = await aiohttp_server(make_worker_app(provider))
        return str(server.make_url("")).rstrip("/")

    return make


@pytest.fixture
def fake_job(fake_rank: FakeRank) -> Callable[..., Awaitable[list[str]]]:
    """``await fake_job(dumps, stacks={rank: text})`` -> one worker URL per rank."""

    async def make(dumps: Mapping[int, Mapping[str, Any]],
                   stacks: Mapping[int, str] | None = None,
                   dump_paths: Sequence[str] | None = None) -> list[str]:
        urls = []
        for r in sorted(dumps):
            urls.append(await fake_rank(
                dumps[r], stacks=(stacks or {}).get(r, MAIN_STACK),
                dump_path=dump_paths[r] if dump_paths else None))
        return urls

    return make


@pytest.fixture
def tcp_store() -> Any:
    """A real TCPStore master on 127.0.0.1, port 0 (``.port`` says which)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=10))
    yield store
    del store

