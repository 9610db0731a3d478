"""What the real agent jobs share (``test_agent``, ``test_tree``): the rank script (3
all_reduces on ``main_comm``, then one rank sleeps instead of the fourth), its hang line, a
JSON GET and waiting for a killed process to be gone."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from httpget import request
from mpjob import kill_all, rank_env

JOB = """
import datetime, os, sys, time, torch
from debug_server import start_debug_server
from debug_server.recording.comms import new_comm
from debug_server.recording.hooks import FlightRecorderHook
rank = int(os.environ["RANK"])
server = start_debug_server(port=0, fetch_timeout=2, host="127.0.0.1")
comm = new_comm("gloo", torch.device("cpu"), "main_comm", timeout=datetime.timedelta(seconds={seconds}))
FlightRecorderHook(max_entries=100).register_with_comm(comm)
t = torch.ones(64)
for _ in range(3):
    comm.all_reduce(t)
if rank == 0:
    print("FRONTEND", server.frontend_url, flush=True)
print("PHASE2", flush=True)
if rank == {stuck}:
    time.sleep({seconds})  # the hang
else:
    comm.all_reduce(t)
"""


def job_script(stuck: int, seconds: int) -> str:
    """The rank script in which rank ``stuck`` sleeps ``seconds`` instead of all_reduce #4."""
    return textwrap.dedent(JOB).replace("{stuck}", str(stuck)).replace("{seconds}", str(seconds))


def hang_line(script: str) -> int:
    return next(i for i, line in enumerate(script.splitlines(), 1) if "# the hang" in line)


def get(url: str, path: str) -> tuple[int, str]:
    return request(f"{url}{path}", headers={"Accept": "application/json"})


def wait_gone(pid: int, timeout: float = 30.0) -> None:
    """Until ``pid`` has exited (gone, or a zombie whose sockets are closed)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return
        if state in ("Z", "X"):
            return
        assert time.monotonic() < deadline, f"pid {pid} still {state} after SIGKILL"
        time.sleep(0.01)


@contextlib.contextmanager
def running_hosts(tmp: Path, script: str, world: int, per_host: int, store_port: int,
                  extra_env: dict[str, str] | None = None,
                  ) -> Iterator[tuple[list[subprocess.Popen[str]], list[Path]]]:
    """``world`` ranks of ``script`` "on" hosts of ``per_host`` (torchrun's per-host variables,
    the agent id ``fakehost<n>``), each in its own session, output in ``rank<r>.log``: the
    processes and the logs; on the way out every session is killed (the rank and the frontend
    or agent it started) and the logs closed."""
    path = tmp / "rank_script.py"
    path.write_text(script)
    logs = [tmp / f"rank{r}.log" for r in range(world)]
    files: list[IO[str]] = [p.open("w") for p in logs]
    procs: list[subprocess.Popen[str]] = []
    try:
        _start(procs, files, path, tmp, world, per_host, store_port, extra_env)
        yield procs, logs
    finally:
        kill_all(procs)
        for f in files:
            f.close()


def _start(procs: list[subprocess.Popen[str]], files: list[IO[str]], path: Path, tmp: Path,
           world: int, per_host: int, store_port: int,
           extra_env: dict[str, str] | None) -> None:
    for rank in range(world):
        env = rank_env(rank, world, store_port, {
            "LOCAL_RANK": str(rank % per_host), "LOCAL_WORLD_SIZE": str(per_host),
            "DEBUG_SERVER_AGENT_ID": f"fakehost{rank // per_host}", **(extra_env or {})})
        for var in ("TORCHCOMM_FR_DUMP_TEMP_FILE", "DEBUG_SERVER_AGENT", "DEBUG_SERVER_HOST"):
            env.pop(var, None)
        procs.append(subprocess.Popen([sys.executable, str(path)], env=env, cwd=tmp,
                                      stdout=files[rank], stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
