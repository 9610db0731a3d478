"""/profile, /tcpstore and /wait_counters on a real 2-rank gloo job (two processes, torchrun's
environment, ``start_debug_server`` with an access token, all_reduce in a loop)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from httpget import request
from mpjob import free_port, kill_all, rank_env

from debug_server.auth import TOKEN_HEADER

pytestmark = pytest.mark.job

TOKEN = "tok_job_0123456789abcdefghijkl"

JOB = """
import os, time, torch, torch.distributed as dist
from debug_server import start_debug_server
dist.init_process_group("gloo")
start_debug_server(port=int(os.environ["FE_PORT"]), fetch_timeout=3, auth_token=os.environ["TOKEN"])
print("READY", flush=True)
t = torch.ones(1024)
end = time.time() + 110
while time.time() < end:
    a = torch.randn(64, 64)
    a @ a
    dist.all_reduce(t)
    time.sleep(0.002)
"""


async def _get(port: int, path: str) -> tuple[int, str]:
    async with aiohttp.ClientSession(headers={TOKEN_HEADER: TOKEN}) as session, session.get(
            f"http://127.0.0.1:{port}{path}", timeout=aiohttp.ClientTimeout(total=90)) as resp:
        return resp.status, await resp.text()


def _job_is_up(port: int) -> bool:
    try:
        status, body = request(f"http://127.0.0.1:{port}/?format=text",
                               headers={TOKEN_HEADER: TOKEN}, timeout=10)
    except OSError:  # not listening yet
        return False
    return status == 200 and "2/2 ranks reachable" in body  # not while rank 1 registers


@pytest.fixture(scope="module")
def job(tmp_path_factory: Any) -> Iterator[int]:
    """The frontend's port while both ranks run; every process is killed by group."""
    tmp = tmp_path_factory.mktemp("job")
    script = tmp / "rank_script.py"
    script.write_text(textwrap.dedent(JOB))
    fe_port, store_port = free_port(), free_port()
    procs: list[subprocess.Popen[str]] = []
    logs = [(tmp / f"rank{r}.log").open("w") for r in range(2)]
    try:
        for rank in range(2):
            env = rank_env(rank, 2, store_port, {"FE_PORT": str(fe_port), "TOKEN": TOKEN})
            env.pop("TORCHCOMM_FR_DUMP_TEMP_FILE", None)
            procs.append(subprocess.Popen([sys.executable, str(script)], env=env, cwd=tmp,
                                          stdout=logs[rank], stderr=subprocess.STDOUT,
                                          text=True, start_new_session=True))
        deadline = time.monotonic() + 60
        while True:
            for p, log in zip(procs, logs, strict=True):
                if p.poll() is not None:
                    raise AssertionError(f"a rank exited:\n{Path(log.name).read_text()[-3000:]}")
            if _job_is_up(fe_port):
                break
            if time.monotonic() > deadline:
                raise AssertionError("job not up in 60 s")
            time.sleep(0.5)
        yield fe_port
    finally:
        kill_all(procs)  # by process group: each rank and rank 0's frontend child
        for log in logs:
            log.close()


@pytest.mark.timeout(150)
async def test_profile_merges_both_ranks_into_one_trace(job: int) -> None:
    status, body = await _get(job, "/profile?duration=1&format=json")
    assert status == 200, body
    report = json.loads(body)
    assert report["ranks_profiled"] == [0, 1] and report["not_profiled"] == []
    assert [r["note"] for r in report["ranks"]] == ["no GPU activity"] * 2
    status, body = await _get(job, report["trace_url"])
    trace = json.loads(body)
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    spans = [e for e in trace["traceEvents"] if e.get("cat") == "Trace"]
    assert sorted(e["pid"] for e in spans) == [0, 1]


@pytest.mark.timeout(150)
async def test_profile_page_has_the_summary_table(job: int) -> None:
    status, text = await _get(job, "/profile?duration=0.5")
    assert status == 200, text
    assert "; 2 of 2 ranks profiled" in text
    assert "  0  no GPU activity" in text and "  1  no GPU activity" in text


@pytest.mark.timeout(150)
async def test_tcpstore_lists_the_ranks_and_redacts_the_token(job: int) -> None:
    status, text = await _get(job, "/tcpstore")
    assert status == 200, text
    assert TOKEN not in text
    lines = {line.split()[0]: line for line in text.splitlines() if line.startswith("debug_server/")}
    assert lines["debug_server/rank0"].split()[-1].startswith("http://127.0.0.1:")
    assert lines["debug_server/auth_token_r0"].split()[-1] == "<redacted>"
    status, body = await _get(job, "/tcpstore?prefix=&format=json")
    assert TOKEN not in body and json.loads(body)["all_keys"] >= 5


@pytest.mark.timeout(150)
async def test_wait_counters_have_one_column_per_rank(job: int) -> None:
    status, body = await _get(job, "/wait_counters?format=json")
    assert status == 200, body
    page = json.loads(body)
    assert page["available"] is True and page["ranks"] == [0, 1]
    row = next(c for c in page["counters"]
               if c["counter"] == "pytorch.wait_counter.c10d.init_process_group"
               and c["field"] == "total_calls")
    assert row["values"] == {"0": 1, "1": 1}
