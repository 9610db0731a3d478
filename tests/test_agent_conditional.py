"""Conditional asks of a host's agent (``agentwire.TAG``): a hung host costs little on a second page.

Real worker apps on port 0 (each stamping its dump with the time it was read, as a live rank's
recorder does) behind real agent apps on port 0, read by the frontend's ``agents_mod.AgentRoute``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from fakes import FLEET_MISSING, FLEET_PER_HOST, FLEET_WORLD, collector_through

from debug_server.agent import app as agent
from debug_server.analysis.core import analyze
from debug_server.analysis.digest import SNAPSHOT_TIME_KEY, DigestMemo, digest_dump
from debug_server.fanout.live import LiveCollector
from debug_server.frontend.dumps import analyze_fr
from debug_server.protocol import agentwire
from debug_server.protocol.agentwire import read_classes_obj, read_times_obj
from debug_server.rank.worker import StaticProvider
from debug_server.tools import synthetic

WORLD, PER_HOST, MISSING = FLEET_WORLD, FLEET_PER_HOST, FLEET_MISSING


class LiveProvider(StaticProvider):
    """A fixed ring whose every read is stamped with the time it was read (``dump_time_ns``)."""

    def fr_snapshot(self, **kw: Any) -> Mapping[str, Any]:
        return {**super().fr_snapshot(**kw), SNAPSHOT_TIME_KEY: time.time_ns()}


@pytest.fixture
def fleet_providers() -> list[LiveProvider]:
    """8 live-stamped ranks (rank 6 never issued the newest all_reduce) for ``agent_fleet``."""
    dumps = synthetic.hang_job(WORLD, n_entries=200, missing_rank=MISSING)
    return [LiveProvider(dumps[r]) for r in range(WORLD)]


def _entries(dump: Mapping[str, Any]) -> list[tuple[Any, ...]]:
    return [(e["record_id"], e["state"], e["frames"]) for e in dump["entries"]]


async def _post(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.post(url) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def test_second_ask_of_a_hung_host_is_answered_unchanged_with_new_read_times(
        agent_fleet: dict[str, Any]) -> None:
    through = agent_fleet["through"]
    first = await through.fr()
    second = await through.fr()
    assert through.route.agent_unchanged == WORLD // PER_HOST
    for r in range(WORLD):
        assert _entries(second.dumps[r]) == _entries(first.dumps[r]), r
        assert second.dumps[r][SNAPSHOT_TIME_KEY] > first.dumps[r][SNAPSHOT_TIME_KEY], r
    assert second.window == first.window
    verdict = analyze_fr(second, None, WORLD)["verdict"]
    assert verdict == analyze_fr(first, None, WORLD)["verdict"]
    assert f"Rank {MISSING} never joined" in verdict


async def test_a_changed_ring_gets_its_host_a_whole_reply_and_the_other_host_unchanged(
        agent_fleet: dict[str, Any]) -> None:
    through = agent_fleet["through"]
    first = await through.fr()
    p = agent_fleet["providers"][1]
    entries = [dict(e) for e in p.dump["entries"]]
    newest = entries[-1]
    newest["state"] = "started" if newest["state"] == "completed" else "completed"
    p.dump = {**p.dump, "entries": entries}
    second = await through.fr()
    assert through.route.agent_unchanged == 1  # host h1 only
    assert second.dumps[1]["entries"][-1]["record_id"] == newest["record_id"]
    assert second.dumps[1]["entries"][-1]["state"] == newest["state"]
    assert first.dumps[1]["entries"][-1]["state"] != newest["state"]
    assert _entries(second.dumps[5]) == _entries(first.dumps[5])


async def test_a_page_of_hosts_that_all_answer_with_their_last_tags_reuses_the_window_and_cut(
        agent_fleet: dict[str, Any]) -> None:
    through = agent_fleet["through"]
    first = await through.fr()
    assert through.route.cuts_reused == 0
    second = await through.fr()
    assert through.route.cuts_reused == 1
    assert second.window == first.window == {"main_comm": first.window["main_comm"]}
    for r in range(WORLD):
        # The same cut entry objects, with this page's read times (as a fresh cut gives).
        assert [id(e) for e in second.dumps[r]["entries"]] == \
            [id(e) for e in first.dumps[r]["entries"]], r
        assert second.dumps[r][SNAPSHOT_TIME_KEY] > first.dumps[r][SNAPSHOT_TIME_KEY], r
        assert {k: v for k, v in second.dumps[r].items() if k != SNAPSHOT_TIME_KEY} == \
            {k: v for k, v in first.dumps[r].items() if k != SNAPSHOT_TIME_KEY}, r
    assert analyze_fr(second, None, WORLD) == analyze_fr(first, None, WORLD)


async def test_one_changed_host_makes_the_page_cut_again_and_see_the_change(
        agent_fleet: dict[str, Any]) -> None:
    through = agent_fleet["through"]
    first = await through.fr()
    p = agent_fleet["providers"][MISSING]
    entries = [dict(e) for e in p.dump["entries"]]
    entries[-1]["state"] = "completed" if entries[-1]["state"] != "completed" else "started"
    p.dump = {**p.dump, "entries": entries}
    second = await through.fr()
    assert through.route.cuts_reused == 0 and through.route.agent_unchanged == 1  # host h0 unchanged
    assert second.dumps[MISSING]["entries"][-1]["state"] == entries[-1]["state"]
    assert first.dumps[MISSING]["entries"][-1]["state"] != entries[-1]["state"]
    await through.fr()
    assert through.route.cuts_reused == 1  # and the page after it reuses the new cut


async def test_agent_answers_unchanged_only_to_the_tag_of_its_last_reply(
        agent_fleet: dict[str, Any]) -> None:
    url = f"{agent_fleet['agents']['h1'].url}/handler/agent_fr?window=4"
    whole = await _post(url)
    same = await _post(f"{url}&tag={whole['tag']}")
    other = await _post(f"{url}&tag=0123456789abcdef01234567")
    assert same["unchanged"] is True and "dumps" not in same and same["tag"] == whole["tag"]
    snap = read_times_obj(same["snap"])
    assert same["snap"]["ranks"] == "4-7" and sorted(snap) == [4, 5, 6, 7]
    # A rank whose window reads as another's goes as that rank's, with its own read time.
    sent = {int(r): d[SNAPSHOT_TIME_KEY] for r, d in whole["dumps"].items()}
    for _, times in read_classes_obj(whole.get("same", [])):
        sent.update(times)
    assert sorted(sent) == [4, 5, 6, 7]
    assert all(snap[r] > sent[r] for r in snap)
    assert "unchanged" not in other and sorted(
        [*map(int, other["dumps"]), *(r for _, t in read_classes_obj(other.get("same", []))
                                      for r in t)]) == [4, 5, 6, 7]


async def test_an_unchanged_reply_for_dumps_no_longer_held_is_asked_again_plainly(
        agent_fleet: dict[str, Any]) -> None:
    through = agent_fleet["through"]
    first = await through.fr()
    # As if another page had replaced what was held after this ask's tag was sent.
    through.route._held = {slot: (q, tag, {}, known)
                           for slot, (q, tag, _, known) in through.route._held.items()}
    second = await through.fr()
    assert through.route.agent_unchanged == 0
    assert sorted(second.dumps) == list(range(WORLD))
    assert [r.note for r in second.results] == [f"via agent h{r // PER_HOST}" for r in range(WORLD)]
    assert _entries(second.dumps[MISSING]) == _entries(first.dumps[MISSING])


async def test_analysis_of_unchanged_hosts_reuses_each_digest_and_finds_the_same(
        agent_fleet: dict[str, Any]) -> None:
    through = agent_fleet["through"]
    memo = through.digest_memo
    analyze_fr(await through.fr(), None, WORLD, memo)
    assert memo.hits == 0 and memo.misses > 0
    misses = memo.misses
    second = await through.fr()
    reused = analyze_fr(second, None, WORLD, memo)
    # Every distinct dump found again (ranks sharing a dump's parts share its digest): none
    # digested anew.
    assert memo.misses == misses and memo.hits >= 1
    fresh = analyze(second.dumps, world_size=WORLD, unavailable=second.unavailable())
    assert reused == fresh and f"Rank {MISSING} never joined" in reused["verdict"]


def test_digest_memo_digests_again_a_dump_with_one_new_entry_object() -> None:
    dump = synthetic.hang_job(2, n_entries=20, missing_rank=1)[0]
    memo = DigestMemo()
    first = memo.digest(0, dump)
    memo.done()
    entries = list(dump["entries"])
    entries[-1] = {**entries[-1], "state": "completed"}
    again = memo.digest(0, {**dump, "entries": entries, SNAPSHOT_TIME_KEY: 7})
    same = memo.digest(0, {**dump, SNAPSHOT_TIME_KEY: 9})
    assert memo.hits == 1 and same == first._replace(snap_ns=9)
    assert again == digest_dump(0, {**dump, "entries": entries, SNAPSHOT_TIME_KEY: 7})
    assert again.colls != first.colls


async def _restarted(agent_fleet: dict[str, Any], session: aiohttp.ClientSession,
                     ) -> LiveCollector:
    """A new frontend's collector (restarted, or attached from elsewhere): it holds no tag."""
    urls = [a.url for a in agent_fleet["through"].registry.addrs]
    return collector_through(session, urls, PER_HOST, agent_fleet["agents"])


async def _from_last(agent_fleet: dict[str, Any]) -> dict[str, int]:
    return {h: (await _post(f"{ag.url}/handler/{agentwire.INFO}"))["requests"].get(
        agent.FROM_LAST, 0) for h, ag in agent_fleet["agents"].items()}


async def test_a_restarted_frontend_gets_the_agents_last_full_replies_with_new_read_times(
        agent_fleet: dict[str, Any]) -> None:
    first = await agent_fleet["through"].fr()
    async with aiohttp.ClientSession() as session:
        again = await (await _restarted(agent_fleet, session)).fr()
    assert await _from_last(agent_fleet) == {"h0": 1, "h1": 1}
    for r in range(WORLD):
        assert _entries(again.dumps[r]) == _entries(first.dumps[r]), r
        assert again.dumps[r][SNAPSHOT_TIME_KEY] > first.dumps[r][SNAPSHOT_TIME_KEY], r
    assert again.window == first.window
    assert analyze_fr(again, None, WORLD)["verdict"] == analyze_fr(first, None, WORLD)["verdict"]


async def test_a_host_whose_ring_changed_is_not_answered_from_its_last_full_reply(
        agent_fleet: dict[str, Any]) -> None:
    await agent_fleet["through"].fr()
    p = agent_fleet["providers"][5]
    entries = [dict(e) for e in p.dump["entries"]]
    entries[-1]["state"] = "started" if entries[-1]["state"] == "completed" else "completed"
    p.dump = {**p.dump, "entries": entries}
    async with aiohttp.ClientSession() as session:
        again = await (await _restarted(agent_fleet, session)).fr()
    assert await _from_last(agent_fleet) == {"h0": 1, "h1": 0}
    assert again.dumps[5]["entries"][-1]["state"] == entries[-1]["state"]


async def test_the_member_lists_a_new_frontend_learns_do_not_make_its_second_page_whole(
        fresh_members: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """24 ranks (their member list long enough to be learnt: ``members.MIN_CHARS``) behind 3
    agents that answered a frontend before (their own lists learnt). A new frontend knows no
    list: its first page asks one agent alone without ``pgknown``, the others naming the list
    that reply taught it. Its second page asks each agent with its last reply's tag and the
    ``pgknown`` that reply answered (the agent's tag covers it): every agent answers
    "unchanged", and the page's window and cut are the first page's."""
    from fakes import agent_fleet as fleet

    from debug_server.fanout import agents as agents_mod
    from debug_server.protocol import members

    world = 24
    dumps = synthetic.hang_job(world, n_entries=50, missing_rank=5)
    async with fleet([LiveProvider(dumps[r]) for r in range(world)], per_host=8) as f:
        # An earlier frontend's page: the agents answered once and learnt their lists.
        await agents_mod.AgentRoute(f["through"].route.agents, f["through"].asker,
                                    f["through"].rounds).fr(
            await f["through"].route.plan(await f["through"].registry.lookup()))
        calls = []

        def new_frontend() -> str | None:  # this process's cache is the agents' too
            calls.append(1)
            return None if len(calls) == 1 else members.known_param()

        monkeypatch.setattr(agents_mod, "members", SimpleNamespace(
            PARAM=members.PARAM, known_param=new_frontend))
        through = f["through"]
        first = await through.fr()
        assert through.route.agent_unchanged == 0 and calls  # its first page: whole replies
        second = await through.fr()
    assert through.route.agent_unchanged == 3 and through.route.cuts_reused == 1
    assert analyze_fr(second, None, world) == analyze_fr(first, None, world)
    assert "Rank 5 never joined" in analyze_fr(second, None, world)["verdict"]
