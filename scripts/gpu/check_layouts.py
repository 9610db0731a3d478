"""GPU check: the right culprit on real layouts (issue 33), on 4 GPUs with NCCL.

    PYTHONPATH=. python scripts/gpu/check_layouts.py OUTDIR [--cases fsdp mesh pipeline]
    python scripts/gpu/check_layouts.py OUTDIR --cpu     # the same on gloo, to try the logic

Each case runs ``torchrun --nproc_per_node=4`` on this script: plain ``torch.distributed`` and
``start_debug_server`` only (no communicator of ours, no hook), and rank 2 misbehaves once:

* ``fsdp``: FSDP2 (``fully_shard`` per layer) of a small MLP; at step 3 rank 2 stalls in its data
  loader (``load_batch``), so it never joins the step's first all_gather;
* ``mesh``: ``init_device_mesh(..., (2, 2), mesh_dim_names=("dp", "tp"))``; after 3 steps rank 2
  skips one tp all_reduce in a conditional branch, then every rank does a dp all_reduce and a
  final barrier (rank 3's dp op is stuck behind the tp op rank 2 never joined);
* ``pipeline``: 4 stages sending activations by ``send``/``recv`` on a ``pp`` group, dp groups
  [0, 1] and [2, 3]; at step 3 stage 2 never sends to stage 3 and goes on to its dp all_reduce.

While the job hangs the driver reads the live ``/fr_trace?format=json``, waits for the hang
report, and, once c10d's watchdog times out (``TORCH_NCCL_DUMP_ON_TIMEOUT=1``: every rank dumps
its NCCL Flight Recorder), runs ``python -m debug_server.fr_trace`` on c10d's own dumps (on
``--cpu``: on the pickles the workers write on request, gloo has no dump on timeout). Each must
lead with rank 2, name its group by desc (``default_pg``, ``mesh_tp``, ``pp``), and name rank
2's line (the CLI has no stacks: it names the line of the op rank 2 went on to, where the FR has
one); category ``cpu_divergence``, never GPU/network advice. Exit 0 when every case passed.

Environment: ``DEBUG_SERVER_PORT``, ``MASTER_PORT`` (unset: free ports), ``READ_AT`` (s into the
hang, 12), ``COMM_TIMEOUT`` (s, 45).
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpucommon import REPO, cpu_pickles, end_job, env_port, get, run_cli, show, wait_path

WORLD = 4
CULPRIT = 2
DESC = {"fsdp": "default_pg", "mesh": "mesh_tp", "pipeline": "pp"}
SKIP_STEP = 3


def _lines() -> dict[str, int]:
    """The lines rank 2 is found at: marked ``# AT <case>`` below."""
    text = Path(__file__).read_text().splitlines()
    return {ln.rsplit("# AT ", 1)[1].strip(): i for i, ln in enumerate(text, 1) if "# AT " in ln
            and not ln.lstrip().startswith(("return", '"'))}


# ---------------------------------------------------------------------------------------------
# One rank (run by torchrun)


def _hang_started(out: Path) -> None:
    if int(os.environ["RANK"]) == 0:
        (out / "hang_started.part").write_text(str(time.time()))
        (out / "hang_started.part").rename(out / "hang_started")


def load_batch(step: int, device: Any) -> Any:
    import torch

    if step == SKIP_STEP and int(os.environ["RANK"]) == CULPRIT:
        time.sleep(3600)  # AT fsdp
    return torch.randn(8, 256, device=device)


def case_fsdp(out: Path, device: Any, sync: Any) -> None:
    import torch
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]).to(device)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(SKIP_STEP + 1):
        if step == SKIP_STEP:
            _hang_started(out)
        loss = model(load_batch(step, device)).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        sync()


def case_mesh(out: Path, device: Any, sync: Any) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("dp", "tp"))
    tp, dp = mesh.get_group("tp"), mesh.get_group("dp")
    rank = dist.get_rank()
    t = torch.ones(1024, device=device)
    for step in range(SKIP_STEP + 1):
        if step == SKIP_STEP:
            _hang_started(out)
        for k in range(4):
            if not (step == SKIP_STEP and k == 3 and rank == CULPRIT):  # rank 2 skips one
                dist.all_reduce(t, group=tp)
        dist.all_reduce(t, group=dp)
        sync()
    dist.barrier()  # AT mesh


def case_pipeline(out: Path, device: Any, sync: Any) -> None:
    import torch
    import torch.distributed as dist

    pp = dist.new_group(list(range(WORLD)), group_desc="pp")
    dps = [dist.new_group([0, 1], group_desc="dp"), dist.new_group([2, 3], group_desc="dp")]
    rank = dist.get_rank()
    dp = dps[rank // 2]
    act = torch.ones(4096, device=device)
    for step in range(SKIP_STEP + 2):
        if step == SKIP_STEP:
            _hang_started(out)
        if rank > 0:
            dist.recv(act, src=rank - 1, group=pp)
        if rank < WORLD - 1 and not (step == SKIP_STEP and rank == CULPRIT):
            dist.send(act, dst=rank + 1, group=pp)
        # One line, so that rank 2's CPU is at this line whether it waits in the all_reduce
        # (gloo) or in the step's synchronize (NCCL); the FR frames of the op say it too.
        dist.all_reduce(act, group=dp); sync()  # noqa: E702 # AT pipeline


def rank_main(case: str, out: Path, cpu: bool) -> None:
    import torch
    import torch.distributed as dist

    from debug_server import start_debug_server

    local = int(os.environ["LOCAL_RANK"])
    # torchrun starts each rank in its own session: the driver ends it (and the frontend it
    # spawned) by this process group.
    (out / f"pid{os.environ['RANK']}").write_text(str(os.getpgrp()))
    timeout = datetime.timedelta(seconds=float(os.environ.get("COMM_TIMEOUT", "45")))
    # torch's own function, not a wrapper here: a rank waiting in it is at the caller's line.
    sync: Any = torch.cuda.synchronize
    if cpu:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
        sync = type(None)  # gloo's collectives block already: nothing to wait for
    else:
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    server = start_debug_server(port=int(os.environ["DEBUG_SERVER_PORT"]),
                                dump_dir=str(out / "dumps"), dump_interval=3600, stall_timeout=4)
    server.wait_registered(60)
    if dist.get_rank() == 0:
        (out / "frontend").write_text(server.frontend_url)
    {"fsdp": case_fsdp, "mesh": case_mesh, "pipeline": case_pipeline}[case](out, device, sync)
    time.sleep(3600)


# ---------------------------------------------------------------------------------------------
# The driver


def check(where: str, result: dict[str, Any], case: str, line: int | None) -> list[str]:
    """What is wrong with one verdict: it must lead with rank 2 in the case's group and line."""
    order, findings = result.get("finding_order") or [], result.get("findings") or []
    if not order:
        return [f"{case} {where}: no finding ({result.get('verdict', '')[:200]})"]
    f = findings[order[0]]
    verdict = result.get("verdict", "")
    problems = []
    if f.get("ranks") != [CULPRIT]:
        problems.append(f"{case} {where}: the first finding names ranks {f.get('ranks')}")
    if DESC[case] not in str(f.get("group_label")) or not verdict.startswith(f"Rank {CULPRIT} "):
        problems.append(f"{case} {where}: the headline does not lead with rank {CULPRIT} on "
                        f"{DESC[case]}: {verdict[:200]}")
    if line is not None and f"{Path(__file__).name}:{line}" not in verdict:
        problems.append(f"{case} {where}: line {line} not named")
    if result.get("category") != "cpu_divergence":
        problems.append(f"{case} {where}: category {result.get('category')!r}")
    if "suspect the GPU" in verdict:
        problems.append(f"{case} {where}: GPU/network advice")
    return problems


def _live(case: str, work: Path, job: subprocess.Popen[Any], line: int) -> list[str]:
    """The live page READ_AT s into the hang, then the hang report."""
    if not (wait_path(work / "hang_started", job, 240) and wait_path(work / "frontend", job, 10)):
        return [f"{case}: the job never reached the hang (see {work / 'job.log'})"]
    base = (work / "frontend").read_text()
    t0 = float((work / "hang_started").read_text())
    time.sleep(max(0.0, t0 + float(os.environ.get("READ_AT", "12")) - time.time()))
    code, body = get(f"{base}/fr_trace?format=json", timeout=60)
    (work / "live_fr_trace.json").write_text(body)
    if code != 200:
        return [f"{case}: live /fr_trace answered {code}: {body[:200]}"]
    live = json.loads(body)
    show(f"{case}: live /fr_trace {time.time() - t0:.1f} s into the hang", live)
    problems = check("live", live, case, line)
    deadline = time.monotonic() + 30
    while not (reports := sorted(glob.glob(str(work / "dumps" / "hang_report_*.json")))):
        if time.monotonic() > deadline:
            return problems + [f"{case}: no hang report in {work / 'dumps'}"]
        time.sleep(0.5)
    rep = json.loads(Path(reports[-1]).read_text())
    rep = {**rep, **(rep.get("analysis") or {})}  # the report keeps the whole analysis result
    show(f"{case}: hang report", rep)
    return problems + check("hang report", rep, case, line)


def _cli(case: str, trace_dir: Path, work: Path, line: int | None) -> list[str]:
    pm, why = run_cli(trace_dir, work, REPO)
    if pm is None:
        return [f"{case}: {why}"]
    show(f"{case}: python -m debug_server.fr_trace {trace_dir}", pm)
    return check("CLI", pm, case, line)


def run_case(case: str, out: Path, cpu: bool, port: int, master_port: int) -> list[str]:
    work = out / case
    work.mkdir(parents=True, exist_ok=True)
    for p in ["hang_started", "frontend", *(f"pid{r}" for r in range(WORLD))]:
        (work / p).unlink(missing_ok=True)
    c10d_dir = work / "c10d"
    c10d_dir.mkdir(exist_ok=True)
    line = _lines()[case]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1",
               DEBUG_SERVER_PORT=str(port), TORCH_NCCL_DUMP_ON_TIMEOUT="1",
               TORCH_FR_BUFFER_SIZE="2000", TORCH_NCCL_TRACE_BUFFER_SIZE="2000",
               TORCH_FR_DUMP_TEMP_FILE=str(c10d_dir / "rank_"),
               TORCH_NCCL_DEBUG_INFO_TEMP_FILE=str(c10d_dir / "rank_"))
    env.pop("TORCHCOMM_FR_DUMP_TEMP_FILE", None)
    args = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}",
            f"--master-port={master_port}", __file__, str(out),
            "--rank-main", case] + (["--cpu"] if cpu else [])
    with open(work / "job.log", "w") as log:
        job = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        problems = _live(case, work, job, line)
        if cpu and (work / "frontend").exists():
            trace_dir = cpu_pickles(work)
        else:
            # c10d's watchdog times out, every rank dumps its FR, the job aborts.
            limit = float(os.environ.get("COMM_TIMEOUT", "45")) + 120
            try:
                job.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                problems.append(f"{case}: the job did not end within {limit:.0f} s")
            trace_dir = c10d_dir
    finally:
        end_job(job, work)
    # Without stacks the CLI names the line of the op rank 2 went on to (mesh, pipeline) from
    # its FR frames; a rank stalled outside any collective (fsdp) has no op to name, and the
    # pickles the gloo workers write carry no frames for c10d's entries.
    return problems + _cli(case, trace_dir, work, None if case == "fsdp" or cpu else line)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--cases", nargs="+", choices=sorted(DESC), default=None,
                   help="default: all three; on --cpu fsdp and mesh (c10d's gloo recorder has "
                        "no send/recv entries, so the pipeline's skipped send is not in its FR)")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU (no dump on timeout)")
    p.add_argument("--rank-main", metavar="CASE", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_main:
        rank_main(args.rank_main, args.out / args.rank_main, args.cpu)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    if args.cases is None:
        args.cases = ["fsdp", "mesh"] if args.cpu else ["fsdp", "mesh", "pipeline"]
        problems: list[str] = []
    for i, case in enumerate(args.cases):
        problems += run_case(case, args.out, args.cpu, env_port("DEBUG_SERVER_PORT", i),
                             env_port("MASTER_PORT", i))
    print(f"outputs in {args.out}")
    if problems:
        print("FAILED:\n  " + "\n  ".join(problems))
        return 1
    print(f"OK: {', '.join(args.cases)}: rank {CULPRIT}, its group and line named live, in the "
          "hang report and by the CLI")
    return 0


if __name__ == "__main__":
    sys.exit(main())
