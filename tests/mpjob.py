"""Run a real multi-process torch.distributed job for a test: one subprocess per rank.

Each rank runs the given script text with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set, as torchrun
would. Every process is bounded by ``timeout`` and killed by pid in a ``finally``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from httpget import get_json

REPO = Path(__file__).resolve().parent.parent


_PICK = random.SystemRandom()  # not the global generator, which hypothesis seeds
PORTS_FROM, PORTS_TO = 10000, 25000
"""Where ``free_port`` picks: below the kernel's ephemeral range (32768 by default, and below
the demo's 25999 and torchrun's 29500, which people start by hand)."""


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port nothing listens on now on 127.0.0.1, for a server that binds it a moment later.

    Not ``bind(0)``: such a port comes from the ephemeral range, where every outgoing connection
    and every port-0 server of a busy run (parallel tests, a benchmark's thousand workers) takes
    ports too, so one may take it before our server binds it. Below that range only explicit
    numbers are used; a random pick keeps parallel test workers apart.
    """
    top = min(PORTS_TO, _ephemeral_low())
    for _ in range(500):
        port = _PICK.randrange(PORTS_FROM, top)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {PORTS_FROM}-{top} on 127.0.0.1")


@dataclass
class RankResult:
    rank: int
    returncode: int | None
    stdout: str
    stderr: str


def rank_env(rank: int, world_size: int, master_port: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(master_port),
        PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    if extra:
        env.update(extra)
    return env


def start_ranks(
    script: str, world_size: int, workdir: Path, extra_env: dict[str, str] | None = None
) -> list[subprocess.Popen[str]]:
    """Start one process per rank running ``script`` (dedented); the caller must end them."""
    path = workdir / "rank_script.py"
    path.write_text(textwrap.dedent(script))
    port = free_port()
    procs = []
    for r in range(world_size):
        procs.append(
            subprocess.Popen(
                [sys.executable, str(path)],
                env=rank_env(r, world_size, port, extra_env),
                cwd=str(workdir),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        )
    return procs


def kill_all(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def finish(procs: list[subprocess.Popen[str]], timeout: float) -> list[RankResult]:
    """Wait for all ranks (bounded), kill stragglers, and collect their output."""
    deadline = time.monotonic() + timeout
    results = []
    try:
        for r, p in enumerate(procs):
            remaining = max(0.1, deadline - time.monotonic())
            try:
                out, err = p.communicate(timeout=remaining)
            except subprocess.TimeoutExpired:
                kill_all(procs)
                out, err = p.communicate()
            results.append(RankResult(r, p.returncode, out, err))
    finally:
        kill_all(procs)
    return results


def run_job(
    script: str,
    world_size: int,
    workdir: Path,
    timeout: float = 60.0,
    extra_env: dict[str, str] | None = None,
) -> list[RankResult]:
    """Run ``script`` on ``world_size`` ranks and return each rank's result."""
    procs = start_ranks(script, world_size, workdir, extra_env)
    return finish(procs, timeout)


def assert_ok(results: list[RankResult]) -> None:
    for r in results:
        assert r.returncode == 0, f"rank {r.rank} exited {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr[-4000:]}"


def rank0_result(results: list[RankResult]) -> Any:
    """The JSON rank 0 printed after ``RESULT ``, once every rank has exited 0."""
    assert_ok(results)
    line = next(ln for ln in results[0].stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


# -- the reference demo (examples/hang_demo.py) under torchrun ---------------------
def reference_job(start: str, phase2: str, after_start: str = "") -> str:
    """The reference scenario as a 2-rank gloo job script on our communicator: three
    all_reduces and a broadcast, ``PHASE2 <phase2>`` printed, then rank 1 sleeps on the line
    marked ``# SLEEP_LINE`` instead of joining all_reduce #4. ``start``: the arguments of
    ``start_debug_server``; ``after_start``: a line run right after the communicator exists."""
    return f"""
import os, time
from datetime import timedelta
import torch
from debug_server.recording import comms, hooks
from debug_server import start_debug_server

rank = int(os.environ["RANK"])
h = start_debug_server({start})
comm = comms.new_comm("gloo", torch.device("cpu"), "main_comm", timeout=timedelta(seconds=80))
hooks.FlightRecorderHook(max_entries=100).register_with_comm(comm)
{after_start}
t = torch.ones(1024)
for _ in range(3):
    comm.all_reduce(t)
comm.broadcast(t, 0)
print("PHASE2", {phase2}, flush=True)
if rank == 1:
    time.sleep(80)  # SLEEP_LINE
else:
    comm.all_reduce(t)
"""


DEMO = REPO / "examples" / "hang_demo.py"


def demo_hang_line() -> int:
    """The line of the demo's sleep, which the dumps must point at."""
    for i, line in enumerate(DEMO.read_text().splitlines(), start=1):
        if "(HANG LINE)" in line:
            return i
    raise AssertionError("demo has no HANG LINE marker")


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc), children before their own children.

    torchrun starts each rank in a session of its own, so killing torchrun's process group
    leaves the ranks (and rank 0's frontend) running: end the whole tree by pid instead.
    """
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out: list[int] = []
    todo = list(children.get(pid, []))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def kill_tree(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL ``proc``'s process group and every descendant (ranks in their own sessions too)."""
    pids = descendants(proc.pid) if proc.poll() is None else []
    for target in (proc.pid, *pids):
        try:
            os.killpg(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            os.kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait(timeout=10)


def start_demo(dump_dir: Path, port: int, stdout: Any, **env: str) -> subprocess.Popen[str]:
    """Start the 2-rank demo in its own session (end it with ``os.killpg``); ``env`` overrides."""
    full = dict(
        os.environ, FR_DUMP_DIR=str(dump_dir), DEBUG_SERVER_PORT=str(port),
        PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **env,
    )
    full.pop("TORCHCOMM_FR_DUMP_TEMP_FILE", None)
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         f"--master-port={free_port()}", str(DEMO)],
        env=full, stdout=stdout, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )


# The one reference run every test of the reference scenario reads (conftest's ``reference_demo``):
# rank 1 sleeps HANG_SECONDS instead of joining all_reduce #4. The stall watchdog (3 s) reports
# well before rank 0's communicator times out (15 s), and rank 1 sleeps 7 s past that timeout,
# so the pages show the hang live for about 22 s after it starts (the finding stays while rank 1
# sleeps: rank 0's entry for seq 4 never completes).
REFERENCE_ENV = {"FR_DUMP_INTERVAL": "1", "FR_STALL_TIMEOUT": "3", "COMM_TIMEOUT": "15",
                 "HANG_SECONDS": "22"}


class ReferenceDemo:
    """The reference demo started once: its live frontend while it hangs, then its dumps.

    ``wait_hung`` returns the frontend's URL once rank 1 is missing from all_reduce #4 (the
    demo must still be running); ``wait_done`` waits for the demo's end and returns its output.
    ``close`` ends the whole process tree by pid.
    """

    def __init__(self, workdir: Path) -> None:
        self.dump_dir = workdir / "dumps"
        self.log = workdir / "demo.log"
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self._log_file = open(self.log, "w")  # noqa: SIM115 - closed in close()
        self.proc = start_demo(self.dump_dir, self.port, self._log_file, **REFERENCE_ENV)
        self._hung = False

    def _tail(self) -> str:
        return self.log.read_text()[-4000:]

    def wait_hung(self, limit_s: float = 90.0) -> str:
        """The live frontend's base URL, once its FR analysis has rank 1 missing from seq 4."""
        deadline = time.monotonic() + limit_s
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"the reference demo is no longer running (exit {self.proc.returncode}); a "
                    f"test of the live hang ran after it ended:\n{self._tail()}")
            if self._hung:
                return self.base
            assert time.monotonic() < deadline, f"no hang seen in {limit_s:g} s:\n{self._tail()}"
            try:
                body = get_json(f"{self.base}/fr_trace?format=json", timeout=5)
                self._hung = any(f["kind"] == "missing_ranks" and f["seq"] == 4
                                 for f in body["findings"])
            except (OSError, ValueError, KeyError):
                pass  # not serving yet
            if not self._hung:
                time.sleep(0.5)

    def wait_done(self, limit_s: float = 150.0) -> str:
        """The demo's whole output, once it has exited 0 (bounded; killed on overrun)."""
        try:
            self.proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc)
            raise AssertionError(
                f"the reference demo ran past {limit_s:g} s:\n{self._tail()}") from None
        self._log_file.flush()
        out = self.log.read_text()
        assert self.proc.returncode == 0, out[-6000:]
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            kill_tree(self.proc)  # torchrun, both ranks (own sessions), the frontend
        self._log_file.close()


def run_demo(dump_dir: Path, timeout: float = 150, **env: str) -> str:
    """Run the demo to its end (bounded, killed by process group) and return its output."""
    proc = start_demo(dump_dir, free_port(), subprocess.PIPE, **env)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    assert proc.returncode == 0, out[-6000:]
    return out
