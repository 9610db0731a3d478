"""Cost of recording per op, side by side in one run: bare torch, c10d's Flight Recorder, ours.

Two child processes (c10d reads its recorder's size when a process group is created): one with
c10d's recorder off (``TORCH_FR_BUFFER_SIZE=0``, ``TORCH_NCCL_TRACE_BUFFER_SIZE=0``), one with it
on (2000, torch's default). Each runs a 1-rank group (gloo, or NCCL with ``--device cuda``) and
times, interleaved, bare ``torch.distributed.all_reduce`` and the same op through ``new_comm`` +
``FlightRecorderHook`` (and the communicator without the hook), issued from a call site 20 frames
deep, with ``async_op=False`` (the default; on CUDA it returns once enqueued) and, on CUDA,
``async_op=True``. Medians of per-op host time. "c10d FR adds" is bare(on) - bare(off); "ours
adds" is ours - bare in the same process (bare on a group of its own). With c10d's recorder on,
an NCCL communicator is c10d-backed (comms module doc): "ours" is then the lean op path plus the
start events its group records ("timing adds": bare torch on the communicator's own group minus
bare torch on a plain group); "bare C++" is bare torch's own C++ call without its Python wrapper
(``pg.allreduce([t], opts)``, what the communicator calls, see ``recording/calls.py``). Then the
communicator path without the collective, and the memory
of a full 2000-entry ring with stacks (c10d's ring when backed: our side holds none).

    python benchmarks/bench_record.py [--device cpu|cuda] [--iters N] [--rounds R]
    taskset -c 0 python benchmarks/bench_record.py          # the gloo figure, pinned to one core
    taskset -c 0 python benchmarks/bench_record.py --clock cpu   # the same, on a busy shared box
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.utils.distributed import get_free_port

from debug_server.recording.comms import _new_group, new_comm
from debug_server.recording.hooks import FlightRecorderHook

FR_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")


def at_depth(depth: int, fn: Callable[[], float]) -> float:
    """Call ``fn`` with ``depth`` extra Python frames on the stack."""
    if depth <= 0:
        return fn()
    return at_depth(depth - 1, fn)


# --clock cpu: the process's CPU time (all its threads) instead of wall time. On a shared box the
# wall time of a block includes whatever ran on the core meanwhile; CPU time does not. (Not for
# CUDA: NCCL's own threads spin.)
_clock: Callable[[], float] = time.perf_counter


def per_op_us(op: Callable[[], object], iters: int, sync: Callable[[], None]) -> float:
    def run() -> float:
        sync()
        t0 = _clock()
        for _ in range(iters):
            op()
        dt = _clock() - t0
        sync()
        return dt / iters * 1e6

    return at_depth(20, run)


def quartiles(xs: list[float]) -> tuple[float, float]:
    """The first and third quartiles of ``xs``."""
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return q[0], q[2]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(args: argparse.Namespace) -> dict[str, Any]:
    """Measure in this process (c10d's recorder as the environment set it); returns medians."""
    cuda = args.device == "cuda"
    backend = "nccl" if cuda else "gloo"
    dev = torch.device("cuda:0") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=60))
    # bare torch on a group of its own, made as a user makes one (no timing events).
    pg = dist.new_group([0], backend=backend)
    comm = new_comm(backend, dev, "bench_comm")
    hook = FlightRecorderHook(max_entries=2000).register_with_comm(comm)
    plain = new_comm(backend, dev, "bench_plain")  # the same communicator code, no hook
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    # bare torch on a group made as a c10d-backed communicator makes its own (on NCCL it records
    # start events, TORCH_NCCL_ENABLE_TIMING): this isolates what timing costs.
    timed_pg = _new_group([0], backend, datetime.timedelta(seconds=60), "bench_timed", local_sync=False,
                          timing=comm.c10d_backed and cuda)
    out: dict[str, Any] = {"rows": [], "c10d_backed": comm.c10d_backed}
    modes = (False, True) if cuda else (False,)
    for async_op in modes:
        for numel in (1, 1024):
            t = torch.ones(numel, device=dev)

            def bare(t: torch.Tensor = t, a: bool = async_op) -> object:
                return dist.all_reduce(t, group=pg, async_op=a)

            def bare_timed(t: torch.Tensor = t, a: bool = async_op) -> object:
                return dist.all_reduce(t, group=timed_pg, async_op=a)

            opts = dist.AllreduceOptions()
            if hasattr(opts, "asyncOp"):
                opts.asyncOp = async_op

            def bare_cpp(t: torch.Tensor = t, a: bool = async_op, o: Any = opts) -> object:
                # torch.distributed.all_reduce's own C++ call, without its Python wrapper.
                work = pg.allreduce([t], o)
                if not a and work is not None:
                    work.wait()
                return work

            def hooked(t: torch.Tensor = t, a: bool = async_op) -> object:
                return comm.all_reduce(t, async_op=a)

            def unhooked(t: torch.Tensor = t, a: bool = async_op) -> object:
                return plain.all_reduce(t, async_op=a)

            for _ in range(200):  # warm-up (NCCL init, event slots created)
                bare()
                bare_timed()
                bare_cpp()
                hooked()
                unhooked()
            sync()
            b, bt, bc, h, u = [], [], [], [], []
            for _ in range(args.rounds):  # interleaved so drift hits all equally
                b.append(per_op_us(bare, args.iters, sync))
                bt.append(per_op_us(bare_timed, args.iters, sync))
                bc.append(per_op_us(bare_cpp, args.iters, sync))
                h.append(per_op_us(hooked, args.iters, sync))
                u.append(per_op_us(unhooked, args.iters, sync))
            # Paired: ours over bare of the same round (neighbours in time), so load that comes
            # and goes on a shared box hits both sides of each ratio.
            paired = sorted(x / y for x, y in zip(h, b, strict=True))
            out["rows"].append({
                "async_op": async_op, "numel": numel, "bare": statistics.median(b),
                "paired": statistics.median(paired), "paired_q": quartiles(paired),
                "bare_timed": statistics.median(bt), "bare_cpp": statistics.median(bc),
                "ours": statistics.median(h), "ours_no_hook": statistics.median(u),
            })
    if not cuda:
        out["op_by_op"] = op_by_op(args, pg, comm, plain)
    if args.extras:
        out["extras"] = extras(args, comm, plain, hook, dev, sync)
    dist.destroy_process_group()
    return out


def op_by_op(args: argparse.Namespace, pg: Any, comm: Any, plain: Any) -> dict[str, float]:
    """gloo: bare, ours and ours without the hook timed one op at a time, by turns (A B C C B
    A ...), 20 frames deep (the ops called from one frame, as a training loop's are); medians of the single ops. On a shared box a preempted op lands in
    the tail, and slow spells hit the three alike, so the medians hold where block timings
    scatter."""
    t = torch.ones(1)
    clock = time.perf_counter_ns
    n = args.iters * args.rounds

    def run() -> float:
        b: list[int] = []
        h: list[int] = []
        u: list[int] = []
        ops = ((b, lambda: dist.all_reduce(t, group=pg)), (h, lambda: comm.all_reduce(t)),
               (u, lambda: plain.all_reduce(t)))
        for i in range(n):
            for times, op in ops if i % 2 else ops[::-1]:  # A B C, then C B A: no fixed neighbour
                t0 = clock()
                op()
                times.append(clock() - t0)
        res.update(bare=statistics.median(b) / 1e3, ours=statistics.median(h) / 1e3,
                   ours_no_hook=statistics.median(u) / 1e3,
                   diff=statistics.median(y - x for x, y in zip(b, h, strict=True)) / 1e3)
        return 0.0

    res: dict[str, float] = {}
    at_depth(20, run)
    return res


def extras(
    args: argparse.Namespace, comm: Any, plain: Any, hook: FlightRecorderHook, dev: torch.device,
    sync: Callable[[], None],
) -> dict[str, Any]:
    """The communicator path with the collective replaced by a no-op, and the ring's memory."""
    res: dict[str, Any] = {}
    t = torch.ones(1024, device=dev)

    def nothing(*a: object, **k: object) -> None:
        return None

    if comm.c10d_backed:
        # The c10d-backed op path (the hook adds nothing per op there). Fresh communicators:
        # these fake ops take sequence numbers c10d never sees.
        pc, pp = new_comm(comm.get_backend(), dev, "bench_path_a"), new_comm(comm.get_backend(), dev, "bench_path_b")
        FlightRecorderHook(max_entries=2000).register_with_comm(pc)

        def path_hooked() -> object:
            return pc._issue("all_reduce", (nothing, (t,), {}), False)

        def path_plain() -> object:
            return pp._issue("all_reduce", (nothing, (t,), {}), False)
    else:
        def path_hooked() -> object:
            return comm._run(comm._record1("all_reduce", t, False), (nothing, (), {}))

        def path_plain() -> object:
            return plain._run(plain._record1("all_reduce", t, False), (nothing, (), {}))

    res["path_hooked"] = statistics.median(per_op_us(path_hooked, args.iters, sync) for _ in range(args.rounds))
    res["path_plain"] = statistics.median(per_op_us(path_plain, args.iters, sync) for _ in range(args.rounds))
    if comm.c10d_backed:
        pc.finalize()
        pp.finalize()

    # Memory of a full ring: a fresh hook, 2000 ops from two call sites 20 frames deep.
    hook.unregister()
    gc.collect()
    tracemalloc.start()
    rss0 = rss_bytes()
    snap0 = tracemalloc.take_snapshot()
    ring = FlightRecorderHook(max_entries=2000).register_with_comm(comm)

    def fill() -> float:
        for i in range(2000):
            if i % 2:
                comm.all_reduce(t)
            else:
                comm.broadcast(t, root=0)
        sync()
        return 0.0

    at_depth(20, fill)
    time.sleep(0.3)  # a watchdog pass: the communicator lets go of what completed
    gc.collect()
    res["ring_py_mb_raw"] = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(snap0, "filename")) / 1e6
    res["ring_rss_mb"] = (rss_bytes() - rss0) / 1e6
    t0 = time.perf_counter()
    dump = ring.dump_json()
    res["dump_ms"] = (time.perf_counter() - t0) * 1e3
    res["states"] = sorted({e["state"] for e in dump["entries"]})
    del dump
    gc.collect()
    res["ring_py_mb_symbolised"] = sum(
        s.size_diff for s in tracemalloc.take_snapshot().compare_to(snap0, "filename")) / 1e6
    tracemalloc.stop()
    return res


def run_child(args: argparse.Namespace, fr_entries: int, port: int, extras_too: bool) -> dict[str, Any]:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0")
    for k in FR_ENV:
        env[k] = str(fr_entries)
    cmd = [sys.executable, __file__, "--child", "--device", args.device, "--iters", str(args.iters),
           "--rounds", str(args.rounds), "--clock", args.clock] + (["--extras"] if extras_too else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.child_timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"child (c10d FR {fr_entries}) failed, exit {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=None,
                    help="ops per timed block (default 2000 on CPU, 200 on CUDA: a block must not fill "
                    "the GPU's launch queue, or the host waits for the GPU and the figure is GPU time)")
    ap.add_argument("--rounds", type=int, default=None, help="timed blocks per variant (default 7 CPU, 41 CUDA)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--port", type=int, default=int(os.environ.get("MASTER_PORT", "0")),
                    help="MASTER_PORT of the first job, the next one per job (0: a free one per job)")
    ap.add_argument("--child-timeout", type=float, default=300.0)
    ap.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                    help="wall time (default) or the process's CPU time per op (a shared CPU box)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--extras", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.iters is None:
        args.iters = 200 if args.device == "cuda" else 2000
    if args.rounds is None:
        args.rounds = 41 if args.device == "cuda" else 7
    if args.clock == "cpu":
        global _clock
        _clock = time.process_time
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return

    off = run_child(args, 0, args.port or get_free_port(), extras_too=False)
    on = run_child(args, 2000, args.port + 1 if args.port else get_free_port(), extras_too=True)
    print(f"torch {torch.__version__}, device {args.device}, iters {args.iters}, rounds {args.rounds}, "
          f"affinity {sorted(os.sched_getaffinity(0))[:8]}, clock {args.clock}")
    print(f"per-op host {'CPU ' if args.clock == 'cpu' else ''}time, medians in us; c10d FR off = TORCH_FR_BUFFER_SIZE=0, on = 2000")
    print(f"recorder with c10d FR on: {'c10d-backed (c10d records, ours reads at dump time)' if on['c10d_backed'] else 'ours (Python)'}"
          f"; with it off: {'c10d-backed' if off['c10d_backed'] else 'ours (Python)'}")
    print(f"{'async':>5} {'numel':>6} {'bare/off':>9} {'bare/on':>8} {'c10d FR adds':>12} "
          f"{'ours/on':>8} {'ours adds':>9} {'timing adds':>11} {'ours/off':>9} "
          f"{'ours adds (off)':>15} {'no hook/on':>10} {'bare C++/on':>11}")
    worst = []
    for r_off, r_on in zip(off["rows"], on["rows"], strict=True):
        fr_adds = r_on["bare"] - r_off["bare"]
        ours_adds = r_on["ours"] - r_on["bare"]  # over bare torch with c10d FR on (its default)
        timing_adds = r_on["bare_timed"] - r_on["bare"]
        ours_adds_off = r_off["ours"] - r_off["bare"]
        worst.append((ours_adds, fr_adds))
        print(f"{str(r_on['async_op']):>5} {r_on['numel']:>6} {r_off['bare']:>9.2f} {r_on['bare']:>8.2f} "
              f"{fr_adds:>12.2f} {r_on['ours']:>8.2f} {ours_adds:>9.2f} {timing_adds:>11.2f} "
              f"{r_off['ours']:>9.2f} {ours_adds_off:>15.2f} {r_on['ours_no_hook']:>10.2f} "
              f"{r_on['bare_cpp']:>11.2f}")
    for name, r in (("off", off), ("on", on)):
        o = r.get("op_by_op")
        if o:
            print(f"op by op (c10d FR {name}), medians of single ops: bare {o['bare']:.2f} us, ours "
                  f"{o['ours']:.2f} us, ours without the hook {o['ours_no_hook']:.2f} us; ours/bare "
                  f"{o['ours'] / o['bare']:.3f}, ours - bare (median of pairs) {o['diff']:+.2f} us")
    ex = on["extras"]
    print(f"without the collective: communicator path {ex['path_plain']:.2f} us, with the FR hook "
          f"{ex['path_hooked']:.2f} us (the hook adds {ex['path_hooked'] - ex['path_plain']:.2f} us)")
    print(f"ring of 2000 entries with stacks: python heap {ex['ring_py_mb_raw']:.2f} MB before symbolising, "
          f"{ex['ring_py_mb_symbolised']:.2f} MB after a dump (RSS delta {ex['ring_rss_mb']:.2f} MB); "
          f"dump_json of 2000 entries {ex['dump_ms']:.1f} ms; states {ex['states']}")
    max_ours = max(o for o, _ in worst)
    max_fr = max(f for _, f in worst)
    ratios = [r["ours"] / r["bare"] for r in on["rows"]]
    paired = " ".join(f"{r['paired']:.3f} ({r['paired_q'][0]:.3f}-{r['paired_q'][1]:.3f})" for r in on["rows"])
    print(f"SUMMARY ours adds at most {max_ours:.2f} us per op; c10d FR adds at most {max_fr:.2f} us; "
          f"ours/bare (c10d FR on) {' '.join(f'{x:.3f}' for x in ratios)}; paired per round, "
          f"median (quartiles): {paired}")


if __name__ == "__main__":
    main()
