"""Diagnosis (issue 31): an overlapped step on our communicator against bare torch on a group of
its own, by how the default group was initialised. One job per call, under torchrun:

    torchrun --nproc_per_node=2 scripts/gpu/step_by_init_mode.py --init newcomm --profile OUT/a

``--init``: ``newcomm`` (new_comm initialises the default group), ``lazy`` (the user's
init_process_group without device_id), ``eager`` (with device_id). ``--ours-eager``: ours' group
made with ``device_id`` (eager) whatever the default. ``--plain``: no communicator of ours, two
bare groups (``g1`` made first, ``g2`` second) to see whether creation order alone matters.
``--first``: the variant whose first collective runs first (lazy NCCL communicators are created
then). Prints paired medians against ``bare_group`` (or ``g2``), and with ``--profile`` a kernel
summary per variant from torch.profiler on rank 0 (NCCL kernel names, grids, streams, durations).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

MIB = 1024 * 1024 // 4


def step(ar: Any, a: torch.Tensor, b: torch.Tensor, buckets: list[torch.Tensor]) -> float:
    t0 = time.perf_counter()
    x = a
    works = []
    for bucket in buckets:
        x = x @ b
        works.append(ar(bucket, async_op=True))
    for w in works:
        w.wait()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def summarize(trace: Path) -> dict[str, Any]:
    ev = json.loads(trace.read_text()).get("traceEvents", [])
    kern = [e for e in ev if e.get("cat") == "kernel"]
    by: dict[str, list[float]] = defaultdict(list)
    streams: dict[str, set[int]] = defaultdict(set)
    grids: dict[str, set[str]] = defaultdict(set)
    for e in kern:
        name = e.get("name", "")
        cls = name[:60] if "nccl" in name.lower() else ("gemm" if ("gemm" in name.lower() or "sm90" in name) else name[:40])
        by[cls].append(float(e.get("dur", 0)))
        streams[cls].add(int(e.get("args", {}).get("stream", -1)))
        grids[cls].add(str(e.get("args", {}).get("grid")))
    waits = [e for e in ev if e.get("name") in ("cudaStreamWaitEvent", "cudaEventRecord")]
    return {cls: {"n": len(d), "median_us": round(statistics.median(d), 1), "sum_us": round(sum(d), 1),
                  "streams": sorted(streams[cls]), "grids": sorted(grids[cls])[:3]} for cls, d in by.items()} | {
        "_runtime_waits": len(waits)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--init", choices=["newcomm", "lazy", "eager"], default="newcomm")
    ap.add_argument("--ours-eager", action="store_true")
    ap.add_argument("--plain", action="store_true")
    ap.add_argument("--first", default="")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profile", default="")
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    dev = torch.device("cuda", local)
    torch.cuda.set_device(dev)
    to = datetime.timedelta(seconds=120)
    if args.init == "lazy":
        dist.init_process_group("nccl", timeout=to)
    elif args.init == "eager":
        dist.init_process_group("nccl", timeout=to, device_id=dev)
    from debug_server.config import Settings
    from debug_server.recording.comms import Comm, new_comm
    from debug_server.recording.groups import _c10d_backed
    from debug_server.recording.hooks import FlightRecorderHook
    variants: dict[str, Any] = {}
    if args.plain:
        if not dist.is_initialized():
            dist.init_process_group("nccl", timeout=to)
        ranks = list(range(dist.get_world_size()))
        g1 = dist.new_group(ranks, backend="nccl")
        g2 = dist.new_group(ranks, backend="nccl")
        variants["g1"] = lambda t, async_op: dist.all_reduce(t, group=g1, async_op=async_op)
        variants["g2"] = lambda t, async_op: dist.all_reduce(t, group=g2, async_op=async_op)
        base = "g2"
    else:
        if args.ours_eager:
            if not dist.is_initialized():
                dist.init_process_group("nccl", timeout=to)
            ranks = list(range(dist.get_world_size()))
            pg = dist.new_group(ranks, backend="nccl", device_id=dev, group_desc="bench")
            settings = Settings.from_env()  # as new_comm reads them
            comm = Comm(pg, "bench", "nccl", dev, ranks, datetime.timedelta(minutes=10), False,
                        c10d_backed=_c10d_backed("nccl", settings), settings=settings)
        else:
            comm = new_comm("nccl", dev, "bench")
        FlightRecorderHook(max_entries=2000).register_with_comm(comm)
        ranks = list(range(dist.get_world_size()))
        bare_pg = dist.new_group(ranks, backend="nccl")
        variants["ours"] = comm.all_reduce
        variants["bare_group"] = lambda t, async_op: dist.all_reduce(t, group=bare_pg, async_op=async_op)
        variants["bare_ours"] = lambda t, async_op: dist.all_reduce(t, group=comm.process_group, async_op=async_op)
        base = "bare_group"
    a = torch.randn(2048, 2048, device=dev)
    b = torch.randn(2048, 2048, device=dev) / 45
    buckets = [torch.ones(16 * MIB, device=dev) for _ in range(4)]
    names = list(variants)
    if args.first in variants:
        names.remove(args.first)
        names.insert(0, args.first)
    for v in names:  # warm-up, the first variant's communicator made first
        for _ in range(5):
            step(variants[v], a, b, buckets)
    per: dict[str, list[float]] = {v: [] for v in names}
    rnd = random.Random(31)
    for _ in range(args.rounds):
        cur: dict[str, list[float]] = {v: [] for v in names}
        for _ in range(args.steps):
            order = list(names)
            rnd.shuffle(order)
            for v in order:
                cur[v].append(step(variants[v], a, b, buckets))
        for v in names:
            per[v].append(statistics.median(cur[v]))
    prof_out: dict[str, Any] = {}
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        for v in names:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
                for _ in range(5):
                    step(variants[v], a, b, buckets)
            if rank == 0:
                Path(args.profile).mkdir(parents=True, exist_ok=True)
                tr = Path(args.profile) / f"trace_{v}.json"
                p.export_chrome_trace(str(tr))
                prof_out[v] = summarize(tr)
    dist.barrier()
    if rank == 0:
        med = {v: round(statistics.median(x), 4) for v, x in per.items()}
        paired = {v: round(statistics.median(o / bb for o, bb in zip(per[v], per[base], strict=True)), 4)
                  for v in names if v != base}
        print(f"RESULT {json.dumps({'args': vars(args), 'world': dist.get_world_size(), 'ms': med, 'paired_vs_' + base: paired})}")
        for v, s in prof_out.items():
            print(f"PROFILE {v} {json.dumps(s)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
