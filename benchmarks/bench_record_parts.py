"""Where the recording cost goes, piece by piece (median us per call), on CPU or CUDA.

    python benchmarks/bench_record_parts.py [--device cuda]
    python benchmarks/bench_record_parts.py --by-turns [--ops N]   # gloo: the hook's pieces in situ

``--by-turns``: communicators that differ only in one pre-hook (none, an empty one, a 2000-slot
ring store, the stack capture, ``sys._getframe``, the capture into a 1-slot ring, the real
``FlightRecorderHook``) and bare ``dist.all_reduce``, one op each by turns (forward, then
backward), 20 frames deep; medians of the single ops and of each one's difference from the
communicator without a hook. A piece timed in a tight loop runs hot in the cache; after a
collective's wait it does not, which is what these show.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.elastic.utils.distributed import get_free_port

from debug_server.recording import comms, frames, hooks
from debug_server.recording.comms import new_comm


def at_depth(depth: int, fn: Callable[[], float]) -> float:
    return fn() if depth <= 0 else at_depth(depth - 1, fn)


def us(fn: Callable[[], object], n: int = 200, rounds: int = 41) -> float:
    # Small blocks with a sync between them: a GPU launch queue never fills, so the figure is
    # host time, not GPU throughput.
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def run() -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        dt = time.perf_counter() - t0
        sync()
        return dt / n * 1e6

    return statistics.median(at_depth(20, run) for _ in range(rounds))


def by_turns(ops: int) -> None:
    """The hook's pieces in situ (see the module doc); gloo, after init_process_group."""
    t = torch.ones(1)
    pg = dist.new_group([0], backend="gloo")
    ring: list[object] = [None] * 2000
    one: list[object] = [None]
    count = itertools.count()

    def with_pre(name: str, pre: Callable[[object], object] | None) -> Callable[[], object]:
        c = new_comm("gloo", torch.device("cpu"), name)
        if pre is not None:
            c.register_pre_hook(pre)
        return lambda: c.all_reduce(t)

    hooked = new_comm("gloo", torch.device("cpu"), "hooked")
    hooks.FlightRecorderHook(2000).register_with_comm(hooked)
    variants: dict[str, Callable[[], object]] = {
        "bare": lambda: dist.all_reduce(t, group=pg),
        "no hook": with_pre("none", None),
        "empty pre-hook": with_pre("empty", lambda rec: None),
        "ring store only": with_pre("ring", lambda rec: ring.__setitem__(next(count) % 2000, rec)),
        "capture only": with_pre("capture", lambda rec: frames.capture(4)),
        "sys._getframe only": with_pre("getframe", lambda rec: sys._getframe(4)),
        "capture, 1-slot ring": with_pre("cap1", lambda rec: one.__setitem__(0, (rec, frames.capture(4)))),
        "FlightRecorderHook": lambda: hooked.all_reduce(t),
    }
    items = list(variants.items())

    def run() -> dict[str, list[int]]:
        times: dict[str, list[int]] = {k: [] for k in variants}
        clock = time.perf_counter_ns
        for i in range(ops):
            for k, op in items if i % 2 else items[::-1]:
                t0 = clock()
                op()
                times[k].append(clock() - t0)
        return times

    times = at_depth(20, run)
    base = times["no hook"]
    print(f"by turns, {ops} ops each, 20 frames deep: median us per op, and over 'no hook'")
    for k, v in times.items():
        over = statistics.median(y - x for x, y in zip(base, v, strict=True)) / 1e3
        print(f"{k:22s} {statistics.median(v) / 1e3:8.2f} {over:+7.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--by-turns", action="store_true", help="gloo: the hook's pieces in situ")
    ap.add_argument("--ops", type=int, default=12000)
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(get_free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    cuda = args.device == "cuda"
    dev = torch.device("cuda:0" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(dev)
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=60))
    if args.by_turns:
        by_turns(args.ops)
        dist.destroy_process_group()
        return
    comm = new_comm(backend, dev, "parts")
    t = torch.ones(4, device=dev)
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, {dev}")
    print(f"capture (depth ~25, met)  {us(lambda: frames.capture()):7.2f}  (frames above the anchor not walked)")
    print(f"_record1                  {us(lambda: comm._record1('all_reduce', t, True)):7.2f}")
    print(f"tensor.shape + dtype      {us(lambda: (t.shape, t.dtype)):7.2f}")
    print(f"time.time_ns              {us(time.time_ns):7.2f}")
    if cuda:
        print(f"cuda.Event()              {us(torch.cuda.Event):7.2f}")
        ev = torch.cuda.Event()
        print(f"ev.record()               {us(ev.record):7.2f}")
        s = torch.cuda.current_stream()
        print(f"ev.record(stream)         {us(lambda: ev.record(s)):7.2f}")
        print(f"current_stream()          {us(torch.cuda.current_stream):7.2f}")
        print(f"_cuda_getCurrentRawStream {us(lambda: torch._C._cuda_getCurrentRawStream(0)):7.2f}")
        print(f"C record(ev, stream)      {us(lambda: comms._record_event(ev, s)):7.2f}")
        print(f"comm stream lookup        {us(lambda: comm._streams.get(comms._raw_stream(0))):7.2f}")

    def nothing(*a: object, **k: object) -> None:
        return None

    print(f"comm._run, no collective  {us(lambda: comm._run(comm._record1('all_reduce', t, False), (nothing, (), {}))):7.2f}")
    print(f"fn(*args, **kw) call      {us(lambda: nothing(*(t,), **{'op': 0, 'group': None, 'async_op': False})):7.2f}")
    pg = comm.process_group
    # The c10d-backed sync path (NCCL's default), piece by piece, before any hook is registered.
    fn, a, _kw = comm._calls.all_reduce(t, comms.ReduceOp.SUM, False)
    print(f"calls.all_reduce (build)  {us(lambda: comm._calls.all_reduce(t, comms.ReduceOp.SUM, False)):7.2f}")
    print(f"direct C++ allreduce      {us(lambda: fn(*a)):7.2f}")
    print(f"direct C++ + work.wait()  {us(lambda: (w := fn(*a)) is not None and w.wait()):7.2f}")
    print(f"comm._issue, no collective{us(lambda: comm._issue('all_reduce', (nothing, (), {}), False)):7.2f}")
    print(f"bare all_reduce sync      {us(lambda: dist.all_reduce(t, group=pg)):7.2f}")
    print(f"comm all_reduce sync      {us(lambda: comm.all_reduce(t)):7.2f}  (recorder: "
          f"{'c10d-backed' if comm.c10d_backed else 'ours'}, start marks: {getattr(comm, '_marks', None)})")
    print(f"bare all_reduce async     {us(lambda: dist.all_reduce(t, group=pg, async_op=True)):7.2f}")
    print(f"comm all_reduce async     {us(lambda: comm.all_reduce(t, async_op=True)):7.2f}")
    hook = hooks.FlightRecorderHook(2000).register_with_comm(comm)
    print(f"comm+hook all_reduce async{us(lambda: comm.all_reduce(t, async_op=True)):7.2f}")
    print(f"bare all_reduce sync      {us(lambda: dist.all_reduce(t, group=pg)):7.2f}")
    print(f"comm+hook all_reduce sync {us(lambda: comm.all_reduce(t)):7.2f}")
    hook.unregister()
    if cuda:
        torch.cuda.synchronize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
