"""/profile, /tcpstore and /wait_counters on the frontend, against real worker servers.

GPU traces cannot be captured on this CPU-only machine, and one process can only run one
profiler, so the multi-rank /profile tests use "canned" ranks: real HTTP servers on port 0 that
answer ``torch_profile`` with a hand-written GPU trace in torch.profiler's format (or an error,
or nothing). Real captures from separate processes are in tests/test_pages_extra_job.py.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest
from _scenarios import gpu_trace, kernel
from aiohttp import web

from debug_server.config import ServerConfig
from debug_server.frontend import pages_extra
from debug_server.frontend.app import make_frontend_app
from debug_server.rank.worker import StaticProvider, make_worker_app
from debug_server.readers.storeview import StaticRegistry, StoreRegistry

BROWSER = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"
TOKEN = "tok_0123456789abcdefghijklmnop"


def _gpu_rank(exposed_us: float) -> str:
    return json.dumps(gpu_trace([kernel("sm90_gemm", 0, 400),
                                 kernel("ncclDevKernel_AllReduce", 300, 100 + exposed_us, 20)]))


def canned_app(profile: tuple[int, str] = (404, "Handler torch_profile not found"),
               counters: tuple[int, str] = (404, "Handler wait_counter_values not found"),
               delay: float = 0.0,
               hold: tuple[asyncio.Event, asyncio.Event] | None = None) -> web.Application:
    """``hold=(started, release)``: the profile handler sets ``started`` and answers only once
    ``release`` is set."""

    async def torch_profile(request: web.Request) -> web.Response:
        if hold is not None:
            hold[0].set()
            await hold[1].wait()
        await asyncio.sleep(delay)
        return web.Response(status=profile[0], text=profile[1])

    async def wait_counter_values(request: web.Request) -> web.Response:
        return web.Response(status=counters[0], text=counters[1])

    app = web.Application()
    app.router.add_post("/handler/torch_profile", torch_profile)
    app.router.add_post("/handler/wait_counter_values", wait_counter_values)
    return app


@pytest.fixture
def canned_job(aiohttp_server: Any, aiohttp_client: Any) -> Any:
    """``await canned_job([app, ...], fetch_timeout=...)`` -> a client of a frontend over them."""

    async def make(apps: list[web.Application], fetch_timeout: float = 5.0,
                   registry: Any = None, token: str | None = None) -> Any:
        urls = [str((await aiohttp_server(a)).make_url("")).rstrip("/") for a in apps]
        config = ServerConfig(port=0, fetch_timeout=fetch_timeout, auth_token=token)
        return await aiohttp_client(make_frontend_app(config, registry or StaticRegistry(urls)))

    return make


async def _get(client: Any, path: str, accept: str = "*/*", status: int = 200) -> str:
    resp = await client.get(path, headers={"Accept": accept})
    text = await resp.text()
    assert resp.status == status, text
    return text


# ---------------------------------------------------------------------------------------------
# /profile


async def test_profile_without_duration_shows_usage_and_no_capture(canned_job: Any) -> None:
    client = await canned_job([canned_app()])
    assert (await _get(client, "/profile")).startswith("No profile captured yet.\nUsage: "
                                                       "/profile?duration=S")
    assert json.loads(await _get(client, "/profile?format=json")) == {"last": None,
                                                                      "running": False}


async def test_profile_merges_every_rank_into_one_trace(canned_job: Any) -> None:
    client = await canned_job([canned_app((200, _gpu_rank(50))) for _ in range(3)])
    report = json.loads(await _get(client, "/profile?duration=0.1&format=json"))
    assert report["ranks_profiled"] == [0, 1, 2] and report["not_profiled"] == []
    trace = json.loads(await _get(client, report["trace_url"]))
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1", 2: "rank 2"}
    assert sum(1 for e in trace["traceEvents"] if e.get("cat") == "kernel") == 6


async def test_profile_download_is_an_attachment(canned_job: Any) -> None:
    client = await canned_job([canned_app((200, _gpu_rank(50)))])
    await _get(client, "/profile?duration=0.1")
    resp = await client.get("/profile/trace.json?id=1")
    assert resp.headers["Content-Disposition"].startswith('attachment; filename="profile_1_')


async def test_profile_table_gives_each_ranks_gpu_split(canned_job: Any) -> None:
    client = await canned_job([canned_app((200, _gpu_rank(50)))])
    row = json.loads(await _get(client, "/profile?duration=0.1&format=json"))["ranks"][0]
    # compute [0,400); comm [300,450): overlap 100, exposed 50 of a 1000 us window
    assert (row["compute_frac"], row["comm_frac"], row["overlap_frac"], row["exposed_frac"]) == (
        0.4, 0.15, 0.1, 0.05)


async def test_rank_that_stands_out_is_flagged_on_every_format(canned_job: Any) -> None:
    apps = [canned_app((200, _gpu_rank(600 if r == 5 else 50))) for r in range(8)]
    client = await canned_job(apps)
    html = await _get(client, "/profile?duration=0.1", accept=BROWSER)
    assert '<tr class="warn"><td>5</td>' in html and "<li>rank 5: exposed communication 60.0%" in html
    report = json.loads(await _get(client, "/profile?format=json"))["last"]
    assert {f["rank"] for f in report["flagged"]} == {5}
    text = await _get(client, "/profile?format=text")
    assert "\n  rank 5: exposed communication 60.0% of the window vs median 5.0%" in text
    assert text.index("Flagged:") < text.index("rank 5: exposed communication")


async def test_cpu_only_rank_says_no_gpu_activity(canned_job: Any) -> None:
    client = await canned_job([canned_app((200, json.dumps(gpu_trace([]))))])
    text = await _get(client, "/profile?duration=0.1")
    assert "  0  no GPU activity" in text


async def test_ranks_that_cannot_profile_are_listed_and_the_others_come_back(
        canned_job: Any, monkeypatch: Any) -> None:
    monkeypatch.setattr(pages_extra, "EXPORT_SLACK_S", 0.5)
    apps = [canned_app((200, _gpu_rank(50))),
            canned_app((409, "another torch.profiler is active in this process")),
            canned_app((200, _gpu_rank(50)), delay=3.0),  # stuck: never answers in time
            canned_app((200, "<html>not a trace</html>"))]
    client = await canned_job(apps, fetch_timeout=0.5)
    report = json.loads(await _get(client, "/profile?duration=0.1&format=json"))
    assert report["ranks_profiled"] == [0]
    reasons = {f["rank"]: f["reason"] for f in report["not_profiled"]}
    assert reasons[1] == "rank 1: HTTP 409: another torch.profiler is active in this process"
    assert reasons[2] == "rank 2: timed out after 1.1 s"
    assert reasons[3].startswith("rank 3: reply is not JSON")


async def test_ranks_beyond_the_merge_budget_are_listed_not_merged(canned_job: Any,
                                                                    monkeypatch: Any) -> None:
    body = _gpu_rank(50)
    monkeypatch.setattr(pages_extra, "MAX_MERGE_BYTES", int(len(body) * 1.5))
    client = await canned_job([canned_app((200, body)) for _ in range(3)])
    report = json.loads(await _get(client, "/profile?duration=0.1&format=json"))
    assert report["ranks_profiled"] == [0]
    assert [f["reason"].split(":")[:2] for f in report["not_profiled"]] == [
        ["rank 1", " not merged"], ["rank 2", " not merged"]]


async def test_second_profile_while_one_runs_is_409(canned_job: Any) -> None:
    started, release = asyncio.Event(), asyncio.Event()
    client = await canned_job([canned_app((200, _gpu_rank(50)), hold=(started, release))])
    first = asyncio.ensure_future(client.get("/profile?duration=0.1"))
    await asyncio.wait_for(started.wait(), 30)  # the first one is at the rank
    text = await _get(client, "/profile?duration=0.1", status=409)
    assert re.match(r"a profile is already running \(started \d+ s ago: 0.1 s on ranks 0\)", text), text
    release.set()
    assert (await first).status == 200


async def test_ranks_parameter_profiles_only_those_ranks(canned_job: Any) -> None:
    client = await canned_job([canned_app((200, _gpu_rank(50))) for _ in range(4)])
    report = json.loads(await _get(client, "/profile?duration=0.1&ranks=1,3&format=json"))
    assert report["ranks_profiled"] == [1, 3] and report["ranks_requested"] == "1, 3"


@pytest.mark.parametrize(("query", "line"), [
    ("duration=0", "bad parameter duration='0': must be seconds with 0 < S <= 30"),
    ("duration=31", "bad parameter duration='31': must be seconds with 0 < S <= 30"),
    ("duration=1&ranks=2", "bad parameter ranks: rank 2 is outside 0..1"),
    ("duration=1&ranks=a", "bad parameter ranks='a': must list ranks like 0,2,5-7"),
    ("duration=1&ranks=3-1", "bad parameter ranks='3-1': range 3-1 runs backwards"),
    ("ranks=1", "ranks= needs duration= (the seconds to profile)"),
])
async def test_bad_profile_requests_are_400_in_one_line(canned_job: Any, query: str,
                                                        line: str) -> None:
    client = await canned_job([canned_app(), canned_app()])
    assert await _get(client, f"/profile?{query}", status=400) == line + "\n"


async def test_trace_download_before_any_capture_is_404(canned_job: Any) -> None:
    client = await canned_job([canned_app()])
    text = await _get(client, "/profile/trace.json", status=404)
    assert text == "no profile captured yet; run /profile?duration=S first\n"


async def test_trace_of_an_older_capture_is_404(canned_job: Any) -> None:
    client = await canned_job([canned_app((200, _gpu_rank(50)))])
    await _get(client, "/profile?duration=0.1")
    await _get(client, "/profile?duration=0.1")
    text = await _get(client, "/profile/trace.json?id=1", status=404)
    assert text == "profile #1 is gone; only the latest (#2) is kept\n"


async def test_hostile_worker_text_is_escaped_on_the_profile_page(canned_job: Any) -> None:
    client = await canned_job([canned_app((500, "<script>alert(1)</script>"))])
    html = await _get(client, "/profile?duration=0.1", accept=BROWSER)
    assert "<script>alert(1)" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html


async def test_profile_runs_a_real_capture_on_a_real_worker(aiohttp_client: Any,
                                                            aiohttp_server: Any) -> None:
    server = await aiohttp_server(make_worker_app(StaticProvider({"entries": []})))
    # A real torch profiler start took over 5 s on a loaded 2-core box: the test's own timeout
    # bounds the capture, not the fan-out's.
    config = ServerConfig(port=0, fetch_timeout=60.0)
    url = str(server.make_url("")).rstrip("/")
    client = await aiohttp_client(make_frontend_app(config, StaticRegistry([url])))
    report = json.loads(await _get(client, "/profile?duration=0.2&format=json"))
    assert report["ranks_profiled"] == [0]
    assert report["ranks"][0]["note"] == "no GPU activity" and report["ranks"][0]["events"] >= 3


# ---------------------------------------------------------------------------------------------
# /wait_counters


def _counters(total_time_us: float) -> str:
    return json.dumps({"pytorch.wait_counter.TCPStore__wait": {
        "active_count": 0, "total_calls": 4, "total_time_us": total_time_us,
        "max_time_us": total_time_us / 4}})


async def test_wait_counters_table_has_ranks_as_columns_and_marks_the_outlier(
        canned_job: Any) -> None:
    apps = [canned_app(counters=(200, _counters(9_000_000 if r == 2 else 100_000)))
            for r in range(4)]
    client = await canned_job(apps)
    html = await _get(client, "/wait_counters", accept=BROWSER)
    assert ("<tr><th>counter</th><th>field</th><th>rank 0</th><th>rank 1</th><th>rank 2</th>"
            "<th>rank 3</th></tr>") in html
    assert ('<tr class="warn"><td>TCPStore__wait</td><td>total_time_us</td><td>100000</td>'
            "<td>100000</td><td>9000000 ▲</td><td>100000</td></tr>") in html
    body = json.loads(await _get(client, "/wait_counters?format=json"))
    row = next(c for c in body["counters"] if c["field"] == "total_time_us")
    assert row["values"] == {"0": 100000, "1": 100000, "2": 9000000, "3": 100000}
    assert row["marked"] == {"2": "high"}


async def test_wait_counters_text_is_one_table(canned_job: Any) -> None:
    client = await canned_job([canned_app(counters=(200, _counters(100))) for _ in range(2)])
    text = await _get(client, "/wait_counters")
    assert "counter         field            rank 0    rank 1" in text
    assert "TCPStore__wait  total_calls           4         4" in text


async def test_wait_counters_unavailable_is_one_line(canned_job: Any) -> None:
    no = (404, "wait counters are not available in this torch build")
    client = await canned_job([canned_app(counters=no), canned_app(counters=no)])
    assert await _get(client, "/wait_counters") == (
        "Wait counters: wait counters are not available in this torch build\n")
    assert json.loads(await _get(client, "/wait_counters?format=json"))["available"] is False


async def test_hostile_counter_names_are_escaped(canned_job: Any) -> None:
    body = json.dumps({"<img src=x onerror=alert(1)>": {"total_calls": 3}})
    client = await canned_job([canned_app(counters=(200, body))])
    html = await _get(client, "/wait_counters", accept=BROWSER)
    assert "<img src=x" not in html and "&lt;img src=x onerror=alert(1)&gt;" in html


async def test_wait_counters_from_real_workers(aiohttp_client: Any, fake_job: Any) -> None:
    from torch.monitor import _WaitCounter

    with _WaitCounter("pytorch.wait_counter.debug_server_pages").guard():
        pass
    urls = await fake_job({0: {"entries": []}, 1: {"entries": []}})
    client = await aiohttp_client(make_frontend_app(ServerConfig(port=0), StaticRegistry(urls)))
    body = json.loads(await _get(client, "/wait_counters?format=json"))
    row = next(c for c in body["counters"]
               if c["counter"] == "pytorch.wait_counter.debug_server_pages"
               and c["field"] == "total_calls")
    assert set(row["values"]) == {"0", "1"} and row["values"]["0"] >= 1


# ---------------------------------------------------------------------------------------------
# /tcpstore


@pytest.fixture
async def store_client(tcp_store: Any, aiohttp_client: Any) -> Any:
    tcp_store.set("debug_server/rank0", "http://127.0.0.1:1")
    tcp_store.set("debug_server/auth_token_r0", TOKEN)
    tcp_store.set("debug_server/<script>alert(1)</script>", "<img src=x onerror=alert(2)>")
    tcp_store.set("torchelastic/x", b"\x80\x04K\x01.")
    registry = StoreRegistry("127.0.0.1", tcp_store.port, 1, 0, timeout=2.0)
    config = ServerConfig(port=0, auth_token=TOKEN)
    client = await aiohttp_client(make_frontend_app(config, registry))
    client.session.headers["X-Debug-Server-Token"] = TOKEN
    return client


async def test_tcpstore_lists_our_keys_and_never_shows_the_token(store_client: Any) -> None:
    for fmt in ("json", "text", "html"):
        body = await _get(store_client, f"/tcpstore?format={fmt}")
        assert TOKEN not in body and "debug_server/rank0" in body, fmt
    page = json.loads(await _get(store_client, "/tcpstore?format=json"))
    values = {k["key"]: k["value"] for k in page["keys"]}
    assert values["debug_server/auth_token_r0"] == "<redacted>"
    assert values["debug_server/rank0"] == "http://127.0.0.1:1"
    assert "torchelastic/x" not in values


async def test_tcpstore_other_prefix_on_request(store_client: Any) -> None:
    page = json.loads(await _get(store_client, "/tcpstore?prefix=torchelastic/&format=json"))
    assert [(k["key"], k["value"]) for k in page["keys"]] == [
        ("torchelastic/x", repr(b"\x80\x04K\x01."))]


async def test_tcpstore_pages_with_limit_and_offset(store_client: Any) -> None:
    page = json.loads(await _get(store_client, "/tcpstore?limit=1&offset=1&format=json"))
    assert [k["key"] for k in page["keys"]] == ["debug_server/auth_token_r0"]
    assert (page["total"], page["next_offset"]) == (3, 2)


async def test_tcpstore_escapes_hostile_keys_and_values(store_client: Any) -> None:
    html = await _get(store_client, "/tcpstore", accept=BROWSER)
    assert "<script>alert(1)" not in html and "<img src=x" not in html
    assert "debug_server/&lt;script&gt;alert(1)&lt;/script&gt;" in html


@pytest.mark.parametrize(("query", "line"), [
    ("limit=0", "bad parameter limit='0': must be 1..1000"),
    ("limit=5000", "bad parameter limit='5000': must be 1..1000"),
    ("offset=-1", "bad parameter offset='-1': must be 0..10000000"),
    ("prefix=" + "a" * 300, "bad parameter prefix='" + "a" * 40 + "': must be printable, at "
                                                                 "most 256 characters"),
])
async def test_bad_tcpstore_requests_are_400_in_one_line(store_client: Any, query: str,
                                                         line: str) -> None:
    assert await _get(store_client, f"/tcpstore?{query}", status=400) == line + "\n"


async def test_tcpstore_needs_the_token(store_client: Any) -> None:
    resp = await store_client.get("/tcpstore", headers={"X-Debug-Server-Token": "wrong" * 5})
    assert resp.status == 403


async def test_tcpstore_without_a_store_says_so(canned_job: Any) -> None:
    client = await canned_job([canned_app()])
    assert (await _get(client, "/tcpstore")).startswith("TCPStore: this frontend has no TCPStore")
