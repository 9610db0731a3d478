"""The straggler page's renderers and the watch's memory, over real worker apps with fixed rings."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from _scenarios import MS, lagged_rings

from debug_server.analysis import stragglers
from debug_server.config import ServerConfig
from debug_server.fanout.live import LiveCollector
from debug_server.frontend import stragglers as page
from debug_server.frontend.app import load_templates, make_frontend_app
from debug_server.rank import clock
from debug_server.rank.worker import StaticProvider, make_worker_app
from debug_server.readers.storeview import StaticRegistry

pytestmark = pytest.mark.timeout(120)


def _slow_rank_2(group: str = "main_comm") -> dict[int, dict[str, Any]]:
    rnd = random.Random(7)
    return lagged_rings(4, 120, lambda r, s: rnd.uniform(0, 2) + (40 if r == 2 else 0), group=group)


def test_text_report_says_who_and_shows_a_table_per_group() -> None:
    text = page.text_report(stragglers.analyze(_slow_rank_2()))
    assert text.startswith("Slow: rank 2 arrives last at 100 % of all_reduce on main_comm, median 4")
    assert "=== main_comm (4 ranks, 120 collectives: all_reduce) ===" in text
    table = text.split("=== main_comm")[1].splitlines()
    assert table[3].split()[0] == "2" and "SLOW (host)" in table[3]  # slowest rank first


def test_text_report_when_nobody_is_slow() -> None:
    text = page.text_report(stragglers.analyze(lagged_rings(4, 60, lambda r, s: 0.0)))
    assert text.startswith("Nobody is slow")


def test_html_escapes_group_names_and_draws_a_sparkline_per_rank() -> None:
    res = stragglers.analyze(_slow_rank_2(group="<b>evil</b>"))
    html = load_templates().get_template("stragglers.html").render(
        title="Stragglers", failures=[], **page.page_model(res))
    assert "<b>evil</b>" not in html and "&lt;b&gt;evil&lt;/b&gt;" in html
    assert html.count("<polyline") == 4 and "slow (host side)" in html


def test_streak_survives_polls_and_restarts_after_a_gap() -> None:
    watch = page.StragglerWatch(LiveCollector(None, StaticRegistry([None] * 4), timeout=1.0))  # type: ignore[arg-type]
    res = stragglers.analyze(_slow_rank_2())
    t0 = 1_000_000.0
    for i in range(8):  # named at every poll, 2 s apart
        watch._remember(res, t0 + 2 * i)
    said = watch.before_hang({2}, now=t0 + 14 * 60)
    assert said == ("rank 2 had been arriving last on main_comm (median 41 ms behind the first "
                    "rank) for 14 min before it stopped.")
    assert "before the hang" in watch.before_hang({0}, now=t0 + 60)  # slow, but not the culprit
    watch._remember(res, t0 + 14 + page.STREAK_GRACE_S + 1)  # a gap: a new streak
    assert watch.before_hang({2}, now=t0 + 14 + page.STREAK_GRACE_S + 11).endswith(
        "for 10 s before it stopped.")


@pytest.fixture
async def fleet(aiohttp_server: Any) -> AsyncIterator[list[str]]:
    urls = []
    for d in _slow_rank_2().values():
        urls.append(str((await aiohttp_server(make_worker_app(StaticProvider(d)))).make_url("")))
    yield urls


async def test_page_json_is_exactly_the_contract(fleet: list[str], aiohttp_client: Any) -> None:
    app = make_frontend_app(ServerConfig(port=0, fetch_timeout=5.0), StaticRegistry(fleet))
    client = await aiohttp_client(app)
    resp = await client.get("/stragglers", headers={"Accept": "application/json"})
    body = await resp.json()
    assert set(body) == {"stragglers", "groups_checked", "window_ops"}
    assert body["groups_checked"] == ["main_comm"] and body["window_ops"] == 128
    assert [(s["rank"], s["group"], s["side"]) for s in body["stragglers"]] == [
        (2, "main_comm", "host")]
    resp = await client.get("/stragglers?format=nope")
    assert resp.status == 400 and "format" in await resp.text()
    resp = await client.get("/metrics")
    assert 'debug_server_rank_last_share{group="main_comm",rank="2"}' in await resp.text()


async def test_worker_clock_offset_is_corrected_from_the_reply(aiohttp_server: Any,
                                                                aiohttp_client: Any) -> None:
    urls = []
    for r, d in _slow_rank_2().items():
        # A live read time, shifted with the entries: what a rank with an injected offset sends.
        provider = _NowProvider(d, 3_000 * MS if r >= 2 else 0)
        urls.append(str((await aiohttp_server(make_worker_app(provider))).make_url("")))
    client = await aiohttp_client(make_frontend_app(ServerConfig(port=0, fetch_timeout=5.0),
                                                    StaticRegistry(urls)))
    # Uncorrected, rank 2's lag would read ~3000 ms; corrected it is the 40 ms it sleeps, give
    # or take the offset's error (half a round trip to a loopback worker). On a loaded box a
    # read's round trip can make that error larger than 40 ms, and a lag below the error is not
    # reported, or it reads further from 40 ms: ask again until a read names rank 2 alone at
    # 30-60 ms (a later read's round trip is shorter); no read may ever show the offset itself.
    deadline = asyncio.get_running_loop().time() + 60
    while True:
        body = await (await client.get("/stragglers?format=json")).json()
        rows = body["stragglers"]
        assert all(s["median_lag_ms"] < 1000 for s in rows), rows
        if [s["rank"] for s in rows] == [2] and 30 <= rows[0]["median_lag_ms"] <= 60:
            break
        assert asyncio.get_running_loop().time() < deadline, rows


class _NowProvider(StaticProvider):
    def __init__(self, dump: dict[str, Any], offset: int) -> None:
        super().__init__(dump)
        self.offset = offset

    def fr_snapshot(self, **kw: Any) -> Any:
        import time

        return clock.shifted({**super().fr_snapshot(**kw), "dump_time_ns": time.time_ns()},
                             self.offset)



async def test_the_poll_keeps_each_reply_s_times_not_its_entries(fleet: list[str]) -> None:
    """The watch's fetch keeps of each reply what the analysis reads as it arrives
    (``reply.kept_on_arrival``): no body text and no entries are held, and the result is the
    one the whole replies give."""
    async with aiohttp.ClientSession() as session:
        collector = LiveCollector(session, StaticRegistry(fleet), timeout=5.0)
        try:
            watch = page.StragglerWatch(collector)
            result = await watch.poll()
            kept = await collector.fr_recent(watch.rule.window_ops, keep=stragglers.compact)
            whole = await collector.fr_recent(watch.rule.window_ops)
        finally:
            collector.close()
    assert [r.ok and r.body == "" for r in kept.results] == [True] * 4
    assert all(stragglers.TIMINGS in d and "entries" not in d for d in kept.dumps.values())
    assert all(len(d["entries"]) == 120 for d in whole.dumps.values())  # the rings, whole
    assert [(s["rank"], s["side"]) for s in result["stragglers"]] == [(2, "host")]
    assert stragglers.analyze(kept.dumps) == stragglers.analyze(whole.dumps)


async def test_where_polls_are_rationed_the_page_shows_the_last_poll_while_it_is_young(
        aiohttp_client: Any) -> None:
    """At 2048 ranks the watch polls every 16 s (``MAX_POLLS_PER_S``), each poll asking every
    rank twice: the page shows the last poll while it is younger than that, saying how old it
    is; an older one, or any at a size where polls are not rationed, is polled again."""
    app = make_frontend_app(ServerConfig(port=0, fetch_timeout=1.0),
                            StaticRegistry([None] * 2048))
    client = await aiohttp_client(app)
    watch = page.watch_of(app)
    polls = []
    real_poll = watch.poll

    async def counted() -> dict[str, Any]:
        polls.append(time.time())
        return await real_poll()

    watch.poll = counted  # type: ignore[method-assign]
    assert watch.poll_interval() == 16.0 > watch.interval
    resp = await client.get("/stragglers?format=text")
    first = await resp.text()
    assert len(polls) == 1 and not first.startswith("From the straggler poll")
    assert "Age" not in resp.headers  # polled now
    again = await (await client.get("/stragglers?format=text")).text()
    assert len(polls) == 1 and again.startswith("From the straggler poll of 0 s ago: at this "
                                                "job size the watch polls every 16 s"), again
    html = await (await client.get("/stragglers", headers={"Accept": "text/html"})).text()
    assert len(polls) == 1 and "From the straggler poll of 0 s ago" in html
    resp = await client.get("/stragglers?format=json")
    body = await resp.json()
    assert len(polls) == 1 and set(body) == {"stragglers", "groups_checked", "window_ops"}
    assert resp.headers["Age"] == "0"  # a JSON reader is told how old it is too
    assert watch.last_at is not None
    watch.last_at -= 17.0  # older than one interval: polled again
    await client.get("/stragglers?format=text")
    assert len(polls) == 2
    small = page.StragglerWatch(LiveCollector(None, StaticRegistry([None] * 4),  # type: ignore[arg-type]
                                              timeout=1.0))
    small.last, small.last_at = {"stragglers": []}, time.time()
    small.poll = counted  # type: ignore[method-assign]
    await small.for_page()  # not rationed at 4 ranks: every page polls
    assert len(polls) == 3
