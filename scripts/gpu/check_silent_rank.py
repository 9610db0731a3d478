"""GPU check: a rank that cannot answer, 2 GPUs (NCCL): rank 1 stops itself (SIGSTOP) at step 3.

    PYTHONPATH=. python scripts/gpu/check_silent_rank.py OUTDIR [--port P] [--master-port P]
    python scripts/gpu/check_silent_rank.py OUTDIR --cpu     # the same on gloo, to try it without GPUs

Starts ``torchrun --nproc_per_node=2`` on this script. Each rank: ``init_process_group``,
``start_debug_server`` (nothing else: the FR data is c10d's own recorder's), then a loop of
``all_reduce`` and a synchronize; at step 3 rank 1 sends itself SIGSTOP (as a debugger, or a
frozen cgroup, stops a process) while rank 0 goes on into the next all_reduce. Rank 1's worker
cannot answer; the frontend reads it from outside (py-spy, ``/proc``). This checks, reading
``/fr_trace?format=json`` from rank 0's frontend, and exits 1 naming what failed:

1. within ``--limit`` s the verdict names rank 1 as the missing rank, category
   ``cpu_divergence``, and its process (``ranks[].process``) is ``stopped``;
2. the verdict says it is stopped and names the line of the ``os.kill`` (``# STOP LINE``);
3. once it has been seen silent, ``/fr_trace`` and the overview answer within 1 s each.

The processes are killed by pid at the end.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpucommon import check_parser, free_ports, get, kill_job, publish, start_torchrun, verdict

STOP_STEP = 3
PAGE_S = 1.0
"""What a page may take while the rank is silent (issue 38)."""


def rank_main(out: Path, port: int, cpu: bool) -> None:
    import torch
    import torch.distributed as dist

    from debug_server import start_debug_server

    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device = torch.device("cpu") if cpu else torch.device("cuda", local)
    if not cpu:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if cpu else "nccl", timeout=datetime.timedelta(seconds=300))
    server = start_debug_server(port=port, dump_interval=3600, fetch_timeout=5.0)
    server.wait_registered(60)
    if rank == 0:
        publish(out / "frontend", server.frontend_url or f"http://127.0.0.1:{port}")
    t = torch.ones(1 << 20, device=device)
    for step in range(1000):
        if step == STOP_STEP and rank == 1:
            publish(out / "stopping", str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)  # STOP LINE
        dist.all_reduce(t)
        if not cpu:
            torch.cuda.synchronize()
        if (out / "stop").exists():
            break


def _stop_line() -> int:
    lines = Path(__file__).read_text().splitlines()
    return 1 + next(i for i, ln in enumerate(lines) if ln.endswith("# STOP LINE"))


def _fr(base: str) -> tuple[dict[str, Any], float]:
    t0 = time.monotonic()
    status, body = get(f"{base}/fr_trace?format=json")
    took = time.monotonic() - t0
    if status != 200:
        raise RuntimeError(f"/fr_trace?format=json answered {status}: {body[:300]}")
    return json.loads(body), took


def check(out: Path, job: subprocess.Popen[Any], limit_s: float) -> list[str]:
    deadline = time.monotonic() + limit_s
    while not (out / "frontend").exists() or not (out / "stopping").exists():
        if job.poll() is not None or time.monotonic() > deadline:
            return [f"the job never reached step {STOP_STEP} (exit {job.poll()})"]
        time.sleep(0.2)
    base = (out / "frontend").read_text().strip()
    failures: list[str] = []
    result: dict[str, Any] = {}
    while time.monotonic() < deadline:
        result, took = _fr(base)
        first = (result.get("findings") or [{}])[0]
        if result.get("category") == "cpu_divergence" and first.get("ranks") == [1]:
            break
        time.sleep(0.5)
    (out / "fr_trace.json").write_text(json.dumps(result, indent=1))
    print("verdict:", result.get("verdict"))
    print("category:", result.get("category"))
    first = (result.get("findings") or [{}])[0]
    if result.get("category") != "cpu_divergence" or first.get("ranks") != [1]:
        failures.append(f"no cpu_divergence verdict naming rank 1 within {limit_s:.0f} s: "
                        f"category {result.get('category')}, verdict {result.get('verdict')!r}")
    proc = next((r.get("process") for r in result.get("ranks", [])
                 if r.get("rank") == 1 and r.get("process")), None)
    print("rank 1 process:", proc)
    if not proc or proc.get("state") != "stopped":
        failures.append(f"rank 1's process is not read as stopped: {proc}")
    text = result.get("verdict") or ""
    if "its process is stopped" not in text or f"{Path(__file__).name}:{_stop_line()}" not in text:
        failures.append(f"the verdict does not say rank 1 is stopped at line {_stop_line()}: "
                        f"{text!r}")
    for path in ("/fr_trace?format=json", "/fr_trace", "/?format=json", "/"):
        t0 = time.monotonic()
        status, _ = get(base + path, accept="text/html")
        took = time.monotonic() - t0
        print(f"GET {path} while rank 1 is stopped: {status} in {took:.3f} s")
        if status != 200 or took > PAGE_S:
            failures.append(f"GET {path} answered {status} in {took:.3f} s (over {PAGE_S} s?)")
    return failures


def main() -> int:
    ap = check_parser(__doc__)
    ap.add_argument("--limit", type=float, default=120.0,
                    help="seconds for the job to start and the verdict to name rank 1")
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU instead of NCCL on 2 GPUs")
    args = ap.parse_args()
    free_ports(args)
    if os.environ.get("GPU_SILENT_RANK"):
        rank_main(args.out, args.port, args.cpu)
        return 0
    shutil.rmtree(args.out, ignore_errors=True)  # an earlier run's files would pass for ours
    args.out.mkdir(parents=True)
    job, log = start_torchrun(__file__, args.out, [
        str(args.out), "--port", str(args.port), *(["--cpu"] if args.cpu else [])],
        args.master_port, {"GPU_SILENT_RANK": "1", "OMP_NUM_THREADS": "1"})
    try:
        failures = check(args.out, job, args.limit)
    except Exception as e:  # the job died or never came up: say so, with its log
        failures = [f"{type(e).__name__}: {e}"]
    finally:
        (args.out / "stop").touch()
        kill_job(job)  # SIGKILL ends the stopped rank too
        log.close()
    return verdict(failures, args.out, "rank 1 stopped at step 3 named with its state and line "
                   f"({'gloo' if args.cpu else 'NCCL'}), pages within {PAGE_S:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
