"""Rank 0 leaves early and the pages stay: a 2x2 mesh on 4 GPUs whose ranks 0 and 2 finish
(uneven data) or are killed while ranks 1 and 3 hang in their tensor-parallel all_reduce.

Launched the way ``srun`` launches a job: one process per rank, none the parent of another (a
rank that ends does not end the others), rank 0 hosting the job's TCPStore at
``MASTER_ADDR:MASTER_PORT`` (so the store goes with rank 0). Every rank: ``start_debug_server``
with periodic dumps, ``new_comm`` ("main_comm", 4 ranks) with a ``FlightRecorderHook``, split
into ``tp`` [0, 1] / [2, 3] and ``dp`` [0, 2] / [1, 3]; phase 1: one all_reduce on each. Phase 2:
ranks 0 and 2 leave (``--rank0 exit``: a normal exit, as when a rank runs out of data;
``--rank0 kill``: SIGKILL, as the OOM killer), ranks 1 and 3 all_reduce on their ``tp`` group,
which their partners never join.

Checked ``READ_AT`` s (default 8) after rank 0 left, on rank 0's frontend:

* ``/`` answers, shows rank 0 as gone (``status: gone``, how it ended where /proc tells);
* ``/fr_trace?format=json`` names rank 0 missing from tp [0, 1] and rank 2 from tp [2, 3],
  with rank 0's last FR data still among the ranks with data;
* once ranks 1 and 3 are ended, the frontend exits by itself within ``DEBUG_SERVER_ORPHAN_EXIT_S``
  (set to 5 here) plus 30 s.

    python scripts/gpu/check_rank0_gone.py OUTDIR                  # NCCL, 4 GPUs
    python scripts/gpu/check_rank0_gone.py OUTDIR --backend gloo   # the same logic on CPU

Exit status 0 when every check passed, 1 otherwise (each check prints PASS/FAIL and why).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpucommon import REPO, free_ports, get

from debug_server.readers.jobpids import fate

WORLD = 4
ORPHAN_EXIT_S = 5.0


def rank_main(backend: str, port: int, dump_dir: str, mode: str) -> int:
    import datetime

    import torch

    from debug_server import start_debug_server
    from debug_server.recording.comms import new_comm
    from debug_server.recording.hooks import FlightRecorderHook

    rank = int(os.environ["RANK"])
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    h = start_debug_server(port=port if rank == 0 else 0, dump_dir=dump_dir, dump_interval=2.0,
                           fetch_timeout=3.0)
    comm = new_comm(backend, device, "main_comm", timeout=datetime.timedelta(seconds=120))
    FlightRecorderHook(max_entries=200).register_with_comm(comm)
    tp = comm.split([0, 1] if rank < 2 else [2, 3], "tp")
    dp = comm.split([0, 2] if rank % 2 == 0 else [1, 3], "dp")
    t = torch.ones(1024, device=device)
    for c in (comm, tp, dp):
        c.all_reduce(t)
    if backend == "nccl":
        torch.cuda.synchronize()
    print(f"READY {rank} {os.getpid()} {h.frontend_url}", flush=True)
    if rank in (0, 2):
        # The driver says when the pages hold every rank's data (the frontend's first lookups
        # and dump cycle): then the early leavers go.
        while not os.path.exists(os.path.join(dump_dir, "go")):
            time.sleep(0.1)
        print(f"LEAVING {rank} {time.time()}", flush=True)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(0)  # skip the process group's teardown, as a rank out of data that returns
    try:
        tp.all_reduce(t)  # the partner (rank 0 or 2) never joins
        if backend == "nccl":
            torch.cuda.synchronize()
    except RuntimeError as e:
        # gloo sees the partner's socket close and fails the op; NCCL keeps waiting. Either
        # way this rank stays, as a hung rank does.
        print(f"OP FAILED {rank}: {str(e).splitlines()[0][:200]}", flush=True)
    time.sleep(120)
    return 0


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return out


def _gone(pid: int) -> bool:
    """Ended (a zombie counts: its parent has not reaped it yet)."""
    return fate(pid, None) is not None


def _wait_line(log: Path, prefix: str, proc: subprocess.Popen[bytes], limit: float) -> str | None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith(prefix):
                return line
        if proc.poll() is not None and prefix != "LEAVING":
            return None
        time.sleep(0.2)
    return None


def check(name: str, ok: bool, detail: Any, results: list[bool]) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    results.append(ok)


def driver(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dump_dir = out / "dumps"
    env = {**os.environ, "WORLD_SIZE": str(WORLD), "LOCAL_WORLD_SIZE": str(WORLD),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(args.master_port),
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH"))
                                         if p),
           "DEBUG_SERVER_ORPHAN_EXIT_S": str(ORPHAN_EXIT_S), "OMP_NUM_THREADS": "1"}
    procs: list[subprocess.Popen[bytes]] = []
    logs = [out / f"rank{r}.log" for r in range(WORLD)]
    results: list[bool] = []
    frontend = None
    try:
        for r in range(WORLD):
            with logs[r].open("wb") as f:
                procs.append(subprocess.Popen(
                    [sys.executable, __file__, "--rank-main", "--backend", args.backend,
                     "--port", str(args.port), "--dump-dir", str(dump_dir), "--rank0", args.rank0],
                    env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=f,
                    stderr=subprocess.STDOUT, start_new_session=True))
        ready = [_wait_line(logs[r], "READY", procs[r], 180) for r in range(WORLD)]
        if not all(ready):
            check("job starts", False, [logs[r].read_text()[-2000:] for r in range(WORLD)
                                        if not ready[r]], results)
            return 1
        base = ready[0].split()[3]  # type: ignore[union-attr]
        frontend = next(iter(_children(int(ready[0].split()[2]))), None)  # type: ignore[union-attr]
        deadline = time.monotonic() + 120
        while True:  # every rank on the pages, with FR data, before anyone leaves
            status, text = get(f"{base}/fr_trace?format=json", accept="application/json")
            if status == 200 and len(json.loads(text)["ranks_with_data"]) == WORLD:
                break
            if time.monotonic() > deadline:
                check("pages hold every rank before rank 0 leaves", False, text[:500], results)
                return 1
            time.sleep(1)
        time.sleep(2.5)  # one more dump cycle (dump_interval 2 s): every rank's stacks on disk
        (dump_dir / "go").touch()
        left = _wait_line(logs[0], "LEAVING", procs[0], 60)
        if left is None:
            check("rank 0 leaves", False, logs[0].read_text()[-2000:], results)
            return 1
        time.sleep(max(0.0, float(left.split()[2]) + args.read_at - time.time()))
        status, text = get(f"{base}/?format=json", accept="application/json")
        check(f"/ answers {args.read_at:.0f} s after rank 0 left", status == 200, status, results)
        if status == 200:
            rows = {r["rank"]: r for r in json.loads(text)["ranks"]}
            check("rank 0 shown as gone", rows[0]["status"] == "gone", rows[0]["line"], results)
            check("rank 2 shown as gone", rows[2]["status"] == "gone", rows[2]["line"], results)
        status, text = get(f"{base}/fr_trace?format=json", accept="application/json")
        if status == 200:
            fr = json.loads(text)
            missing = sorted((f["ranks"], f["group"]) for f in fr["findings"]
                             if f["kind"] == "missing_ranks")
            named = {r for ranks, _ in missing for r in ranks}
            check("verdict names ranks 0 and 2 missing from their tp all_reduce",
                  {0, 2} <= named and all(r in (0, 2) for r in named),
                  f"{missing}; verdict: {fr.get('verdict')}", results)
            check("rank 0's last FR data kept", 0 in fr["ranks_with_data"],
                  fr["ranks_with_data"], results)
        else:
            check("/fr_trace answers", False, f"{status} {text[:300]}", results)
        (out / "fr_trace_after_rank0.txt").write_text(get(f"{base}/fr_trace")[1])
        (out / "stacks_after_rank0.txt").write_text(get(f"{base}/stacks")[1])
        for r in (1, 3):
            os.killpg(procs[r].pid, signal.SIGKILL)
        ended = time.monotonic()
        while frontend is not None and not _gone(frontend) and time.monotonic() - ended < \
                ORPHAN_EXIT_S + 30:
            time.sleep(0.5)
        check("frontend exits by itself once the job is gone",
              frontend is not None and _gone(frontend),
              f"{time.monotonic() - ended:.1f} s after the last ranks ended", results)
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(10)
        if frontend is not None and not _gone(frontend):
            os.kill(frontend, signal.SIGKILL)
    print(f"{sum(results)}/{len(results)} checks passed; logs and pages in {out}")
    return 0 if results and all(results) else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", default="/tmp/gpu_check_rank0_gone")
    p.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    p.add_argument("--rank0", default="exit", choices=("exit", "kill"),
                   help="how ranks 0 and 2 leave: a normal exit, or SIGKILL")
    p.add_argument("--port", type=int, default=0, help="rank 0's frontend port (0: a free one)")
    p.add_argument("--master-port", type=int, default=0, help="0: a free one")
    p.add_argument("--read-at", type=float, default=8.0)
    p.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dump-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    free_ports(args)
    if args.rank_main:
        return rank_main(args.backend, args.port, args.dump_dir, args.rank0)
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
