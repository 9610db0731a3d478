"""Helpers shared by the GPU check drivers (``scripts/gpu_check_*.py``).

They run from the source tree on the GPU machine (``python scripts/gpu_check_x.py``, so this
folder is on ``sys.path``), with the standard library only: no pytest, no test helpers.
"""

from __future__ import annotations

import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any


def get(url: str, accept: str = "*/*", timeout: float = 60) -> tuple[int, str]:
    """(status, body) of a GET; status 0 and the reason when the server could not be read."""
    try:
        req = urllib.request.Request(url, headers={"Accept": accept})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except OSError as e:
        return 0, str(e)


def wait_for_mark(job: subprocess.Popen[Any], marker: Path, limit_s: float,
                  read_at: float) -> float | None:
    """The wall time a rank wrote into ``marker`` (when the hang began), after sleeping until
    ``read_at`` seconds past it; None when the job exits or ``limit_s`` pass before the mark."""
    started = time.monotonic()
    while not marker.exists():
        if job.poll() is not None or time.monotonic() - started > limit_s:
            return None
        time.sleep(0.2)
    t0 = float(marker.read_text())
    time.sleep(max(0.0, t0 + read_at - time.time()))
    return t0


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc), children before grandchildren."""
    import os

    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    # "pid (comm) state ppid ...": comm may hold spaces; split after its ")".
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    out, frontier = [], [pid]
    while frontier:
        kids = [c for c, p in parent.items() if p in frontier]
        out += kids
        frontier = kids
    return out


def kill_job(job: subprocess.Popen[Any]) -> None:
    """SIGKILL torchrun and every process under it: torchrun puts each rank in a session of its
    own, and rank 0 has the frontend, so its process group alone is not enough."""
    import os
    import signal

    for pid in [job.pid, *descendants(job.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    job.wait(timeout=30)


def start_torchrun(script: str, out: Path, argv: list[str], master_port: int,
                   env: dict[str, str]) -> tuple[subprocess.Popen[bytes], Any]:
    """``torchrun --nproc_per_node=2 script argv`` from the source tree, its output in
    ``out/job.log``, in a session of its own; returns the process and the open log."""
    import os
    import sys

    full = dict(os.environ, **env, PYTHONPATH=str(Path(script).resolve().parent.parent))
    log = open(out / "job.log", "w")  # noqa: SIM115 - the caller closes it
    job = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         f"--master-port={master_port}", script, *argv],
        env=full, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return job, log


def verdict(failures: list[str], out: Path, passed: str) -> int:
    """Print PASS or what failed (with the job log's tail); the exit code."""
    if failures:
        print("FAIL:\n  " + "\n  ".join(failures))
        print("job log tail:\n" + (out / "job.log").read_text()[-3000:])
        return 1
    print(f"PASS: {passed}")
    return 0


def publish(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole: a reader polling for the file never sees half of it."""
    tmp = path.with_suffix(".part")
    tmp.write_text(text)
    tmp.rename(path)


def show(where: str, result: dict[str, Any]) -> None:
    """Print one verdict as the checks' logs show it."""
    print(f"--- {where} ---\nverdict: {result.get('verdict', '')}")
    print(f"category: {result.get('category')}; next step: {result.get('next_step')}")


def wait_path(path: Path, job: subprocess.Popen[Any], limit_s: float) -> bool:
    """True once ``path`` exists; False when the job ends or ``limit_s`` pass first."""
    deadline = time.monotonic() + limit_s
    while not path.exists():
        if job.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def end_job(job: subprocess.Popen[Any], work: Path) -> None:
    """End torchrun and every rank (each in its own session, its pgid in ``work/pid<N>``)."""
    import os
    import signal

    groups = [job.pid] + [int(p.read_text()) for p in sorted(work.glob("pid[0-9]*"))]
    for g in groups:
        try:
            os.killpg(g, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    job.wait(10)


def cpu_pickles(work: Path) -> Path:
    """gloo has no dump on timeout: each worker writes its rank's pickle on request."""
    import json

    base = (work / "frontend").read_text()
    _, body = get(f"{base}/?format=json", accept="application/json")
    for r in json.loads(body)["ranks"]:
        subprocess.run(["curl", "-s", "-X", "POST", f"{r['url']}/handler/torchcomms_fr_dump_file"],
                       capture_output=True, check=True)
    return work / "dumps" / "per_rank"


def run_cli(trace_dir: Path, work: Path, repo: Path) -> tuple[dict[str, Any] | None, str]:
    """``python -m debug_server.tools.fr_trace DIR -p rank_ --json`` (its result, or None and
    why); the output is kept in ``work/cli.json``."""
    import json
    import os
    import sys

    cli = subprocess.run([sys.executable, "-m", "debug_server.tools.fr_trace", str(trace_dir),
                          "-p", "rank_", "--json", "--allow-incomplete-ranks"],
                         capture_output=True, text=True, cwd=repo, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(repo)))
    (work / "cli.json").write_text(cli.stdout)
    if cli.returncode != 2 or not cli.stdout.strip():
        return None, (f"CLI on {trace_dir} exit {cli.returncode} (want 2): "
                      f"{cli.stderr.strip()[-300:]}")
    return json.loads(cli.stdout), ""
