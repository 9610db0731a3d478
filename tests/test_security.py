"""Security: escaping on every page, loopback binding, and the shared-secret access control."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from httpget import get_json, request

from debug_server.auth import TOKEN_COOKIE, TOKEN_HEADER, TokenGate, token_required
from debug_server.config import ConfigError, ServerConfig
from debug_server.frontend.app import make_frontend_app
from debug_server.rank.server import start_debug_server, stop_debug_server
from debug_server.rank.worker import StaticProvider, make_worker_app
from debug_server.readers.storeview import StaticRegistry
from debug_server.tools import synthetic

REPO = Path(__file__).resolve().parent.parent
BROWSER = "text/html,application/xhtml+xml,*/*;q=0.8"
TOKEN = "s3cret-token-for-tests-0123456789"
EVIL = "<script>alert(1)</script>"
EVIL_STACK = (
    "Thread 0x00007f0000000001 (most recent call first):\n"
    '  File "/job/<script>alert(2)</script>.py", line 7 in evil\n'
    '  File "/job/train.py", line 120 in <module>\n'
)


# ---------------------------------------------------------------------------------------------
# Escaping


async def test_every_html_page_shows_script_tags_and_module_frames_as_text(
        aiohttp_client: Any, fake_job: Any) -> None:
    dumps = synthetic.hang_job(2, n_entries=3, missing_rank=1, comm=EVIL)
    urls = await fake_job(dumps, stacks={0: EVIL_STACK, 1: EVIL_STACK})
    client = await aiohttp_client(make_frontend_app(ServerConfig(port=0, fetch_timeout=2),
                                                    StaticRegistry(urls)))
    for path in ("/", "/fr_trace", "/torchcomms_fr_trace", "/fr_trace?full=1", "/stacks"):
        resp = await client.get(path, headers={"Accept": BROWSER})
        html = await resp.text()
        assert resp.status == 200 and resp.content_type == "text/html", path
        assert "<script>alert" not in html, path
        assert "<module>" not in html, path
    stacks = await (await client.get("/stacks", headers={"Accept": BROWSER})).text()
    assert "in &lt;module&gt;" in stacks and "&lt;script&gt;alert(2)&lt;/script&gt;" in stacks
    overview = await (await client.get("/", headers={"Accept": BROWSER})).text()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in overview  # the verdict names the comm


# ---------------------------------------------------------------------------------------------
# Binding


def _listening(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp* writes them) listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in list(f)[1:]:
                cols = line.split()
                addr, hexport = cols[1].rsplit(":", 1)
                if int(hexport, 16) == port and cols[3] == "0A":  # LISTEN
                    found.add(addr)
    return found


@pytest.mark.job
def test_single_host_job_binds_loopback_only_and_needs_no_token(
        monkeypatch: Any, tcp_store: Any) -> None:
    for k, v in {"RANK": 0, "WORLD_SIZE": 1, "LOCAL_WORLD_SIZE": 1, "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": tcp_store.port}.items():
        monkeypatch.setenv(k, str(v))
    handle = start_debug_server(port=0, fetch_timeout=3)
    try:
        assert handle.auth_token is None and handle.frontend_url
        for port in (handle.worker_port, handle.frontend_port):
            assert port and _listening(port) == {"0100007F"}, port  # 127.0.0.1, nothing else
        # The first page waits for the frontend's store connection: bounded by the test's own
        # timeout, not 10 s (a loaded box took longer).
        assert get_json(f"{handle.frontend_url}/?format=json", timeout=90)["ranks"][0][
            "status"] == "ok"
    finally:
        stop_debug_server()


def _proc_strings(pid: int, name: str) -> list[str]:
    return Path(f"/proc/{pid}/{name}").read_bytes().decode(errors="replace").split("\0")


@pytest.mark.job
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc")
def test_frontend_gets_its_whole_config_with_no_option_and_no_token_in_ps_or_environment(
        monkeypatch: Any, tcp_store: Any, tmp_path: Path) -> None:
    for k, v in {"RANK": 0, "WORLD_SIZE": 1, "LOCAL_WORLD_SIZE": 1, "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": tcp_store.port}.items():
        monkeypatch.setenv(k, str(v))
    handle = start_debug_server(port=0, fetch_timeout=3, auth_token=TOKEN, dump_dir=str(tmp_path),
                                dump_interval=600, enabled_dumps={"stacks"})
    try:
        assert handle.frontend is not None
        pid = handle.frontend.pid
        assert _proc_strings(pid, "cmdline")[1:3] == ["-m", "debug_server.frontend"]
        assert _proc_strings(pid, "cmdline")[3:] == [""]  # nothing after the module
        environ = _proc_strings(pid, "environ")
        assert not [v for v in environ if TOKEN in v or v.startswith("DEBUG_SERVER_AUTH_TOKEN=")]
        # The config arrived whole: the token guards the pages, and the dumper runs with this
        # dump_dir and only the stacks dump.
        assert request(f"{handle.frontend_url}/?format=json", timeout=90)[0] == 401
        assert request(f"{handle.frontend_url}/?format=json", headers={TOKEN_HEADER: TOKEN}, timeout=90)[0] == 200
        deadline = time.monotonic() + 20
        while not os.listdir(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [n[:7] for n in os.listdir(tmp_path)] == ["stacks_"]
    finally:
        stop_debug_server()


# ---------------------------------------------------------------------------------------------
# Tokens: units


@pytest.mark.parametrize(("mode", "host", "token", "required"), [
    ("auto", "127.0.0.1", None, False),
    ("auto", None, None, True),          # multi-host default: all interfaces
    ("auto", "0.0.0.0", None, True),
    ("auto", "10.1.2.3", None, True),
    ("auto", "127.0.0.1", TOKEN, True),  # an explicit token is always enforced
    ("token", "127.0.0.1", None, True),
    ("none", None, None, False),
])
def test_token_is_required_iff_servers_listen_beyond_loopback(
        mode: str, host: str | None, token: str | None, required: bool) -> None:
    assert token_required(mode, host, token) is required


@pytest.mark.parametrize("bad", ["", "short", "has space in it 0123456789", "naïve-token-0123456789"])
def test_bad_tokens_are_refused_at_config_time(bad: str) -> None:
    with pytest.raises(ConfigError, match="auth_token"):
        ServerConfig(auth_token=bad)


def test_auth_none_with_a_token_is_a_contradiction() -> None:
    with pytest.raises(ConfigError, match="contradict"):
        token_required("none", None, TOKEN)


# ---------------------------------------------------------------------------------------------
# Tokens: the worker and the frontend apps


async def test_worker_requires_the_token_header(aiohttp_client: Any) -> None:
    client = await aiohttp_client(make_worker_app(StaticProvider({}), TokenGate(TOKEN)))
    resp = await client.post("/handler/ping")
    text = await resp.text()
    assert resp.status == 401 and text.count("\n") == 1 and TOKEN_HEADER in text
    assert (await client.post("/handler/ping", headers={TOKEN_HEADER: "nope" * 8})).status == 403
    resp = await client.post("/handler/ping", headers={TOKEN_HEADER: TOKEN})
    assert resp.status == 200 and await resp.text() == "pong"
    assert (await client.get("/handler/")).status == 401


async def test_worker_refuses_everything_until_it_knows_the_token(aiohttp_client: Any) -> None:
    gate = TokenGate()
    client = await aiohttp_client(make_worker_app(StaticProvider({}), gate))
    resp = await client.post("/handler/ping", headers={TOKEN_HEADER: TOKEN})
    assert resp.status == 503 and "not known yet" in await resp.text()
    gate.set(TOKEN)
    assert (await client.post("/handler/ping", headers={TOKEN_HEADER: TOKEN})).status == 200


@pytest.fixture
async def guarded(aiohttp_client: Any, aiohttp_server: Any) -> Any:
    """A frontend with a token over two fake ranks whose workers require the same token."""
    dumps = synthetic.hang_job(2, n_entries=5, missing_rank=1)
    urls = []
    for r in range(2):
        server = await aiohttp_server(make_worker_app(StaticProvider(dumps[r]), TokenGate(TOKEN)))
        urls.append(str(server.make_url("")).rstrip("/"))
    config = ServerConfig(port=0, fetch_timeout=2, auth_token=TOKEN)
    return await aiohttp_client(make_frontend_app(config, StaticRegistry(urls)))


@pytest.mark.parametrize("path", ["/", "/fr_trace", "/stacks", "/torchcomms_fr_trace", "/nope"])
async def test_frontend_without_token_is_401_with_one_line(guarded: Any, path: str) -> None:
    resp = await guarded.get(path)
    text = await resp.text()
    assert resp.status == 401 and text.count("\n") == 1 and "token" in text


async def test_frontend_with_wrong_token_is_403(guarded: Any) -> None:
    assert (await guarded.get("/", headers={TOKEN_HEADER: "x" * 40})).status == 403
    assert (await guarded.get("/?token=" + "x" * 40)).status == 403


async def test_frontend_with_header_answers_and_fans_out_with_the_token(guarded: Any) -> None:
    resp = await guarded.get("/fr_trace?format=json", headers={TOKEN_HEADER: TOKEN})
    body = await resp.json()
    assert resp.status == 200
    assert [r["status"] for r in body["ranks"]] == ["ok", "ok"]  # the workers accepted it
    assert [f["ranks"] for f in body["findings"] if f["kind"] == "missing_ranks"] == [[1]]


async def test_browser_link_swaps_the_token_for_an_httponly_strict_cookie(guarded: Any) -> None:
    resp = await guarded.get(f"/stacks?format=json&token={TOKEN}", allow_redirects=False)
    assert resp.status == 303
    assert resp.headers["Location"] == "/stacks?format=json"  # the token leaves the address bar
    cookie = resp.headers["Set-Cookie"]
    assert f"{TOKEN_COOKIE}={TOKEN}" in cookie and "HttpOnly" in cookie
    assert "SameSite=Strict" in cookie
    resp = await guarded.get("/stacks?format=json")  # the client's cookie jar sends it now
    assert resp.status == 200
    assert [r["status"] for r in (await resp.json())["ranks"]] == ["ok", "ok"]


# ---------------------------------------------------------------------------------------------
# Tokens: a real 2-rank job, forced into token mode on one host


RANK = """
import os, sys, time
from debug_server import start_debug_server
# port=0: a port picked in advance can be taken meanwhile by a worker's ephemeral bind.
h = start_debug_server(port=0, fetch_timeout=3, auth="token")
assert h.wait_registered(60)
print("READY", h.worker_url, h.browser_url, h.auth_token, flush=True)
time.sleep(90)
"""


@pytest.mark.job
@pytest.mark.timeout(90)
def test_store_distributed_token_guards_two_real_ranks(tcp_store: Any, tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(RANK))
    procs: list[subprocess.Popen[bytes]] = []
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    try:
        for r in range(2):
            env = {**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(tcp_store.port),
                   "PYTHONPATH": str(REPO)}
            with logs[r].open("wb") as out:  # the child keeps its own copy of the fd
                procs.append(subprocess.Popen([sys.executable, str(script)], env=env,
                                              stdout=out, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        ready: dict[int, list[str]] = {}
        deadline = time.monotonic() + 60
        while len(ready) < 2 and time.monotonic() < deadline:
            for r in range(2):
                m = re.search(r"^READY (.*)$", logs[r].read_text(), re.M)
                if m:
                    ready[r] = m.group(1).split()
                assert procs[r].poll() is None, logs[r].read_text()[-3000:]
            time.sleep(0.2)
        assert len(ready) == 2, [p.read_text()[-2000:] for p in logs]
        worker1, token = ready[1][0], ready[0][2]
        assert ready[1][2] == token  # rank 1 learnt rank 0's token through the store
        base = ready[0][1].removesuffix(f"/?token={token}")
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", base), ready[0][1]
        assert f"access token required; open {base}/?token={token}" in logs[0].read_text()
        assert request(f"{base}/", timeout=90)[0] == 401
        assert request(f"{worker1}/handler/ping", method="POST", timeout=90)[0] == 401
        assert request(f"{worker1}/handler/ping", method="POST", headers={TOKEN_HEADER: token}, timeout=90) == (200, "pong")
        status, body = request(f"{base}/?format=json", headers={TOKEN_HEADER: token}, timeout=90)
        assert status == 200
        assert [r["status"] for r in json.loads(body)["ranks"]] == ["ok", "ok"]
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the rank and rank 0's frontend child
            except ProcessLookupError:
                pass
        for p in procs:
            p.wait(10)
