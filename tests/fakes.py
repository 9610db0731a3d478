"""In-process fakes that more than one test module uses: apps on port 0, agents, registries.

``serve`` runs any aiohttp app on 127.0.0.1 port 0; ``start_agents`` puts one real agent app in
front of each host's worker apps; ``AgentedRegistry`` and ``FakeDirectory`` are what the store
would say of those workers and agents. ``agent_fleet`` is all of it at once (conftest's
``agent_fleet`` fixture): worker apps behind one agent per host and two collectors over them.
``write_cycle`` writes one dump cycle as the frontend's dumper does. ``make_job``,
``closed_port_url`` and ``MAIN_STACK`` are conftest's fake ranks' pieces.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from mpjob import free_port

from debug_server.agent import app as agent
from debug_server.agent.registry import StaticHostRegistry
from debug_server.config import JobEnv
from debug_server.fanout import agents as agents_mod
from debug_server.fanout.live import LiveCollector
from debug_server.fanout.reply import FrData
from debug_server.fanout.transport import OK, UNREACHABLE, RankResult
from debug_server.frontend.dumps import snapshot_json, stacks_report
from debug_server.protocol.addrs import WorkerAddr
from debug_server.rank.worker import make_worker_app

FLEET_WORLD, FLEET_PER_HOST, FLEET_MISSING = 8, 4, 6
"""``agent_fleet``'s job: 8 ranks on two hosts of 4; rank 6 never issued the newest
all_reduce (in the dumps of ``synthetic.hang_job(8, ..., missing_rank=6)``)."""


async def serve(app: web.Application, runners: list[web.AppRunner]) -> str:
    """``app`` on 127.0.0.1, port 0; its runner goes into ``runners`` (the caller cleans up)."""
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    runners.append(runner)
    return f"http://127.0.0.1:{runner.addresses[0][1]}"


class FakeDirectory:
    """The agents' registrations, as ``AgentDirectory`` reads them from a store."""

    def __init__(self, agents: dict[str, agents_mod.AgentAddr],
                 groups: list[agents_mod.AgentAddr] | None = None) -> None:
        self.agents = agents
        self.tree = groups
        """The tree's aggregators (``AgentDirectory.groups``), if any."""

    async def lookup(self, ids: set[str]) -> dict[str, agents_mod.AgentAddr]:
        return {i: a for i, a in self.agents.items() if i in ids}

    async def groups(self) -> list[agents_mod.AgentAddr]:
        return list(self.tree or [])

    def forget(self, agent_id: str) -> None:
        pass

    def close(self) -> None:
        pass


class AgentedRegistry:
    """Workers as the store gives them: each with its sidecar naming its host's agent
    (``h0`` for the first ``per_host`` ranks, ``h1`` for the next...)."""

    def __init__(self, urls: list[str], per_host: int) -> None:
        self.world_size = len(urls)
        self.addrs = [WorkerAddr(r, u, meta={"agent": f"h{r // per_host}", "restart": 0})
                      for r, u in enumerate(urls)]

    async def lookup(self) -> list[WorkerAddr]:
        return list(self.addrs)

    def close(self) -> None:
        pass


async def start_agents(urls: list[str], runners: list[web.AppRunner],
                       per_host: int) -> dict[str, agents_mod.AgentAddr]:
    """One real agent app per ``per_host`` of the workers at ``urls``, hosts ``h0``, ``h1``..."""
    found = {}
    for h in range(len(urls) // per_host):
        lo = h * per_host
        app = agent.make_agent_app(StaticHostRegistry(urls[lo:lo + per_host], lo, len(urls)),
                                   f"h{h}", fetch_timeout=3.0)
        found[f"h{h}"] = agents_mod.AgentAddr(f"h{h}", await serve(app, runners),
                                              frozenset(range(lo, lo + per_host)))
    return found


def collector_through(session: aiohttp.ClientSession, urls: list[str], per_host: int,
                      agents: dict[str, agents_mod.AgentAddr]) -> LiveCollector:
    """A frontend's collector that asks the ranks at ``urls`` through ``agents``."""
    return LiveCollector(session, AgentedRegistry(urls, per_host), timeout=3.0,  # type: ignore[arg-type]
                         route=agents_mod.agent_route(FakeDirectory(agents)))  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def agent_fleet(providers: Sequence[Any],
                      per_host: int = FLEET_PER_HOST) -> AsyncIterator[dict[str, Any]]:
    """A worker app per provider (rank = index) behind one agent app per ``per_host`` ranks.

    Yields ``through`` (a collector asking through the agents), ``plain`` (one asking every
    rank), ``agents`` (host id -> ``AgentAddr``), ``agent_runners`` (host id -> its runner, to
    kill one), ``urls`` and ``providers``. Every app is cleaned up on exit.
    """
    runners: list[web.AppRunner] = []
    try:
        urls = [await serve(make_worker_app(p), runners) for p in providers]
        agents = await start_agents(urls, runners, per_host)
        agent_runners = dict(zip(agents, runners[len(urls):], strict=True))
        async with aiohttp.ClientSession() as session:
            yield {"through": collector_through(session, urls, per_host, agents),
                   "plain": LiveCollector(session, AgentedRegistry(urls, per_host), timeout=3.0),  # type: ignore[arg-type]
                   "agents": agents, "agent_runners": agent_runners, "urls": urls,
                   "providers": list(providers)}
    finally:
        for r in runners:
            await r.cleanup()


# ---------------------------------------------------------------------------------------------
# Fake ranks' pieces (conftest's fake_rank and fake_job)

MAIN_STACK = """Thread 0x00007f0000000001 (most recent call first):
  File "/job/train.py", line 88 in hang_phase
  File "/job/train.py", line 120 in <module>
"""


def closed_port_url() -> str:
    """A URL nothing listens on (``free_port``: checked free, below the ephemeral range)."""
    return f"http://127.0.0.1:{free_port()}"


def make_job(rank: int, world_size: int, master_port: int, restart: int = 0) -> JobEnv:
    """A single-host job's environment as torchrun would describe it."""
    return JobEnv(rank=rank, world_size=world_size, local_world_size=world_size,
                  master_addr="127.0.0.1", master_port=master_port, restart_count=restart,
                  run_id="job")


# ---------------------------------------------------------------------------------------------
# A dump dir as the frontend's dumper writes it (for the post-mortem viewer)

RANK0_STACK = """Thread 0x00007f0000000001 (most recent call first):
  File "/job/train.py", line 137 in all_reduce_phase
  File "/job/train.py", line 150 in <module>
"""
RANK1_STACK = """Thread 0x00007f0000000002 (most recent call first):
  File "/job/train.py", line 66 in hang_phase
  File "/job/train.py", line 150 in <module>
"""
OLD = "20240101_100000"
NEW = "20240101_100005"
"""Two dump cycles' stamps, the older first."""


def _cycle_results(dumps: dict[int, Any], stacks: dict[int, str | None]) -> tuple[FrData, list[RankResult]]:
    fr = [RankResult(r, f"http://h:{r}", OK, json.dumps(d)) for r, d in dumps.items()]
    st = [RankResult(r, f"http://h:{r}", OK, t) if t is not None
          else RankResult(r, f"http://h:{r}", UNREACHABLE, error=f"rank {r}: unreachable after 2.0 s")
          for r, t in stacks.items()]
    return FrData(fr, dict(dumps)), st


def write_cycle(d: Path, stamp: str, dumps: dict[int, Any], stacks: dict[int, str | None]) -> None:
    """One dump cycle as the dumper writes it."""
    fr, st = _cycle_results(dumps, stacks)
    (d / f"fr_snapshot_{stamp}.json").write_text(snapshot_json(fr))
    (d / f"stacks_{stamp}.txt").write_text(stacks_report(st))
