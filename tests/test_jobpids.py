"""Which processes may be read: a pid a rank of this job announced on this host, still the same
process and of the same user; and each rank names exactly its host's reader as its tracer."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from debug_server.protocol.addrs import agent_key
from debug_server.rank import ptracer
from debug_server.readers import jobpids
from debug_server.readers.storeview import store_client

pytestmark = pytest.mark.job


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    yield proc
    proc.kill()
    proc.wait()


def test_an_announced_pid_of_this_host_may_be_read(child: subprocess.Popen[bytes]) -> None:
    assert jobpids.check(child.pid, jobpids.identity(child.pid)) is None


def test_a_pid_nobody_announced_is_refused_in_one_line(child: subprocess.Popen[bytes]) -> None:
    assert jobpids.check(child.pid, None) == \
        f"pid {child.pid} was not announced by any rank of this job"


def test_a_reused_pid_is_refused(child: subprocess.Popen[bytes]) -> None:
    announced = {**jobpids.identity(child.pid), "start": jobpids.start_time(child.pid) - 1}
    assert jobpids.check(child.pid, announced) == \
        f"pid {child.pid} is no longer the rank that announced it (started at another time)"


def test_a_pid_announced_on_another_host_is_refused(child: subprocess.Popen[bytes]) -> None:
    announced = {**jobpids.identity(child.pid), "host": "elsewhere"}
    reason = jobpids.check(child.pid, announced)
    assert reason == f"pid {child.pid} was announced on host elsewhere, not on {socket.gethostname()}"


def test_another_users_pid_is_refused(child: subprocess.Popen[bytes]) -> None:
    announced = {**jobpids.identity(child.pid), "uid": os.geteuid() + 1}
    assert jobpids.check(child.pid, announced) == f"pid {child.pid} belongs to another user"


def test_fate_tells_a_signal_from_an_exit_while_the_rank_is_a_zombie() -> None:
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    exited = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    starts = {p.pid: jobpids.start_time(p.pid) for p in (killed, exited)}
    assert jobpids.fate(killed.pid, starts[killed.pid]) is None
    os.kill(killed.pid, signal.SIGKILL)
    for p in (killed, exited):  # zombies until reaped: /proc still has their exit status
        os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)
    assert jobpids.fate(killed.pid, starts[killed.pid]) == "killed by SIGKILL"
    assert jobpids.fate(exited.pid, starts[exited.pid]) == "exited with code 3"
    killed.wait()
    exited.wait()
    assert jobpids.fate(killed.pid, starts[killed.pid]) == "its process has ended"


def test_ptracer_is_the_hosts_agent_else_the_frontend_else_any(tcp_store: Any,
                                                              child: subprocess.Popen[bytes]) -> None:
    from fakes import make_job

    store = store_client("127.0.0.1", tcp_store.port, 5)
    calls: list[int] = []

    def prctl(option: Any, value: Any, *rest: Any) -> int:
        assert option.value == ptracer.PR_SET_PTRACER
        calls.append(value.value)
        return 0

    keeper = ptracer.PtracerKeeper(make_job(1, 2, tcp_store.port), "h1", prctl=prctl)
    keeper.apply(ptracer.choose_reader(store, 0, "h1"))
    assert calls == [ptracer.PR_SET_PTRACER_ANY]  # no reader published yet
    jobpids.publish_frontend(store, 0)
    keeper.apply(ptracer.choose_reader(store, 0, "h1"))
    assert calls[-1] == os.getpid()
    agent = {**jobpids.identity(child.pid), "restart": 0, "url": "http://x:1", "ranks": "0-1"}
    store.set(agent_key("h1"), json.dumps(agent))
    keeper.apply(ptracer.choose_reader(store, 0, "h1"))
    assert calls[-1] == child.pid
    # A reader of another restart, or one whose pid now names another process, is not trusted.
    store.set(agent_key("h1"), json.dumps({**agent, "start": agent["start"] - 1}))
    store.set(jobpids.FRONTEND_READER_KEY, json.dumps({**jobpids.identity(), "restart": 1}))
    assert ptracer.choose_reader(store, 0, "h1") is None
