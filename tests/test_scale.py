"""Costs that must stay linear in ranks: member lists parsed once per group, bounded polling."""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from debug_server import dumpio
from debug_server.analysis import core as analysis
from debug_server.analysis.digest import digest_dump
from debug_server.fanout.live import LiveCollector
from debug_server.frontend.hangreport import MAX_POLL_INTERVAL, HangWatch
from debug_server.protocol import frwindow
from debug_server.readers.storeview import StaticRegistry
from debug_server.tools import synthetic


def _job(world: int) -> dict[int, dict[str, Any]]:
    # A fresh member-list text (a world size no other test uses) so the caches start cold.
    entries = [synthetic.make_entry(record_id=0, seq=0, state="started")]
    return {r: synthetic.make_dump(entries, {"main_comm": list(range(world))}) for r in range(world)}


def test_world_member_list_is_parsed_once_for_all_ranks_by_the_analyzer() -> None:
    dumps = _job(777)
    before = dumpio._members_text.cache_info()
    result = analysis.analyze(dumps, world_size=777)
    after = dumpio._members_text.cache_info()
    assert after.misses - before.misses == 1  # one parse for 777 ranks
    assert after.hits - before.hits == 776
    assert result["groups"][0]["ranks"] == list(range(777))


def test_world_member_list_is_parsed_once_for_all_ranks_by_the_frontier() -> None:
    dumps = _job(779)
    before = frwindow._members_text.cache_info()
    assert frwindow.frontier(dumps) == {}  # nothing completed yet: the group is needed whole
    assert frwindow._members_text.cache_info().misses - before.misses == 1


def test_frontier_still_waits_for_a_member_that_reported_nothing() -> None:
    done = [synthetic.make_entry(record_id=i, seq=i) for i in range(10)]
    dumps = {r: synthetic.make_dump(done, {"main_comm": [0, 1, 2]}) for r in range(3)}
    assert frwindow.frontier(dumps) == {"main_comm": 7}
    dumps[2]["pg_status"] = {}
    dumps[2]["entries"] = []
    assert frwindow.frontier(dumps) == {}  # rank 2 answered but shows nothing of main_comm


async def test_health_poll_interval_grows_with_the_job_above_1024_ranks() -> None:
    async with aiohttp.ClientSession() as session:
        def watch(world: int) -> HangWatch:
            c = LiveCollector(session, StaticRegistry([None] * world), timeout=1)
            return HangWatch(c, None, interval=60)

        assert watch(1024).poll_interval() == MAX_POLL_INTERVAL
        assert watch(16384).poll_interval() == 32.0  # 512 health requests a second at most


def test_member_list_string_of_pg_config_is_unchanged_on_the_wire() -> None:
    # torch's clients read pg_config ranks as a string; the caches change nothing they see.
    dump = _job(3)[0]
    assert json.loads(json.dumps(dump))["pg_config"]["main_comm"]["ranks"] == "[0, 1, 2]"


def test_connections_per_rank_shrink_to_fit_the_file_limit(monkeypatch: Any) -> None:
    from debug_server.frontend import app as frontend

    monkeypatch.setattr(frontend, "_nofile_limit", lambda: 20000)
    assert frontend.connections_per_rank(64) == frontend.CONNECTIONS_PER_RANK
    assert frontend.connections_per_rank(4096) == 4  # (20000 - 1024) // 4096
    assert frontend.connections_per_rank(16384) == 1
    assert frontend.connections_per_rank(100_000) == 1  # never 0: one per rank at least


def test_every_ranks_digest_shares_one_member_tuple_hashed_once() -> None:
    dumps = _job(781)
    a, b = digest_dump(0, dumps[0]), digest_dump(5, dumps[5])
    ranks = a.pg[0][2]
    assert ranks is b.pg[0][2] and ranks == tuple(range(781))
    assert hash(ranks) == hash(tuple(range(781)))  # equal to a plain tuple, as a dict key
    assert ranks.__dict__["_hash"] == hash(ranks)  # kept: the next rank's key costs O(1)
