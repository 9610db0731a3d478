"""Faults a real cluster produces: a SIGKILLed rank, a rank that never registered, a rank whose
main thread holds the GIL in C code, a stuck rank 0, a full dump directory."""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from fakes import make_job
from httpget import timed_get

from debug_server.config import ServerConfig, Settings
from debug_server.fanout.transport import RankResult, RankStates
from debug_server.frontend import dumps as dumps_mod
from debug_server.frontend.app import DUMPER, make_frontend_app
from debug_server.rank.discovery import register_worker
from debug_server.rank.sigstack import install
from debug_server.readers.sigstack import MARKER, capture
from debug_server.readers.storeview import StaticRegistry, StoreRegistry, store_client
from debug_server.tools import synthetic

REPO = Path(__file__).resolve().parent.parent
CURL = "*/*"
BROWSER = "text/html,*/*;q=0.8"


def _kill(proc: subprocess.Popen[Any]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)
    if proc.stdout is not None:
        proc.stdout.close()


# ---------------------------------------------------------------------------------------------
# A rank killed with SIGKILL


WORKER = """
import sys, time
from debug_server.tools import synthetic
from debug_server.rank.worker import StaticProvider, start_worker_thread
w = start_worker_thread(StaticProvider(synthetic.hang_job(2, n_entries=5, missing_rank=1)[1]))
print(w.port, flush=True)
time.sleep(120)
"""


@pytest.mark.job
async def test_sigkilled_rank_is_gone_on_every_page_and_logged_once(
        aiohttp_client: Any, fake_rank: Any, tmp_path: Path, caplog: Any) -> None:
    url0 = await fake_rank(synthetic.hang_job(2, n_entries=5, missing_rank=1)[0])
    proc = subprocess.Popen([sys.executable, "-c", WORKER], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
    try:
        assert proc.stdout is not None
        url1 = f"http://127.0.0.1:{int(proc.stdout.readline())}"
        config = ServerConfig(port=0, fetch_timeout=2, dump_dir=str(tmp_path / "d"),
                              dump_interval=3600, enabled_dumps=frozenset({"fr_trace", "stacks"}))
        client = await aiohttp_client(make_frontend_app(config, StaticRegistry([url0, url1])))
        # A rank that stops answering is logged at debug level (the frontend's watch says, once
        # per batch, whether the job went on without it).
        caplog.set_level(logging.DEBUG, logger="debug_server.fanout.transport")
        body = await (await client.get("/?format=json")).json()
        assert [r["status"] for r in body["ranks"]] == ["ok", "ok"]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        for path, accept in [("/", CURL), ("/fr_trace", CURL), ("/stacks", CURL), ("/", BROWSER),
                             ("/fr_trace", BROWSER), ("/stacks", BROWSER)] * 2:
            t0 = time.monotonic()
            resp = await client.get(path, headers={"Accept": accept})
            text = await resp.text()
            assert resp.status == 200 and time.monotonic() - t0 < 2.0, path
            # Gone, and since when; its last FR data and stacks stay, marked with their age.
            assert "rank 1: gone (unreachable since " in text, (path, accept)
        body = await (await client.get("/fr_trace?format=json")).json()
        assert [r["status"] for r in body["ranks"]] == ["ok", "gone"]
        assert "its FR data and stacks are from " in body["ranks"][1]["note"]
        await client.app[DUMPER].run_cycle()
        lines = [r.getMessage() for r in caplog.records if "rank 1:" in r.getMessage()]
        assert len(lines) == 1, lines
        assert lines[0].startswith("debug_server: rank 1: ok -> unreachable (unreachable after")
        assert "rank 0" not in " ".join(r.getMessage() for r in caplog.records)
    finally:
        _kill(proc)


def test_rank_state_log_has_one_line_per_change(caplog: Any) -> None:
    states = RankStates()
    caplog.set_level(logging.DEBUG, logger="debug_server.fanout.transport")
    ok = RankResult(3, "u", "ok", http_status=200)
    dead = RankResult(3, "u", "unreachable", error="unreachable after 0.0 s")
    http_error = RankResult(3, "u", "failed", error="HTTP 404: x", http_status=404)
    for batch in ([ok], [ok], [http_error], [dead], [dead], [dead], [ok], [ok]):
        states.update(batch)
    assert [r.getMessage() for r in caplog.records] == [
        "debug_server: rank 3: ok -> unreachable (unreachable after 0.0 s)",
        "debug_server: rank 3: unreachable -> ok",
    ]


# ---------------------------------------------------------------------------------------------
# A rank that never registered


async def test_never_registered_rank_never_delays_pages_or_the_dumper(
        aiohttp_client: Any, fake_rank: Any, tcp_store: Any, tmp_path: Path) -> None:
    url0 = await fake_rank(synthetic.hang_job(2, n_entries=5, missing_rank=1)[0])
    register_worker(store_client("127.0.0.1", tcp_store.port, 5), make_job(0, 2, tcp_store.port),
                    url0)
    registry = StoreRegistry("127.0.0.1", tcp_store.port, world_size=2, restart_count=0, timeout=2)
    config = ServerConfig(port=0, fetch_timeout=2, dump_dir=str(tmp_path / "d"),
                          dump_interval=3600)
    client = await aiohttp_client(make_frontend_app(config, registry))
    for path in ("/", "/fr_trace", "/torchcomms_fr_trace", "/stacks"):
        for fmt in ("json", "html", "text"):
            t0 = time.monotonic()
            resp = await client.get(f"{path}?format={fmt}")
            text = await resp.text()
            assert resp.status == 200 and time.monotonic() - t0 < 2.0, (path, fmt)
            assert "not registered" in text, (path, fmt)
    t0 = time.monotonic()
    written = await client.app[DUMPER].run_cycle()
    assert time.monotonic() - t0 < 2.0
    report = next(p for p in written if "torchcomms_fr_trace_" in p)
    assert "rank 1: not registered" in Path(report).read_text()


# ---------------------------------------------------------------------------------------------
# A rank whose main thread holds the GIL in C code (here rank 0: the frontend is its own process)


HOLDER = """
import ctypes, os, sys, time
from debug_server import start_debug_server
h = start_debug_server(port=0, fetch_timeout=2)
assert h.wait_registered(30)
print("READY", h.frontend_url, flush=True)
buf = ctypes.create_string_buffer(1)
ctypes.PyDLL(None).read(int(os.environ["HOLD_FD"]), buf, 1)  # HOLD_LINE
time.sleep(60)
"""
# PyDLL keeps the GIL for the whole C call. read() on a pipe blocks until the test writes (or
# closes its end) and, unlike sleep(), is restarted after the capture signal's handler
# (SA_RESTART), so the hold lasts as long as the test wants: here up to 20 s.


@pytest.mark.job
@pytest.mark.timeout(90)
def test_gil_holding_rank_that_opted_in_comes_by_signal_without_pyspy_and_the_frontend_keeps_serving(
        tcp_store: Any, tmp_path: Path) -> None:
    # The signal path is opt-in and only stands in where py-spy cannot read the rank (here:
    # absent); py-spy itself is covered in test_pyspy.py.
    script = tmp_path / "rank_script.py"
    script.write_text(textwrap.dedent(HOLDER))
    hold_line = 1 + script.read_text().splitlines().index(
        'ctypes.PyDLL(None).read(int(os.environ["HOLD_FD"]), buf, 1)  # HOLD_LINE')
    log = tmp_path / "rank0.log"
    hold_r, hold_w = os.pipe()
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(tcp_store.port),
           "PYTHONPATH": str(REPO), "HOLD_FD": str(hold_r),
           "DEBUG_SERVER_SIGNAL_STACKS": "1", "DEBUG_SERVER_PYSPY": str(tmp_path / "no-py-spy")}
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, str(script)], env=env, cwd=tmp_path, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                pass_fds=(hold_r,))
    os.close(hold_r)
    try:
        deadline = time.monotonic() + 60
        while not (m := re.search(r"^READY (\S+)", log.read_text(), re.M)):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        base = m.group(1)
        # The first page also waits for the frontend's store connection (seconds on a busy
        # machine); the bound below is about the stacks path.
        assert timed_get(f"{base}/?format=json")[0] == 200
        status, text, took = timed_get(f"{base}/stacks")
        assert status == 200 and took < 3.0, (took, text)
        # A read kept from an earlier page says its age inside the marker's parentheses.
        assert MARKER.rstrip(")") in text
        assert f'rank_script.py", line {hold_line} in <module>' in text
        # Rank 0's trainer is stuck; its frontend process still answers every page.
        with ThreadPoolExecutor(2) as pool:
            overview, fr = pool.map(timed_get, [f"{base}/?format=json", f"{base}/fr_trace?format=json"])
        assert overview[0] == 200 and overview[2] < 3.5
        assert fr[0] == 200 and fr[2] < 3.5
        assert json.loads(fr[1])["ranks"][0]["status"] == "timed out"
        status, text, _ = timed_get(f"{base}/stacks")
        assert status == 200 and MARKER.rstrip(")") in text  # still held: it outlived every page
    finally:
        os.close(hold_w)  # ends the hold
        _kill(proc)


def test_signal_stacks_are_off_unless_the_rank_opts_in() -> None:
    # start_debug_server hands install its choice: the argument, else Settings.signal_stacks.
    assert Settings.from_env({}).signal_stacks is False
    assert install(Settings.from_env({}).signal_stacks) is None
    assert install(False) is None


@pytest.mark.job
def test_signal_capture_refuses_a_pid_that_does_not_hold_the_file() -> None:
    sig = install(True)
    assert sig is not None
    try:
        text = capture(os.getpid(), sig.meta())
        assert text and "test_signal_capture_refuses_a_pid_that_does_not_hold_the_file" in text
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            # Same file, another process (a reused pid): no signal is sent, nothing is read.
            assert capture(other.pid, sig.meta()) is None
            assert other.poll() is None  # a real-time signal would have killed it
            assert capture(os.getpid(), {**sig.meta(), "file": "/etc/passwd"}) is None
        finally:
            other.kill()
            other.wait()
    finally:
        sig.close()


# ---------------------------------------------------------------------------------------------
# A full dump directory


class _FullDisk(io.RawIOBase):
    """A file whose writes stop half way with ENOSPC, like a disk that fills up mid-write."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.real.write(bytes(data)[: max(1, len(data) // 2)])
        self.real.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    def close(self) -> None:
        self.real.close()
        super().close()


async def test_full_dump_dir_logs_once_leaves_no_partial_files_and_recovers(
        aiohttp_client: Any, fake_job: Any, tmp_path: Path, caplog: Any,
        monkeypatch: Any) -> None:
    dump_dir = tmp_path / "dumps"
    dump_dir.mkdir()
    urls = await fake_job(synthetic.hang_job(2, n_entries=5, missing_rank=1))
    config = ServerConfig(port=0, fetch_timeout=2, dump_dir=str(dump_dir), dump_interval=3600,
                          enabled_dumps=frozenset({"fr_trace", "stacks", "snapshot"}))
    client = await aiohttp_client(make_frontend_app(config, StaticRegistry(urls)))
    dumper = client.app[DUMPER]
    caplog.set_level(logging.WARNING, logger="debug_server.frontend.dumps")
    real_fdopen = os.fdopen
    monkeypatch.setattr(dumps_mod.os, "fdopen", lambda fd, *a, **k: _FullDisk(real_fdopen(fd, "wb")))
    for _ in range(3):
        assert await dumper.run_cycle() == []
    resp = await client.get("/fr_trace", headers={"Accept": CURL})
    assert resp.status == 200 and "Rank 1 never joined" in await resp.text()
    assert sorted(os.listdir(dump_dir)) == []  # no partial report, no leftover temp file
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "No space left on device" in errors[0] and "\n" not in errors[0]
    monkeypatch.setattr(dumps_mod.os, "fdopen", real_fdopen)
    written = await dumper.run_cycle()
    assert len(written) == 3 and all(os.path.getsize(p) > 0 for p in written)
    assert any("works again" in r.getMessage() for r in caplog.records)
