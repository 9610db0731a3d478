from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from typing import Any

import pytest
from fakes import MAIN_STACK, closed_port_url, make_job
from waiting import until_async

from debug_server.analysis import core as analysis
from debug_server.config import ServerConfig
from debug_server.frontend import departed
from debug_server.frontend.app import load_templates, make_frontend_app
from debug_server.frontend.render import fr_tables
from debug_server.rank.discovery import register_worker
from debug_server.readers.storeview import StaticRegistry, StoreRegistry, store_client
from debug_server.tools import synthetic

BROWSER = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"
CURL = "*/*"


def _config(**kw: Any) -> ServerConfig:
    return ServerConfig(**{"port": 0, "fetch_timeout": 2.0, **kw})


@pytest.fixture
async def job_client(aiohttp_client: Any, fake_job: Any) -> Any:
    """A frontend over 3 fake ranks: rank 1 never issued all_reduce #4, rank 2 is unreachable."""

    async def make(extra_unreachable: bool = True, dumps: Any = None, stacks: Any = None) -> Any:
        dumps = dumps or synthetic.hang_job(2, n_entries=5, missing_rank=1)
        urls = await fake_job(dumps, stacks=stacks)
        if extra_unreachable:
            urls.append(closed_port_url())
        return await aiohttp_client(make_frontend_app(_config(), StaticRegistry(urls)))

    return make


async def test_fr_trace_for_curl_is_the_text_report_with_missing_rank(job_client: Any) -> None:
    client = await job_client()
    resp = await client.get("/fr_trace", headers={"Accept": CURL})
    text = await resp.text()
    assert resp.status == 200 and resp.content_type == "text/plain"
    assert text.startswith("PARTIAL DATA: 2/3 ranks answered\n  rank 2: unreachable after ")
    row = next(line for line in text.splitlines() if "nccl:all_reduce" in line and "started" in line)
    assert " 4 " in f" {row} " and "1" in row.split("started", 1)[1]
    assert "=== Verdict ===" in text and "Rank 1 never joined all_reduce #4" in text


@pytest.mark.parametrize("how", [{"headers": {"Accept": "application/json"}}, {"params": {"format": "json"}}])
async def test_fr_trace_json_has_missing_ranks_finding_and_rank_status(job_client: Any, how: dict[str, Any]) -> None:
    client = await job_client()
    resp = await client.get("/fr_trace", **how)
    body = json.loads(await resp.text())
    (finding,) = [f for f in body["findings"] if f["kind"] == "missing_ranks"]
    assert (finding["seq"], finding["ranks"]) == (4, [1])
    assert [r["status"] for r in body["ranks"]] == ["ok", "ok", "unreachable"]


async def test_fr_trace_for_browsers_is_html_with_verdict_first(job_client: Any) -> None:
    client = await job_client()
    resp = await client.get("/fr_trace", headers={"Accept": BROWSER})
    html = await resp.text()
    assert resp.content_type == "text/html"
    assert html.index("Rank 1 never joined") < html.index("<table>")
    assert "rank 2: unreachable after" in html


async def test_torchcomms_fr_trace_is_the_same_page(job_client: Any) -> None:
    client = await job_client(extra_unreachable=False)
    a = json.loads(await (await client.get("/fr_trace?format=json")).text())
    b = json.loads(await (await client.get("/torchcomms_fr_trace?format=json")).text())
    assert a["findings"] == b["findings"]


async def test_page_fetches_from_the_frontier_and_whole_rings_on_request(job_client: Any) -> None:
    # Both ranks completed up to #18 (rank 1 never issued #19): the frontier is 18 - 2.
    client = await job_client(extra_unreachable=False,
                              dumps=synthetic.hang_job(2, n_entries=20, missing_rank=1))
    window = json.loads(await (await client.get("/fr_trace?format=json")).text())
    whole = json.loads(await (await client.get("/fr_trace?format=json&onlyactive=false")).text())
    assert [c["seq"] for c in window["collectives"]] == [16, 17, 18, 19]
    assert [c["seq"] for c in whole["collectives"]] == list(range(20))
    assert window["findings"] == whole["findings"]


@pytest.mark.parametrize("query", ["format=xml", "full=2", "page=0", "page=x", "onlyactive=maybe", "bogus=1"])
async def test_bad_query_parameter_is_400(job_client: Any, query: str) -> None:
    client = await job_client(extra_unreachable=False)
    resp = await client.get(f"/fr_trace?{query}")
    assert resp.status == 400
    text = await resp.text()
    assert text.count("\n") <= 1 and ("bad parameter" in text or "unknown parameter" in text)


async def test_stacks_bad_format_is_400(job_client: Any) -> None:
    client = await job_client(extra_unreachable=False)
    assert (await client.get("/stacks?format=yaml")).status == 400


async def test_unknown_path_is_404(job_client: Any) -> None:
    client = await job_client(extra_unreachable=False)
    assert (await client.get("/nope")).status == 404
    assert (await client.get("/handler/ping")).status == 404


async def test_stacks_for_curl_are_rank_sections_with_failure_lines(job_client: Any) -> None:
    client = await job_client()
    text = await (await client.get("/stacks", headers={"Accept": CURL})).text()
    sections = text.split("=== Rank ")
    assert [s.split(" ===")[0] for s in sections[1:]] == ["0", "1", "2"]
    assert 'File "/job/train.py", line 88 in hang_phase' in sections[1]
    assert sections[3].splitlines()[1].startswith("rank 2: unreachable after ")


async def test_stacks_html_escapes_module_frames(job_client: Any) -> None:
    client = await job_client()
    html = await (await client.get("/stacks", headers={"Accept": BROWSER})).text()
    assert "line 120 in &lt;module&gt;" in html
    assert "<module>" not in html


async def test_stacks_json_lists_every_rank(job_client: Any) -> None:
    client = await job_client()
    body = await (await client.get("/stacks", headers={"Accept": "application/json"})).json()
    assert [r["status"] for r in body["ranks"]] == ["ok", "ok", "unreachable"]
    assert body["ranks"][0]["stacks"] == MAIN_STACK and body["ranks"][2]["stacks"] is None


async def test_communicator_name_with_script_tag_is_escaped(job_client: Any) -> None:
    evil = "<script>alert(1)</script>"
    client = await job_client(extra_unreachable=False,
                              dumps=synthetic.hang_job(2, n_entries=3, missing_rank=1, comm=evil))
    for path in ("/fr_trace", "/fr_trace?full=1", "/"):
        html = await (await client.get(path, headers={"Accept": BROWSER})).text()
        assert "<script>" not in html, path
    html = await (await client.get("/fr_trace", headers={"Accept": BROWSER})).text()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html


async def test_overview_shows_reachability_health_and_verdict(job_client: Any) -> None:
    client = await job_client()
    text = await (await client.get("/", headers={"Accept": CURL})).text()
    assert text.splitlines()[0] == "debug_server: 2/3 ranks reachable"
    assert "Rank 1 never joined all_reduce #4" in text.splitlines()[1]
    assert "rank 0: ok, healthy" in text and "rank 2: unreachable after" in text
    body = await (await client.get("/?format=json")).json()
    assert body["reachable"] == 2 and body["ranks"][1]["health"] == "healthy"
    html = await (await client.get("/", headers={"Accept": BROWSER})).text()
    assert "2 of 3 ranks reachable" in html


async def test_overview_names_the_stalled_op_of_an_unhealthy_rank(aiohttp_client: Any, fake_rank: Any) -> None:
    dumps = synthetic.hang_job(1, n_entries=3)
    url = await fake_rank(dumps[0], health={"healthy": False, "in_flight": 1, "stalled_op": {
        "group": "main_comm", "seq": 2, "op": "all_reduce", "age_s": 612.4}})
    client = await aiohttp_client(make_frontend_app(_config(), StaticRegistry([url])))
    text = await (await client.get("/", headers={"Accept": CURL})).text()
    assert "rank 0: ok, UNHEALTHY: main_comm seq 2 all_reduce in flight for 612.4 s" in text


async def test_never_registered_rank_does_not_block_pages(aiohttp_client: Any, fake_rank: Any, tcp_store: Any) -> None:
    dumps = synthetic.hang_job(2, n_entries=5, missing_rank=1)
    url0 = await fake_rank(dumps[0])
    register_worker(store_client("127.0.0.1", tcp_store.port, 5), make_job(0, 2, tcp_store.port), url0)
    registry = StoreRegistry("127.0.0.1", tcp_store.port, world_size=2, restart_count=0, timeout=2)
    client = await aiohttp_client(make_frontend_app(_config(fetch_timeout=2.0), registry))
    for path in ("/fr_trace", "/stacks", "/"):
        t0 = time.monotonic()
        text = await (await client.get(path, headers={"Accept": CURL})).text()
        assert time.monotonic() - t0 < 2.0, path
        assert "rank 1: not registered" in text, path


def test_default_html_tables_are_bounded_and_full_view_pages_every_row() -> None:
    result = analysis.analyze(synthetic.hang_job(2, n_entries=2000, missing_rank=1), world_size=2)
    coll, calls = fr_tables(result, full=False, page=1)
    assert coll.html.count("<tr") == 1 + 1 + 50  # header, the failing row, newest passing
    assert coll.html.count('<tr class="fail">') == 1
    assert "51 of 2000 collectives" in coll.note
    assert calls.html.count("<tr") == 1 + 200
    coll2, calls2 = fr_tables(result, full=True, page=2)
    assert coll2.html.count("<tr") == 1 + 1000 and coll2.note == "rows 1001-2000 of 2000 (page 2)"
    assert ">1999<" in coll2.html and ">999<" not in coll2.html
    assert calls2.html.count("<tr") == 1 + 1000
    past, _ = fr_tables(result, full=True, page=9)
    assert past.note == "page 9 is past the end (2000 rows)"


def test_templates_load_with_autoescape() -> None:
    env = load_templates()
    assert env.autoescape is True
    assert {"base.html", "index.html", "fr_trace.html", "stacks.html"} <= set(env.list_templates())


@pytest.mark.job
async def test_frontend_shuts_down_once_its_parent_and_every_rank_are_gone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        shutdown = asyncio.Event()
        departures = departed.Departures()
        # A one-rank job (rank 0 is the parent): once it is gone nothing of the job is left.
        checks: list[int] = []

        def alive(pid: int) -> bool:
            checks.append(pid)
            return real_alive(pid)

        real_alive = departed.jobpids.alive
        monkeypatch.setattr(departed.jobpids, "alive", alive)
        task = asyncio.create_task(departed.watch(proc.pid, StaticRegistry([None]), departures,
                                                  0.5, shutdown))
        await until_async("a poll has seen the parent alive", 30, lambda: checks)
        assert not shutdown.is_set() and departures.gone == {}
        proc.kill()
        proc.wait()
        await asyncio.wait_for(shutdown.wait(), 5)
        assert departures.line(0) is not None and f"parent process {proc.pid} ended" in \
            departures.line(0)
        await task
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
