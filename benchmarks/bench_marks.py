"""What a start mark costs a launch-bound step, by kind of mark (2 or more ranks, NCCL, c10d FR on).

A c10d-backed communicator learns that a collective reached its stream from a mark recorded on
the issuing stream just before the call. Here a step of 200 x 4 KiB all_reduces (c10d's direct
call, as the communicator makes it) runs with no mark and with each kind of mark:

* ``event``: an untimed CUDA event recorded per op (one of 1024 slots);
* ``pause``: as ``event``, on an op issued ``groups.MARK_GAP_US`` or more after the previous one
  (the communicator's default: the first op of a burst);
* ``sparse``: as ``event``, at most one per ``groups.MARK_GAP_US`` (the default until
  2026-11-26), so on different ops on different ranks;
* ``every16``: as ``event`` on every 16th op (the same ops on every rank);
* ``stagger``: as ``every16``, but rank r marks ops r, r + 16, ... (different ops per rank);
* ``first``: as ``event`` on the first op of each step only;
* ``write``: a stream memory write (``cuStreamWriteValue64``) of the op's number into one of
  1024 slots of pinned host memory, which the host then reads without any CUDA call.

Printed: median ms per step and, paired per round, each variant over no mark; and the host
cost of each mark alone (median us per call).

    python benchmarks/bench_marks.py [--matmuls] [--nproc 4]    # 2 GPUs by default
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d
from torch.distributed.elastic.utils.distributed import get_free_port

from debug_server.recording.groups import MARK_GAP_US

SLOTS = 1024


def _writer() -> Callable[[int, int, int, int], int] | None:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    for name in ("cuStreamWriteValue64_v2", "cuStreamWriteValue64"):
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
            fn.restype = ctypes.c_int
            return fn
    return None


def worker(args: argparse.Namespace) -> None:
    rank = int(os.environ["RANK"])
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2 * int(os.environ["WORLD_SIZE"]) + 2:
        os.sched_setaffinity(0, {cores[2 + 2 * rank]})
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=120), device_id=dev)
    pg = dist.new_group(list(range(dist.get_world_size())))
    opts = _c10d.AllreduceOptions()
    opts.asyncOp = False
    tiny = [torch.ones(1024, device=dev) for _ in range(200)]
    events = [torch.cuda.Event() for _ in range(SLOTS)]
    stream = torch.cuda.current_stream()
    for ev in events:
        ev.record(stream)
    record = torch.cuda.Event.__mro__[1].record
    raw = torch._C._cuda_getCurrentRawStream
    slots = torch.zeros(SLOTS, dtype=torch.int64, pin_memory=True)
    addr = slots.data_ptr()
    write = _writer()
    seq = [0]

    def none() -> None:
        pass

    def event() -> None:
        n = seq[0]
        seq[0] = n + 1
        record(events[n & (SLOTS - 1)], stream)

    def wr() -> None:
        n = seq[0]
        seq[0] = n + 1
        write(raw(rank), addr + 8 * (n & (SLOTS - 1)), n + 1, 0)

    last = [0]
    prev = [0]

    def pause() -> None:
        # As the communicator's default: a mark on an op issued MARK_GAP_US after the previous.
        n = seq[0]
        seq[0] = n + 1
        now = time.time_ns()
        if now - prev[0] >= MARK_GAP_US * 1000:
            record(events[n & (SLOTS - 1)], stream)
        prev[0] = now

    def sparse() -> None:
        # As the communicator's default: at most one mark per groups.MARK_GAP_US.
        n = seq[0]
        seq[0] = n + 1
        now = time.time_ns()
        if now - last[0] >= MARK_GAP_US * 1000:
            last[0] = now
            record(events[n & (SLOTS - 1)], stream)

    def every16() -> None:
        n = seq[0]
        seq[0] = n + 1
        if n % 16 == 0:
            record(events[n & (SLOTS - 1)], stream)

    def stagger() -> None:
        n = seq[0]
        seq[0] = n + 1
        if n % 16 == rank % 16:
            record(events[n & (SLOTS - 1)], stream)

    def first() -> None:
        n = seq[0]
        seq[0] = n + 1
        if n % len(tiny) == 0:
            record(events[n & (SLOTS - 1)], stream)

    marks: dict[str, Callable[[], None]] = {"none": none, "event": event, "pause": pause, "sparse": sparse,
                                            "every16": every16, "stagger": stagger, "first": first}
    if write is not None:
        marks["write"] = wr
    a = torch.randn(2048, 2048, device=dev)
    b = torch.randn(2048, 2048, device=dev)

    def step(mark: Callable[[], None]) -> float:
        seq[0] -= seq[0] % len(tiny)  # steps stay aligned on op 0 whatever ran before
        t0 = time.perf_counter()
        if args.matmuls:
            x = a
            for _ in range(4):
                x = x @ b
        for t in tiny:
            mark()
            w = pg.allreduce([t], opts)
            if w is not None:
                w.wait()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    for m in marks.values():
        seq[0] = 0  # every step starts at op 0 of the step (``first``, ``every16``)
        for _ in range(5):
            step(m)
    times: dict[str, list[float]] = {k: [] for k in marks}
    names = tuple(marks)
    for rnd in range(args.rounds):
        for k in names[rnd % len(names):] + names[:rnd % len(names)]:
            times[k].append(statistics.median(step(marks[k]) for _ in range(10)))
    host: dict[str, float] = {}
    for k, m in marks.items():
        per = []
        for _ in range(21):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(200):
                m()
            per.append((time.perf_counter() - t0) / 200 * 1e6)
        host[k] = statistics.median(per)
    torch.cuda.synchronize()
    check = None
    if write is not None:
        seq[0] = 0
        for _ in range(5):
            wr()
        torch.cuda.synchronize()
        check = slots[:6].tolist()
    dist.barrier()
    if rank == 0:
        out = {"ms": {k: statistics.median(v) for k, v in times.items()},
               "paired": {k: statistics.median(a / b for a, b in zip(v, times["none"], strict=True))
                          for k, v in times.items()},
               "host_us": host, "write_check": check}
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--port", type=int, default=0, help="MASTER_PORT (0: a free one)")
    ap.add_argument("--nproc", type=int, default=2, help="ranks, one GPU each")
    ap.add_argument("--max-ratio", type=float, default=None,
                    help="exit 1 when the communicator's default (pause) over no mark exceeds this")
    ap.add_argument("--matmuls", action="store_true", help="4 matmuls of 2048x2048 before the ops, as bench_step")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.port = args.port or get_free_port()
    if args.worker:
        worker(args)
        return 0
    env = dict(os.environ, TORCH_NCCL_TRACE_BUFFER_SIZE="2000", TORCH_FR_BUFFER_SIZE="2000")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}",
           f"--master-port={args.port}", __file__, "--worker", "--rounds", str(args.rounds)] + (["--matmuls"] if args.matmuls else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        print(proc.stdout[-2000:], proc.stderr[-4000:])
        return 1
    out = json.loads(lines[-1][len("RESULT "):])
    print(f"torch {torch.__version__}, {args.nproc} ranks: {'4 matmuls + ' if args.matmuls else ''}200 x 4 KiB "
          f"all_reduce step, {args.rounds} rounds, medians")
    for k, ms in out["ms"].items():
        print(f"{k:>7}: {ms:7.3f} ms/step  paired vs none {out['paired'][k]:.3f}  "
              f"host {out['host_us'][k]:.2f} us per mark")
    print("write check (slots 0..5 after 5 writes):", out["write_check"])
    if args.max_ratio is not None and out["paired"]["pause"] > args.max_ratio:
        print(f"OVER: pause marks (the default) {out['paired']['pause']:.3f} > {args.max_ratio}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
