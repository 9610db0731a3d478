"""A rank that disappeared keeps its last FR data and stacks on the pages, marked gone with how
and how old the data is; a rank that answers again is back."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import pytest
from waiting import until_async

from debug_server.agent import main as agent_main
from debug_server.fanout.reply import FrData
from debug_server.fanout.transport import GONE, OK, UNREACHABLE, RankResult
from debug_server.frontend import departed
from debug_server.protocol.addrs import WorkerAddr
from debug_server.readers import jobpids

STACK = 'Thread 0x1 (most recent call first):\n  File "/job/train.py", line 7 in step\n'


class Fleet:
    """A collector whose ranks answer or not as the test says (the records are the real type)."""

    def __init__(self) -> None:
        self.down: set[int] = set()
        self.registry = "the registry"

    def _rec(self, rank: int, body: str) -> RankResult:
        if rank in self.down:
            return RankResult(rank, f"u{rank}", UNREACHABLE,
                              error=f"unreachable after 0.0 s (rank {rank})")
        return RankResult(rank, f"u{rank}", OK, body)

    page = 0
    """Put in each fetched dump ("page"): which fetch it came from."""

    async def fr(self, **_: Any) -> FrData:
        results = [self._rec(r, '{"entries": []}') for r in range(2)]
        return FrData(results, {r.rank: {"entries": [], "rank": r.rank,
                                         **({"page": self.page} if self.page else {})}
                                for r in results if r.ok})

    async def stacks(self, addrs: Any = None, **_: Any) -> list[RankResult]:
        return [self._rec(r, STACK) for r in range(2)]

    async def fetch(self, handler: str, params: Any = None, addrs: Any = None,
                    each: Any = None) -> list[RankResult]:
        return [self._rec(r, "{}") for r in range(2)]


async def test_a_rank_that_became_unreachable_keeps_its_last_data_marked_gone() -> None:
    fleet = Fleet()
    keep = departed.KeepLast(fleet, departed.Departures())
    await keep.fr()
    await keep.stacks()
    fleet.down.add(1)
    fr = await keep.fr()
    assert fr.dumps[1] == {"entries": [], "rank": 1}
    rec = fr.results[1]
    assert rec.status == GONE and rec.note is not None
    assert rec.line().startswith("rank 1: gone (unreachable since ")
    assert "its FR data and stacks are from 0 s ago" in rec.note
    stacks = await keep.stacks()
    assert stacks[1].body is not None and stacks[1].body.endswith(STACK)
    assert stacks[1].status == GONE and stacks[1].ok  # ok: it holds data to show
    # Its health record keeps its own line: unreachable is a guess, not a known end.
    assert (await keep.fetch("h"))[1].error == "unreachable after 0.0 s (rank 1)"
    assert keep.registry == "the registry"  # everything else passes through


async def test_a_rank_gone_for_many_pages_keeps_the_data_of_the_last_page_it_answered() -> None:
    fleet = Fleet()
    keep = departed.KeepLast(fleet, departed.Departures())
    for page, down in ((1, set()), (2, {1}), (3, {1}), (4, set()), (5, {1}), (6, {0, 1})):
        fleet.page, fleet.down = page, set(down)
        fr = await keep.fr()
        stacks = await keep.stacks()
        if page in (2, 3):  # rank 1 last answered on page 1
            assert fr.dumps[1]["page"] == 1 and fr.results[1].status == GONE
            assert stacks[1].status == GONE and stacks[1].body.endswith(STACK)
        if page == 4:
            assert fr.dumps[1]["page"] == 4 and fr.results[1].status == OK
        if page == 5:  # back on page 4, gone again since: page 4's data
            assert fr.dumps[1]["page"] == 4 and fr.results[1].status == GONE
        if page == 6:  # both gone: each keeps the data of its own last page
            assert (fr.dumps[0]["page"], fr.dumps[1]["page"]) == (5, 4)
            assert [r.status for r in fr.results] == [GONE, GONE]


async def test_a_rank_known_to_have_ended_says_how_on_every_record() -> None:
    fleet = Fleet()
    departures = departed.Departures()
    keep = departed.KeepLast(fleet, departures)
    fleet.down.add(1)
    departures.mark(1, "unreachable since 10:00:00")
    departures.mark(1, "killed by SIGKILL")  # /proc knows better than a refused connection
    departures.mark(1, "its process has ended")  # ... and does not forget it
    assert (await keep.fetch("h"))[1].error.startswith("gone (killed by SIGKILL at ")
    # Never reached before it died: nothing to keep, the record says why.
    assert not (await keep.fr()).results[1].ok


async def test_a_rank_that_answers_again_is_back() -> None:
    fleet = Fleet()
    keep = departed.KeepLast(fleet, departed.Departures())
    await keep.fr()
    fleet.down.add(1)
    await keep.fr()
    fleet.down.clear()
    fr = await keep.fr()
    assert fr.results[1].note is None and keep.departures.gone == {}


class _HostRanks:
    """An agent's registry: its host's ranks as the store announced them."""

    def __init__(self, pids: list[int]) -> None:
        self.addrs = [WorkerAddr(r, f"http://h:{r}", meta=jobpids.identity(pid))
                      for r, pid in enumerate(pids)]
        self.lookups = 0
        """How often the agent's watch has read them (on its first poll, and on every poll
        while its local rank 0 is gone)."""

    async def lookup(self) -> list[WorkerAddr]:
        self.lookups += 1
        return self.addrs


@pytest.mark.job
async def test_agent_outlives_its_local_rank_0_while_a_rank_of_its_host_runs() -> None:
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    parent, rank1 = subprocess.Popen(sleep), subprocess.Popen(sleep)
    done = asyncio.Event()
    try:
        host = _HostRanks([parent.pid, rank1.pid])
        watch = asyncio.create_task(agent_main._watch_parent(parent.pid, done, host))
        await until_async("a poll has read the host's ranks", 30, lambda: host.lookups >= 1)
        parent.kill()
        parent.wait()
        read = host.lookups
        await until_async("two polls with local rank 0 gone", 30,
                          lambda: host.lookups >= read + 2 or done.is_set())
        assert not done.is_set()  # rank 1 still runs (and may hang): the agent stays
        rank1.kill()
        rank1.wait()
        await asyncio.wait_for(done.wait(), 10)
        await watch
    finally:
        for p in (parent, rank1):
            if p.poll() is None:
                p.kill()
                p.wait()


async def test_agents_found_before_stay_when_the_store_dies_with_rank_0(monkeypatch: Any) -> None:
    import gc
    import json
    from datetime import timedelta

    import torch.distributed as dist
    from mpjob import free_port

    from debug_server.fanout import agentdir
    from debug_server.fanout import agents as agents_mod
    from debug_server.protocol.addrs import agent_key
    from debug_server.readers.storeview import store_client

    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=5))
    store_client("127.0.0.1", port, 5).set(agent_key("h1"), json.dumps(
        {"url": "http://h1:1", "ranks": "0-1", "restart": 0}))
    monkeypatch.setattr(agentdir, "AGENT_TTL_S", 0.0)  # read it again on every lookup
    directory = agents_mod.AgentDirectory("127.0.0.1", port, 0, timeout=1.0)
    try:
        assert set(await directory.lookup({"h1"})) == {"h1"}
        del master  # rank 0 hosted the store: it is gone with it
        gc.collect()
        for _ in range(2):  # the failed read, then the backoff: the agent stays, no page waits
            assert set(await directory.lookup({"h1"})) == {"h1"}
    finally:
        directory.close()
