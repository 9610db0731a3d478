"""Helpers shared by the GPU checks (``scripts/gpu/check_*.py``, run by ``scripts/gpu/run.sh``).

A check runs as ``python scripts/gpu/check_x.py`` (or under torchrun), so this folder is first on
``sys.path`` and ``from gpucommon import ...`` finds this module; the package comes from the
install, or from ``PYTHONPATH=.`` in the source tree on the GPU machine. Standard library only:
no pytest, no test helpers (``tests/quietjob.py`` uses the quiet-exit helpers too).
"""

from __future__ import annotations

import re
import subprocess
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
"""The source tree: the ranks a check starts import the package from it (``PYTHONPATH``)."""


def env_port(name: str, offset: int = 0) -> int:
    """The port in the environment variable ``name`` (plus ``offset``) where it is set, else a
    free one found now (torch's ``get_free_port``)."""
    import os

    if os.environ.get(name):
        return int(os.environ[name]) + offset
    from torch.distributed.elastic.utils.distributed import get_free_port

    return get_free_port()


def free_ports(args: Any) -> None:
    """Fill the ``port`` and ``master_port`` options left at 0 with free ports."""
    from torch.distributed.elastic.utils.distributed import get_free_port

    for name in ("port", "master_port"):
        if getattr(args, name, None) == 0:
            setattr(args, name, get_free_port())


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

    full = dict(os.environ, **env, PYTHONPATH=str(REPO))
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


# ---------------------------------------------------------------------------------------------
# What a job with the debug server printed and left beyond the same job without it (issue 39;
# check_quiet_exit.py, and tests/quietjob.py on CPU)

CPP_TRACE = ("TCPStore.cpp", "socket.cpp", "Exception raised from")
"""What c10d prints with each failed call of a store client."""

TORCHRUN_REPORT = re.compile(
    r"^\s*(exitcode|traceback|error_file|host|rank|time)\s*:|failed \(exitcode|"
    r"terminate called without an active exception")
"""torchrun's failure report, whose lines say how each rank died (a signal, an exit code) and
differ from run to run without the server too: gloo's threads at exit abort some runs with
SIGABRT ("terminate called without an active exception"), server or not."""


def job_pids(master_port: int) -> dict[int, str]:
    """pid -> command line of every process of ours whose environment names ``master_port``
    (a job's ranks, rank 0's frontend, an agent, py-spy: all inherit the ranks' environment)."""
    import os

    needle = f"MASTER_PORT={master_port}".encode()
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile, or not ours
            continue
        if cmd:  # a zombie has none: it is dead already
            out[int(entry)] = cmd
    return out


def outlived(master_port: int, ended: float, bound_s: float) -> tuple[float | None, list[str]]:
    """How long the job's last process outlived ``ended`` (``time.monotonic()`` when torchrun
    returned), and none left; or (None, their command lines) when some were still alive
    ``bound_s`` later, then killed by pid."""
    import os
    import signal

    last = 0.0
    while True:
        pids = job_pids(master_port)
        now = time.monotonic()
        if not pids:
            return last, []
        last = now - ended
        if last > bound_s:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return None, sorted(pids.values())
        time.sleep(0.05)


def _norm(line: str) -> str:
    # Times, pids, ports and the widths of torchrun's rules and traceback carets vary by run.
    return re.sub(r"([=\-^])\1+", r"\1", re.sub(r"\d+", "N", line)).strip()


TORCHRUN_FAILED = re.compile(r"api\.py:\d+\] failed \(exitcode")
"""torchrun's line that a rank failed: its report follows (then torchrun exits)."""


def job_lines(lines: list[str]) -> list[str]:
    """``lines`` without torchrun's failure report: after torchrun's "failed" line only ours
    (every line of ours names ``debug_server``) are kept, and the report's own lines nowhere.
    Which rank failed first and how differs from run to run, server or not."""
    out, reporting = [], False
    for ln in lines:
        reporting = reporting or bool(TORCHRUN_FAILED.search(ln))
        if TORCHRUN_REPORT.search(ln) or (reporting and "debug_server" not in ln):
            continue
        out.append(ln)
    return out


def added_lines(with_server: list[str], baseline: list[str]) -> list[str]:
    """The lines of ``with_server`` that ``baseline`` has no match for (``job_lines`` of
    both)."""
    base = Counter(_norm(ln) for ln in job_lines(baseline))
    out = []
    for ln in job_lines(with_server):
        key = _norm(ln)
        if base[key] > 0:
            base[key] -= 1
        else:
            out.append(ln)
    return out


def cpp_traces(lines: list[str]) -> list[str]:
    """The lines of c10d's C++ traces among ``lines``."""
    return [ln for ln in lines if any(m in ln for m in CPP_TRACE)]


def check_parser(doc: str) -> Any:
    """The arguments every job-driving check takes: ``OUT`` and the two ports (0: a free one)."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--port", type=int, default=0, help="0: a free one")
    ap.add_argument("--master-port", type=int, default=0, help="0: a free one")
    return ap
