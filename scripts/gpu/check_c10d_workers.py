"""GPU check: a hang on NCCL seen through torch's own C++ workers alone (no sidecar of ours).

    PYTHONPATH=. python scripts/gpu/check_c10d_workers.py OUTDIR [--master-port P]
    python scripts/gpu/check_c10d_workers.py OUTDIR --cpu    # the same on gloo, without GPUs

Starts ``torchrun --nproc_per_node=2`` on this script. Each rank: ``init_process_group("nccl")``,
torch's ``_WorkerServer`` registered in the job's store as torch's server registers it
(``debug_server/rank<N>``), 3 all_reduce on the default group; then rank 0 issues all_reduce #4,
which rank 1 never joins (it sleeps). c10d keeps NCCL's ops in its NCCL recorder
(``dump_nccl_trace_json``), not in the CPU one that ``fr_trace_json`` serves. A frontend attached
by store (``python -m debug_server.frontend --store ...``) must name rank 1 missing from
all_reduce #4 on pg 0 (``fanout.c10d_workers``), and each rank's NCCL recorder, asked
``onlyactive=true`` as the frontend's first round asks it, must vouch for its cut from #4 on
(``analysis.activecover``; else every page reads whole rings). Exits 1 naming what failed. ``--cpu``: gloo (only ``fr_trace_json``;
the NCCL handler answers 404), to try the check itself without GPUs.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from gpucommon import REPO, free_ports, get, publish


def skip_collective(seconds: float) -> None:
    time.sleep(seconds)  # SKIP LINE


def rank_main(out: Path, cpu: bool) -> None:
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import _WorkerServer

    from debug_server.protocol.addrs import url_key
    from debug_server.readers.storeview import store_client

    rank = int(os.environ["RANK"])
    device = torch.device("cpu") if cpu else torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    if not cpu:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if cpu else "nccl", timeout=datetime.timedelta(seconds=600))
    server = _WorkerServer("127.0.0.1", 0)
    store = store_client(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), 30)
    store.set(url_key(rank), f"http://127.0.0.1:{server.port}")
    for _ in range(3):
        dist.all_reduce(torch.ones(16, device=device))
    if not cpu:
        torch.cuda.synchronize()
    time.sleep(1.0)  # c10d's watchdog marks them completed
    if rank == 1:
        publish(out / "ready1", "1")
        skip_collective(600)
    dist.all_reduce(torch.ones(16, device=device), async_op=True)
    publish(out / "ready0", "1")
    time.sleep(600)


def _wait(path: Path, job: subprocess.Popen[bytes], limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} not written within {limit_s:g} s")
        if job.poll() is not None:
            raise RuntimeError(f"the job exited (code {job.returncode}) before {path.name}")
        time.sleep(0.2)


def _attach(master_port: int, out: Path) -> tuple[subprocess.Popen[bytes], str]:
    err = open(out / "frontend.log", "wb")  # noqa: SIM115 - the process owns it
    proc = subprocess.Popen(
        [sys.executable, "-m", "debug_server.frontend", "--store", f"127.0.0.1:{master_port}",
         "--world-size", "2", "--port", "0", "--host", "127.0.0.1", "--fetch-timeout", "10"],
        env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO, stdout=subprocess.PIPE,
        stderr=err, start_new_session=True)
    assert proc.stdout is not None
    first = proc.stdout.readline().decode()
    m = re.match(r"debug_server frontend: (http://127\.0\.0\.1:\d+)/", first)
    if m is None:
        raise RuntimeError(f"the attached frontend did not start: {first!r}")
    return proc, m.group(1)


def check(out: Path, job: subprocess.Popen[bytes], master_port: int,
          cpu: bool = False) -> list[str]:
    failures: list[str] = []
    _wait(out / "ready0", job, 240)
    _wait(out / "ready1", job, 10)
    frontend, base = _attach(master_port, out)
    try:
        result: dict[str, Any] = {}
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            status, body = get(f"{base}/fr_trace?format=json", "application/json")
            if status == 200:
                result = json.loads(body)
                if any(f["kind"] == "missing_ranks" for f in result["findings"]):
                    break
            time.sleep(2)
        (out / "fr_trace.json").write_text(json.dumps(result, indent=1))
        print(f"verdict: {result.get('verdict')}")
        print("ranks: " + "; ".join(f"{r['rank']} {r['status']} {r.get('error') or ''}"
                                    for r in result.get("ranks", [])))
        missing = [(f["group"], f["seq"], f["op"], f["ranks"]) for f in result.get("findings", [])
                   if f["kind"] == "missing_ranks"]
        if missing[:1] != [("0", 4, "all_reduce", [1])]:
            failures.append(f"findings {missing}, expected [('0', 4, 'all_reduce', [1])]")
        bad = [r for r in result.get("ranks", []) if r["status"] != "ok"]
        if bad:
            failures.append(f"ranks not read: {bad}")
        if not cpu:
            failures += _active_replies(master_port)
    finally:
        os.killpg(frontend.pid, signal.SIGKILL)
        frontend.wait(timeout=30)
    return failures


def _active_replies(master_port: int) -> list[str]:
    """Each rank's NCCL recorder asked ``onlyactive=true``, as the frontend's first round asks
    it: the reply must vouch for its cut from #4 on (``analysis.activecover``: pg_status and
    pg_config name the same groups, and it holds every op after the last completed one), or
    every page would ask every rank for its whole ring again."""
    from debug_server.protocol import activecover
    from debug_server.protocol.addrs import url_key
    from debug_server.readers.storeview import store_client

    store = store_client("127.0.0.1", master_port, 30)
    failures = []
    for rank in (0, 1):
        url = f"{store.get(url_key(rank)).decode()}/handler/dump_nccl_trace_json?onlyactive=true"
        try:
            with urllib.request.urlopen(urllib.request.Request(url, method="POST"),
                                        timeout=30) as r:
                reply = json.loads(r.read())
        except (OSError, ValueError) as e:
            failures.append(f"rank {rank}: {url}: {e}")
            continue
        facts = activecover.facts(reply)
        print(f"rank {rank} onlyactive: pg_status {reply.get('pg_status')}, pg_config keys "
              f"{sorted(reply.get('pg_config') or {})}, {len(reply.get('entries') or [])} "
              f"entries -> since {facts['since']}")
        if facts["since"] != {"0": 4}:
            failures.append(f"rank {rank}: its onlyactive reply vouches for {facts['since']}, "
                            "expected {'0': 4}")
    return failures


def _process_tree(pid: int) -> list[int]:
    """Every live descendant of ``pid``, from the kernel's child lists (``/proc/<pid>/task/*/
    children``), parents first."""
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop(0)
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{p}/task").iterdir():
                kids = [int(k) for k in (task / "children").read_text().split()]
                out += kids
                todo += kids
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--master-port", type=int, default=0, help="0: a free one")
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU instead of NCCL on 2 GPUs")
    args = ap.parse_args()
    free_ports(args)
    if os.environ.get("GPU_CHECK_C10D_RANK"):
        rank_main(args.out, args.cpu)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for p in args.out.iterdir():
        if p.is_file():
            p.unlink()
    env = dict(os.environ, GPU_CHECK_C10D_RANK="1", PYTHONPATH=str(REPO),
               TORCH_FR_BUFFER_SIZE="2000", TORCH_NCCL_TRACE_BUFFER_SIZE="2000",
               OMP_NUM_THREADS="1")
    log = open(args.out / "job.log", "w")  # noqa: SIM115 - closed in the finally below
    job = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         f"--master-port={args.master_port}", __file__, str(args.out),
         *(["--cpu"] if args.cpu else [])],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        failures = check(args.out, job, args.master_port, args.cpu)
    except Exception as e:  # the job died or never came up: say so, with its log
        failures = [f"{type(e).__name__}: {e}"]
    finally:
        # The hang never ends by itself; torchrun starts the ranks in sessions of their own.
        for pid in [job.pid, *_process_tree(job.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        job.wait(timeout=30)
        log.close()
    if not failures:
        print(f"PASS: a hang on {'gloo' if args.cpu else 'NCCL'} named through torch's own workers")
        return 0
    print("FAIL:", *failures, sep="\n  ")
    print("job log tail:", (args.out / "job.log").read_text()[-3000:], sep="\n")
    return 1


if __name__ == "__main__":
    sys.exit(main())
