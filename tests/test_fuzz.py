"""Every endpoint's parameters, fuzzed: only 200, 400 or 404 (405 for a wrong method, as aiohttp
answers it), never 500, never a traceback in a body.

The servers run in daemon threads (``WorkerThread``) so hypothesis can drive them from a plain
function; requests go through ``http.client`` so paths and headers arrive as sent.
"""

from __future__ import annotations

import http.client
import string
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote, urlencode

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from debug_server.config import ServerConfig
from debug_server.frontend.app import make_frontend_app
from debug_server.rank.worker import HANDLERS, StaticProvider, WorkerThread, start_worker_thread
from debug_server.readers.storeview import StaticRegistry
from debug_server.tools import synthetic

PAGES = ["/", "/fr_trace", "/torchcomms_fr_trace", "/stacks", "/metrics", "/fr_trace/trace.json",
         "/profile", "/profile/trace.json", "/tcpstore", "/wait_counters"]
PAGE_PARAMS = ["format", "full", "page", "onlyactive", "refresh", "token",
               "duration", "ranks", "id", "prefix", "limit", "offset"]
WORKER_PARAMS = ["onlyactive", "includecollectives", "duration", "since", "window"]
ACCEPTS = ["*/*", "text/html", "application/json", "text/plain;q=0.5, application/json",
           "text/html;q=nan, */*;q=inf", "application/json;q=-1", "", ";;;,,,", "text/*;q=0.x"]
ALLOWED = {200, 400, 404}
SETTINGS = settings(max_examples=200, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])

_text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=30)
_ascii = st.text(alphabet=string.printable.replace("\r", "").replace("\n", ""), max_size=30)
_values = st.one_of(_text, _ascii, st.sampled_from(["", "0", "1", "true", "false", "json", "html",
                                                     "text", "-1", "99999999999", "1e3", "nan"]))


def _query(keys: list[str]) -> st.SearchStrategy[str]:
    pairs = st.lists(st.tuples(st.one_of(st.sampled_from(keys), _text), _values), max_size=4)
    raw = st.one_of(_ascii.map(lambda s: quote(s, safe="=&%+")), st.just("%zz&=&&a=%"),
                    st.just("format"))
    # Valid combinations too, so the full page path (fan-out, analysis, rendering) runs often.
    valid = st.fixed_dictionaries({}, optional={
        "format": st.sampled_from(["html", "text", "json"]), "full": st.sampled_from(["0", "1"]),
        "page": st.integers(1, 5).map(str), "onlyactive": st.sampled_from(["true", "false"])})
    return st.one_of(st.just(""), valid.map(urlencode), pairs.map(urlencode), raw)


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, int]]:
    dumps = synthetic.hang_job(2, n_entries=5, missing_rank=1)
    ranks = [start_worker_thread(StaticProvider(dumps[r])) for r in range(2)]
    urls = [f"http://127.0.0.1:{w.port}" for w in ranks]
    config = ServerConfig(port=0, fetch_timeout=2)
    frontend = WorkerThread(make_frontend_app(config, StaticRegistry(urls)), "127.0.0.1", 0).start()
    try:
        yield {"frontend": frontend.port, "worker": ranks[0].port}
    finally:
        frontend.stop()
        for w in ranks:
            w.stop()


def _request(port: int, method: str, target: str, headers: dict[str, str]) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.putrequest(method, target, skip_accept_encoding=True)
        for k, v in headers.items():
            conn.putheader(k, v)
        conn.endheaders()
        resp = conn.getresponse()
        return resp.status, resp.read().decode("utf-8", "replace")
    finally:
        conn.close()


def _check(status: int, body: str, allowed: set[int], what: str) -> None:
    assert status in allowed, f"{what} -> {status}: {body[:300]}"
    assert "Traceback" not in body and 'File "' not in body.replace('File "/job/', ""), what


@SETTINGS
@given(path=st.one_of(st.sampled_from(PAGES), _ascii.map(lambda s: "/" + quote(s))),
       query=_query(PAGE_PARAMS), accept=st.one_of(st.sampled_from(ACCEPTS), _ascii))
def test_frontend_pages_answer_200_400_or_404(servers: dict[str, int], path: str, query: str,
                                              accept: str) -> None:
    target = f"{path}?{query}" if query else path
    status, body = _request(servers["frontend"], "GET", target, {"Accept": accept})
    _check(status, body, ALLOWED, target)


@pytest.mark.job
@SETTINGS
@given(name=st.one_of(st.sampled_from(sorted(HANDLERS)), _ascii.filter(bool).map(quote)),
       query=_query(WORKER_PARAMS))
def test_worker_handlers_answer_200_400_or_404(servers: dict[str, int], name: str,
                                               query: str) -> None:
    target = f"/handler/{name}" + (f"?{query}" if query else "")
    status, body = _request(servers["worker"], "POST", target, {"Content-Length": "0"})
    # torchcomms_fr_dump_file has no dump path in this fake rank: its one-line 500 is the
    # documented "failure" answer, not a crash; fr_trace_json is 404 here (no c10d FR).
    allowed = ALLOWED | ({500} if name == "torchcomms_fr_dump_file" else set())
    if name == "pyspy_dump" and status == 200:
        # py-spy's read of this very process: a stack dump is that handler's answer by design.
        assert body.startswith("Thread 0x"), body[:300]
        return
    if name == "pyspy_dump" and status == 500:
        # Its documented one-line answer where py-spy's read outlasts its bound (a loaded box).
        assert body.startswith("py-spy did not finish reading pid "), body[:300]
        return
    _check(status, body, allowed, target)
    if status == 500:
        assert body == "no dump path configured", body


@pytest.mark.parametrize(("who", "method", "path"), [
    ("frontend", "POST", "/"), ("frontend", "DELETE", "/stacks"), ("frontend", "PUT", "/fr_trace"),
    ("worker", "GET", "/handler/ping"), ("worker", "PUT", "/handler/ping"),
    ("worker", "POST", "/handler/"),
])
def test_wrong_method_is_405(servers: dict[str, int], who: str, method: str, path: str) -> None:
    status, body = _request(servers[who], method, path, {"Content-Length": "0"})
    _check(status, body, {405}, f"{method} {path}")


def test_malformed_request_lines_are_400(servers: dict[str, Any]) -> None:
    for target in ["/stacks?format=%", "/%zz", "/fr_trace?page=%00", "/?format=json&format=text"]:
        status, body = _request(servers["frontend"], "GET", target, {})
        _check(status, body, ALLOWED, target)
