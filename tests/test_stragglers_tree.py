"""The straggler poll through the tree (``fanout.recent``, ``agent_recent``): each level asks
its own ranks or agents, the clocks are composed on the way up, and the frontend asks only the
aggregators; the wire gives the analysis what the poll kept, and a hostile reply is refused.

The fleet: 8 real worker apps (rank 5 issues every all_reduce 40 ms late; ranks 4-7 read a clock
3 s ahead, as another host's), a real host agent per 2 ranks, a real aggregator app per 2 host
agents, and the frontend's collector through them (``fakes``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from _scenarios import MS, lagged_rings
from aiohttp import web
from fakes import AgentedRegistry, FakeDirectory, closed_port_url, serve, start_agents
from test_stragglers_page import _NowProvider

from debug_server.agent import app as agent
from debug_server.analysis import stragglers
from debug_server.analysis.stragglers import Clock, Rule
from debug_server.fanout import agents as agents_mod
from debug_server.fanout import recent
from debug_server.fanout.live import LiveCollector
from debug_server.frontend import stragglers as page
from debug_server.protocol.agentwire import RECENT
from debug_server.rank.worker import make_worker_app

pytestmark = pytest.mark.timeout(180)

WORLD, PER_HOST, HOSTS_PER_GROUP, SLOW, AHEAD_NS = 8, 2, 2, 5, 3_000 * MS


class _Counted(_NowProvider):
    """A rank's provider that counts the FR reads it serves."""

    def __init__(self, dump: dict[str, Any], offset: int) -> None:
        super().__init__(dump, offset)
        self.reads = 0

    def fr_snapshot(self, **kw: Any) -> Any:
        self.reads += 1
        return super().fr_snapshot(**kw)


@contextlib.asynccontextmanager
async def _tree(dead: frozenset[int] = frozenset(),
                wedged_agg: bool = False) -> AsyncIterator[dict[str, Any]]:
    rnd = random.Random(11)
    dumps = lagged_rings(WORLD, 60, lambda r, s: rnd.uniform(0, 2) + (40 if r == SLOW else 0))
    runners: list[Any] = []
    released = asyncio.Event()
    try:
        providers = {r: _Counted(d, AHEAD_NS if r >= 4 else 0) for r, d in dumps.items()}
        urls = [closed_port_url() if r in dead else await serve(make_worker_app(p), runners)
                for r, p in providers.items()]
        hosts = await start_agents(urls, runners, PER_HOST)
        aggs, agg_apps, agg_runners = [], [], []
        for g in range(len(hosts) // HOSTS_PER_GROUP):
            mine = {h: a for i, (h, a) in enumerate(hosts.items()) if i // HOSTS_PER_GROUP == g}
            app = agent.make_agent_app(
                AgentedRegistry(urls, PER_HOST), f"agg-{g}", fetch_timeout=3.0,
                route=agents_mod.agent_route(FakeDirectory(mine), classes=True))  # type: ignore[arg-type]
            if wedged_agg and g == 1:  # takes every request, answers none until the end

                async def wedged(request: web.Request) -> web.Response:
                    await released.wait()
                    return web.Response()

                app = web.Application()
                app.router.add_post("/handler/{name}", wedged)
            url = await serve(app, runners)
            agg_apps.append(app)
            agg_runners.append(runners[-1])
            aggs.append(agents_mod.AgentAddr(f"agg-{g}", url,
                                             frozenset(r for a in mine.values() for r in a.ranks)))
        async with aiohttp.ClientSession() as session:
            through = LiveCollector(session, AgentedRegistry(urls, PER_HOST), timeout=3.0,  # type: ignore[arg-type]
                                    route=agents_mod.agent_route(FakeDirectory(hosts, aggs)))  # type: ignore[arg-type]
            plain = LiveCollector(session, AgentedRegistry(urls, PER_HOST), timeout=3.0)  # type: ignore[arg-type]
            try:
                yield {"through": through, "plain": plain, "providers": providers,
                       "agg_apps": agg_apps, "agg_runners": agg_runners, "hosts": hosts}
            finally:
                through.close()
                plain.close()
    finally:
        released.set()
        for r in runners:
            await r.cleanup()


def _counts(app: Any) -> int:
    return int(app[agent.COUNTS].get(RECENT, 0))


async def _named(watch: page.StragglerWatch, want: list[int]) -> dict[str, Any]:
    """Polls until the result names ``want`` at 30-60 ms (a loaded box's round trip can make a
    clock's error larger than the lag for one poll; a later one's is shorter, as the page
    test); never a lag near the 3 s offset."""
    deadline = time.monotonic() + 60
    while True:
        res = await watch.poll()
        rows = res["stragglers"]
        assert all(s["median_lag_ms"] < 1000 for s in rows), rows
        if [s["rank"] for s in rows] == want and all(30 <= s["median_lag_ms"] <= 60 for s in rows):
            return res
        assert time.monotonic() < deadline, rows


async def test_the_poll_asks_only_the_aggregators_and_names_the_slow_rank() -> None:
    async with _tree() as t:
        watch = page.StragglerWatch(t["through"])
        before = {r: p.reads for r, p in t["providers"].items()}
        res = await _named(watch, [SLOW])
        polls = sum(_counts(a) for a in t["agg_apps"]) // (2 * len(t["agg_apps"]))
        assert polls >= 1 and all(_counts(a) == 2 * polls for a in t["agg_apps"])
        # Each rank read twice per poll (its clock, its times) by its host's agent: nobody
        # asked any rank directly.
        assert all(p.reads - before[r] == 2 * polls for r, p in t["providers"].items())
        assert watch.failures == []
        # The frontend's book holds the aggregators' clocks only: it asked no rank or host.
        assert set(watch.book._by) == {("agent", "agg-0"), ("agent", "agg-1")}
        plain = await _named(page.StragglerWatch(t["plain"]), [SLOW])
        assert [(s["rank"], s["group"], s["side"]) for s in res["stragglers"]] == \
            [(s["rank"], s["group"], s["side"]) for s in plain["stragglers"]]
        assert res["groups_checked"] == plain["groups_checked"] == ["main_comm"]


async def test_composed_clocks_put_every_rank_on_the_frontend_s_clock() -> None:
    async with _tree() as t:
        got = await recent.read(t["through"], 16, await t["through"].registry.lookup(),
                                recent.ClockBook())
        assert sorted(got.dumps) == list(range(WORLD)) and got.failed == {}
        for r, c in got.clocks.items():
            want = AHEAD_NS if r >= 4 else 0
            # Each level's estimate is within its error; the errors add up the tree.
            assert abs(c.offset_ns - want) <= c.error_ns + MS, (r, c)
            assert c.error_ns < 2_000 * MS, (r, c)  # round trips, not a data reply's wait


async def test_a_dead_aggregator_s_ranks_come_through_their_host_agents() -> None:
    async with _tree() as t:
        await t["agg_runners"][1].cleanup()  # agg-1: ranks 4-7, the slow one among them
        watch = page.StragglerWatch(t["through"])
        before = {r: p.reads for r, p in t["providers"].items()}
        await _named(watch, [SLOW])
        assert watch.failures == []
        assert ("agent", "agg-0") in watch.book._by and ("agent", "agg-1") not in watch.book._by
        assert {("agent", "h2"), ("agent", "h3")} <= set(watch.book._by)
        # Still two reads per rank and poll: no rank was asked directly as well.
        polls = (t["providers"][0].reads - before[0]) // 2
        assert polls >= 1 and all(p.reads - before[r] == 2 * polls
                                  for r, p in t["providers"].items())


async def test_a_wedged_aggregator_s_ranks_come_through_their_host_agents() -> None:
    """An aggregator that takes the clock ask and never answers: its clock ask gives up after
    ``recent.CLOCK_TIMEOUT_S`` (not a page's agent timeout) and its ranks come through their
    host agents, the slow one named."""
    async with _tree(wedged_agg=True) as t:
        watch = page.StragglerWatch(t["through"])
        await _named(watch, [SLOW])
        assert watch.failures == [] and ("agent", "agg-1") not in watch.book._by
        assert {("agent", "h2"), ("agent", "h3")} <= set(watch.book._by)


async def test_a_rank_its_host_agent_cannot_read_is_one_failure_not_asked_again() -> None:
    async with _tree(dead=frozenset({7})) as t:
        watch = page.StragglerWatch(t["through"])
        res = await watch.poll()
        assert [line.split(":")[0] for line in watch.failures] == ["rank 7"], watch.failures
        # A member without data hides its group (``_complete``): nobody is named meanwhile.
        assert res["stragglers"] == []


def _fleet(rnd: random.Random) -> tuple[dict[int, dict[str, Any]], dict[int, Clock], Rule]:
    m, slow = rnd.choice((2, 4, 8)), rnd.randrange(8)
    dumps = lagged_rings(m, rnd.choice((12, 40)),
                         lambda r, s: rnd.uniform(0, 2) + (40 if r == slow else 0),
                         start_lag=(lambda r, s: rnd.uniform(0, 50 if r == slow else 1))
                         if rnd.random() < 0.5 else None)
    lagged_rings(m, 30, lambda r, s: rnd.uniform(0, 20), group="tp",
                 members=sorted(rnd.sample(range(m), 2)), into=dumps)
    for d in dumps.values():  # a P2P entry, one without a time, one without a start time
        es = d["entries"]
        k = rnd.randrange(len(es))
        es[k] = rnd.choice(({**es[k], "is_p2p": True}, {**es[k], "time_created_ns": None},
                            {**es[k], "time_discovered_started_ns": 0}))
    clocks = {r: Clock(rnd.choice((0, 2 * MS, -3 * MS)), rnd.choice((1000, 3 * MS)))
              for r in dumps}
    return dumps, clocks, Rule(window_ops=rnd.choice((8, 200)))


def test_the_wire_gives_the_analysis_what_the_poll_kept() -> None:
    """``encode`` then ``decode`` (through JSON text) reads as the compact dumps it came from:
    the same analysis, the same clocks, over random fleets with two groups, start times,
    clock offsets and damaged entries."""
    rnd = random.Random(9)
    named = 0
    for _ in range(60):
        dumps, clocks, rule = _fleet(rnd)
        kept = {r: stragglers.compact(d) for r, d in dumps.items()}
        got = recent.Recent(kept, clocks, {99: ("timed out", "rank 99: timed out")})
        back = recent.decode(json.loads(json.dumps(recent.encode(got))))
        assert back.clocks == clocks and back.failed == got.failed
        want = stragglers.analyze(kept, clocks, rule)
        assert stragglers.analyze(back.dumps, back.clocks, rule) == want
        named += len(want["stragglers"])
    assert named >= 10


@pytest.mark.parametrize("bad", [
    [], {"ranks": []}, {"groups": {}, "seqs": [], "ops": [], "ranks": [[0, 0, 0]], "failed": []},
    {"groups": {}, "seqs": [[1]], "ops": [["x"]], "ranks": [[0, 0, 0, {"g": [0, 0, [1, 2], None]}]],
     "failed": []},
    {"groups": {}, "seqs": [[1]], "ops": [["x"]], "ranks": [[0, 0, 0, {"g": [3, 0, [1], None]}]],
     "failed": []},
    {"groups": {}, "seqs": [[1]], "ops": [["x"]], "ranks": [[0, 0, 0, {"g": [0, 0, ["1"], None]}]],
     "failed": []},
    {"groups": {}, "seqs": [[1]], "ops": [["x"]], "ranks": [[0, 0, 0, {"g": [0, 0, [1], [1, 2]]}]],
     "failed": []},
    {"groups": {"g": {"ranks": [[5, 2]]}}, "seqs": [], "ops": [], "ranks": [], "failed": []},
    {"groups": {"g": {"ranks": [[0, 1 << 40]]}}, "seqs": [], "ops": [], "ranks": [], "failed": []},
    {"groups": {}, "seqs": [], "ops": [], "ranks": [], "failed": [["x", "y"]]},
    {"groups": {}, "seqs": [], "ops": [], "ranks": [[0, 0, 0, {"g": 7}]], "failed": []},
])
def test_a_hostile_reply_is_refused_with_one_line(bad: Any) -> None:
    with pytest.raises(ValueError):
        recent.decode(bad)


async def test_an_agent_answers_its_clock_and_refuses_bad_parameters(aiohttp_client: Any) -> None:
    app = agent.make_agent_app(AgentedRegistry([closed_port_url()], 1), "h0", fetch_timeout=1.0)
    client = await aiohttp_client(app)
    t0 = time.time_ns()
    resp = await client.post(f"/handler/{RECENT}?clock=true")
    assert resp.status == 200 and t0 <= (await resp.json())["dump_time_ns"] <= time.time_ns()
    for q in ("ops=0", "ops=x", "ops=99999", "ops=4&nope=1"):
        resp = await client.post(f"/handler/{RECENT}?{q}")
        assert resp.status == 400 and len((await resp.text()).splitlines()) == 1, q
    resp = await client.post(f"/handler/{RECENT}?ops=4")
    body = await resp.json()
    assert resp.status == 200 and body["ranks"] == []
    assert [f[:2] for f in body["failed"]] == [[0, "unreachable"]], body["failed"]


async def test_agents_clocks_are_sampled_between_polls_without_asking_a_rank() -> None:
    """``recent.sample_clocks``: the clocks of the agents the route's last plan found (the
    aggregators, after a page) asked again and again into the book (each a short round trip at
    a quiet moment); no rank is read for it. A reader without a route (a host's agent over its
    ranks) has nothing to sample and returns."""
    async with _tree() as t:
        book = recent.ClockBook()
        await t["through"].fetch("ping")  # a page through the route: its plan's agents
        before = {r: p.reads for r, p in t["providers"].items()}
        task = asyncio.ensure_future(recent.sample_clocks(t["through"], book, interval=0.02))
        try:
            deadline = time.monotonic() + 30
            while not all(len(book._by.get(("agent", f"agg-{g}"), ())) >= 3 for g in (0, 1)):
                assert time.monotonic() < deadline, book._by
                await asyncio.sleep(0.01)
        finally:
            task.cancel()
        assert set(book._by) == {("agent", "agg-0"), ("agent", "agg-1")}
        assert all(_counts(a) >= 3 for a in t["agg_apps"])
        assert {r: p.reads for r, p in t["providers"].items()} == before
        await asyncio.wait_for(recent.sample_clocks(t["plain"], book, interval=0.01), 5)
