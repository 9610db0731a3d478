"""What c10d's start timing costs a real training step: a DDP transformer, timing off and on.

    python benchmarks/bench_timing_model.py --pairs 2            # 2 GPUs, NCCL
    python benchmarks/bench_timing_model.py --device cpu --layers 2 --pairs 1   # gloo, to try it

``start_debug_server`` sets ``TORCH_NCCL_ENABLE_TIMING=1`` (c10d records a start event per
collective, so the analysis can tell a GPU that never started its op). This runs the same job,
a ``--layers``-layer ``nn.TransformerEncoder`` under DDP (bf16 autocast, AdamW), with the
variable 0 (A) and 1 (B) as whole jobs in the order A B B A ..., and prints each job's median ms
per step and, per pair, B / A; the median of those is the figure. Exit 1 when it is over
``--max-ratio``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from torch.distributed.elastic.utils.distributed import get_free_port

TIMING_ENV = "TORCH_NCCL_ENABLE_TIMING"


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = int(os.environ["RANK"])
    if args.device == "cuda":
        dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    layer = torch.nn.TransformerEncoderLayer(args.width, 16, 4 * args.width, batch_first=True)
    model = DDP(torch.nn.TransformerEncoder(layer, args.layers).to(dev))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, args.seq, args.width, device=dev)
    times = []
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    if rank == 0:
        print("RESULT " + json.dumps({"median_ms": statistics.median(times)}), flush=True)
    dist.destroy_process_group()


def job(args: argparse.Namespace, timing: str, port: int) -> float:
    env = dict(os.environ, **{TIMING_ENV: timing}, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}",
           f"--master-port={port}", __file__, "--worker", "--device", args.device,
           "--layers", str(args.layers), "--width", str(args.width), "--seq", str(args.seq),
           "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        sys.exit(f"job failed ({TIMING_ENV}={timing}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return float(json.loads(lines[-1][7:])["median_ms"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--port", type=int, default=0, help="MASTER_PORT of the first job, the next one per job (0: a free one per job)")
    ap.add_argument("--max-ratio", type=float, default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    ratios = []
    n = 0
    for i in range(args.pairs):
        got = {}
        for v in ("01" if i % 2 == 0 else "10"):
            got[v] = job(args, v, args.port + n if args.port else get_free_port())
            n += 1
            print(f"  pair {i + 1}: {TIMING_ENV}={v}: {got[v]:.2f} ms/step", flush=True)
        ratios.append(got["1"] / got["0"])
    med = statistics.median(ratios)
    print(f"{args.layers}-layer DDP transformer, {args.nproc} ranks ({args.device}): timing on / off "
          f"{med:.3f} (pairs: {', '.join(f'{r:.3f}' for r in ratios)})")
    if args.max_ratio is not None and med > args.max_ratio:
        print(f"OVER the {args.max_ratio} budget")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
