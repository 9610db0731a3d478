"""Stacks read by py-spy from outside the rank: a rank holding the GIL in C code is read without
a signal, its sleep runs its full length, native frames show the C function it sits in, and
where py-spy cannot run the page says why in one line."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from httpget import timed_get
from jobscripts import FETCH_TIMEOUT, HOLD_S
from jobscripts import GIL_HOLDING_RANK as RANK
from rankprocs import RankProcs

from debug_server.analysis import stackparse
from debug_server.config import ServerConfig
from debug_server.fanout.transport import OK, RankResult
from debug_server.frontend import render
from debug_server.frontend.app import COLLECTOR, make_frontend_app
from debug_server.rank.worker import StaticProvider, make_worker_app
from debug_server.readers import pyspy
from debug_server.readers.storeview import StaticRegistry, StoreRegistry

REPO = Path(__file__).resolve().parent.parent


class Job(RankProcs):
    """Ranks of a single-host job registered in ``store_port``'s TCPStore, running ``script``."""

    def __init__(self, tmp: Path, world_size: int, store_port: int, env: dict[str, str],
                 script: str = RANK) -> None:
        def rank_env(r: int) -> dict[str, str]:
            return {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r),
                    "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store_port),
                    "PYTHONPATH": str(REPO), **env}

        super().__init__(tmp, script.replace("FETCH_TIMEOUT", repr(FETCH_TIMEOUT))
                         .replace("HOLD_S", repr(HOLD_S)), world_size, rank_env)

    def ready(self, rank: int) -> tuple[int, str]:
        """The rank's pid and (rank 0) its frontend URL, once it registered."""
        m = self.wait_for(rank, r"^READY (\d+) (\S+)")
        return int(m.group(1)), m.group(2)

    def hold(self, base: str, rank: int = 0) -> None:
        """Start ``rank``'s hold once the frontend has answered a page: the first page also
        waits for the frontend's store connection, seconds on a busy machine."""
        status, text, _ = timed_get(f"{base}/?format=json")
        assert status == 200, text
        (self.tmp / "go").touch()
        self.wait_for(rank, r"^HOLDING", timeout=20)
        # Into the usleep: the main thread (its tid is the pid) seen asleep three reads running
        # (after HOLDING nothing but the usleep sleeps, bar a moment's wait for the GIL).
        pid = self.ready(rank)[0]
        deadline, asleep = time.monotonic() + 20, 0
        while asleep < 3:
            stat = Path(f"/proc/{pid}/task/{pid}/stat").read_text()
            asleep = asleep + 1 if stat.rsplit(")", 1)[1].split()[0] == "S" else 0
            assert time.monotonic() < deadline, "the rank never went to sleep in usleep"
            time.sleep(0.02)

    def assert_slept_full_length(self, rank: int = 0) -> None:
        """The rank's usleep, measured in the rank, was not cut short (no EINTR)."""
        slept = float(self.wait_for(rank, r"^SLEPT (\S+)", timeout=HOLD_S + 10).group(1))
        print(f"usleep of {HOLD_S} s lasted {slept:.4f} s in the rank")
        assert slept >= HOLD_S - 0.005, f"usleep cut short: {slept:.4f} s of {HOLD_S} s"

    @property
    def hold_line(self) -> int:
        return self.line_of("HOLD_LINE")


@contextlib.contextmanager
def held(tmp: Path, store_port: int, env: dict[str, str]) -> Iterator[tuple[Job, str]]:
    """A one-rank job whose rank holds the GIL in usleep; yields it and its frontend URL."""
    job = Job(tmp, 1, store_port, env)
    try:
        _, base = job.ready(0)
        job.hold(base)
        yield job, base
    finally:
        job.close()


def _section(text: str, rank: int) -> str:
    return text.split(f"=== Rank {rank} ===", 1)[1].split("\n=== Rank ", 1)[0]


def _main_frames(text: str) -> list[stackparse.Frame]:
    main = stackparse.main_thread(stackparse.parse_threads(text))
    assert main is not None, text
    return main.frames


# ---------------------------------------------------------------------------------------------
# A rank holding the GIL in usleep


@pytest.mark.job
@pytest.mark.timeout(60)
def test_stuck_rank_is_read_by_pyspy_within_the_timeout_and_its_usleep_runs_full_length(
        tcp_store: Any, tmp_path: Path) -> None:
    with held(tmp_path, tcp_store.port, {}) as (job, base):
        status, text, took = timed_get(f"{base}/stacks")
        print(f"/stacks answered in {took:.3f} s (fetch_timeout {FETCH_TIMEOUT} s)")
        assert status == 200 and took < FETCH_TIMEOUT + 1.5, (took, text)
        section = _section(text, 0)
        assert "(py-spy: read from outside the process by the frontend; worker not answering)" in section
        assert f'rank_script.py", line {job.hold_line} in <module>' in section
        assert "holds the GIL" in section
        job.assert_slept_full_length()


@pytest.mark.job
@pytest.mark.timeout(60)
async def test_rank_on_a_host_without_the_frontend_is_read_by_a_sibling_ranks_worker(
        aiohttp_client: Any, tcp_store: Any, tmp_path: Path) -> None:
    job = Job(tmp_path, 2, tcp_store.port, {"HOLD_RANK": "1"})
    try:
        _, base = await asyncio.to_thread(job.ready, 0)
        await asyncio.to_thread(job.ready, 1)
        config = ServerConfig(port=0, fetch_timeout=FETCH_TIMEOUT)
        client = await aiohttp_client(make_frontend_app(
            config, StoreRegistry("127.0.0.1", tcp_store.port, 2, 0)))
        # This frontend believes it runs on another host: it cannot read rank 1 itself, so it
        # asks a worker on rank 1's host that still answers (rank 0's).
        client.app[COLLECTOR].pyspy.host = "frontend-elsewhere"
        assert (await client.get("/?format=json")).status == 200  # store connected
        await asyncio.to_thread(job.hold, base, 1)
        t0 = time.monotonic()
        resp = await client.get("/stacks?format=json")
        took = time.monotonic() - t0
        body = await resp.json()
        print(f"/stacks answered in {took:.3f} s (fetch_timeout {FETCH_TIMEOUT} s)")
        assert resp.status == 200 and took < FETCH_TIMEOUT + 1.5, (took, body)
        rank1 = body["ranks"][1]
        assert rank1["status"] == OK, rank1
        assert "stacks read by py-spy (rank 0's worker)" in rank1["note"]
        assert f'rank_script.py", line {job.hold_line} in <module>' in rank1["stacks"]
        await asyncio.to_thread(job.assert_slept_full_length, 1)
    finally:
        job.close()


@pytest.mark.job
@pytest.mark.timeout(60)
def test_without_pyspy_the_page_says_why_in_one_line_and_the_rank_is_not_disturbed(
        tcp_store: Any, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "py-spy"
    # Neither on PATH nor where the variable points; the rank did not opt in to signals.
    env = {"PATH": "/usr/bin:/bin", pyspy.PYSPY_ENV: str(missing)}
    with held(tmp_path, tcp_store.port, env) as (job, base):
        status, text, took = timed_get(f"{base}/stacks")
        print(f"/stacks answered in {took:.3f} s (fetch_timeout {FETCH_TIMEOUT} s)")
        assert status == 200 and took < FETCH_TIMEOUT + 1.5, (took, text)
        # The process, read from /proc, heads the section; the failure is one line after it.
        proc, line = _section(text, 0).strip().split("\n", 1)
        assert proc.startswith("Process: running (S sleeping)") and "\n" not in line, proc
        assert line.startswith("rank 0: timed out after 2.0 s; no py-spy stacks: py-spy not "
                               f"found at ${pyspy.PYSPY_ENV}={missing}"), line
        assert "pip install py-spy" in line
        job.assert_slept_full_length()


@pytest.mark.job
@pytest.mark.timeout(60)
def test_rank_that_opted_in_to_signals_is_still_read_by_pyspy_first(
        tcp_store: Any, tmp_path: Path) -> None:
    with held(tmp_path, tcp_store.port, {"DEBUG_SERVER_SIGNAL_STACKS": "1"}) as (job, base):
        status, text, _ = timed_get(f"{base}/stacks")
        assert status == 200
        assert "(py-spy: read from outside the process by the frontend" in text
        assert "captured by signal" not in text
        job.assert_slept_full_length()


@pytest.mark.job
@pytest.mark.timeout(60)
def test_native_frames_of_a_rank_blocked_in_usleep_show_the_c_function(
        tcp_store: Any, tmp_path: Path) -> None:
    with held(tmp_path, tcp_store.port, {}) as (job, base):
        status, text, _ = timed_get(f"{base}/stacks?native=1")
        assert status == 200, text
        frames = _main_frames(_section(text, 0))
        native = [f.function for f in frames if f.native]
        python = [f for f in frames if not f.native]
        assert "usleep" in native and {"clock_nanosleep", "nanosleep"} & set(native), frames
        # The C function sits below (is called by) the Python line that holds the GIL.
        first_py = frames.index(python[0])
        assert frames.index(next(f for f in frames if f.function == "usleep")) < first_py
        assert (python[0].function, python[0].line) == ("<module>", job.hold_line)
        assert "in clock_nanosleep (libc.so.6)" in text.split("=== Rank 0 ===")[0]  # the group line
        # Native frames pause the rank for the read; the kernel restarts its sleep (no signal).
        job.assert_slept_full_length()


IDLE = """
import os, time
from debug_server import start_debug_server
h = start_debug_server(port=0, fetch_timeout=FETCH_TIMEOUT)
assert h.wait_registered(30)
print("READY", os.getpid(), h.frontend_url, flush=True)
while True:
    time.sleep(3600)  # IDLE_LINE
"""


@pytest.mark.job
@pytest.mark.timeout(60)
def test_pyspy_dump_page_gives_json_and_text_the_same_native_frames(
        tcp_store: Any, tmp_path: Path) -> None:
    job = Job(tmp_path, 1, tcp_store.port, {}, script=IDLE)
    idle_line = job.line_of("IDLE_LINE")
    try:
        _, base = job.ready(0)
        status, text, _ = timed_get(f"{base}/pyspy_dump?format=text")
        assert status == 200, text
        status, raw, _ = timed_get(f"{base}/pyspy_dump?format=json")
        assert status == 200, raw
        body = json.loads(raw)
        assert body["native"] is True
        from_json = _main_frames(body["ranks"][0]["stacks"])
        from_text = _main_frames(_section(text, 0))
        assert from_json == from_text
        assert any(f.native for f in from_text)
        py = [f for f in from_text if not f.native]
        assert (py[0].function, py[0].line) == ("<module>", idle_line)
        assert "(py-spy --native: read from outside the process by the frontend)" in text
    finally:
        job.close()


# ---------------------------------------------------------------------------------------------
# The worker's pyspy_dump handler


@pytest.mark.job
async def test_worker_pyspy_dump_reads_its_own_process(aiohttp_client: Any) -> None:
    client = await aiohttp_client(make_worker_app(StaticProvider({})))
    resp = await client.post("/handler/pyspy_dump?nonblocking=1")
    text = await resp.text()
    assert resp.status == 200, text
    # The handler itself is on this process's stack while py-spy reads it.
    assert re.search(r'debug_server/rank/worker\.py", line \d+ in _pyspy_dump\n', text), text
    assert f"tid {os.getpid()}, " in text  # the main thread of this very process


@pytest.mark.job
async def test_worker_pyspy_dump_refuses_a_pid_no_rank_of_the_job_announced(
        aiohttp_client: Any) -> None:
    client = await aiohttp_client(make_worker_app(StaticProvider({})))
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        # Its own child, same user, same host: still no rank of this job (jobpids).
        resp = await client.post(f"/handler/pyspy_dump?pid={other.pid}")
        text = await resp.text()
        assert resp.status == 403, text
        assert text == f"pid {other.pid} was not announced by any rank of this job"
    finally:
        other.kill()
        other.wait()


async def test_worker_pyspy_dump_rejects_a_flag_that_is_not_boolean(aiohttp_client: Any) -> None:
    client = await aiohttp_client(make_worker_app(StaticProvider({})))
    resp = await client.post("/handler/pyspy_dump?native=maybe")
    assert resp.status == 400
    assert await resp.text() == "parameter native='maybe' must be 0/1 or true/false"


# ---------------------------------------------------------------------------------------------
# Failures in one line, with the fix


@pytest.mark.job
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv to run py-spy as an unprivileged user")
def test_ptrace_refusal_reads_as_one_line_naming_the_fix() -> None:
    # The real py-spy, run as nobody against a root process: the kernel refuses the read.
    # It lives in a directory nobody can reach (pytest's tmp_path is root-only).
    where = Path(tempfile.mkdtemp(prefix="debug_server_pyspy_"))
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        where.chmod(0o755)
        binary = where / "py-spy-real"
        shutil.copy(pyspy.locate(), binary)
        binary.chmod(0o755)
        wrapper = where / "py-spy"
        wrapper.write_text(f"#!/bin/sh\nexec {' '.join(as_nobody)} {binary} \"$@\"\n")
        wrapper.chmod(0o755)
        procs.append(subprocess.Popen([*as_nobody, "sleep", "30"]))
        procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]))
        # Until setpriv has become nobody and exec'd sleep (before, root owns the process).
        deadline = time.monotonic() + 30
        while Path(f"/proc/{procs[0].pid}/comm").read_text().strip() != "sleep":
            assert time.monotonic() < deadline, "setpriv never ran sleep"
            time.sleep(0.01)
        # Control: nobody's own process is read (it is no Python, which is what py-spy says).
        with pytest.raises(pyspy.PySpyError) as ok:
            pyspy.read(procs[0].pid, setting=str(wrapper))
        assert ok.value.kind == pyspy.FAILED and "python" in ok.value.reason.lower(), ok.value
        with pytest.raises(pyspy.PySpyError) as err:
            pyspy.read(procs[1].pid, setting=str(wrapper))
        assert err.value.kind == pyspy.NOT_PERMITTED, err.value
        assert err.value.reason.startswith(f"py-spy may not read pid {procs[1].pid}: ")
        assert "CAP_SYS_PTRACE" in err.value.reason and "\n" not in err.value.reason
    finally:
        for p in procs:
            p.kill()
            p.wait()
        shutil.rmtree(where, ignore_errors=True)


def test_pyspy_switched_off_says_so() -> None:
    with pytest.raises(pyspy.PySpyError) as err:
        pyspy.locate("0")
    assert (err.value.kind, err.value.reason) == (pyspy.UNAVAILABLE,
                                                  f"py-spy is off (${pyspy.PYSPY_ENV}=0)")


# ---------------------------------------------------------------------------------------------
# Native frames in the stacks pages: parsing, grouping, escaping

# The main thread of a real `py-spy dump --native --json` of a rank in ctypes usleep, as
# pyspy.to_text writes it.
NATIVE_STACK = """Thread 0x00007f0baba1fb80 [tid 18016, "MainThread", idle, holds the GIL] (most recent call first):
  Native "libc.so.6" in clock_nanosleep
  Native "libc.so.6" in nanosleep
  Native "libc.so.6" in usleep
  Native "libffi.so.8.1.2" in ??
  Native "libffi.so.8.1.2" in ffi_call
  Native "callproc.c", line 943 in _call_function_pointer
  File "/job/train.py", line 7 in <module>
  Native "libc.so.6" in ??
"""


def test_native_lines_parse_as_native_frames_under_the_python_main_thread() -> None:
    frames = _main_frames(NATIVE_STACK)
    assert frames[0] == stackparse.Frame("libc.so.6", 0, "clock_nanosleep", native=True)
    assert frames[5] == stackparse.Frame("callproc.c", 943, "_call_function_pointer", native=True)
    assert frames[6] == stackparse.Frame("/job/train.py", 7, "<module>")
    pos = stackparse.summarize(frames)
    assert pos.summary == "<module> at train.py:7 in clock_nanosleep (libc.so.6)"
    assert pos.native == "clock_nanosleep" and not pos.in_collective


def _ok(rank: int, body: str) -> RankResult:
    return RankResult(rank, f"http://r{rank}", OK, body=body)


def test_ranks_with_the_same_python_frames_but_other_native_frames_group_apart() -> None:
    other = NATIVE_STACK.replace("clock_nanosleep", "epoll_wait")
    model = render.stacks_model([_ok(0, NATIVE_STACK), _ok(1, NATIVE_STACK), _ok(2, other)],
                               native=True)
    assert [g["ranks"] for g in model["groups"]] == [[2], [0, 1]]
    assert model["groups"][1]["main"][0]["frames"][0] == "[native] clock_nanosleep (libc.so.6)"


def test_stack_group_says_how_its_stacks_were_read() -> None:
    r = _ok(3, NATIVE_STACK)
    r.note = "worker timed out after 2.0 s; stacks read by py-spy (the frontend)"
    (group,) = render.stacks_model([r])["groups"]
    assert group["note"] == "rank 3: worker timed out after 2.0 s; stacks read by py-spy (the frontend)"


async def test_stacks_html_escapes_native_cpp_template_frames(
        aiohttp_client: Any, fake_rank: Any) -> None:
    text = NATIVE_STACK.replace("in ffi_call", "in std::vector<int>::push_back")
    url = await fake_rank({}, stacks=text)
    client = await aiohttp_client(make_frontend_app(ServerConfig(port=0, fetch_timeout=2),
                                                    StaticRegistry([url])))
    resp = await client.get("/stacks", headers={"Accept": "text/html"})
    html = await resp.text()
    assert resp.status == 200
    assert "[native] std::vector&lt;int&gt;::push_back (libffi.so.8.1.2)" in html
    assert "<int>" not in html
