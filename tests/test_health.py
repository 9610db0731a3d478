"""One health line per rank: the overview (``/``) and the hang report word it the same way."""

from __future__ import annotations

from typing import Any

import aiohttp

from debug_server.config import ServerConfig
from debug_server.fanout.live import LiveCollector
from debug_server.fanout.transport import FAILED, OK, RankResult
from debug_server.frontend.app import make_frontend_app
from debug_server.frontend.hangreport import HangWatch, parse_health
from debug_server.readers.storeview import StaticRegistry
from debug_server.tools import synthetic

STALLED = {"healthy": False, "in_flight": 1, "oldest_in_flight_s": 612.4,
           "stalled_op": {"group": "main_comm", "seq": 2, "op": "all_reduce", "age_s": 612.4}}
BUSY = {"healthy": True, "stalled_op": None, "in_flight": 2, "oldest_in_flight_s": 3.2}


async def _overview(aiohttp_client: Any, urls: list[str]) -> dict[str, Any]:
    app = make_frontend_app(ServerConfig(port=0, fetch_timeout=2.0), StaticRegistry(urls))
    client = await aiohttp_client(app)
    resp = await client.get("/?format=json")
    assert resp.status == 200
    return await resp.json()


async def test_overview_and_hang_report_give_a_stalled_rank_the_same_line(
        aiohttp_client: Any, fake_rank: Any) -> None:
    dumps = synthetic.hang_job(2, n_entries=3)
    urls = [await fake_rank(dumps[0], health=STALLED), await fake_rank(dumps[1])]
    overview = await _overview(aiohttp_client, urls)
    async with aiohttp.ClientSession() as session:
        watch = HangWatch(LiveCollector(session, StaticRegistry(urls), timeout=2.0), None,
                          interval=3600.0)
        report = await watch.poll()
    line = "UNHEALTHY: main_comm seq 2 all_reduce in flight for 612.4 s"
    assert [r["health"] for r in overview["ranks"]] == [line, "healthy"]
    assert report is not None and [h.line() for h in report.trigger] == [f"rank 0: {line}"]


async def test_healthy_rank_with_ops_in_flight_says_how_many_and_the_oldest_age(
        aiohttp_client: Any, fake_rank: Any) -> None:
    dumps = synthetic.hang_job(1, n_entries=3)
    overview = await _overview(aiohttp_client, [await fake_rank(dumps[0], health=BUSY)])
    assert overview["ranks"][0]["health"] == "healthy (2 ops in flight, oldest 3 s)"


def test_worker_without_a_health_check_reads_as_no_health_check() -> None:
    res = RankResult(3, "http://127.0.0.1:9", FAILED, error="HTTP 404: Not Found", http_status=404)
    (h,) = parse_health([res])
    assert (h.healthy, h.line()) == (None, "rank 3: health unknown (no health check)")


def test_unreachable_rank_health_names_why_it_is_unknown() -> None:
    res = RankResult(2, "http://127.0.0.1:9", "unreachable", error="unreachable after 2.0 s")
    (h,) = parse_health([res])
    assert h.text() == "health unknown (unreachable after 2.0 s)"


def test_health_reply_without_a_verdict_is_unknown_not_healthy() -> None:
    (h,) = parse_health([RankResult(1, "http://127.0.0.1:9", OK, body='{"in_flight": 0}')])
    assert h.text() == "health unknown (health reply is not understood)"
