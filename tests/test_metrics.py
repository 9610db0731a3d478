"""``/metrics``: Prometheus text from the frontend's last cycles, over fake ranks; a scrape
asks no rank."""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from fakes import MAIN_STACK, closed_port_url
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from debug_server.config import ServerConfig
from debug_server.frontend import hangreport, metrics, stragglers
from debug_server.frontend.app import HANG_WATCH, LAST_CYCLE, METRICS_CYCLE, make_frontend_app
from debug_server.frontend.metrics import CONTENT_TYPE
from debug_server.rank.worker import StaticProvider, make_worker_app
from debug_server.readers.storeview import StaticRegistry
from debug_server.tools import synthetic

Samples = dict[str, list[Any]]


def _parse(text: str) -> Samples:
    samples: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples.setdefault(s.name, []).append(s)
    return samples


def _value(samples: Samples, name: str, **labels: str) -> float | None:
    for s in samples.get(name, []):
        if all(s.labels.get(k) == v for k, v in labels.items()):
            return float(s.value)
    return None


def _ready(samples: Samples) -> bool:
    return _value(samples, "debug_server_cycle_ready") == 1.0


async def metrics_when(client: Any, cond: Callable[[Samples], bool],
                       limit_s: float = 30.0) -> tuple[Any, str, Samples]:
    """Scrape until ``cond`` holds of the samples (scrapes are free: they ask no rank)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while True:
        resp = await client.get("/metrics")
        text = await resp.text()
        samples = _parse(text)
        if cond(samples):
            return resp, text, samples
        assert loop.time() < deadline, text
        await asyncio.sleep(0.02)

STALLED = {"healthy": False, "in_flight": 1, "oldest_in_flight_s": 42.5,
           "stalled_op": {"group": "main_comm", "seq": 4, "op": "all_reduce", "age_s": 42.5}}
HEALTHY = {"healthy": True, "stalled_op": None, "in_flight": 0, "oldest_in_flight_s": None}


@pytest.fixture
async def scrape(aiohttp_client: Any, fake_rank: Any) -> Any:
    """Scrape a frontend over rank 0 (stalled in all_reduce #4), rank 1 (never issued it,
    healthy) and rank 2 (unreachable) once its cycles came in; returns the response, the
    text and ``{name: [samples]}``."""
    return await metrics_when(await _frontend(aiohttp_client, fake_rank), _ready)


async def _frontend(aiohttp_client: Any, fake_rank: Any) -> Any:
    """A test client of the ``scrape`` fixture's frontend."""
    dumps = synthetic.hang_job(2, n_entries=5, missing_rank=1)
    dumps[0]["pg_status"]["main_comm"] = {"last_enqueued_collective": 4,
                                          "last_started_collective": 4,
                                          "last_completed_collective": 3}
    dumps[1]["pg_status"]["main_comm"] = {"last_enqueued_collective": 3,
                                          "last_started_collective": 3,
                                          "last_completed_collective": 3}
    urls = [await fake_rank(dumps[0], stacks=MAIN_STACK, health=STALLED),
            await fake_rank(dumps[1], stacks=MAIN_STACK, health=HEALTHY),
            closed_port_url()]
    # Cycles every 0.3 s (the hang watch's health poll and the frontend's FR cycle): the
    # scrape waits for both to have come in.
    return await aiohttp_client(make_frontend_app(
        ServerConfig(port=0, fetch_timeout=2.0, dump_interval=0.3), StaticRegistry(urls)))


def _by(samples: dict[str, list[Any]], name: str, key: str = "rank") -> dict[str, float]:
    return {s.labels[key]: s.value for s in samples[name]}


async def test_metrics_is_prometheus_text_0_0_4(scrape: Any) -> None:
    resp, text, _ = scrape
    assert resp.status == 200
    assert resp.headers["Content-Type"] == CONTENT_TYPE == "text/plain; version=0.0.4; charset=utf-8"
    assert "# HELP debug_server_stuck_seq " in text and "# TYPE debug_server_stuck_seq gauge" in text


async def test_a_scrape_that_takes_gzip_gets_the_same_text_gzipped(aiohttp_client: Any,
                                                                   fake_rank: Any) -> None:
    """Prometheus asks ``Accept-Encoding: gzip``: the cycle's text is compressed once, each
    scrape's own lines added to a copy of the compressor; one gzip member, the same text."""
    client = await _frontend(aiohttp_client, fake_rank)
    resp, text, _ = await metrics_when(client, _ready)
    assert resp.headers["Content-Encoding"] == "gzip"  # aiohttp's client asks gzip, deflate
    for _ in range(2):  # the second from the held compressor
        got = await client.get("/metrics", headers={"Accept-Encoding": "gzip"},
                               auto_decompress=False)
        raw = await got.read()
        assert got.headers["Content-Encoding"] == "gzip" and raw[:2] == b"\x1f\x8b"
        one = zlib.decompressobj(31)
        assert _cycle_lines(one.decompress(raw).decode()) == _cycle_lines(text)
        assert one.eof and not one.unused_data  # one member, nothing after it
    plain = await client.get("/metrics", headers={"Accept-Encoding": "gzip;q=0, identity"})
    assert "Content-Encoding" not in plain.headers
    assert _cycle_lines(await plain.text()) == _cycle_lines(text)


async def test_head_of_metrics_sends_no_body(aiohttp_client: Any, fake_rank: Any) -> None:
    """HEAD (which aiohttp routes to the GET handler) gets the headers alone, plain or gzip:
    the next request on the same connection reads its own reply."""
    client = await _frontend(aiohttp_client, fake_rank)
    _, text, _ = await metrics_when(client, _ready)
    for accept in ("identity", "gzip"):
        head = await client.head("/metrics", headers={"Accept-Encoding": accept})
        assert head.status == 200 and await head.read() == b""
        assert int(head.headers["Content-Length"]) > 0
        again = await client.get("/metrics", headers={"Accept-Encoding": "identity"})
        assert _cycle_lines(await again.text()) == _cycle_lines(text)


def _cycle_lines(text: str) -> list[str]:
    """The cycle's families (the scrape's own moment, ``NowCollector``'s, starts at the world
    size) less how long the last FR cycle took: a cycle every 0.3 s here."""
    cycle = text.partition("# HELP debug_server_world_size")[0]
    assert cycle != text
    return [line for line in cycle.splitlines() if "scrape_duration" not in line]


@pytest.mark.parametrize(("header", "takes"), [
    ("gzip", True), ("deflate, gzip;q=1.0, *;q=0.5", True), ("*", True), ("GZIP", True),
    ("gzip;q=0", False), ("identity", False), ("", False), ("gzip;q=x", False),
    ("br, deflate", False)])
def test_takes_gzip_reads_the_accept_encoding_header(header: str, takes: bool) -> None:
    assert metrics.takes_gzip(header) is takes


async def test_metrics_show_the_stuck_sequence_number(scrape: Any) -> None:
    _, _, samples = scrape
    (stuck,) = samples["debug_server_stuck_seq"]
    assert stuck.labels == {"group": "main_comm", "op": "all_reduce"} and stuck.value == 4


async def test_metrics_show_missing_rank_per_collective_and_the_count(scrape: Any) -> None:
    _, text, samples = scrape
    assert [(s.labels, s.value) for s in samples["debug_server_missing_ranks"]] == [
        ({"group": "main_comm", "seq": "4", "rank": "1"}, 1.0)]
    assert [(s.labels, s.value) for s in samples["debug_server_missing_ranks_count"]] == [
        ({"group": "main_comm", "seq": "4"}, 1.0)]
    assert 'debug_server_missing_ranks{group="main_comm",rank="1",seq="4"} 1.0' in text


async def test_metrics_show_up_and_healthy_per_rank(scrape: Any) -> None:
    _, _, samples = scrape
    assert _by(samples, "debug_server_up") == {"0": 1.0, "1": 1.0, "2": 0.0}
    # The unreachable rank has no health sample (unknown is not "healthy" nor "stalled").
    assert _by(samples, "debug_server_healthy") == {"0": 0.0, "1": 1.0}
    assert _by(samples, "debug_server_oldest_in_flight_seconds") == {"0": 42.5, "1": 0.0}
    (stalled,) = samples["debug_server_stalled_op_seq"]
    assert stalled.labels == {"rank": "0", "group": "main_comm", "op": "all_reduce"}
    assert stalled.value == 4


async def test_metrics_show_last_enqueued_and_completed_seq_per_communicator(scrape: Any) -> None:
    _, _, samples = scrape
    enq = {(s.labels["rank"], s.labels["group"]): s.value for s in samples["debug_server_last_enqueued_seq"]}
    done = {(s.labels["rank"], s.labels["group"]): s.value
            for s in samples["debug_server_last_completed_seq"]}
    assert enq == {("0", "main_comm"): 4.0, ("1", "main_comm"): 3.0}
    assert done == {("0", "main_comm"): 3.0, ("1", "main_comm"): 3.0}


async def test_metrics_use_a_private_registry(scrape: Any) -> None:
    _, text, _ = scrape
    assert "python_gc_objects_collected_total" not in text  # the global registry's default
    assert not any(n.startswith("debug_server_") for n in REGISTRY._names_to_collectors)


async def test_metrics_rejects_unknown_parameters(aiohttp_client: Any, fake_rank: Any) -> None:
    url = await fake_rank(synthetic.hang_job(1, n_entries=2)[0])
    client = await aiohttp_client(make_frontend_app(ServerConfig(port=0), StaticRegistry([url])))
    resp = await client.get("/metrics?x=1")
    assert resp.status == 400 and "unknown parameter 'x'" in await resp.text()


async def test_clean_job_has_no_stuck_seq_and_all_healthy(aiohttp_client: Any, fake_rank: Any) -> None:
    dumps = synthetic.hang_job(2, n_entries=3)
    for d in dumps.values():
        for e in d["entries"]:
            e["state"] = "completed"
    urls = [await fake_rank(dumps[r], health=HEALTHY) for r in (0, 1)]
    client = await aiohttp_client(make_frontend_app(ServerConfig(port=0, dump_interval=0.3),
                                                    StaticRegistry(urls)))
    _, text, _ = await metrics_when(client, _ready)
    samples = {s.name: s for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert "debug_server_stuck_seq" not in samples and "debug_server_missing_ranks" not in samples
    assert "debug_server_healthy" in text and 'debug_server_healthy{rank="0"} 0.0' not in text
    assert samples["debug_server_world_size"].value == 2


# ---------------------------------------------------------------------------------------------
# From the last cycle: a scrape asks no rank


class CountingWorkers:
    """Real worker apps (``make_worker_app``) that count every request they get."""

    def __init__(self) -> None:
        self.requests: list[str] = []

    async def serve(self, aiohttp_server: Any, provider: StaticProvider) -> str:
        @web.middleware
        async def count(request: web.Request, handler: Any) -> web.StreamResponse:
            self.requests.append(request.path)
            return await handler(request)

        app = make_worker_app(provider)
        app.middlewares.append(count)
        return str((await aiohttp_server(app)).make_url("")).rstrip("/")


@pytest.fixture
def quiet_cycles(monkeypatch: pytest.MonkeyPatch) -> None:
    """No background cycle comes by itself (the test runs each one): the hang watch, the
    straggler poll and the frontend's FR cycle all wait an hour."""
    monkeypatch.setattr(hangreport, "MAX_POLL_INTERVAL", 3600.0)
    monkeypatch.setattr(metrics, "FIRST_CYCLE_S", 3600.0)
    monkeypatch.setattr(stragglers.StragglerWatch, "poll_interval", lambda self: 3600.0)


def _stuck_job() -> tuple[dict[int, Any], list[dict[str, Any]]]:
    dumps = synthetic.hang_job(2, n_entries=5, missing_rank=1)
    return dumps, [STALLED, HEALTHY]


async def test_a_scrape_asks_no_rank(aiohttp_client: Any, aiohttp_server: Any,
                                     quiet_cycles: None) -> None:
    workers = CountingWorkers()
    dumps, health = _stuck_job()
    urls = [await workers.serve(aiohttp_server, StaticProvider(dumps[r], stacks=MAIN_STACK,
                                                               health=health[r]))
            for r in (0, 1)]
    app = make_frontend_app(ServerConfig(port=0, fetch_timeout=2.0, dump_interval=3600),
                            StaticRegistry(urls))
    client = await aiohttp_client(app)

    # Before any cycle: what is known, and no rank asked for it.
    for _ in range(3):
        samples = _parse(await (await client.get("/metrics")).text())
        assert _value(samples, "debug_server_cycle_ready") == 0.0
        assert _value(samples, "debug_server_world_size") == 2.0
        assert "debug_server_last_cycle_age_seconds" not in samples
        assert "debug_server_up" not in samples and "debug_server_stuck_seq" not in samples
    assert workers.requests == []

    # One cycle of each, run by their own code: the health poll and the frontend's FR cycle.
    await app[HANG_WATCH].poll()
    part = await app[METRICS_CYCLE].run_once()
    assert part.by == "metrics cycle" and app[LAST_CYCLE].fr is part
    asked = len(workers.requests)
    assert asked > 0

    for _ in range(20):
        resp = await client.get("/metrics")
        samples = _parse(await resp.text())
        assert resp.status == 200 and _ready(samples)
        assert _value(samples, "debug_server_stuck_seq", group="main_comm") == 4.0
        assert _value(samples, "debug_server_healthy", rank="0") == 0.0
        assert _value(samples, "debug_server_last_cycle_age_seconds", part="fr") is not None
        assert _value(samples, "debug_server_last_cycle_age_seconds", part="health") is not None
    assert len(workers.requests) == asked, workers.requests[asked:]


async def test_values_change_after_the_next_cycle_of_the_dumper(
        aiohttp_client: Any, fake_rank: Any, tmp_path: Path) -> None:
    # A dumper that fetches FR every 0.3 s feeds /metrics; the frontend's own cycle, due only
    # when the FR part is METRICS_INTERVAL_S old, never fetches.
    dumps = synthetic.hang_job(2, n_entries=3)
    for d in dumps.values():
        for e in d["entries"]:
            e["state"] = "completed"
    providers = [StaticProvider(dumps[r], stacks=MAIN_STACK, health=HEALTHY) for r in (0, 1)]
    urls = [await fake_rank(None, provider=p) for p in providers]
    app = make_frontend_app(ServerConfig(port=0, fetch_timeout=2.0, dump_interval=0.3,
                                         dump_dir=str(tmp_path), enabled_dumps={"snapshot"}),
                            StaticRegistry(urls))
    client = await aiohttp_client(app)
    _, _, before = await metrics_when(client, _ready)
    assert _value(before, "debug_server_healthy", rank="0") == 1.0
    assert "debug_server_stuck_seq" not in before
    assert app[LAST_CYCLE].fr is not None and app[LAST_CYCLE].fr.by == "dumper"

    # Rank 1 stops before all_reduce #4 that rank 0 is stuck in: the next cycles say so.
    stuck, _ = _stuck_job()
    providers[0].dump, providers[1].dump = stuck[0], stuck[1]
    providers[0].health_info = STALLED
    _, _, after = await metrics_when(client, lambda s: _value(
        s, "debug_server_stuck_seq", group="main_comm") == 4.0 and _value(
        s, "debug_server_healthy", rank="0") == 0.0)
    assert _value(after, "debug_server_missing_ranks", group="main_comm", seq="4",
                  rank="1") == 1.0
    assert app[LAST_CYCLE].fr.by in ("dumper", "hang report")
    assert app[METRICS_CYCLE].cycles == 0
