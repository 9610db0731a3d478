"""GPU check: a healthy DDP job's end is as quiet with the debug server as without it (issue 39).

    PYTHONPATH=. python scripts/gpu/check_quiet_exit.py OUTDIR [--steps 40] [--port P]
                                                  [--master-port P]
    python scripts/gpu/check_quiet_exit.py OUTDIR --cpu      # the same on gloo, to try it without GPUs

Runs one job twice under ``torchrun --nproc_per_node=2``: without ``start_debug_server``, then
with it (dumps every 2 s into OUTDIR/server/dumps). Each rank: ``init_process_group("nccl")``, a
small transformer layer under DDP, ``--steps`` steps, ``barrier()`` and
``destroy_process_group()``; with the server, rank 0 first waits until the frontend has read both
ranks through the store (its store client and its polls are what made a job's end noisy).

Prints the lines the server's run added to the job's output, c10d's C++ trace lines in it, and
how long the frontend (and every other process of the job: found in ``/proc`` by the job's
``MASTER_PORT``) outlived torchrun. Exits 1 when more than 3 lines were added (the two start
lines and the finish line), on any C++ trace line, when a process of the job outlived torchrun
by 2 s, or when either run did not exit 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request
from pathlib import Path
from typing import NamedTuple

from gpucommon import (
    added_lines,
    cpp_traces,
    free_ports,
    kill_job,
    outlived,
    start_torchrun,
    verdict,
)

MAX_ADDED = 3
"""The frontend's start line, rank 0's "pages at" line, the frontend's finish line."""
LINGER_S = 2.0


def _wait_frontend_read_both(port: int, limit_s: float = 120.0) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/?format=json", timeout=10) as r:
                if json.loads(r.read())["reachable"] == 2:
                    return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.2)


def rank_main(out: Path, steps: int, port: int, server: bool, cpu: bool) -> None:
    """One rank of the job; prints nothing of its own."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    local = int(os.environ["LOCAL_RANK"])
    device = torch.device("cpu") if cpu else torch.device("cuda", local)
    if not cpu:
        torch.cuda.set_device(device)
    if server:
        from debug_server import start_debug_server

        start_debug_server(port=port, dump_dir=str(out / "dumps"), dump_interval=2.0)
    dist.init_process_group("gloo" if cpu else "nccl")
    if server and dist.get_rank() == 0:
        _wait_frontend_read_both(port)
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=256, nhead=8, dim_feedforward=1024,
                                             batch_first=True).to(device)
    model = DDP(layer, device_ids=None if cpu else [local])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        loss = model(torch.randn(8, 64, 256, device=device)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    if not cpu:
        torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()


class JobRun(NamedTuple):
    code: int
    lines: list[str]
    lived: float | None
    """How long the job's last process (the frontend, with the server) outlived torchrun; None
    when some were still alive ``10 * LINGER_S`` later (then killed)."""
    left: list[str]
    took: float


def run_job(out: Path, args: argparse.Namespace, server: bool) -> JobRun:
    """The job once, with or without the server, its output in ``out/job.log``."""
    out.mkdir(parents=True, exist_ok=True)
    argv = [str(out), "--steps", str(args.steps), "--port", str(args.port),
            *(["--server"] if server else []), *(["--cpu"] if args.cpu else [])]
    t0 = time.monotonic()
    job, log = start_torchrun(__file__, out, argv, args.master_port,
                              {"GPU_QUIET_EXIT_RANK": "1"})
    try:
        code = job.wait(timeout=args.limit)
    except Exception:
        kill_job(job)
        raise
    finally:
        log.close()
    ended = time.monotonic()
    lived, left = outlived(args.master_port, ended, 10 * LINGER_S)
    return JobRun(code, (out / "job.log").read_text().splitlines(), lived, left, ended - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--port", type=int, default=0, help="the frontend's port (0: a free one)")
    ap.add_argument("--master-port", type=int, default=0, help="0: a free one")
    ap.add_argument("--limit", type=float, default=300.0, help="seconds each run may take")
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU instead of NCCL on 2 GPUs")
    ap.add_argument("--server", action="store_true", help=argparse.SUPPRESS)  # a rank's own
    args = ap.parse_args()
    free_ports(args)
    if os.environ.get("GPU_QUIET_EXIT_RANK"):
        rank_main(args.out, args.steps, args.port, args.server, args.cpu)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    failures: list[str] = []
    runs = {}
    for server in (False, True):  # the same ports twice: nothing of the first may hold them
        name = "server" if server else "bare"
        r = runs[name] = run_job(args.out / name, args, server)
        lived = f"more than {10 * LINGER_S:g} s" if r.lived is None else f"{r.lived:.2f} s"
        print(f"{name}: torchrun exit {r.code} after {r.took:.1f} s; "
              f"{'the frontend and ' if server else ''}the job's processes outlived it by {lived}")
        if r.code != 0:
            failures.append(f"the job {name} exited {r.code}")
        if r.lived is None or r.lived > LINGER_S:
            failures.append(f"the job {name} left processes running {LINGER_S:g} s after "
                            f"torchrun returned: {r.left or 'gone later'}")
    added = added_lines(runs["server"].lines, runs["bare"].lines)
    traces = cpp_traces(runs["server"].lines)
    print(f"lines the server added ({len(added)}, at most {MAX_ADDED}):")
    for ln in added:
        print(f"  + {ln}")
    print(f"C++ trace lines in the server's run: {len(traces)}")
    if len(added) > MAX_ADDED:
        failures.append(f"{len(added)} lines added to the job's output (at most {MAX_ADDED})")
    if traces:
        failures.append(f"{len(traces)} C++ trace lines, the first: {traces[0][:160]}")
    return verdict(failures, args.out / "server",
                   f"a healthy DDP job's end adds {len(added)} lines with the server, no C++ "
                   f"trace, and nothing of it outlives torchrun by {LINGER_S:g} s")


if __name__ == "__main__":
    sys.exit(main())
