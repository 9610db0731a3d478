"""The rank that cannot answer, on real gloo jobs (plain ``torch.distributed`` and
``start_debug_server``): 3 CPU ranks, rank 2 leaves the loop at step 3 while ranks 0-1 wait in
the next all_reduce, and either

* stops itself (SIGSTOP, as a debugger or a frozen cgroup does),
* sleeps in a C call that keeps the GIL (``ctypes.PyDLL``: its worker thread cannot run), or
* blocks in a system call that never returns (``open`` of a FIFO nobody writes: Python lets the
  GIL go there, so its worker answers; its wait channel is shown);

and through a host agent, the stopped rank again. Each checks the verdict (the rank, category
``cpu_divergence``, its state or line), the process state in the JSON, and that ``/fr_trace``
and the overview answer within a second while the rank is silent, once it has been seen silent
(a rank that timed out is asked briefly, its last outside read reused: ``fanout.outside``).
One job per case, every process ended by its process group.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from httpget import get_json, timed_get
from mpjob import free_port, rank_env
from rankprocs import RankProcs

from debug_server.config import ServerConfig
from debug_server.frontend.app import COLLECTOR, make_frontend_app
from debug_server.readers.storeview import StoreRegistry

pytestmark = pytest.mark.job  # starts real processes (tests/tiers.py)

WORLD, BAD = 3, 2
FETCH_TIMEOUT = 3.0
PAGE_S = 1.0
"""What the issue asks of a page while one rank is silent."""

RANK = """
import ctypes, datetime, os, signal, time
import torch
import torch.distributed as dist
from debug_server import start_debug_server

rank, case = int(os.environ["RANK"]), os.environ["CASE"]
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
h = start_debug_server(port=0, fetch_timeout=FETCH_TIMEOUT)
assert h.wait_registered(60)
t = torch.ones(16)
for step in range(3):
    dist.all_reduce(t)
print("READY", os.getpid(), h.frontend_url, flush=True)
if rank == BAD:
    if case == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)  # STOP_LINE
    elif case == "gil":
        ctypes.PyDLL(None).sleep(600)  # GIL_LINE
    elif case == "fifo":
        open("fifo").read()  # FIFO_LINE
dist.all_reduce(t)
time.sleep(600)
"""


class SilentJob(RankProcs):
    """``WORLD`` gloo ranks; rank ``BAD`` goes silent as ``case`` says."""

    def __init__(self, tmp: Path, case: str, extra: dict[str, str] | None = None) -> None:
        self.port = port = free_port()
        os.mkfifo(tmp / "fifo")

        def env(r: int) -> dict[str, str]:
            return rank_env(r, WORLD, port, {"CASE": case, **(extra or {})})

        super().__init__(tmp, RANK.replace("FETCH_TIMEOUT", repr(FETCH_TIMEOUT))
                         .replace("BAD", str(BAD)), WORLD, env)
        self.base = self.wait_for(0, r"^READY \d+ (\S+)", timeout=120).group(1)
        self.pid = int(self.wait_for(BAD, r"^READY (\d+)", timeout=60).group(1))

    def letter(self) -> str:
        with open(f"/proc/{self.pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]

    def wait_silent(self, letter: str) -> None:
        """Until rank ``BAD``'s process shows ``letter`` (main thread) three reads running."""
        deadline, seen = time.monotonic() + 30, 0
        while seen < 3:
            seen = seen + 1 if self.letter() == letter else 0
            assert time.monotonic() < deadline, f"rank {BAD} never reached state {letter}"
            time.sleep(0.05)

    def verdict(self, want: str, timeout: float = 60) -> dict[str, Any]:
        """``/fr_trace?format=json`` once its first finding names rank ``BAD`` with
        category ``want`` (the peers need a moment to enter their all_reduce)."""
        deadline = time.monotonic() + timeout
        while True:
            result = get_json(f"{self.base}/fr_trace?format=json")
            f = (result.get("findings") or [{}])[0]
            if result.get("category") == want and f.get("ranks") == [BAD]:
                return result
            assert time.monotonic() < deadline, (result.get("category"), result.get("verdict"))
            time.sleep(0.2)

    def page_times(self) -> dict[str, float]:
        """Seconds the overview and /fr_trace (HTML and JSON) take now."""
        out = {}
        for path in ("/", "/fr_trace", "/fr_trace?format=json", "/?format=json"):
            status, body, took = timed_get(self.base + path, accept="text/html")
            assert status == 200, body[:500]
            out[path] = took
        print("page times while rank", BAD, "is silent:",
              ", ".join(f"{p} {t:.3f} s" for p, t in out.items()))
        return out


def _process(result: dict[str, Any], rank: int = BAD) -> dict[str, Any]:
    return next(r["process"] for r in result["ranks"] if r["rank"] == rank and "process" in r)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, SilentJob]]:
    """One job per case, started on first use and ended with the module."""
    started: dict[str, SilentJob] = {}

    class Jobs(dict):  # type: ignore[type-arg]
        def __missing__(self, case: str) -> SilentJob:
            extra = {"DEBUG_SERVER_AGENT": "1"} if case == "agent" else None
            job = SilentJob(tmp_path_factory.mktemp(case), "stop" if case == "agent" else case,
                            extra)
            started[case] = self[case] = job
            return job

    try:
        yield Jobs()
    finally:
        for job in started.values():
            job.close()


def _assert_fast(job: SilentJob) -> None:
    times = job.page_times()
    slow = {p: t for p, t in times.items() if t > PAGE_S}
    assert not slow, f"pages over {PAGE_S} s while rank {BAD} is silent: {slow}"


@pytest.mark.timeout(180)
def test_stopped_rank_is_named_with_its_state_line_and_pages_stay_fast(
        jobs: dict[str, SilentJob]) -> None:
    job = jobs["stop"]
    job.wait_silent("T")
    result = job.verdict("cpu_divergence")
    line = job.line_of("STOP_LINE")
    assert f"Rank {BAD} never joined all_reduce" in result["verdict"], result["verdict"]
    assert f"Rank {BAD} cannot answer: its process is stopped" in result["verdict"]
    assert f"rank_script.py:{line}" in result["verdict"]
    assert f"kill -CONT {job.pid}" in result["next_step"]
    proc = _process(result)
    assert (proc["state"], proc["letter"], proc["pid"]) == ("stopped", "T", job.pid)
    _assert_fast(job)
    status, text, _ = timed_get(f"{job.base}/stacks")
    section = text.split(f"=== Rank {BAD} ===", 1)[1]
    assert status == 200 and section.lstrip().startswith("Process: stopped (T stopped)"), section


@pytest.mark.timeout(180)
def test_rank_holding_the_gil_in_a_c_call_is_named_with_its_line(
        jobs: dict[str, SilentJob]) -> None:
    job = jobs["gil"]
    job.wait_silent("S")
    result = job.verdict("cpu_divergence")
    line = job.line_of("GIL_LINE")
    assert (f"Rank {BAD} cannot answer: its main thread holds the GIL in a C call at "
            f"rank_script.py:{line}") in result["verdict"], result["verdict"]
    proc = _process(result)
    assert (proc["state"], proc["holds_gil"]) == ("running", True), proc
    assert proc["cpu_pct"] is not None and proc["cpu_pct"] < 50, proc  # asleep, not spinning
    _assert_fast(job)


@pytest.mark.timeout(180)
def test_rank_blocked_in_a_system_call_shows_its_wait_channel(
        jobs: dict[str, SilentJob]) -> None:
    job = jobs["fifo"]
    job.wait_silent("S")
    result = job.verdict("cpu_divergence")
    line = job.line_of("FIFO_LINE")
    proc = _process(result)
    wchan = proc["wchan"]
    assert proc["state"] == "running" and wchan, proc
    # Its worker answers (open() lets the GIL go): its own stack names the line, and its
    # process the kernel function it sleeps in.
    assert f"rank_script.py:{line}" in result["verdict"], result["verdict"]
    assert f"sleeps in the kernel ({wchan})" in result["verdict"], result["verdict"]
    status, text, _ = timed_get(f"{job.base}/stacks")
    assert status == 200 and f"in {wchan}" in text.split(f"=== Rank {BAD} ===", 1)[1]


@pytest.mark.timeout(180)
def test_stopped_rank_read_through_its_hosts_agent(jobs: dict[str, SilentJob]) -> None:
    job = jobs["agent"]
    job.wait_silent("T")
    result = job.verdict("cpu_divergence")
    assert f"Rank {BAD} cannot answer: its process is stopped" in result["verdict"]
    assert _process(result)["state"] == "stopped"
    ranks = get_json(f"{job.base}/stacks?format=json")["ranks"]
    assert "via agent" in (ranks[BAD].get("note") or ""), ranks[BAD]
    _assert_fast(job)


@pytest.mark.timeout(180)
async def test_stopped_rank_on_another_host_is_read_by_a_worker_there(
        aiohttp_client: Any, jobs: dict[str, SilentJob]) -> None:
    job = await asyncio.to_thread(jobs.__getitem__, "stop")
    await asyncio.to_thread(job.wait_silent, "T")
    client = await aiohttp_client(make_frontend_app(
        ServerConfig(port=0, fetch_timeout=FETCH_TIMEOUT),
        StoreRegistry("127.0.0.1", job.port, WORLD, 0)))
    # This frontend believes it runs on another host: rank 2's process is read by an
    # answering worker on rank 2's host (process_state?pid=), as its stacks are.
    client.app[COLLECTOR].pyspy.host = "frontend-elsewhere"
    deadline = time.monotonic() + 60
    while True:
        result = await (await client.get("/fr_trace?format=json")).json()
        proc = next((r.get("process") for r in result["ranks"] if r["rank"] == BAD), None)
        if proc or time.monotonic() > deadline:
            break
    assert proc is not None and proc["state"] == "stopped", result["ranks"]
    assert proc["read_by"] in ("rank 0's worker", "rank 1's worker"), proc
    assert result["category"] == "cpu_divergence", result["verdict"]
    assert f"Rank {BAD} cannot answer: its process is stopped" in result["verdict"]
