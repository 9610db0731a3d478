"""Member lists cross the wire once per frontend (``members``), torch's format unchanged."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from debug_server.analysis import core as analysis
from debug_server.fanout.live import LiveCollector
from debug_server.protocol import members
from debug_server.rank import worker
from debug_server.readers.storeview import StaticRegistry
from debug_server.tools import synthetic


def _job(world: int, fakes: int) -> dict[int, dict[str, Any]]:
    """``fakes`` ranks of a ``world``-rank job whose last rank never issued seq 3."""
    done = [synthetic.make_entry(record_id=i, seq=i) for i in range(3)]
    hang = [*done, synthetic.make_entry(record_id=3, seq=3, state="started")]
    groups = {"main_comm": list(range(world))}
    return {r: synthetic.make_dump(hang if r < fakes - 1 else done, groups) for r in range(fakes)}


async def _post(fake_rank: Any, aiohttp_client: Any, dump: dict[str, Any], query: str) -> Any:
    url = await fake_rank(dump)
    async with aiohttp.ClientSession() as s, s.post(
            f"{url}/handler/torchcomms_fr_trace_json?{query}") as resp:
        return resp.status, await resp.text()


async def test_worker_sends_a_reference_for_a_list_the_frontend_holds(fake_rank: Any,
                                                                     aiohttp_client: Any) -> None:
    dump = _job(300, 1)[0]
    text = dump["pg_config"]["main_comm"]["ranks"]
    status, body = await _post(fake_rank, aiohttp_client, dump,
                               f"{members.PARAM}={members.digest(text)}")
    assert status == 200
    assert json.loads(body)["pg_config"]["main_comm"]["ranks"] == "@" + members.digest(text)


async def test_worker_without_pgknown_answers_torchs_format(fake_rank: Any,
                                                           aiohttp_client: Any) -> None:
    dump = _job(300, 1)[0]
    status, body = await _post(fake_rank, aiohttp_client, dump, "onlyactive=false")
    assert json.loads(body)["pg_config"]["main_comm"]["ranks"] == json.dumps(list(range(300)))


async def test_bad_pgknown_is_a_one_line_400(fake_rank: Any, aiohttp_client: Any) -> None:
    status, body = await _post(fake_rank, aiohttp_client, _job(4, 1)[0], f"{members.PARAM}=xyz")
    assert (status, body.strip()) == (
        400, "parameter pgknown: 'xyz' is not a 16-digit hex digest")


async def test_second_fetch_moves_no_member_lists_and_still_finds_the_missing_rank(
        fake_job: Any) -> None:
    world = 3001  # a member list no other test has taught this process's cache
    urls = await fake_job(_job(world, 4))
    async with aiohttp.ClientSession() as session:
        c = LiveCollector(session, StaticRegistry(urls), timeout=5)
        first = await c.fr()
        second = await c.fr()
    list_chars = len(json.dumps(list(range(world))))
    assert all(len(r.body or "") > list_chars for r in first.results)  # learnt from these
    assert all(len(r.body or "") < list_chars for r in second.results)  # references only
    texts = {id(d["pg_config"]["main_comm"]["ranks"]) for d in second.dumps.values()}
    assert len(texts) == 1  # one shared copy for every rank
    result = analysis.analyze(second.dumps, world_size=4)
    missing = [f for f in result["findings"] if f["kind"] == "missing_ranks"]
    assert [(f["seq"], f["ranks"]) for f in missing] == [(3, [3])]
    assert result["groups"][0]["ranks"] == list(range(world))


async def test_worker_that_refuses_pgknown_is_asked_without_it(
        fake_job: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # An older worker of ours: it knows the window parameters but not pgknown.
    monkeypatch.setattr(worker, "_FR_PARAMS", frozenset({"onlyactive", "includecollectives",
                                                         "since", "window"}))
    urls = await fake_job(_job(3002, 2))
    async with aiohttp.ClientSession() as session:
        c = LiveCollector(session, StaticRegistry(urls), timeout=5)
        await c.fr()  # learns the list: the next fetch would name it
        fr = await c.fr()
    assert [r.status for r in fr.results] == ["ok", "ok"]
    assert fr.dumps[0]["pg_config"]["main_comm"]["ranks"] == json.dumps(list(range(3002)))
    assert fr.window is not None  # still the window, not whole rings


async def test_first_fetch_of_a_big_job_learns_the_lists_from_one_rank(
        fake_job: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from debug_server.fanout import rounds

    monkeypatch.setattr(rounds, "PRIME_RANKS", 3)
    monkeypatch.setattr(members, "known_param", _only_lists_of(members.known_param, 3003))
    world = 3003
    urls = await fake_job(_job(world, 4))
    async with aiohttp.ClientSession() as session:
        fr = await LiveCollector(session, StaticRegistry(urls), timeout=5).fr()
    list_chars = len(json.dumps(list(range(world))))
    full = [r.rank for r in fr.results if len(r.body or "") > list_chars]
    assert full == [0]  # the other three were sent a reference
    assert {d["pg_config"]["main_comm"]["ranks"] for d in fr.dumps.values()} == {
        json.dumps(list(range(world)))}


def _only_lists_of(real: Any, world: int) -> Any:
    # Other tests taught this process other lists; this test starts from none but its own.
    mine = members.digest(json.dumps(list(range(world))))

    def known_param(budget: int = members.MAX_PARAM_CHARS) -> str | None:
        got = real(budget)
        return mine if got and mine in got.split(",") else None

    return known_param



def test_refer_text_writes_torchs_lists_as_references_that_inline_puts_back(
        fresh_members: None) -> None:
    # torch's C++ worker writes the world's list in every reply (compact JSON, pg_config after
    # entries): the first reply teaches it, and every copy then travels as one reference.
    world = 3003
    ranks = json.dumps(list(range(world)))
    dump = {"entries": [{"process_group": ["0", "main"], "note": '"ranks":"x'}],
            "pg_config": {"0": {"desc": "main", "name": "0", "ranks": ranks},
                          "1": {"desc": "pair", "name": "1", "ranks": "[0, 1]"}},
            "pg_status": {}, "version": "2.10"}
    text = json.dumps(dump, separators=(",", ":"))
    first, again = members.refer_text(text), members.refer_text(text[:-1] + " }")
    ref = "@" + members.digest(ranks)
    assert ranks not in first and ranks not in again
    assert f'"ranks":"{ref}"' in first and '"ranks":"[0, 1]"' in first  # short lists stay
    parsed = [json.loads(t) for t in (first, again)]
    for d in parsed:
        members.inline(d)
        assert d == dump
    # one shared copy: parsed, hashed and held once however many ranks send it
    assert parsed[0]["pg_config"]["0"]["ranks"] is parsed[1]["pg_config"]["0"]["ranks"]


def test_refer_text_leaves_a_list_written_with_escapes_as_it_is(fresh_members: None) -> None:
    # "\u0031" is "1": the text is not the string it stands for, so it cannot be matched as one
    listed = ", ".join(map(str, range(40))) + ", \\u0031"
    text = '{"pg_config":{"0":{"ranks":"[' + listed + ']"}}}'
    assert len(listed) > members.MIN_CHARS
    assert members.refer_text(text) == text
