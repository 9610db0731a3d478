"""A page that shows FR and stacks asks each rank once for both (``LiveCollector.fr_stacks``,
``wire.WITH_STACKS``), directly and through the host agents, and gives what asking each apart
gives. Real worker and agent apps on 127.0.0.1 port 0; each worker counts the requests it gets.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from fakes import FLEET_MISSING, FLEET_PER_HOST, FLEET_WORLD, collector_through, serve, start_agents

from debug_server.agent import app as agent
from debug_server.agent.registry import StaticHostRegistry
from debug_server.fanout import agents as agents_mod
from debug_server.fanout.collector import PRIME_RANKS
from debug_server.fanout.live import LiveCollector
from debug_server.fanout.transport import OK
from debug_server.frontend.dumps import analyze_fr
from debug_server.protocol import agentwire, members
from debug_server.protocol.names import HEALTH_HANDLER
from debug_server.protocol.wire import STACKS_SEP, split_stacks
from debug_server.rank.worker import StaticProvider, make_worker_app
from debug_server.readers.storeview import StaticRegistry
from debug_server.tools import synthetic

WORLD, PER_HOST, MISSING = FLEET_WORLD, FLEET_PER_HOST, FLEET_MISSING


def _stack_text(rank: int) -> str:
    line = "time.sleep(60)" if rank == MISSING else "dist.all_reduce(t)"
    return (f'Thread 0x1 (most recent call first):\n  File "train.py", line {100 + rank} '
            f"in step\n    {line}\n")


def _health(rank: int) -> dict[str, Any]:
    """Each rank's own health reply (its own age), the missing rank healthy."""
    if rank == MISSING:
        return {"healthy": True, "stalled_op": None}
    return {"healthy": False, "stalled_op": {"group": "0", "seq": 7, "op": "all_reduce",
                                             "age_s": 60.0 + rank / 100}}


def _counting(seen: list[str]) -> Any:
    @web.middleware
    async def count(request: web.Request, handler: Any) -> web.StreamResponse:
        seen.append(request.path_qs)
        return await handler(request)
    return count


async def _refuses_stacks(request: web.Request, handler: Any) -> web.StreamResponse:
    """An older worker of ours: its FR handler knows no ``stacks`` parameter."""
    if "stacks" in request.query:
        return web.Response(status=400, text="unknown parameter 'stacks' (allowed: "
                                             "includecollectives, onlyactive, pgknown, since, window)")
    return await handler(request)


async def _counted_workers(dumps: Mapping[int, Mapping[str, Any]], older: int,
                          runners: list[web.AppRunner]) -> tuple[list[str], dict[int, list[str]]]:
    """A worker app per dump, each recording the requests it gets; rank ``older`` is an older
    worker that refuses ``stacks``."""
    seen: dict[int, list[str]] = {r: [] for r in dumps}
    urls = []
    for r in sorted(dumps):
        app = make_worker_app(StaticProvider(dumps[r], stacks=_stack_text(r),
                                             health=_health(r)))
        app.middlewares.append(_counting(seen[r]))
        if r == older:
            app.middlewares.append(web.middleware(_refuses_stacks))
        urls.append(await serve(app, runners))
    return urls, seen


@pytest.fixture
async def workers() -> AsyncIterator[dict[str, Any]]:
    """8 worker apps (rank 6 never issued the newest all_reduce), each counting its requests;
    rank 3 is an older worker that refuses ``stacks``."""
    runners: list[web.AppRunner] = []
    urls, seen = await _counted_workers(
        synthetic.hang_job(WORLD, n_entries=200, missing_rank=MISSING), 3, runners)
    yield {"urls": urls, "seen": seen, "runners": runners}
    for runner in runners:
        await runner.cleanup()


def _stack_bodies(results: list[Any]) -> dict[int, str]:
    return {r.rank: r.body for r in results if r.status == OK}


async def test_one_request_per_rank_brings_fr_and_stacks_equal_to_asking_each_apart(
        workers: dict[str, Any], fresh_members: None) -> None:
    seen = workers["seen"]
    async with aiohttp.ClientSession() as session:
        c = LiveCollector(session, StaticRegistry(workers["urls"]), timeout=5.0)
        apart_fr, apart_stacks = await c.fr(), await c.stacks()
        for r in seen:
            seen[r].clear()
        fr, stacks = await c.fr_stacks()
    ours = [r for r in range(WORLD) if r != 3]
    for r in ours:
        assert len(seen[r]) == 1, seen[r]
        assert seen[r][0].startswith("/handler/torchcomms_fr_trace_json?") and \
            "stacks=true" in seen[r][0], seen[r]
    # The older worker refuses the parameter once: FR again without it, stacks asked apart.
    assert seen[3] == ["/handler/torchcomms_fr_trace_json?window=4&stacks=true",
                       "/handler/torchcomms_fr_trace_json?window=4",
                       "/handler/dump_traceback"], seen[3]
    assert _stack_bodies(stacks) == _stack_bodies(apart_stacks) == \
        {r: _stack_text(r) for r in range(WORLD)}
    assert fr.dumps.keys() == apart_fr.dumps.keys() == set(range(WORLD))
    for r in range(WORLD):
        assert fr.dumps[r]["entries"] == apart_fr.dumps[r]["entries"], r
    verdict = analyze_fr(fr, stacks, WORLD)["verdict"]
    assert verdict == analyze_fr(apart_fr, apart_stacks, WORLD)["verdict"]
    assert f"Rank {MISSING} never joined" in verdict and "train.py:106" in verdict


async def test_a_worker_that_does_not_answer_keeps_its_record_in_both(
        workers: dict[str, Any]) -> None:
    urls = list(workers["urls"])
    urls[5] = "http://127.0.0.1:9"  # nothing listens on the discard port
    async with aiohttp.ClientSession() as session:
        fr, stacks = await LiveCollector(session, StaticRegistry(urls), timeout=5.0).fr_stacks()
    by_rank = {r.rank: r for r in stacks}
    assert by_rank[5].status == "unreachable" and by_rank[5].body is None
    assert {r.rank for r in fr.results if r.status == "unreachable"} == {5}
    assert 5 not in fr.dumps and {r for r in range(WORLD) if r != 5} <= fr.dumps.keys()
    assert by_rank[4].body == _stack_text(4)


async def test_the_worker_sends_its_stacks_after_the_fr_json_only_when_asked(
        workers: dict[str, Any]) -> None:
    base = workers["urls"][0]
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{base}/handler/torchcomms_fr_trace_json?window=4&stacks=true") as r:
            both = await r.text()
        async with s.post(f"{base}/handler/torchcomms_fr_trace_json?window=4") as r:
            plain = await r.text()
        async with s.post(f"{base}/handler/torchcomms_fr_trace_json?stacks=maybe") as r:
            bad = (r.status, await r.text())
    fr_text, stacks = split_stacks(both)
    assert stacks == _stack_text(0)
    assert json.loads(fr_text) == json.loads(plain)
    assert STACKS_SEP not in plain and split_stacks(plain) == (plain, None)
    assert bad == (400, "parameter stacks='maybe' must be true or false")


@pytest.fixture
async def agents(workers: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    yield {**workers, "agents": await start_agents(workers["urls"], workers["runners"],
                                                    PER_HOST)}


async def _agent_counts(agents: Mapping[str, agents_mod.AgentAddr]) -> dict[str, dict[str, int]]:
    out = {}
    async with aiohttp.ClientSession() as s:
        for aid, ag in agents.items():
            async with s.post(f"{ag.url}/handler/{agentwire.INFO}") as resp:
                out[aid] = (await resp.json())["requests"]
    return out


async def test_through_agents_each_agent_and_each_rank_is_asked_once_per_page(
        agents: dict[str, Any], fresh_members: None) -> None:
    seen = agents["seen"]
    async with aiohttp.ClientSession() as session:
        through = collector_through(session, agents["urls"], PER_HOST, agents["agents"])
        pages = [await through.fr_stacks() for _ in range(2)]
    counts = await _agent_counts(agents["agents"])
    assert counts == {h: {agentwire.FR: 2, agentwire.INFO: 1} for h in counts}, counts
    assert through.route.agent_unchanged == WORLD // PER_HOST  # the second page: a hung job
    for r in range(WORLD):
        if r == 3:  # the older worker: refused once, remembered on the second page
            assert seen[r] == ["/handler/torchcomms_fr_trace_json?window=4&stacks=true"] + [
                "/handler/torchcomms_fr_trace_json?window=4", "/handler/dump_traceback"] * 2
        else:
            assert [q.split("?")[0] for q in seen[r]] == \
                ["/handler/torchcomms_fr_trace_json"] * 2, (r, seen[r])
    for fr, stacks in pages:
        assert _stack_bodies(stacks) == {r: _stack_text(r) for r in range(WORLD)}
        assert all(s.note and "via agent" in s.note for s in stacks)
        verdict = analyze_fr(fr, stacks, WORLD)["verdict"]
        assert f"Rank {MISSING} never joined" in verdict and "train.py:106" in verdict


async def test_the_overview_asks_each_agent_once_for_fr_stacks_and_health(
        agents: dict[str, Any], fresh_members: None) -> None:
    """``fr_stacks_health`` through agents: one ``agent_fr`` per host carries the ranks' health
    too (``agentwire.WITH_HEALTH``), no ``agent_fetch``; each rank is asked for its health once
    a page, and the records are what asking every rank directly gives. An agent that is gone
    has its ranks' health asked directly in the same page."""
    seen = agents["seen"]
    async with aiohttp.ClientSession() as session:
        direct = await LiveCollector(session, StaticRegistry(agents["urls"]), timeout=5.0
                                     ).fetch(HEALTH_HANDLER)
        for r in seen:
            seen[r].clear()
        through = collector_through(session, agents["urls"], PER_HOST, agents["agents"])
        pages = [await through.fr_stacks_health() for _ in range(2)]
        counts = await _agent_counts(agents["agents"])
        await agents["runners"][WORLD].cleanup()  # host h0's agent: ranks 0-3 now directly
        fr, stacks, health = await through.fr_stacks_health()
    assert counts == {h: {agentwire.FR: 2, agentwire.INFO: 1} for h in counts}, counts
    for r in range(WORLD):
        asked = [q.split("?")[0] for q in seen[r]]
        assert asked.count(f"/handler/{HEALTH_HANDLER}") == 3, (r, seen[r])
    want = {r.rank: json.loads(r.body or "") for r in direct}
    assert want[1]["stalled_op"]["age_s"] == 60.01 and want[MISSING]["healthy"] is True
    for _, _, got in pages:
        assert [r.rank for r in got] == list(range(WORLD))
        assert {r.rank: json.loads(r.body or "") for r in got} == want
        assert all(r.note and "via agent" in r.note for r in got), [r.note for r in got]
    assert {r.rank: json.loads(r.body or "") for r in health} == want
    assert [bool(r.note and "via agent" in r.note) for r in health] == \
        [r >= PER_HOST for r in range(WORLD)]
    assert fr.dumps.keys() == set(range(WORLD)) and len(stacks) == WORLD


async def test_ranks_no_agent_serves_get_their_health_asked_directly_in_the_same_page(
        agents: dict[str, Any], fresh_members: None) -> None:
    """Host h0 has no agent (its ranks' sidecars name one the directory does not know): its
    ranks' FR, stacks and health are asked directly, h1's through its agent, each rank's
    health once."""
    seen = agents["seen"]
    async with aiohttp.ClientSession() as session:
        through = collector_through(session, agents["urls"], PER_HOST,
                                    {"h1": agents["agents"]["h1"]})
        for r in seen:
            seen[r].clear()
        fr, stacks, health = await through.fr_stacks_health()
    assert [r.rank for r in health if r.status == OK] == list(range(WORLD))
    via = [bool(r.note and "via agent" in r.note) for r in health]
    assert via == [r >= PER_HOST for r in range(WORLD)], [r.note for r in health]
    for r in range(WORLD):
        asked = [q.split("?")[0] for q in seen[r]]
        assert asked.count(f"/handler/{HEALTH_HANDLER}") == 1, (r, seen[r])
    assert fr.dumps.keys() == set(range(WORLD)) and len(stacks) == WORLD


async def _refuses_health(request: web.Request, handler: Any) -> web.StreamResponse:
    """An older agent: its ``agent_fr`` knows no ``health`` parameter."""
    if agentwire.WITH_HEALTH in request.query:
        return web.Response(status=400, text="unknown parameter 'health' (allowed: classes, "
                                             "onlyactive, pgknown, ranks, since, stacks, tag, "
                                             "whole, window)")
    return await handler(request)


async def test_an_older_agent_that_refuses_health_still_serves_fr_and_stacks(
        workers: dict[str, Any], fresh_members: None) -> None:
    """A newer frontend (attached from another host) and an older agent: the agent's refusal of
    ``health=true`` is remembered, its FR and stacks still come through it, and its ranks'
    health is asked directly; the agent is not skipped as failed."""
    found = {}
    for h in range(WORLD // PER_HOST):
        lo = h * PER_HOST
        app = agent.make_agent_app(StaticHostRegistry(workers["urls"][lo:lo + PER_HOST], lo,
                                                      WORLD), f"h{h}", fetch_timeout=3.0)
        if h == 1:
            app.middlewares.append(web.middleware(_refuses_health))
        found[f"h{h}"] = agents_mod.AgentAddr(f"h{h}", await serve(app, workers["runners"]),
                                              frozenset(range(lo, lo + PER_HOST)))
    async with aiohttp.ClientSession() as session:
        through = collector_through(session, workers["urls"], PER_HOST, found)
        pages = [await through.fr_stacks_health() for _ in range(2)]
    older = range(PER_HOST, 2 * PER_HOST)
    for fr, stacks, health in pages:
        assert fr.dumps.keys() == set(range(WORLD))
        assert all(r.note and "via agent" in r.note for r in fr.results + stacks)
        assert [r.rank for r in health if r.status == OK] == list(range(WORLD))
        assert [bool(r.note and "via agent" in r.note) for r in health] == \
            [r not in older for r in range(WORLD)]
    assert through.route.agent_unchanged == WORLD // PER_HOST  # the second page, h1 too
    seen = workers["seen"][PER_HOST]  # h1's first rank: its health asked directly each page
    assert [q.split("?")[0] for q in seen].count(f"/handler/{HEALTH_HANDLER}") == 2, seen


async def test_an_agent_refuses_health_without_stacks_in_one_line(
        agents: dict[str, Any]) -> None:
    ag = agents["agents"]["h0"]
    async with aiohttp.ClientSession() as s, \
            s.post(f"{ag.url}/handler/{agentwire.FR}?{agentwire.WITH_HEALTH}=true") as resp:
        assert resp.status == 400
        assert await resp.text() == "bad parameter health=true: only with stacks=true"


async def test_an_agent_refuses_stacks_with_a_re_ask_in_one_line(agents: dict[str, Any]) -> None:
    ag = agents["agents"]["h0"]
    async with aiohttp.ClientSession() as s, \
            s.post(f"{ag.url}/handler/{agentwire.FR}?stacks=true&since=%7B%7D") as resp:
        assert resp.status == 400
        assert await resp.text() == ("bad parameter stacks=true: only with the default window "
                                     "(no since, whole or onlyactive)")


async def test_a_big_job_s_first_rank_asked_alone_gets_its_stacks_apart_and_lists_learnt(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # From PRIME_RANKS ranks on, a frontend that holds no member list asks one rank first and
    # learns its lists from the reply, so the others are asked with ``pgknown``.
    world = PRIME_RANKS
    runners: list[web.AppRunner] = []
    urls, seen = await _counted_workers(
        synthetic.hang_job(world, n_entries=20, missing_rank=world - 1), 5, runners)
    # A frontend that holds no list yet (this process may have learnt one in another test).
    for name, empty in (("_text_of", {}), ("_digest_of", {}), ("_weight", {}), ("_chars", 0)):
        monkeypatch.setattr(members, name, empty)
    try:
        async with aiohttp.ClientSession() as session:
            c = LiveCollector(session, StaticRegistry(urls), timeout=5.0)
            fr, stacks = await c.fr_stacks()
            await c.fr_stacks()
    finally:
        for runner in runners:
            await runner.cleanup()
    assert _stack_bodies(stacks) == {r: _stack_text(r) for r in range(world)}
    assert fr.dumps.keys() == set(range(world))
    asked_alone = [r for r in range(world) if members.PARAM not in seen[r][0]]
    assert asked_alone == [0], asked_alone  # the first rank with a URL
    # The worker that refuses ``stacks`` (its 400 lists pgknown as allowed) still gets pgknown.
    assert members.PARAM in seen[5][-2] and "stacks" not in seen[5][-2], seen[5]
    assert f"Rank {world - 1} never joined" in analyze_fr(fr, stacks, world)["verdict"]


async def test_an_agent_asks_one_of_its_ranks_first_then_tells_the_others_the_lists(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A host's agent holds no member list on its first ask: one of its 8 ranks is asked alone
    # and its lists learnt, so the other 7 send a reference, not the world's members each.
    world = 512
    dumps = synthetic.hang_job(world, n_entries=20, missing_rank=world - 1)
    runners: list[web.AppRunner] = []
    urls, seen = await _counted_workers({r: dumps[r] for r in range(8)}, -1, runners)
    for name, empty in (("_text_of", {}), ("_digest_of", {}), ("_weight", {}), ("_chars", 0)):
        monkeypatch.setattr(members, name, empty)
    app = agent.make_agent_app(StaticHostRegistry(urls, 0, world), "h0",
                               fetch_timeout=5.0, max_concurrency=8)
    try:
        url = await serve(app, runners)
        async with aiohttp.ClientSession() as s:
            for _ in range(2):
                async with s.post(f"{url}/handler/{agentwire.FR}?stacks=true") as resp:
                    assert resp.status == 200, await resp.text()
                    reply = await resp.json()
    finally:
        for runner in runners:
            await runner.cleanup()
    first = [r for r in range(8) if members.PARAM not in seen[r][0]]
    assert first == [0], seen  # ranks 1-7 were told the list on the first ask
    assert all(members.PARAM in seen[r][-1] for r in range(8)), seen  # told on the next ask
    list_text = json.dumps(list(range(world)))
    assert list(reply["lists"].values()) == [list_text]  # the asker holds none: sent once
    assert {d["pg_config"]["main_comm"]["ranks"] for d in reply["dumps"].values()} == {
        "@" + members.digest(list_text)}


async def test_a_job_whose_lists_are_short_has_one_rank_asked_alone_once_not_every_page(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Lists of 8 members are sent whole (members.MIN_CHARS): the first ask teaches nothing, and
    # asking one rank first again would cost every page a round trip for nothing.
    monkeypatch.setattr(members, "known_param", lambda budget=0: None)
    runners: list[web.AppRunner] = []
    urls, _ = await _counted_workers(synthetic.hang_job(WORLD, n_entries=20,
                                                        missing_rank=MISSING), -1, runners)
    fan_outs: list[int] = []
    try:
        async with aiohttp.ClientSession() as session:
            c = LiveCollector(session, StaticRegistry(urls), timeout=5.0, prime_ranks=2)
            fetch = c.asker.fetch

            async def counted(handler: str, params: Any = None, addrs: Any = None,
                              each: Any = None) -> Any:
                fan_outs.append(len(addrs))
                return await fetch(handler, params, addrs, each)

            monkeypatch.setattr(c.asker, "fetch", counted)
            for _ in range(3):
                fr = await c.fr()
                assert fr.dumps.keys() == set(range(WORLD))
    finally:
        for runner in runners:
            await runner.cleanup()
    assert fan_outs == [WORLD - 1, WORLD, WORLD], fan_outs
