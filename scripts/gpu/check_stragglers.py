"""GPU check: a DDP job on 2 GPUs (NCCL) whose rank 1 gets a slow data loader while it trains.

    PYTHONPATH=. python scripts/gpu/check_stragglers.py OUTDIR [--port P] [--master-port P]
    python scripts/gpu/check_stragglers.py OUTDIR --cpu     # the same on gloo, to try it without GPUs

Starts ``torchrun --nproc_per_node=2`` on this script. Each rank: ``init_process_group``,
``start_debug_server`` (nothing else: the page comes from c10d's own recorder), a small DDP
model, and a training loop fed by a "data loader" that, on rank 1 only and once the checker
says so (a marker file), sleeps ``--slow-ms`` (40) per batch. Rank 0 records every step's time.
This checks, and exits 1 naming what failed:

1. while every rank is fast, ``/stragglers`` (JSON) checks DDP's group and names nobody, in
   several polls;
2. once rank 1 is slow, it is named on that group within 10 s, host side, with its median lag
   within 20 % of ``--slow-ms``; the overview says "Slow: rank 1 arrives last at ...";
3. the step time shows the cost: the median step of the slow phase is at least 0.8 x
   ``--slow-ms`` longer than the fast phase's.

The processes are killed by pid at the end.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpucommon import check_parser, free_ports, get, kill_job, publish, start_torchrun, verdict

NAMED_WITHIN_S = 10.0
FAST_STEPS = 60
"""Steps of the fast phase at least, before rank 1's loader is slowed (the step-time baseline)."""
JOB_LIMIT_S = 300.0


def load_batch(rank: int, out: Path, slow_s: float, device: Any) -> Any:
    """The data loader: rank 1 sleeps ``slow_s`` per batch once ``out/slow`` exists."""
    import torch

    if rank == 1 and (out / "slow").exists():
        time.sleep(slow_s)  # SLOW LOADER
    return torch.randn(32, 512, device=device)


def rank_main(out: Path, port: int, cpu: bool, slow_s: float) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from debug_server import start_debug_server

    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device = torch.device("cpu") if cpu else torch.device("cuda", local)
    if not cpu:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if cpu else "nccl", timeout=datetime.timedelta(seconds=120))
    server = start_debug_server(port=port, dump_interval=3600)
    server.wait_registered(30)
    if rank == 0:
        publish(out / "frontend", server.frontend_url or "")
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                    torch.nn.Linear(512, 8)).to(device),
                device_ids=None if cpu else [local])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    flag = torch.zeros(1, device=device)
    steps = open(out / f"steps{rank}.jsonl", "w")  # noqa: SIM115 - closed below
    end = time.monotonic() + JOB_LIMIT_S
    step = 0
    while time.monotonic() < end:
        if step % 10 == 0:  # every rank agrees on when to stop
            flag.fill_(float((out / "stop").exists()))
            dist.all_reduce(flag)
            if flag.item() > 0:
                break
        t0 = time.perf_counter()
        x = load_batch(rank, out, slow_s, device)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if not cpu:
            torch.cuda.synchronize()
        steps.write(json.dumps({"t": time.time(), "step_s": time.perf_counter() - t0,
                                "slow": (out / "slow").exists()}) + "\n")
        steps.flush()
        step += 1
    steps.close()
    print(f"[rank {rank}] {step} steps", flush=True)
    dist.destroy_process_group()


def _wait(what: str, limit_s: float, probe: Any, job: subprocess.Popen[bytes]) -> Any:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if job.poll() is not None:
            raise RuntimeError(f"the job exited (code {job.returncode}) before {what}")
        got = probe()
        if got:
            return got
        time.sleep(0.3)
    raise TimeoutError(f"{what}: not within {limit_s:g} s")


def _stragglers(frontend: str) -> dict[str, Any] | None:
    status, body = get(f"{frontend}/stragglers?format=json")
    return json.loads(body) if status == 200 else None


def _step_times(out: Path, slow: bool, since: float = 0.0) -> list[float]:
    rows = [json.loads(ln) for ln in (out / "steps0.jsonl").read_text().splitlines() if ln]
    return [r["step_s"] for r in rows if r["slow"] == slow and r["t"] >= since]


def check(out: Path, job: subprocess.Popen[bytes], slow_ms: float) -> list[str]:
    failures: list[str] = []
    frontend = _wait("the frontend's address", 180, lambda: (out / "frontend").exists()
                     and (out / "frontend").read_text(), job)
    res = _wait("a group checked", 120, lambda: (r := _stragglers(frontend))
                and r["groups_checked"] and r, job)
    fast = [res] + [_stragglers(frontend) or {} for _ in range(4)]
    named = [r.get("stragglers") for r in fast if r.get("stragglers")]
    print(f"1. fast phase: groups checked {res['groups_checked']}; named in 5 polls: {named}")
    if named:
        failures.append(f"a rank was named while every rank was fast: {named}")
    _wait(f"{FAST_STEPS} fast steps", 120, lambda: len(_step_times(out, slow=False)) >= FAST_STEPS,
          job)
    (out / "slow").touch()
    t0 = time.monotonic()
    slow_since = time.time()

    def named_with_lag() -> Any:
        r = _stragglers(frontend)
        s = r["stragglers"] if r else []
        return s and abs(s[0]["median_lag_ms"] - slow_ms) <= 0.2 * slow_ms and s

    try:
        got = _wait("rank 1 named with its lag", 60, named_with_lag, job)
    except TimeoutError as e:
        failures.append(str(e) + f" (last: {_stragglers(frontend)})")
        return failures
    took = time.monotonic() - t0
    print(f"2. named after {took:.1f} s: {got}")
    if took > NAMED_WITHIN_S:
        failures.append(f"rank 1 named with its lag after {took:.1f} s (> {NAMED_WITHIN_S} s)")
    if [(s["rank"], s["side"]) for s in got] != [(1, "host")]:
        failures.append(f"named {got}, expected rank 1 alone, host side")
    _, overview = get(f"{frontend}/?format=text")
    line = next((ln for ln in overview.splitlines() if ln.startswith("Slow: ")), None)
    print(f"   overview: {line}")
    if line is None or not line.startswith("Slow: rank 1 arrives last at"):
        failures.append("the overview has no 'Slow: rank 1 arrives last at' line")
    (out / "stragglers.txt").write_text(get(f"{frontend}/stragglers")[1])
    (out / "stragglers.html").write_text(get(f"{frontend}/stragglers", "text/html")[1])
    time.sleep(5)  # more slow steps
    base = _step_times(out, slow=False)
    slow = _step_times(out, slow=True, since=slow_since + 1.0)
    if len(base) < 20 or len(slow) < 20:
        failures.append(f"too few steps to compare ({len(base)} fast, {len(slow)} slow)")
        return failures
    fast_ms, slow_step_ms = statistics.median(base) * 1e3, statistics.median(slow) * 1e3
    print(f"3. median step on rank 0: {fast_ms:.1f} ms fast, {slow_step_ms:.1f} ms with rank 1's "
          f"loader slowed by {slow_ms:.0f} ms (+{slow_step_ms - fast_ms:.1f} ms; "
          f"{len(base)} and {len(slow)} steps)")
    if slow_step_ms - fast_ms < 0.8 * slow_ms:
        failures.append(f"the step time does not show the cost: +{slow_step_ms - fast_ms:.1f} ms")
    return failures


def main() -> int:
    ap = check_parser(__doc__)
    ap.add_argument("--slow-ms", type=float, default=40.0)
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU instead of NCCL on 2 GPUs")
    args = ap.parse_args()
    free_ports(args)
    if os.environ.get("GPU_CHECK_STRAGGLERS_RANK"):
        rank_main(args.out, args.port, args.cpu, args.slow_ms / 1e3)
        return 0
    shutil.rmtree(args.out, ignore_errors=True)  # an earlier run's files would pass for ours
    args.out.mkdir(parents=True)
    job, log = start_torchrun(__file__, args.out, [
        str(args.out), "--port", str(args.port), "--slow-ms", str(args.slow_ms),
        *(["--cpu"] if args.cpu else [])], args.master_port,
        {"GPU_CHECK_STRAGGLERS_RANK": "1", "OMP_NUM_THREADS": "1"})
    try:
        failures = check(args.out, job, args.slow_ms)
    except Exception as e:  # the job died or never came up: say so, with its log
        failures = [f"{type(e).__name__}: {e}"]
    finally:
        (args.out / "stop").touch()
        try:
            job.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        kill_job(job)
        log.close()
    return verdict(failures, args.out, "a slow data loader on rank 1 named on /stragglers "
                   f"({'gloo' if args.cpu else 'NCCL'}) and seen in the step time")


if __name__ == "__main__":
    sys.exit(main())
