"""What reading c10d's own Flight Recorder costs a job that never calls our communicators.

A DDP/FSDP job adds only ``start_debug_server()``: nothing of ours is on its op path, c10d
records every op itself, and our worker reads that record when asked. So the cost is the
worker's reads holding the GIL now and then: the health check (every <= 2 s, ``pg_status``
only), the live pages and the dump cycle (c10d's dump, merged with ours). This
runs a 1-rank group (gloo, or NCCL with ``--device cuda``) and times plain
``torch.distributed.all_reduce`` of 1024 floats in blocks, interleaved per round: with no debug
server, then with one running (frontend polling health, dumps every ``--dump-interval`` s),
then stopped again. Per mode: the median of per-block per-op times (the common op) and the mean
over all blocks (which includes every read that landed in a block). Then the reads themselves,
on a full 2000-entry ring.

    python benchmarks/bench_c10d_overhead.py [--device cpu|cuda] [--rounds R] [--seconds S]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.elastic.utils.distributed import get_free_port

from debug_server import start_debug_server, stop_debug_server
from debug_server.recording import c10d_fr, hooks
from debug_server.recording.stall import StallWatch

BLOCK = 200



def blocks(op: Callable[[], object], sync: Callable[[], None], seconds: float) -> list[float]:
    """Per-op microseconds of each BLOCK-op block, for about ``seconds``."""
    out = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sync()
        t0 = time.perf_counter()
        for _ in range(BLOCK):
            op()
        sync()
        out.append((time.perf_counter() - t0) / BLOCK * 1e6)
    return out


def timed_ms(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=4.0, help="timing per mode and round")
    ap.add_argument("--dump-interval", type=float, default=5.0)
    args = ap.parse_args()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(get_free_port()))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=120))
    t = torch.ones(1024, device=args.device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def op() -> None:
        dist.all_reduce(t)

    blocks(op, sync, 1.0)  # warm-up; also fills c10d's 2000-entry ring
    bare: list[float] = []
    served: list[float] = []
    dump_dir = tempfile.mkdtemp(prefix="bench_c10d_")
    for _ in range(args.rounds):
        bare += blocks(op, sync, args.seconds)
        handle = start_debug_server(port=0, dump_dir=dump_dir, dump_interval=args.dump_interval,
                                    stall_timeout=60.0)
        handle.wait_registered(30)
        time.sleep(1.0)  # the frontend's first health poll and dump cycle
        served += blocks(op, sync, args.seconds)
        stop_debug_server()

    def line(name: str, xs: list[float]) -> str:
        return (f"{name:<26} median {statistics.median(xs):8.2f} us/op   mean {statistics.mean(xs):8.2f}"
                f" us/op   ({len(xs)} blocks of {BLOCK})")

    print(f"torch {torch.__version__}, {args.device}, 1 rank, all_reduce of 1024 floats, "
          f"{args.rounds} rounds x {args.seconds:g} s per mode, dumps every {args.dump_interval:g} s")
    print(line("bare torch", bare))
    print(line("torch + start_debug_server", served))
    dm = statistics.median(served) - statistics.median(bare)
    da = statistics.mean(served) - statistics.mean(bare)
    print(f"added per op: median {dm:+.2f} us ({statistics.median(served) / statistics.median(bare):.3f}x), "
          f"mean {da:+.2f} us ({statistics.mean(served) / statistics.mean(bare):.3f}x)")

    n = sum(len(d.get("entries", [])) for _, d in c10d_fr.read_recorders())
    print(f"reads on this rank's c10d ring ({n} entries), median of 5 ms (first call in brackets):")
    watch = StallWatch()
    for name, fn in (
        ("health (pg_status)", lambda: c10d_fr.c10d_stalled_op(watch, 60.0, hooks.owned_groups())),
        ("live page (no stacks)", lambda: hooks.snapshot()),
        (f"dump (pickle, stacks {'on' if c10d_fr._stacks_safe() else 'off: no inductor'})",
         lambda: hooks.snapshot(stacks=True)),
    ):
        first = timed_ms(fn)
        rest = [timed_ms(fn) for _ in range(5)]
        print(f"  {name:<40} {statistics.median(rest):8.2f} ms   [{first:.2f} ms]")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
