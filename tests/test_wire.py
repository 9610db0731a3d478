"""The host agent answers through the worker's ``/handler/`` routes (``rank.wire``): the same
listing, 404, 400 and one-line 500 as a rank's worker, plus its own per-handler call counts."""

from __future__ import annotations

from typing import Any

import pytest

from debug_server.agent.app import make_agent_app
from debug_server.agent.registry import StaticHostRegistry
from debug_server.protocol.addrs import WorkerAddr

URLS = ["http://127.0.0.1:9", "http://127.0.0.1:9"]  # agent_info never asks the ranks


class _GoneStore(StaticHostRegistry):
    """A registry whose store went away mid-lookup (a real store cannot be made to fail so)."""

    async def lookup(self) -> list[WorkerAddr]:
        raise RuntimeError("store connection reset\nwhile reading debug_server/rank4")


@pytest.fixture
async def agent(aiohttp_client: Any) -> Any:
    return await aiohttp_client(make_agent_app(StaticHostRegistry(URLS, 4, 8), "h2",
                                               fetch_timeout=5.0))


async def test_agent_lists_its_five_handlers(agent: Any) -> None:
    resp = await agent.get("/handler/")
    assert await resp.json() == ["agent_fetch", "agent_fr", "agent_info", "agent_recent",
                                 "agent_stacks"]


async def test_agent_unknown_handler_is_404_naming_it_cut_to_80_characters(agent: Any) -> None:
    resp = await agent.post("/handler/" + "x" * 300)
    assert resp.status == 404
    assert await resp.text() == f"Handler {'x' * 80} not found"


async def test_agent_info_counts_each_call_of_each_handler(agent: Any) -> None:
    await agent.post("/handler/agent_info")
    await agent.post("/handler/agent_fr?bogus=1")  # refused, but asked
    resp = await agent.post("/handler/agent_info")
    body = await resp.json()
    assert body["host"] == "h2" and body["ranks"] == [4, 5]
    assert body["requests"] == {"agent_info": 2, "agent_fr": 1}


async def test_agent_bad_parameter_is_400_in_one_line(agent: Any) -> None:
    resp = await agent.post("/handler/agent_info?ranks=1")
    assert resp.status == 400
    assert await resp.text() == "unknown parameter 'ranks' (allowed: none)"


async def test_agent_handler_failure_is_500_with_the_first_line_only(aiohttp_client: Any) -> None:
    client = await aiohttp_client(make_agent_app(_GoneStore(URLS, 4, 8), "h2", fetch_timeout=5.0))
    resp = await client.post("/handler/agent_info")
    assert resp.status == 500
    assert await resp.text() == "agent_info failed: RuntimeError: store connection reset"
