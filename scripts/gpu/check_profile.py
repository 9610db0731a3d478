"""GPU check of /profile, /wait_counters and /tcpstore on 2 GPUs with NCCL (run by scripts/gpu/run.sh).

    torchrun --nproc_per_node=2 --master-port=P scripts/gpu/check_profile.py OUTDIR PORT

Both ranks run a loop of matmuls on a side stream overlapping an all_reduce, each step synced;
rank 0 asks its own frontend for a 2-second profile of both ranks and checks that it came back
merged (one process per rank, kernels of both ranks) with GPU shares that make sense: NCCL
kernels counted as communication, GEMMs as compute, communication > 0 on both ranks. It writes
the report and the merged trace to OUTDIR, prints one PASS/FAIL line per goal, and exits 1 if any
goal failed (torchrun then exits non-zero).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
import urllib.request

import torch
import torch.distributed as dist

from debug_server import start_debug_server


def _get(url: str, timeout: float = 90) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url), timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def check(base: str, out: str, results: list[tuple[bool, str]]) -> None:
    def goal(ok: bool, what: str) -> None:
        results.append((bool(ok), what))

    try:
        status, body = _get(f"{base}/profile?duration=2&format=json")
        goal(status == 200, f"/profile answers 200 (got {status}: {body[:200]!r})")
        report = json.loads(body)
        with open(os.path.join(out, "profile_report.json"), "w") as f:
            json.dump(report, f, indent=1)
        goal(report["ranks_profiled"] == [0, 1],
             f"both ranks profiled: {report['ranks_profiled']} {report['not_profiled']}")
        for row in report["ranks"]:
            r = row["rank"]
            goal(row["gpu"] and row["comm_kernels"] > 0 and row["kernels"] > row["comm_kernels"],
                 f"rank {r}: NCCL and compute kernels seen ({row['comm_kernels']} of "
                 f"{row['kernels']} kernels are communication)")
            goal(0 < row.get("comm_frac", 0) < 1 and 0 < row.get("compute_frac", 0) < 1
                 and row.get("overlap_frac", -1) >= 0
                 and abs(row["comm_frac"] - row["overlap_frac"] - row["exposed_frac"]) < 2e-3,
                 f"rank {r}: shares consistent: {json.dumps(row)}")
        status, body = _get(f"{base}{report['trace_url']}")
        with open(os.path.join(out, "profile_merged.trace.json"), "wb") as f:
            f.write(body)
        trace = json.loads(body)
        kernels: dict[int, int] = {}
        for e in trace["traceEvents"]:
            if e.get("cat") == "kernel":
                kernels[e["pid"]] = kernels.get(e["pid"], 0) + 1
        goal(sorted(kernels) == [0, 1], f"merged trace has kernels of pid 0 and 1: {kernels}")
        status, body = _get(f"{base}/wait_counters?format=json")
        wc = json.loads(body)
        goal(status == 200 and (wc.get("ranks") == [0, 1] or not wc.get("available")),
             f"/wait_counters: a column per rank or one reason: {str(wc)[:300]}")
        status, body = _get(f"{base}/tcpstore?format=json")
        keys = [k["key"] for k in json.loads(body).get("keys", [])]
        goal("debug_server/rank1" in keys, f"/tcpstore lists debug_server/rank1: {keys[:8]}")
    except Exception as e:  # a failed goal, reported like the others
        goal(False, f"check raised {type(e).__name__}: {e}")


def main() -> int:
    out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/gpu_profile_check"
    port = int(sys.argv[2]) if len(sys.argv) > 2 else 25997
    os.makedirs(out, exist_ok=True)
    rank = int(os.environ["RANK"])
    # GPU_CHECK_DEVICE=cpu: a dry run of the flow on gloo (its kernel goals fail: no GPU).
    cpu = os.environ.get("GPU_CHECK_DEVICE") == "cpu"
    if not cpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("gloo" if cpu else "nccl")
    start_debug_server(port=port, fetch_timeout=10, stall_timeout=None)
    dev = torch.device("cpu" if cpu else "cuda")
    n = 256 if cpu else 2048
    a = torch.randn(n, n, device=dev)
    grad = torch.randn((64 if cpu else 16 * 1024) * 1024, device=dev)
    side = None if cpu else torch.cuda.Stream()
    stop = torch.zeros(1, device=dev)
    results: list[tuple[bool, str]] = []
    checker = None
    if rank == 0:
        checker = threading.Thread(target=check, args=(f"http://127.0.0.1:{port}", out, results))
    deadline = time.time() + 150
    step = 0
    while time.time() < deadline:
        with contextlib.nullcontext() if side is None else torch.cuda.stream(side):
            for _ in range(4):
                a = torch.tanh(a @ a / n)
        dist.all_reduce(grad)  # on the default stream, concurrent with the side stream's GEMMs
        if not cpu:
            torch.cuda.synchronize()
        step += 1
        if checker is not None and step == 20:
            checker.start()
        if checker is not None and step > 20 and not checker.is_alive():
            stop.fill_(1)
        dist.all_reduce(stop)
        if stop.item() > 0:
            break
    if rank == 0:
        for ok, what in results:
            print(f"{'PASS' if ok else 'FAIL'}: {what}", flush=True)
        if not results:
            print("FAIL: the check never ran (deadline)", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if rank != 0 or (results and all(ok for ok, _ in results)) else 1


if __name__ == "__main__":
    sys.exit(main())
