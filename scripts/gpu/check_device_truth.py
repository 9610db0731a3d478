"""GPU check: where each GPU is (issue 37), with NCCL on 2 or 4 GPUs.

    PYTHONPATH=. python scripts/gpu/check_device_truth.py OUTDIR [--nproc 2|4] [--cases inversion busy]
    python scripts/gpu/check_device_truth.py OUTDIR --cpu --cases inversion   # gloo, to try the logic

Each case runs ``torchrun --nproc_per_node=N`` on this script: plain ``torch.distributed`` and
``start_debug_server`` (called before ``init_process_group``, so it turns c10d's start timing
on), and the culprit (rank 1 on 2 GPUs, rank 2 on 4) misbehaves at step 3:

* ``inversion``: two groups over all ranks, ``grad_sync`` then ``metrics`` every step; at step 3
  the culprit reduces ``metrics`` first (a dict iterated in another order on one rank). Every
  rank issued both; each GPU runs them in its own order, so neither completes;
* ``busy``: DDP-like all_reduce steps; at step 3 the culprit's GPU runs a long kernel
  (``torch.cuda._sleep``) before its all_reduce: its host issued the op, its GPU never starts it.

The driver reads the live ``/fr_trace?format=json`` while the job hangs, then, once c10d's
watchdog times out (``TORCH_NCCL_DUMP_ON_TIMEOUT=1``), runs ``python -m debug_server.fr_trace``
on c10d's own dumps. Both must name the culprit: ``order_inversion`` with category
``cpu_divergence`` for the inversion, category ``gpu_busy`` with the culprit as the rank whose
GPU did not start the op for the busy GPU, and never GPU/network advice. Exit 0 when all passed.

Environment: ``DEBUG_SERVER_PORT``, ``MASTER_PORT`` (unset: free ports), ``READ_AT`` (s into the
hang, 10), ``COMM_TIMEOUT`` (s, 30).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpucommon import REPO, cpu_pickles, end_job, env_port, get, run_cli, show, wait_path

STEP = 3
CASES = ("inversion", "busy")


def _culprit(world: int) -> int:
    return 1 if world == 2 else 2


# ---------------------------------------------------------------------------------------------
# One rank (run by torchrun)


def _hang_started(out: Path) -> None:
    if int(os.environ["RANK"]) == 0:
        (out / "hang_started.part").write_text(str(time.time()))
        (out / "hang_started.part").rename(out / "hang_started")


def case_inversion(out: Path, device: Any, sync: Any) -> None:
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    # new_group's own default timeout is 10 min, not init_process_group's: pass it on, so the
    # watchdog times these out (and dumps) as it does the default group.
    timeout = datetime.timedelta(seconds=float(os.environ.get("COMM_TIMEOUT", "30")))
    grad = dist.new_group(list(range(world)), group_desc="grad_sync", timeout=timeout)
    metrics = dist.new_group(list(range(world)), group_desc="metrics", timeout=timeout)
    t = torch.ones(1024, device=device)
    for step in range(STEP + 1):
        order = {"grad_sync": grad, "metrics": metrics}
        if step == STEP:
            _hang_started(out)
            if rank == _culprit(world):
                order = {"metrics": metrics, "grad_sync": grad}
        for g in order.values():
            dist.all_reduce(t, group=g)
        sync()


def case_busy(out: Path, device: Any, sync: Any) -> None:
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.randn(1024, 1024, device=device)
    for step in range(STEP + 1):
        if step == STEP:
            _hang_started(out)
            if rank == _culprit(world):
                torch.cuda._sleep(1 << 62)  # a kernel that runs for hours on this rank's GPU
        y = x @ x
        dist.all_reduce(y)
        sync()


def rank_main(case: str, out: Path, cpu: bool) -> None:
    import torch
    import torch.distributed as dist

    from debug_server import start_debug_server

    local = int(os.environ["LOCAL_RANK"])
    (out / f"pid{os.environ['RANK']}").write_text(str(os.getpgrp()))
    timeout = datetime.timedelta(seconds=float(os.environ.get("COMM_TIMEOUT", "30")))
    server = start_debug_server(port=int(os.environ["DEBUG_SERVER_PORT"]),
                                dump_dir=str(out / "dumps"), dump_interval=3600, stall_timeout=4)
    sync: Any = torch.cuda.synchronize
    if cpu:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
        sync = type(None)
    else:
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    server.wait_registered(60)
    if dist.get_rank() == 0:
        (out / "frontend").write_text(server.frontend_url)
    {"inversion": case_inversion, "busy": case_busy}[case](out, device, sync)
    time.sleep(3600)


# ---------------------------------------------------------------------------------------------
# The driver


def check(where: str, result: dict[str, Any], case: str, world: int) -> list[str]:
    """What is wrong with one verdict."""
    culprit = _culprit(world)
    order, findings = result.get("finding_order") or [], result.get("findings") or []
    verdict = result.get("verdict", "")
    if not order:
        return [f"{case} {where}: no finding ({verdict[:200]})"]
    f = findings[order[0]]
    problems = []
    if case == "inversion":
        if f.get("kind") != "order_inversion" or f.get("ranks") != [culprit]:
            problems.append(f"{case} {where}: first finding {f.get('kind')} ranks {f.get('ranks')}")
        if result.get("category") != "cpu_divergence":
            problems.append(f"{case} {where}: category {result.get('category')!r}")
    else:
        if result.get("category") != "gpu_busy" or f.get("not_started") != [culprit]:
            problems.append(f"{case} {where}: category {result.get('category')!r}, not started "
                            f"{f.get('not_started')}")
    if "suspect the GPU" in verdict:
        problems.append(f"{case} {where}: GPU/network advice")
    return problems


def _live(case: str, work: Path, job: subprocess.Popen[Any], world: int) -> list[str]:
    if not (wait_path(work / "hang_started", job, 240) and wait_path(work / "frontend", job, 30)):
        return [f"{case}: the job never reached the hang (see {work / 'job.log'})"]
    base = (work / "frontend").read_text()
    t0 = float((work / "hang_started").read_text())
    time.sleep(max(0.0, t0 + float(os.environ.get("READ_AT", "10")) - time.time()))
    problems: list[str] = []
    verdicts = set()
    for i in range(3):  # the same verdict on every read
        t = time.monotonic()
        code, body = get(f"{base}/fr_trace?format=json", timeout=60)
        if code != 200:
            return [f"{case}: live /fr_trace answered {code}: {body[:200]}"]
        (work / f"live_fr_trace_{i}.json").write_text(body)
        live = json.loads(body)
        verdicts.add(live.get("verdict"))
        if i == 0:
            show(f"{case}: live /fr_trace {time.time() - t0:.1f} s into the hang "
                  f"(answered in {time.monotonic() - t:.2f} s)", live)
            problems += check("live", live, case, world)
    if len(verdicts) != 1:
        problems.append(f"{case}: the live verdict changed between reads")
    return problems


def _cli(case: str, trace_dir: Path, work: Path, world: int) -> list[str]:
    pm, why = run_cli(trace_dir, work, REPO)
    if pm is None:
        return [f"{case}: {why}"]
    show(f"{case}: python -m debug_server.fr_trace {trace_dir}", pm)
    return check("CLI", pm, case, world)


def run_case(case: str, out: Path, world: int, cpu: bool, port: int, master_port: int) -> list[str]:
    work = out / f"{case}_{world}"
    work.mkdir(parents=True, exist_ok=True)
    for p in ["hang_started", "frontend", *(f"pid{r}" for r in range(world))]:
        (work / p).unlink(missing_ok=True)
    c10d_dir = work / "c10d"
    c10d_dir.mkdir(exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1",
               DEBUG_SERVER_PORT=str(port), TORCH_NCCL_DUMP_ON_TIMEOUT="1",
               TORCH_FR_DUMP_TEMP_FILE=str(c10d_dir / "rank_"),
               TORCH_NCCL_DEBUG_INFO_TEMP_FILE=str(c10d_dir / "rank_"))
    env.pop("TORCHCOMM_FR_DUMP_TEMP_FILE", None)
    env.pop("TORCH_NCCL_ENABLE_TIMING", None)  # start_debug_server turns it on
    args = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
            f"--master-port={master_port}", __file__, str(out / f"{case}_{world}"),
            "--rank-main", case] + (["--cpu"] if cpu else [])
    with open(work / "job.log", "w") as log:
        job = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        problems = _live(case, work, job, world)
        if cpu and (work / "frontend").exists():
            trace_dir = cpu_pickles(work)
        else:
            limit = float(os.environ.get("COMM_TIMEOUT", "30")) + 120
            deadline = time.monotonic() + limit
            while len(list(c10d_dir.glob("rank_*"))) < world and time.monotonic() < deadline:
                if job.poll() is not None and len(list(c10d_dir.glob("rank_*"))) < world:
                    break
                time.sleep(0.5)
            time.sleep(2)  # the last writer renames its file into place
            trace_dir = c10d_dir
    finally:
        end_job(job, work)
    return problems + _cli(case, trace_dir, work, world)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--nproc", type=int, nargs="+", default=[2], help="world sizes (2 and/or 4)")
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    p.add_argument("--cpu", action="store_true", help="gloo on CPU (inversion only)")
    p.add_argument("--rank-main", metavar="CASE", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_main:
        rank_main(args.rank_main, args.out, args.cpu)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    port = env_port("DEBUG_SERVER_PORT")
    master = env_port("MASTER_PORT")
    problems: list[str] = []
    i = 0
    for world in args.nproc:
        for case in args.cases:
            if args.cpu and case == "busy":
                continue
            problems += run_case(case, args.out, world, args.cpu, port + i, master + i)
            i += 1
    print(f"outputs in {args.out}")
    if problems:
        print("FAILED:\n  " + "\n  ".join(problems))
        return 1
    print("all device-truth cases passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
