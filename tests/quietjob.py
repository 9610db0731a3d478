"""One small torchrun job, with and without ``start_debug_server``, and what the server added.

A run returns the job's whole output, when torchrun returned, and how long any process of the
job (found in ``/proc`` by the job's ``MASTER_PORT`` in its environment: the ranks, rank 0's
frontend, an agent, py-spy) outlived torchrun. ``added`` compares a run with the server to the
same job without it: the lines that only the server's run printed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# What the comparison needs is shared with the GPU check (scripts/gpu/check_quiet_exit.py), whose
# helpers are standard library only (pytest puts scripts/gpu/ on the path: pyproject.toml).
from gpucommon import added_lines, cpp_traces, outlived
from mpjob import REPO, free_port, kill_tree

# Each exit path as the job does it. Ranks that are only waiting for the launcher's teardown
# sleep outside any collective, so torch's own output is the same with and without the server.
JOB = r'''
import os, signal, sys, time
import torch
import torch.distributed as dist

path = os.environ["QUIET_PATH"]
if os.environ.get("QUIET_SERVER") == "1":
    from debug_server import start_debug_server
    start_debug_server(port=int(os.environ["QUIET_FRONTEND_PORT"]),
                       dump_dir=os.environ["QUIET_DUMPS"], dump_interval=1.0)
dist.init_process_group("gloo")
rank = dist.get_rank()
if os.environ.get("QUIET_SERVER") == "1" and rank == 0:
    # Until the frontend has read both ranks through the store: its store client and its
    # polls are what a job's end used to make noisy.
    import json, urllib.request
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            url = f"http://127.0.0.1:{os.environ['QUIET_FRONTEND_PORT']}/?format=json"
            with urllib.request.urlopen(url, timeout=10) as r:
                if json.loads(r.read())["reachable"] == 2:
                    break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.1)
t = torch.ones(1024)
for _ in range(int(os.environ.get("QUIET_STEPS", "30"))):
    dist.all_reduce(t)
dist.barrier()
if path == "signal":  # the test signals torchrun once every rank is here
    open(os.environ["QUIET_MARK"] + str(rank), "w").close()
    while True:
        time.sleep(0.05)
if path == "raise":
    if rank == 1:
        raise RuntimeError("rank 1 fails")
    time.sleep(60)
if path == "kill0":
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
if path == "destroy":
    dist.barrier()
    dist.destroy_process_group()
'''

PATHS = ("return", "destroy", "raise", "sigint", "sigterm", "kill0")
"""The exit paths: normal return (no destroy_process_group), barrier + destroy, one rank
raising, torchrun getting SIGINT or SIGTERM, rank 0 SIGKILLed."""

@dataclass
class Run:
    path: str
    server: bool
    returncode: int
    output: list[str]
    ended_at: float
    """``time.time()`` when torchrun returned."""
    outlived_s: float | None
    """How long the last process of the job outlived torchrun (None: still alive at the bound)."""
    leftovers: list[str]
    """Command lines of the job's processes still alive at the bound (then killed by pid)."""


def run(path: str, server: bool, workdir: Path, *, master_port: int | None = None,
        frontend_port: int | None = None, limit_s: float = 90.0,
        linger_bound_s: float = 2.0, extra_env: dict[str, str] | None = None) -> Run:
    """Run the job down ``path`` (one of ``PATHS``) on 2 gloo ranks under torchrun."""
    workdir.mkdir(parents=True, exist_ok=True)
    # One script for the runs under one folder: torchrun's failure report names it.
    script = workdir.parent / "quiet_job.py"
    if not script.exists():
        script.write_text(JOB)
    mark = workdir / "ready_rank"
    master_port = master_port or free_port()
    env = dict(os.environ, QUIET_PATH=path.removeprefix("sig") if path.startswith("sig")
               else path, QUIET_SERVER="1" if server else "0",
               QUIET_FRONTEND_PORT=str(frontend_port or free_port()),
               QUIET_DUMPS=str(workdir / "dumps"), QUIET_MARK=str(mark),
               OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1",
               **(extra_env or {}))
    if path.startswith("sig"):
        env["QUIET_PATH"] = "signal"
    log = workdir / "out.txt"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
             f"--master-port={master_port}", str(script)],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=workdir)
        try:
            deadline = time.monotonic() + limit_s
            if path.startswith("sig"):
                while not all(Path(f"{mark}{r}").exists() for r in range(2)):
                    assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                    time.sleep(0.05)
                proc.send_signal(signal.SIGINT if path == "sigint" else signal.SIGTERM)
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except BaseException:
            kill_tree(proc)
            raise
        ended, ended_at = time.monotonic(), time.time()
    lived, left = outlived(master_port, ended, linger_bound_s)
    return Run(path, server, proc.returncode, log.read_text().splitlines(), ended_at, lived,
               left)


def added(with_server: Run, baseline: Run) -> list[str]:
    """The lines of ``with_server``'s output that ``baseline``'s has no match for."""
    return added_lines(with_server.output, baseline.output)


def traces(r: Run) -> list[str]:
    """c10d's C++ trace lines in ``r``'s output."""
    return cpp_traces(r.output)
