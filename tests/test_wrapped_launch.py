"""Ranks started the way clusters start them: each through its own wrapper process (``srun bash
-c '... python train.py'``, ``timeout 3600 python ...``), so the ranks are cousins, not
siblings. A rank holding the GIL in a C call is still read by py-spy from outside, because the
job (each rank's announcement in the store), not the process tree, says who its ranks are; a
pid no rank announced is refused in one line."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from httpget import post, timed_get
from jobscripts import FETCH_TIMEOUT, GIL_HOLDING_RANK, HOLD_S
from mpjob import REPO, descendants, free_port
from rankprocs import RankProcs

pytestmark = pytest.mark.job

# jobscripts' GIL-holding rank (start_debug_server, then a 8 s usleep holding the GIL on HOLD_RANK), each
# rank saying who it is, who its parent is and where its worker listens.
RANK = GIL_HOLDING_RANK.replace(
    'print("READY", os.getpid(), h.frontend_url, flush=True)',
    'print("READY", os.environ["RANK"], os.getpid(), os.getppid(), h.frontend_url, '
    'h.worker_url, flush=True)',
).replace("FETCH_TIMEOUT", repr(FETCH_TIMEOUT)).replace("HOLD_S", repr(HOLD_S))
assert "os.getppid()" in RANK

READY = re.compile(r"^READY (\d+) (\d+) (\d+) (\S+) (\S+)$", re.M)


def _wrapped(rank: int, argv: list[str]) -> list[str]:
    if rank % 2 == 0:  # bash runs the rank as its child (a command follows it: no exec)
        return ["bash", "-c", '"$0" "$@"; exit $?', *argv]
    return ["timeout", "120", *argv]


def _section(text: str, rank: int) -> str:
    return text.split(f"=== Rank {rank} ===", 1)[1].split("\n=== Rank ", 1)[0]


def _hold_and_read(log: Any, tmp: Path, base: str, hold_line: int, hold_rank: int) -> str:
    """Warm the frontend, start the hold, read /stacks; returns the held rank's section."""
    status, text, _ = timed_get(f"{base}/?format=json")
    assert status == 200, text
    worker = next(r["url"] for r in json.loads(text)["ranks"] if r["rank"] == hold_rank)
    (tmp / "go").touch()
    log.wait_for(r"^HOLDING")
    _wait_gil_held(worker)
    status, text, took = timed_get(f"{base}/stacks")
    print(f"/stacks answered in {took:.3f} s (fetch_timeout {FETCH_TIMEOUT} s)")
    assert status == 200 and took < FETCH_TIMEOUT + 1.5, (took, text)
    section = _section(text, hold_rank)
    assert "(py-spy: read from outside the process by the frontend; worker not answering)" \
        in section, section
    assert f'rank_script.py", line {hold_line} in <module>' in section, section
    return section


def _wait_gil_held(worker: str, limit_s: float = 30) -> None:
    """Until the rank is inside its GIL-holding call: its worker thread stops answering."""
    deadline = time.monotonic() + limit_s
    while True:
        try:
            post(f"{worker}/handler/ping", timeout=0.3)
        except OSError as e:  # a timeout, or urllib's URLError around one
            if isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError):
                return
            raise
        assert time.monotonic() < deadline, "the rank never held the GIL"
        time.sleep(0.05)


def _slept_full_length(text: str) -> None:
    slept = float(re.search(r"^SLEPT (\S+)", text, re.M).group(1))  # type: ignore[union-attr]
    print(f"usleep of {HOLD_S} s lasted {slept:.4f} s in the rank")
    assert slept >= HOLD_S - 0.005, f"usleep cut short: {slept:.4f} s of {HOLD_S} s"


class _Logs:
    def __init__(self, read: Any, alive: Any) -> None:
        self.read, self.alive = read, alive

    def wait_for(self, pattern: str, timeout: float = 60, count: int = 1) -> list[re.Match[str]]:
        deadline = time.monotonic() + timeout
        while len(found := list(re.finditer(pattern, self.read(), re.M))) < count:
            assert self.alive() and time.monotonic() < deadline, self.read()[-3000:]
            time.sleep(0.05)
        return found


@pytest.mark.timeout(90)
def test_gil_held_rank_under_per_rank_wrappers_is_read_by_the_frontend(
        tcp_store: Any, tmp_path: Path) -> None:
    def env(r: int) -> dict[str, str]:
        return {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "3",
                "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(tcp_store.port), "PYTHONPATH": str(REPO), "HOLD_RANK": "1"}

    job = RankProcs(tmp_path, RANK, 3, env, wrap=_wrapped)
    try:
        ready = {r: job.wait_for(r, READY.pattern) for r in range(3)}
        pids = {r: int(m.group(2)) for r, m in ready.items()}
        parents = {r: int(m.group(3)) for r, m in ready.items()}
        # Cousins: every rank has a wrapper of its own, none is the launcher's child.
        assert len(set(parents.values())) == 3 and pids[1] != job.procs[1].pid, ready
        base = ready[0].group(4)
        logs = _Logs(lambda: job.logs[1].read_text(), lambda: job.procs[1].poll() is None)
        _hold_and_read(logs, tmp_path, base, job.line_of("HOLD_LINE"), 1)
        # Another rank's worker reads it too (the way a host without the frontend is read) ...
        worker2 = ready[2].group(5)
        status, text = post(f"{worker2}/handler/pyspy_dump?nonblocking=1&pid={pids[1]}", timeout=20)
        assert status == 200 and f"line {job.line_of('HOLD_LINE')} in <module>" in text, text
        # ... but not a process no rank announced: rank 1's own wrapper, same user, same host.
        status, text = post(f"{worker2}/handler/pyspy_dump?nonblocking=1&pid={parents[1]}", timeout=20)
        assert (status, text) == (403, f"pid {parents[1]} was not announced by any rank of "
                                        "this job"), text
        logs.wait_for(r"^SLEPT", timeout=HOLD_S + 10)
        _slept_full_length(job.logs[1].read_text())
    finally:
        job.close()


@pytest.mark.timeout(120)
def test_gil_held_rank_under_torchrun_is_read_by_the_frontend(tmp_path: Path) -> None:
    script = tmp_path / "rank_script.py"
    script.write_text(RANK)
    hold_line = 1 + next(i for i, ln in enumerate(RANK.splitlines()) if "HOLD_LINE" in ln)
    log = tmp_path / "torchrun.log"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOLD_RANK": "1", "OMP_NUM_THREADS": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
             f"--master_port={free_port()}", "--master_addr=127.0.0.1", str(script)],
            env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    logs = _Logs(log.read_text, lambda: proc.poll() is None)
    try:
        ready = {int(m.group(1)): m for m in logs.wait_for(READY.pattern, count=2)}
        _hold_and_read(logs, tmp_path, ready[0].group(4), hold_line, 1)
        logs.wait_for(r"^SLEPT", timeout=HOLD_S + 10)
        _slept_full_length(log.read_text())
    finally:
        for pid in [*reversed(descendants(proc.pid)), proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(10)
