"""Cost of recording: bare torch.distributed.all_reduce vs the same op through new_comm + FR hook.

Runs in one process (a 1-rank gloo group, or 1-rank NCCL with --device cuda), measures in the same
run, and prints the median per-op time of each, the added microseconds and the ratio, for 1- and
1024-element tensors issued from a call site 20 frames deep; then the memory of a full 2000-entry
ring with stacks (before and after a dump symbolises them).

    python benchmarks/bench_record.py [--iters 2000] [--rounds 7] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from debug_server.comms import new_comm  # noqa: E402
from debug_server.hooks import FlightRecorderHook  # noqa: E402


def at_depth(depth: int, fn: Callable[[], float]) -> float:
    """Call ``fn`` with ``depth`` extra Python frames on the stack."""
    if depth <= 0:
        return fn()
    return at_depth(depth - 1, fn)


def per_op_us(op: Callable[[], object], iters: int, sync: Callable[[], None]) -> float:
    def run() -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            op()
        sync()
        return (time.perf_counter() - t0) / iters * 1e6

    return at_depth(20, run)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--iters",
        type=int,
        default=None,
        help="ops per timed block (default 2000 on CPU, 200 on CUDA: a block must not fill the "
        "GPU's launch queue, or the host waits for the GPU and the figure is GPU time)",
    )
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args()
    if args.iters is None:
        args.iters = 200 if args.device == "cuda" else 2000
    if args.device == "cuda":
        args.rounds = max(args.rounds, 51)

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29555")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    backend = "nccl" if args.device == "cuda" else "gloo"
    dev = torch.device("cuda:0") if args.device == "cuda" else torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=60))
    comm = new_comm(backend, dev, "bench_comm")
    hook = FlightRecorderHook(max_entries=2000).register_with_comm(comm)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    pg = comm.process_group
    # On CUDA both sides issue asynchronously (stream-ordered), so the figure is the host-side
    # cost the recorder adds per op; on CPU both are gloo's synchronous all_reduce.
    async_op = args.device == "cuda"

    print(f"torch {torch.__version__}, backend {backend}, device {dev}, iters {args.iters}, rounds {args.rounds}")
    plain = new_comm(backend, dev, "bench_plain")  # the same communicator code, no hook
    print(f"{'numel':>6} {'bare us':>9} {'hooked us':>10} {'added us':>9} {'ratio':>6} {'(comm w/o hook us)':>19}")
    for numel in (1, 1024):
        t = torch.ones(numel, device=dev)

        def bare(t: torch.Tensor = t) -> object:
            return dist.all_reduce(t, group=pg, async_op=async_op)

        def hooked(t: torch.Tensor = t) -> object:
            return comm.all_reduce(t, async_op=async_op)

        def unhooked(t: torch.Tensor = t) -> object:
            return plain.all_reduce(t, async_op=async_op)

        for _ in range(200):  # warm-up
            bare()
            hooked()
            unhooked()
        b, h, u = [], [], []
        for _ in range(args.rounds):  # interleaved so drift hits all equally
            b.append(per_op_us(bare, args.iters, sync))
            h.append(per_op_us(hooked, args.iters, sync))
            u.append(per_op_us(unhooked, args.iters, sync))
        mb, mh, mu = statistics.median(b), statistics.median(h), statistics.median(u)
        print(f"{numel:>6} {mb:>9.2f} {mh:>10.2f} {mh - mb:>9.2f} {mh / mb:>6.2f} {mu:>19.2f}")
    # The same paths with the collective replaced by a no-op work object: what recording and
    # the communicator wrapper cost on their own, free of the collective's scheduling noise.
    class _DoneWork:
        def wait(self, timeout: object = None) -> bool:
            return True

        def is_completed(self) -> bool:
            return True

    done = _DoneWork()
    t = torch.ones(1024, device=dev)

    def issue() -> object:
        return done

    def path_hooked() -> object:
        return comm._run(comm._record1("all_reduce", t, async_op), issue)

    def path_plain() -> object:
        return plain._run(plain._record1("all_reduce", t, async_op), issue)

    ph = statistics.median(per_op_us(path_hooked, args.iters, sync) for _ in range(args.rounds))
    pp = statistics.median(per_op_us(path_plain, args.iters, sync) for _ in range(args.rounds))
    print(f"without the collective: communicator path {pp:.2f} us, with the FR hook {ph:.2f} us "
          f"(the hook adds {ph - pp:.2f} us)")
    if args.device == "cuda":
        # What a start event costs on its own (pooled events are reused; this is a fresh one).
        def event() -> object:
            ev = torch.cuda.Event()
            ev.record()
            return ev

        print(f"torch.cuda.Event() + record(): {statistics.median(per_op_us(event, args.iters, sync) for _ in range(args.rounds)):.2f} us")

    # Memory of a full ring: a fresh hook, 2000 ops from two call sites 20 frames deep.
    hook.unregister()
    gc.collect()
    tracemalloc.start()
    rss0 = rss_bytes()
    snap0 = tracemalloc.take_snapshot()
    ring = FlightRecorderHook(max_entries=2000).register_with_comm(comm)
    t = torch.ones(1024, device=dev)

    def fill() -> float:
        for i in range(2000):
            if i % 2:
                comm.all_reduce(t, async_op=async_op)
            else:
                comm.broadcast(t, root=0, async_op=async_op)
        sync()
        return 0.0

    at_depth(20, fill)
    gc.collect()
    raw_py = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(snap0, "filename"))
    rss1 = rss_bytes()
    t0 = time.perf_counter()
    dump = ring.dump_json()
    dump_ms = (time.perf_counter() - t0) * 1e3
    del dump
    gc.collect()
    sym_py = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(snap0, "filename"))
    tracemalloc.stop()
    print(
        f"ring of 2000 entries with stacks: python heap {raw_py / 1e6:.2f} MB before symbolising, "
        f"{sym_py / 1e6:.2f} MB after a dump (RSS delta {(rss1 - rss0) / 1e6:.2f} MB); "
        f"dump_json of 2000 entries {dump_ms:.1f} ms"
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
