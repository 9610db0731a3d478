"""Run a real multi-process torch.distributed job for a test: one subprocess per rank.

Each rank runs the given script text with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set, as torchrun
would. Every process is bounded by ``timeout`` and killed by pid in a ``finally``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


# -- the reference demo (scripts/verify_flight_recorder.py) under torchrun ---------------------
DEMO = REPO / "scripts" / "verify_flight_recorder.py"


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
