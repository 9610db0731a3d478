"""The overview's health column from the hang watch's last poll where the watch rations its polls
(``frontend.health_held``): used only while young, its age on the page, and a rank that does not
answer now never reads as the held poll saw it."""

from __future__ import annotations

import time
from typing import Any

import pytest
from fakes import closed_port_url

from debug_server.config import ServerConfig
from debug_server.fanout.transport import OK, UNREACHABLE, RankResult
from debug_server.frontend.app import HANG_WATCH, make_frontend_app
from debug_server.frontend.hangreport import HangWatch, RankHealth
from debug_server.frontend.health_held import MAX_AGE_POLLS, held_health
from debug_server.readers.storeview import StaticRegistry
from debug_server.tools import synthetic

CURL = "*/*"
BROWSER = "text/html,application/xhtml+xml"
STALLED = {"group": "main_comm", "seq": 4, "op": "all_reduce", "age_s": 30.0}


class _Job:
    world_size = 16384


class _Collector:
    registry = _Job()
    world_size = 16384


def _watch(world_size: int = 16384) -> HangWatch:
    c = _Collector()
    c.world_size = world_size
    return HangWatch(c, None, interval=60.0)  # type: ignore[arg-type]


def _poll(watch: HangWatch, at: float) -> None:
    watch.last = [RankHealth(0, True, False, STALLED), RankHealth(1, True, True),
                  RankHealth(2, True, True)]
    watch.last_at = at


def test_a_young_poll_of_a_watch_that_rations_its_polls_is_held_with_its_age() -> None:
    watch = _watch()
    assert watch.poll_interval() == 32.0  # 16384 ranks / MAX_POLLS_PER_S
    _poll(watch, 100.0)
    held = held_health(watch, now=110.0)
    assert held is not None and (held.age_s, held.interval_s) == (10.0, 32.0)
    assert held.note().startswith("Health column: the hang watch's poll of 10 s ago (at this job "
                                  "size the hang watch polls every 32 s")


def test_a_poll_older_than_the_bound_is_not_held() -> None:
    watch = _watch()
    _poll(watch, 100.0)
    assert held_health(watch, now=100.0 + MAX_AGE_POLLS * 32.0 + 0.1) is None


def test_a_poll_47_s_old_is_still_held_at_16384_ranks_as_pages_stretch_the_next_poll() -> None:
    # Measured with pages back to back at 16384 via agents: polls 45-48 s apart (pagefirst).
    watch = _watch()
    _poll(watch, 100.0)
    held = held_health(watch, now=147.0)
    assert held is not None and held.age_s == 47.0


def test_where_the_watch_polls_at_its_full_rate_the_overview_asks_every_rank() -> None:
    watch = _watch(world_size=1024)  # 1024 / 512 = 2 s: not rationed
    _poll(watch, 100.0)
    assert held_health(watch, now=100.5) is None


def test_no_poll_yet_is_nothing_held() -> None:
    assert held_health(_watch(), now=1.0) is None
    assert held_health(None) is None


def test_a_rank_unreachable_now_reads_unreachable_whatever_the_held_poll_said() -> None:
    watch = _watch()
    _poll(watch, 100.0)
    held = held_health(watch, now=101.0)
    assert held is not None
    reach = [RankResult(0, "u0", OK, "stacks"), RankResult(1, "u1", OK, "stacks"),
             RankResult(2, "u2", UNREACHABLE, error="unreachable after 0.0 s (refused)"),
             RankResult(3, "u3", OK, "stacks")]
    assert held.texts(reach, 4) == {
        0: "UNHEALTHY: main_comm seq 4 all_reduce in flight for 30.0 s",
        1: "healthy",
        2: "health unknown (unreachable after 0.0 s (refused))",
        3: "health unknown (not in the hang watch's last poll)"}


@pytest.fixture
async def held_client(aiohttp_client: Any, fake_job: Any) -> Any:
    """A frontend over 2 fake ranks that report healthy and a dead rank 2, whose hang watch
    rations its polls and holds a poll of 5 s ago in which rank 0 was stalled and rank 2 healthy."""
    urls = await fake_job(synthetic.hang_job(2, n_entries=5, missing_rank=1))
    urls.append(closed_port_url())
    client = await aiohttp_client(make_frontend_app(ServerConfig(port=0, fetch_timeout=2.0),
                                                    StaticRegistry(urls)))
    watch = client.app[HANG_WATCH]

    async def no_poll() -> None:
        return None

    watch.poll = no_poll  # the held poll stays the one set here
    watch.poll_interval = lambda: 40.0
    _poll(watch, time.monotonic() - 5.0)
    return client


async def test_overview_takes_the_held_health_and_says_how_old_it_is(held_client: Any) -> None:
    body = await (await held_client.get("/?format=json")).json()
    assert 5.0 <= body["health_age_s"] < 40.0
    # The workers themselves would say "healthy": rank 0's line is the held poll's.
    assert [r["health"] for r in body["ranks"][:2]] == [
        "UNHEALTHY: main_comm seq 4 all_reduce in flight for 30.0 s", "healthy"]
    text = await (await held_client.get("/", headers={"Accept": CURL})).text()
    assert text.splitlines()[2].startswith("Health column: the hang watch's poll of ")
    html = await (await held_client.get("/", headers={"Accept": BROWSER})).text()
    assert "Health column: the hang watch&#39;s poll of " in html


async def test_overview_with_a_held_poll_shows_a_dead_rank_dead(held_client: Any) -> None:
    body = await (await held_client.get("/?format=json")).json()
    dead = body["ranks"][2]
    assert dead["status"] == "unreachable" and body["reachable"] == 2
    assert dead["health"].startswith("health unknown (unreachable after ")
    assert "Rank 1 never joined all_reduce #4" in body["verdict"]


async def test_an_overview_that_read_every_rank_s_health_lends_it_to_the_next_ones(
        aiohttp_client: Any, fake_job: Any) -> None:
    """Where the watch rations its polls and none is young enough, the overview asks every rank
    for its health, and holds that read as the watch's last (``HangWatch.hold``): the next
    overview shows it with its age and who read it, and asks no rank for its health."""
    urls = await fake_job(synthetic.hang_job(2, n_entries=5, missing_rank=1))
    client = await aiohttp_client(make_frontend_app(ServerConfig(port=0, fetch_timeout=2.0),
                                                    StaticRegistry(urls)))
    watch = client.app[HANG_WATCH]
    watch.poll_interval = lambda: 40.0  # rationed; its own first poll is 40 s away
    first = await (await client.get("/?format=json")).json()
    assert "health_age_s" not in first and watch.last_by == "an overview's read of every rank"
    assert [r["health"] for r in first["ranks"]] == ["healthy", "healthy"]
    # What the held read says, not a worker.
    watch.last = [RankHealth(0, True, False, STALLED), *watch.last[1:]]
    again = await (await client.get("/", headers={"Accept": CURL})).text()
    assert again.splitlines()[2].startswith(
        "Health column: an overview's read of every rank of 0 s ago (at this job size the hang "
        "watch polls every 40 s"), again
    assert "rank 0: ok, UNHEALTHY: main_comm seq 4 all_reduce in flight for 30.0 s" in again
    # A read asked before the watch's last poll came in does not replace that poll.
    _poll(watch, time.monotonic())
    polled, at = watch.last, watch.last_at
    watch.hold([], [], asked_at=time.monotonic() - 1.0)
    assert watch.last is polled and watch.last_at == at
