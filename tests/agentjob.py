"""What the real agent jobs share (``test_agent``, ``test_tree``): the rank script (3
all_reduces on ``main_comm``, then one rank sleeps instead of the fourth), its hang line, a
JSON GET and waiting for a killed process to be gone."""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

from httpget import request

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
