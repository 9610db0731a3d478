"""Training-like steps, 2 ranks (``--nproc``): bare torch vs bare torch with c10d's Flight Recorder vs ours.

Each step is 4 matmuls, then collectives in one of four shapes:

* ``big``:   one 64 MiB gradient all_reduce;
* ``mixed``: one 4 MiB all_reduce and 50 x 4 KiB all_reduces;
* ``small``: 200 x 4 KiB all_reduces;
* ``ddp``:   4 gradient buckets of 16 MiB, each all_reduced with ``async_op=True`` right after
  its matmul (overlapping the next ones), then ``wait()`` on all four.

All with ``async_op=False`` unless said, as in the TorchComms example. A step ends with
``torch.cuda.synchronize()`` (on CPU the ops are synchronous anyway); its wall time is the figure.
c10d reads its recorder's size when a process group is created, so the launcher runs two
jobs: c10d's recorder off (``TORCH_FR_BUFFER_SIZE=0`` / ``TORCH_NCCL_TRACE_BUFFER_SIZE=0``) and
on (2000, torch's default). In each job the variants run interleaved, round by round, on the same
GPUs:

* ``bare``: bare ``torch.distributed`` on the process group of our communicator, so that the
  pair ours / bare differs only in the op path (each group is its own NCCL communicator, and two
  of them can run the small shape a few per cent apart);
* ``bare_group``: bare torch on a group of its own;
* ``timed``: bare torch on a group with c10d's timing (start) events, what a c10d-backed
  communicator's group records with ``DEBUG_SERVER_NCCL_TIMING=1``;
* ``ours``: ``new_comm`` + ``FlightRecorderHook(2000)``, as configured by default;
* ``marks_all`` / ``unmarked`` (c10d-backed CUDA only): ours with a start mark on every
  collective / with none (``groups.MARKS_ENV``; ours marks the first collective after a 0.5 ms pause);
* with ``--control``: ``ours_own``, ours on a set of tensors of its own (the noise of where the
  tensors lie), and ``ours_wrapped``, ours through the wrapper the two above use: on 4 H200s
  the small shape's noise between identical configurations reached 0.76 against 0.99.

Every variant but ``ours_own`` runs on one shared set of tensors (see ``Tensors``).

Printed: medians of ms per step and the ratios; "ours / bare" compares ours with bare torch in
the same job, so torch's default configuration (c10d FR on) is the headline.

    python benchmarks/bench_step.py --device cuda                 # 2 GPUs
    python benchmarks/bench_step.py --device cpu --rounds 5       # gloo, small shapes
    python benchmarks/bench_step.py --device cuda --max-ratio 1.05  # exit 1 when a shape is over

Exit status: 0, or 1 when ours / bare or ours / bare_group (c10d FR on), the median over rounds
of the pair measured side by side, exceeds ``--max-ratio`` on some shape. Each rank is pinned to
one core.

``--init`` says who initialises the default group: by default ``new_comm`` does, as the README
teaches, and the bare group is made after the communicator, as a job's DDP or FSDP group is.
The ``own group`` column (ours / bare torch on a group of its own, side by side) is what a user
comparing a step with and without the debugger sees; the ``ddp`` shape overlaps the buckets'
all_reduces with the compute. ``--init lazy`` (the user's init_process_group without device_id)
makes every group a separate NCCL communicator, and two of those ran the ``ddp`` shape up to 9 %
apart, bare torch against bare torch (``scripts/gpu/step_by_init_mode.py --plain``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.utils.distributed import get_free_port

from debug_server.recording.comms import _new_group, new_comm
from debug_server.recording.groups import MARK_GAP_US
from debug_server.recording.hooks import FlightRecorderHook

FR_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
TIMING_ENV = "TORCH_NCCL_ENABLE_TIMING"
SHAPES = ("big", "mixed", "small", "ddp")
KIB = 1024 // 4  # float32 elements in 1 KiB
MIB = 1024 * KIB


def sizes(cuda: bool) -> dict[str, Any]:
    """Element counts of each shape: the real ones on CUDA, small ones for gloo on a laptop."""
    if cuda:
        return {"mm": 2048, "big": 64 * MIB, "mixed_big": 4 * MIB, "tiny": 4 * KIB, "bucket": 16 * MIB}
    return {"mm": 256, "big": 1 * MIB, "mixed_big": 64 * KIB, "tiny": 4 * KIB, "bucket": 256 * KIB}


class Tensors:
    """The tensors of the four shapes, one set shared by every variant: where a small tensor
    lands in GPU memory can change NCCL's time for it (on 4 H200s one set of 200 x 4 KiB ran
    1.49x another, same code path), so the variants differ only in how they issue the ops."""

    def __init__(self, dev: torch.device, cuda: bool) -> None:
        n = sizes(cuda)
        self.a = torch.randn(n["mm"], n["mm"], device=dev)
        self.b = torch.randn(n["mm"], n["mm"], device=dev)
        self.big = torch.ones(n["big"], device=dev)
        self.mixed_big = torch.ones(n["mixed_big"], device=dev)
        self.tiny = [torch.ones(n["tiny"], device=dev) for _ in range(200)]
        self.buckets = [torch.ones(n["bucket"], device=dev) for _ in range(4)]


class Step:
    """The four step shapes over one issuing API (bare torch or ours)."""

    def __init__(self, all_reduce: Callable[..., Any], data: Tensors, cuda: bool) -> None:
        self.ar = all_reduce
        self.issued_ms = 0.0
        self.sync = torch.cuda.synchronize if cuda else (lambda: None)
        self.a, self.b, self.big, self.mixed_big = data.a, data.b, data.big, data.mixed_big
        self.tiny, self.buckets = data.tiny, data.buckets

    def matmuls(self) -> None:
        x = self.a
        for _ in range(4):
            x = x @ self.b

    def run(self, shape: str) -> float:
        """One step; returns its wall time in ms."""
        t0 = time.perf_counter()
        if shape == "ddp":
            x = self.a
            works = []
            for bucket in self.buckets:
                x = x @ self.b  # the next layer's backward overlaps the previous bucket's all_reduce
                works.append(self.ar(bucket, async_op=True))
            for w in works:
                w.wait()
        else:
            self.matmuls()
            if shape == "big":
                self.ar(self.big)
            elif shape == "mixed":
                self.ar(self.mixed_big)
                for t in self.tiny[:50]:
                    self.ar(t)
            else:
                for t in self.tiny:
                    self.ar(t)
        self.issued_ms = (time.perf_counter() - t0) * 1e3  # the host's part: until the last op returned
        self.sync()
        return (time.perf_counter() - t0) * 1e3


def worker(args: argparse.Namespace) -> None:
    rank = int(os.environ["RANK"])
    cuda = args.device == "cuda"
    # One core per rank, the same for every variant: the launch-bound shapes measure host time,
    # and a rank moved between cores mid-round skews one variant of a pair.
    local = int(os.environ.get("LOCAL_RANK", rank))
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2 * args.nproc + 2 and not args.no_pin:
        os.sched_setaffinity(0, {cores[2 + 2 * local]})
    backend = "nccl" if cuda else "gloo"
    dev = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    timeout = datetime.timedelta(seconds=120)
    # --init: who initialises the default group. "newcomm" (the default): new_comm, as the
    # README teaches; "lazy" / "eager": the user, without / with device_id, before new_comm.
    if args.init == "eager":
        dist.init_process_group(backend, timeout=timeout, device_id=dev if cuda else None)
    elif args.init == "lazy":
        dist.init_process_group(backend, timeout=timeout)
    comm = new_comm(backend, dev, "bench_step", timeout=timeout)
    FlightRecorderHook(max_entries=2000).register_with_comm(comm)
    ranks = list(range(dist.get_world_size()))
    # The user's other group, made after the communicator as in a job that adds DDP or FSDP.
    bare_pg = dist.new_group(ranks, backend=backend)
    # bare torch on a group with start events, as a c10d-backed communicator's group records
    # them (TORCH_NCCL_ENABLE_TIMING): what timing alone costs a step.
    timed_pg = _new_group(ranks, backend, datetime.timedelta(seconds=120), "bench_timed", local_sync=False,
                          timing=comm.c10d_backed and cuda)

    def bare_ar(t: torch.Tensor, async_op: bool = False) -> Any:
        # Bare torch on our communicator's own process group: the pair ours / bare then differs
        # only in the op path. Each group is its own NCCL communicator, and two of them can run
        # the small shape a few per cent apart (bare_group: bare torch on a group of its own).
        return dist.all_reduce(t, group=comm.process_group, async_op=async_op)

    def bare_group_ar(t: torch.Tensor, async_op: bool = False) -> Any:
        return dist.all_reduce(t, group=bare_pg, async_op=async_op)

    def timed_ar(t: torch.Tensor, async_op: bool = False) -> Any:
        return dist.all_reduce(t, group=timed_pg, async_op=async_op)

    default_gap = comm._mark_gap

    def marks(mode: str) -> Callable[..., Any]:
        """ours with its start marks set to ``mode`` (as groups.MARKS_ENV would) for this variant."""
        def ar(t: torch.Tensor, async_op: bool = False) -> Any:
            comm._marks = mode != "0"
            comm._mark_gap = MARK_GAP_US * 1000 if mode == "1" else 0  # "all": every collective
            try:
                return comm.all_reduce(t, async_op=async_op)
            finally:
                comm._marks, comm._mark_gap = True, default_gap
        return ar

    data = Tensors(dev, cuda)
    steps = {"bare": Step(bare_ar, data, cuda), "bare_group": Step(bare_group_ar, data, cuda),
             "timed": Step(timed_ar, data, cuda), "ours": Step(comm.all_reduce, data, cuda)}
    if comm._marks:  # c10d-backed on CUDA: where ours' cost goes (ours: a mark after each pause)
        steps["marks_all"] = Step(marks("all"), data, cuda)
        steps["unmarked"] = Step(marks("0"), data, cuda)
    if args.control:  # the noise floor: ours on tensors of its own, and ours through the wrapper
        steps["ours_own"] = Step(comm.all_reduce, Tensors(dev, cuda), cuda)
        if comm._marks:
            steps["ours_wrapped"] = Step(marks("1"), data, cuda)
    for shape in SHAPES:  # warm-up: NCCL channels, cuBLAS, event slots
        for s in steps.values():
            for _ in range(args.warmup):
                s.run(shape)
    times: dict[str, dict[str, list[float]]] = {v: {sh: [] for sh in SHAPES} for v in steps}
    issued: dict[str, dict[str, list[float]]] = {v: {sh: [] for sh in SHAPES} for v in steps}
    raw: dict[str, dict[str, list[float]]] = {v: {sh: [] for sh in SHAPES} for v in steps}
    shuffle = random.Random(1126)
    for _rnd in range(args.rounds):
        for shape in SHAPES:
            # The variants take turns step by step, in a shuffled order (the same on every rank:
            # one seed), so that none always follows another: what a variant leaves behind
            # (c10d's watchdog threads finishing its ops, dearer on the timed group) slows
            # whatever runs next. In a fixed cyclic order, whichever variant followed ``timed``
            # ran the small shape 1.17-1.49x bare on 4 H200s, pinned or not; the same
            # configuration elsewhere 0.82-1.04.
            names = tuple(steps)
            per: dict[str, list[float]] = {v: [] for v in names}
            for _ in range(args.steps):
                order = list(names)
                shuffle.shuffle(order)
                for v in order:
                    per[v].append(steps[v].run(shape))
                    issued[v][shape].append(steps[v].issued_ms)
            for v in names:
                times[v][shape].append(statistics.median(per[v]))
                raw[v][shape].extend(per[v])
    dist.barrier()
    if rank == 0:
        out: dict[str, Any] = {v: {sh: statistics.median(ts) for sh, ts in d.items()} for v, d in times.items()}
        # Per round, ours over bare measured side by side: the median of those pairs is what
        # the budget is checked on (a slow spell of the host hits both of a pair alike).
        out["paired"] = {sh: statistics.median(o / b for o, b in zip(times["ours"][sh], times["bare"][sh], strict=True))
                         for sh in SHAPES}
        # The user's view: ours against bare torch on a group of its own (the headline column).
        out["paired_group"] = {sh: statistics.median(o / b for o, b in zip(times["ours"][sh], times["bare_group"][sh],
                                                                            strict=True)) for sh in SHAPES}
        # What start_debug_server's timing costs a user's own group: bare torch on a group with
        # start events against bare torch on a group without, side by side per round.
        out["paired_timed"] = {sh: statistics.median(o / b for o, b in zip(times["timed"][sh],
                                                                            times["bare_group"][sh],
                                                                            strict=True)) for sh in SHAPES}
        out["paired_all"] = {v: {sh: statistics.median(o / b for o, b in zip(times[v][sh], times["bare"][sh],
                                                                             strict=True)) for sh in SHAPES}
                             for v in steps if v != "bare"}
        out["c10d_backed"] = comm.c10d_backed
        # Every step's time, and the host's part of it, by variant: quartiles show a variant
        # that is slow in some steps only.
        out["quartiles"] = {v: {sh: statistics.quantiles(ts, n=4) for sh, ts in d.items() if len(ts) > 1}
                            for v, d in raw.items()}
        out["issued"] = {v: {sh: statistics.median(ts) for sh, ts in d.items()} for v, d in issued.items()}
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


def launch(args: argparse.Namespace, fr_entries: int, port: int,
           extra_env: dict[str, str] | None = None) -> dict[str, dict[str, float]]:
    env = dict(os.environ, **(extra_env or {}))
    for k in FR_ENV:
        env[k] = str(fr_entries)
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}",
        f"--master-port={port}", __file__, "--worker", "--device", args.device,
        "--rounds", str(args.rounds), "--steps", str(args.steps), "--warmup", str(args.warmup),
        *(["--control"] if args.control else []), *(["--no-pin"] if args.no_pin else []),
        "--init", args.init,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.job_timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"bench job (c10d FR {fr_entries}) failed, exit {proc.returncode}:\n"
                 f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def timing_ab(args: argparse.Namespace) -> int:
    """What c10d's start timing costs a whole job: the same job with it off (A) and on (B)."""
    runs: list[tuple[str, dict[str, Any]]] = []
    for i in range(args.timing_ab):
        for v in ("01" if i % 2 == 0 else "10"):
            runs.append((v, launch(args, 2000, args.port + len(runs) if args.port else get_free_port(),
                                   {TIMING_ENV: v})))
    print(f"torch {torch.__version__}, device {args.device}, {args.nproc} ranks, {args.rounds} rounds x "
          f"{args.steps} steps per job; {args.timing_ab} pairs of jobs, {TIMING_ENV}=0 (A) / 1 (B)")
    over = []
    for variant in ("bare", "bare_group", "ours"):
        for sh in SHAPES:
            ratios = []
            for j in range(0, len(runs), 2):
                a = next(r for v, r in runs[j:j + 2] if v == "0")
                b = next(r for v, r in runs[j:j + 2] if v == "1")
                ratios.append(b[variant][sh] / a[variant][sh])
            med = statistics.median(ratios)
            print(f"  {variant:>10} {sh:>6}: timing on / off {med:.3f}  (pairs: "
                  + ", ".join(f"{x:.3f}" for x in ratios) + ")")
            if args.timing_max_ratio is not None and variant != "ours" and med > args.timing_max_ratio:
                over.append(f"{variant} {sh} {med:.3f}")
    if over:
        print(f"OVER the {args.timing_max_ratio} budget: {', '.join(over)}")
        return 1
    if args.timing_max_ratio is not None:
        print(f"every shape within timing on / off <= {args.timing_max_ratio}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15, help="rounds per shape and variant (median)")
    ap.add_argument("--steps", type=int, default=10, help="steps per round (median)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--port", type=int, default=int(os.environ.get("MASTER_PORT", "0")),
                    help="MASTER_PORT of the first job, the next one per job (0: a free one per job)")
    ap.add_argument("--timing-ab", type=int, default=0, metavar="PAIRS",
                    help="instead: PAIRS pairs of whole jobs (c10d FR on), TORCH_NCCL_ENABLE_TIMING=0 "
                         "against =1 (what start_debug_server sets), in the order A B B A ...; prints "
                         "each shape's step time with timing over without, per pair, and the median")
    ap.add_argument("--timing-max-ratio", type=float, default=None,
                    help="with --timing-ab: exit 1 when the median ratio of bare torch's step (on "
                         "either group) exceeds this on some shape")
    ap.add_argument("--max-ratio", type=float, default=None,
                    help="exit 1 when ours / bare (c10d FR on) exceeds this on some shape")
    ap.add_argument("--job-timeout", type=float, default=400.0)
    ap.add_argument("--control", action="store_true",
                    help="add ours_own (ours on tensors of its own) and ours_wrapped (ours' marks through the variants' wrapper)")
    ap.add_argument("--no-pin", action="store_true",
                    help="leave each rank on every core (its main thread then shares none with NCCL's and c10d's threads)")
    ap.add_argument("--fr-on-only", action="store_true",
                    help="skip the run with c10d FR off (its columns then repeat the FR-on run's)")
    ap.add_argument("--init", default="newcomm", choices=["newcomm", "lazy", "eager"],
                    help="who initialises the default group: new_comm (as the README teaches), or the user "
                         "before it, without (lazy) or with (eager) device_id")
    ap.add_argument("--json", default=None, help="also write the medians here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0

    if args.timing_ab:
        return timing_ab(args)
    on = launch(args, 2000, args.port + 1 if args.port else get_free_port())
    off = on if args.fr_on_only else launch(args, 0, args.port or get_free_port())
    if args.fr_on_only:
        print("--fr-on-only: the FR-off columns repeat the FR-on run")
    print(f"torch {torch.__version__}, device {args.device}, {args.nproc} ranks, "
          f"{args.rounds} rounds x {args.steps} steps, medians in ms per step; default group by {args.init}")
    print(f"ours with c10d FR on: {'c10d-backed' if on.get('c10d_backed') else 'Python recorder'}; "
          f"with it off: {'c10d-backed' if off.get('c10d_backed') else 'Python recorder'}; "
          "bare+timing: bare torch on a group with start events (c10d FR on)")
    print("ours/bare+FR: ratio of the medians; paired: median over rounds of ours/bare in the same "
          "round; own group: the same against bare torch on a group of its own (the budget is checked on both)")
    print(f"{'shape':>6} {'bare':>8} {'bare+FR':>8} {'ours+FR':>8} {'ours/bare+FR':>12} {'paired':>7} {'own group':>9} "
          f"{'FR cost':>8} {'bare+timing':>11} {'timing cost':>11} {'ours (FR off)':>13} {'ours/bare (FR off)':>18}")
    over = []
    for sh in SHAPES:
        bare_off, ours_off = off["bare"][sh], off["ours"][sh]
        bare_on, ours_on = on["bare"][sh], on["ours"][sh]
        timed_on = on["timed"][sh]
        ratio = ours_on / bare_on
        paired = on["paired"][sh]
        own = on["paired_group"][sh]
        if args.max_ratio is not None:
            over += [f"{sh} {name} {r:.3f}" for name, r in (("ours/bare", paired), ("ours/own group", own))
                     if r > args.max_ratio]
        print(f"{sh:>6} {bare_off:>8.3f} {bare_on:>8.3f} {ours_on:>8.3f} {ratio:>12.3f} {paired:>7.3f} {own:>9.3f} "
              f"{bare_on / bare_off:>8.3f} {timed_on:>11.3f} {timed_on / bare_on:>11.3f} "
              f"{ours_off:>13.3f} {ours_off / bare_off:>18.3f}")
    print("paired against bare (c10d FR on, our communicator's group), every variant: bare_group = bare "
          "torch on a group of its own, marks_all = ours with a start mark on every collective, "
          "unmarked = ours without start marks (ours: a mark after each 0.5 ms pause)")
    for v, d in on.get("paired_all", {}).items():
        print(f"  {v:>10}: " + "  ".join(f"{sh} {d[sh]:.3f}" for sh in SHAPES))
    if args.control:
        print("control: the small shape's step times (ms) by variant: quartiles over every step, and the "
              "host's part (until the last op returned), median")
        for v, q in on.get("quartiles", {}).items():
            if "small" in q:
                print(f"  {v:>12}: " + " / ".join(f"{x:.3f}" for x in q["small"])
                      + f"   host {on['issued'][v]['small']:.3f}")
    print("bare+timing / bare on a group of its own, paired per round (two groups; --timing-ab "
          "compares whole jobs): " + "  ".join(f"{sh} {on['paired_timed'][sh]:.3f}" for sh in SHAPES))
    if args.json:
        Path(args.json).write_text(json.dumps({"fr_off": off, "fr_on": on}, indent=1))
    if over:
        print(f"OVER the {args.max_ratio} budget: {', '.join(over)}")
        return 1
    if args.max_ratio is not None:
        print(f"all shapes within ours / bare <= {args.max_ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
