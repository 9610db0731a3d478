"""A rank's process read from /proc (``readers.procstate``): real child processes that sleep, stop
and spin, one that is gone, one whose pid nobody announced; the worker's ``process_state``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from debug_server.rank.worker import StaticProvider, make_worker_app
from debug_server.readers import jobpids, procstate

pytestmark = pytest.mark.job  # starts real processes (tests/tiers.py)


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    """A Python child that sleeps; killed by pid at the end."""
    p = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); "
                          "time.sleep(120)"], stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline() == b"up\n"
    yield p
    p.kill()
    p.wait(10)
    p.stdout.close()


def _letter(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _wait_letter(pid: int, letter: str) -> None:
    deadline = time.monotonic() + 10
    while _letter(pid) != letter:
        assert time.monotonic() < deadline, f"pid {pid} never reached {letter}"
        time.sleep(0.01)


def test_stopped_process_reads_stopped_since_it_was_first_seen_so(
        child: subprocess.Popen[bytes]) -> None:
    clock = iter([1000.0, 2000.0, 3000.0]).__next__
    reader = procstate.ProcReader(wall=clock)
    me = jobpids.identity(child.pid)
    first = reader.read([(child.pid, me)])[0]
    assert (first["state"], first["letter"], first["since"]) == ("running", "S", 1000.0)
    assert first["cpu_pct"] is not None and first["cpu_pct"] < 50
    os.kill(child.pid, signal.SIGSTOP)
    _wait_letter(child.pid, "T")
    rec = reader.read([(child.pid, me)])[0]
    assert (rec["state"], rec["letter"], rec["since"], rec["pid"]) == ("stopped", "T", 2000.0,
                                                                        child.pid)
    assert reader.read([(child.pid, me)])[0]["since"] == 2000.0  # the same state: same since
    os.kill(child.pid, signal.SIGCONT)


def test_spinning_process_reads_its_cpu_use() -> None:
    p = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        reader = procstate.ProcReader()
        # On a loaded 2-core box a spinner may get a small share of a core in any one window:
        # read until it shows (a sleeper reads 0), within a deadline.
        deadline = time.monotonic() + 30
        while True:
            rec = reader.read([(p.pid, jobpids.identity(p.pid))], settle_s=0.3)[0]
            if rec["cpu_pct"] is not None and rec["cpu_pct"] >= 5 or time.monotonic() > deadline:
                break
        assert rec["state"] == "running" and rec["cpu_pct"] >= 5, rec
    finally:
        p.kill()
        p.wait(10)


def test_gone_and_reused_pids_read_gone_and_an_unannounced_one_is_refused(
        child: subprocess.Popen[bytes]) -> None:
    me = jobpids.identity(child.pid)
    reader = procstate.ProcReader()
    reused = {**me, "start": me["start"] - 1}  # another process under the same pid
    recs = reader.read([(child.pid, reused), (child.pid, None)])
    assert recs[0]["state"] == "gone"
    assert recs[1]["state"] is None and "not announced" in recs[1]["error"]
    child.kill()
    child.wait(10)
    assert reader.read([(child.pid, me)])[0]["state"] == "gone"


def test_gil_is_read_off_pyspys_main_thread_header_only() -> None:
    held = ('(py-spy: read from outside the process by the frontend)\n'
            'Thread 0x1 [tid 5, "MainThread", idle, holds the GIL] (most recent call first):\n'
            '  File "t.py", line 3 in <module>\n')
    assert procstate.gil_from_stack(held) is True
    assert procstate.gil_from_stack(held.replace(", holds the GIL", "")) is False
    assert procstate.gil_from_stack(held.split("\n", 1)[1]) is None  # not py-spy's


def test_describe_says_state_letter_cpu_wchan_gil_and_age() -> None:
    proc = {"pid": 42, "state": "stopped", "letter": "T", "since": 0, "cpu_pct": 0.0,
            "wchan": "do_signal_stop", "holds_gil": True, "age_s": 3.2}
    assert procstate.describe(proc) == ("stopped (T stopped), 0 % CPU, in do_signal_stop, "
                                        "holds the GIL; pid 42, read 3 s ago")
    assert procstate.describe(None) == ""


async def test_worker_process_state_reads_itself_and_refuses_a_pid_nobody_announced(
        aiohttp_client: Any) -> None:
    client = await aiohttp_client(make_worker_app(StaticProvider({})))
    resp = await client.post("/handler/process_state")
    rec = await resp.json()
    assert resp.status == 200 and (rec["pid"], rec["state"]) == (os.getpid(), "running"), rec
    resp = await client.post("/handler/process_state?pid=1")
    assert resp.status == 403 and "not announced" in await resp.text()
    assert (await client.post("/handler/process_state?pid=x")).status == 400
