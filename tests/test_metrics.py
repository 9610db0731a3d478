"""``/metrics``: Prometheus text built from one fan-out at scrape time, over fake ranks."""

from __future__ import annotations

from typing import Any

import pytest
from fakes import MAIN_STACK, closed_port_url
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from debug_server.config import ServerConfig
from debug_server.frontend.app import make_frontend_app
from debug_server.frontend.metrics import CONTENT_TYPE
from debug_server.readers.storeview import StaticRegistry
from debug_server.tools import synthetic

STALLED = {"healthy": False, "in_flight": 1, "oldest_in_flight_s": 42.5,
           "stalled_op": {"group": "main_comm", "seq": 4, "op": "all_reduce", "age_s": 42.5}}
HEALTHY = {"healthy": True, "stalled_op": None, "in_flight": 0, "oldest_in_flight_s": None}


@pytest.fixture
async def scrape(aiohttp_client: Any, fake_rank: Any) -> Any:
    """Scrape a frontend over rank 0 (stalled in all_reduce #4), rank 1 (never issued it,
    healthy) and rank 2 (unreachable); returns the response and ``{name: [samples]}``."""
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
    client = await aiohttp_client(make_frontend_app(ServerConfig(port=0, fetch_timeout=2.0),
                                                    StaticRegistry(urls)))
    resp = await client.get("/metrics")
    text = await resp.text()
    samples: dict[str, list[Any]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples.setdefault(s.name, []).append(s)
    return resp, text, samples


def _by(samples: dict[str, list[Any]], name: str, key: str = "rank") -> dict[str, float]:
    return {s.labels[key]: s.value for s in samples[name]}


async def test_metrics_is_prometheus_text_0_0_4(scrape: Any) -> None:
    resp, text, _ = scrape
    assert resp.status == 200
    assert resp.headers["Content-Type"] == CONTENT_TYPE == "text/plain; version=0.0.4; charset=utf-8"
    assert "# HELP debug_server_stuck_seq " in text and "# TYPE debug_server_stuck_seq gauge" in text


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
    client = await aiohttp_client(make_frontend_app(ServerConfig(port=0), StaticRegistry(urls)))
    text = await (await client.get("/metrics")).text()
    samples = {s.name: s for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert "debug_server_stuck_seq" not in samples and "debug_server_missing_ranks" not in samples
    assert "debug_server_healthy" in text and 'debug_server_healthy{rank="0"} 0.0' not in text
    assert samples["debug_server_world_size"].value == 2
