"""GPU check: a DDP job on 2 GPUs (NCCL) where rank 1 skips a step's backward.

    PYTHONPATH=. python scripts/gpu/check_ddp_skipped_backward.py OUTDIR [--port P] [--master-port P]
    python scripts/gpu/check_ddp_skipped_backward.py OUTDIR --cpu      # the same on gloo, to try it without GPUs

Starts ``torchrun --nproc_per_node=2`` on this script. Each rank: ``init_process_group("nccl")``,
``start_debug_server`` (dumps every 2 s, stall timeout 4 s), a communicator ``main_comm`` with a
hook (3 all_reduce), then a tiny DDP model; in step 1 rank 1 sleeps instead of ``backward()``, so
rank 0's gradient all_reduce on ``default_pg`` never completes. Only c10d's NCCL Flight Recorder
sees the DDP ops. While it hangs this checks, and exits 1 naming what failed:

1. the live verdict (``/fr_trace?format=json``) names rank 1, all_reduce, the seq on default_pg
   (rank 1's own last enqueued + 1) and rank 1's sleep line;
2. rank 0's merged record has main_comm's ops once (c10d recorded them too, on its own group);
3. a hang report is written from c10d's progress alone (no hook watches DDP's ops);
4. PyTorch's fr_trace reads the dumper's merged pickles and reports the same seq.

The processes are killed by process group at the end (the hang never ends by itself).
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from gpucommon import check_parser, free_ports, kill_job, publish, start_torchrun, verdict


def skip_backward(seconds: float) -> None:
    time.sleep(seconds)  # SKIP LINE


def rank_main(out: Path, port: int, cpu: bool) -> None:
    import torch
    import torch.distributed as dist
    from torch._C import _distributed_c10d as c10d
    from torch.nn.parallel import DistributedDataParallel as DDP

    from debug_server import start_debug_server
    from debug_server.recording.comms import new_comm
    from debug_server.recording.hooks import FlightRecorderHook

    rank = int(os.environ["RANK"])
    local = int(os.environ["LOCAL_RANK"])
    backend = "gloo" if cpu else "nccl"
    device = torch.device("cpu") if cpu else torch.device("cuda", local)
    # c10d's recorder of this backend's ops (gloo's is the CPU one).
    c10d_json = c10d._dump_fr_trace_json if cpu else c10d._dump_nccl_trace_json
    if not cpu:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=300))
    server = start_debug_server(port=port, dump_dir=str(out / "dumps"), dump_interval=2,
                                stall_timeout=4)
    server.wait_registered(30)
    publish(out / f"worker{rank}", server.worker_url)
    if rank == 0:
        publish(out / "frontend", server.frontend_url or "")
    comm = new_comm(backend, device, "main_comm", timeout=300)
    hook = FlightRecorderHook(max_entries=100).register_with_comm(comm)
    for _ in range(3):
        comm.all_reduce(torch.ones(16, device=device))
    if not cpu:
        torch.cuda.synchronize()
    time.sleep(1.0)  # c10d's watchdog marks them completed
    recorded = json.loads(c10d_json(True, False))
    copies = [e["collective_seq_id"] for e in recorded.get("entries", [])
              if e["process_group"][1] == "main_comm"]
    publish(out / f"c10d_main_comm{rank}", json.dumps(copies))
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 4).to(device), device_ids=None if cpu else [local])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        loss = model(torch.randn(4, 8, device=device)).sum()
        if rank == 1 and step == 1:
            status = json.loads(c10d_json(False, False))["pg_status"]["0"]
            publish(out / "rank1_last_enqueued", str(status["last_enqueued_collective"]))
            skip_backward(600)
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"[rank {rank}] step {step} loss {loss.item():.4f}", flush=True)
    hook.unregister()


_JOB: list[subprocess.Popen[bytes]] = []


def _wait(path: Path, limit_s: float) -> str:
    deadline = time.monotonic() + limit_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} not written within {limit_s:g} s")
        if _JOB and _JOB[0].poll() is not None:
            raise RuntimeError(f"the job exited (code {_JOB[0].returncode}) before writing {path.name}")
        time.sleep(0.2)
    return path.read_text()


def _get(url: str, method: str = "GET") -> Any:
    req = urllib.request.Request(url, method=method, headers={"Accept": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read().decode())


def check(out: Path) -> list[str]:
    """Run the four checks against the running job; returns the failures."""
    failures: list[str] = []
    frontend = _wait(out / "frontend", 180)
    seq = int(_wait(out / "rank1_last_enqueued", 120)) + 1
    # The first match is skip_backward's sleep, at the top of this file.
    skip_line = next(i for i, ln in enumerate(Path(__file__).read_text().splitlines(), 1)
                     if "SKIP LINE" in ln)
    print(f"rank 1 skipped backward; expected: rank 1 missing from all_reduce #{seq} on default_pg")

    result: dict[str, Any] = {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        t0 = time.monotonic()
        result = _get(f"{frontend}/fr_trace?format=json")
        took = time.monotonic() - t0
        if any(f["kind"] == "missing_ranks" for f in result["findings"]):
            break
        time.sleep(1)
    (out / "live_fr_trace.json").write_text(json.dumps(result, indent=1))
    print(f"1. live verdict (GET /fr_trace?format=json took {took:.2f} s): {result.get('verdict')}")
    missing = [(f["group"], f["seq"], f["op"], f["ranks"]) for f in result.get("findings", [])
               if f["kind"] == "missing_ranks"]
    if missing[:1] != [("0", seq, "all_reduce", [1])]:
        failures.append(f"live findings {missing}, expected [('0', {seq}, 'all_reduce', [1])]")
    for want in (f"Rank 1 never joined all_reduce #{seq} on pg 0 (default_pg)",
                 f"{Path(__file__).name}:{skip_line} in skip_backward"):
        if want not in str(result.get("verdict")):
            failures.append(f"live verdict lacks {want!r}")

    worker0 = _wait(out / "worker0", 10)
    merged = _get(f"{worker0}/handler/torchcomms_fr_trace_json", "POST")
    ours = [(e["process_group"][0], e["collective_seq_id"]) for e in merged["entries"]
            if e["process_group"][0] == "main_comm"]
    dup = [k for k, c in merged["pg_config"].items() if c.get("desc") == "main_comm"]
    copies = json.loads(_wait(out / "c10d_main_comm0", 10))
    print(f"2. main_comm in rank 0's merged record: {ours}; c10d's own copies (dropped): seqs "
          f"{copies}; c10d groups left with desc main_comm: {dup}")
    if ours != [("main_comm", s) for s in (0, 1, 2)] or dup or copies != [1, 2, 3]:
        failures.append("main_comm's ops are not exactly once in the merged record "
                        f"(ours {ours}, c10d copies {copies}, leftover groups {dup})")

    dumps = out / "dumps"
    deadline = time.monotonic() + 60
    while not list(dumps.glob("hang_report_*.json")) and time.monotonic() < deadline:
        time.sleep(0.5)
    reports = sorted(dumps.glob("hang_report_*.json"))
    if not reports:
        failures.append("no hang report within 60 s")
    else:
        time.sleep(0.5)
        report = json.loads(reports[0].read_text())
        stalled = {h["rank"]: h["stalled_op"] for h in report["health"] if h["stalled_op"]}
        print(f"3. hang report {reports[0].name}: stalled {stalled}; verdict: {report['verdict']}")
        got = {r: (op["group"], op["seq"], op["op"]) for r, op in stalled.items()}
        if got.get(0) != ("0", seq, "all_reduce"):
            failures.append(f"hang report stalled ops {got}, expected rank 0 at ('0', {seq})")

    text = ""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
                               str(dumps / "per_rank"), "-p", "rank_"], capture_output=True,
                              text=True, timeout=120)
        text = proc.stdout + proc.stderr
        if f"sequence number: {seq}" in text:
            break
        time.sleep(2)
    (out / "pytorch_fr_trace.txt").write_text(text)
    print("4. PyTorch fr_trace on per_rank/: " + " | ".join(
        ln.strip() for ln in text.splitlines()
        if any(k in ln for k in ("sequence number", "missing ranks", "group info", "collective:"))))
    if f"Not all ranks joining collective, sequence number: {seq}" not in text:
        failures.append(f"PyTorch's fr_trace did not report seq {seq} on the merged pickles")
    return failures


def main() -> int:
    ap = check_parser(__doc__)
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU instead of NCCL on 2 GPUs")
    args = ap.parse_args()
    free_ports(args)
    if os.environ.get("GPU_CHECK_DDP_RANK"):
        rank_main(args.out, args.port, args.cpu)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    # What an earlier run left here would pass for this run's evidence.
    shutil.rmtree(args.out / "dumps", ignore_errors=True)
    for p in args.out.iterdir():
        if p.is_file():
            p.unlink()
    job, log = start_torchrun(__file__, args.out, [
        str(args.out), "--port", str(args.port), *(["--cpu"] if args.cpu else [])],
        args.master_port, {"GPU_CHECK_DDP_RANK": "1"})
    _JOB.append(job)
    try:
        failures = check(args.out)
    except Exception as e:  # the job died or never came up: say so, with its log
        failures = [f"{type(e).__name__}: {e}"]
    finally:
        kill_job(job)
        log.close()
    return verdict(failures, args.out, f"DDP hang on {'gloo' if args.cpu else 'NCCL'} diagnosed "
                   "live, in the hang report and by PyTorch's fr_trace")


if __name__ == "__main__":
    sys.exit(main())
