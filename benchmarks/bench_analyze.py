"""Analyzer speed and memory against PyTorch's fr_trace, on the same files, in the same run.

    python benchmarks/bench_analyze.py                    # 512 ranks, both analyzers
    python benchmarks/bench_analyze.py --ranks 4096 --only-ours
    python benchmarks/bench_analyze.py --synthetic        # the older synthetic entries
    python benchmarks/bench_analyze.py --baseline-src /tmp/base   # + another checkout (before/after)
    python benchmarks/bench_analyze.py --record-src /tmp/base     # dumps from that checkout's recorder

The dumps are real: a 2-rank gloo job records ``--entries`` ops (a training loop's bucketed
all_reduces and a periodic broadcast, each called through a 5-frame Python stack) with
``FlightRecorderHook`` and writes both ranks' pickles; rank 1 never issues the last all_reduce.
They are then replicated to ``--ranks`` files (rank 0's for every rank but the last, rank 1's for
the last; group ranks rewritten, timestamps and thread ids varied per rank like real dumps).
Then ``python -m torch.distributed.flight_recorder.fr_trace DIR -p rank_`` and
``python -m debug_server.fr_trace DIR -p rank_ --json`` run as subprocesses, measured for wall
time and peak RSS (``resource.getrusage(RUSAGE_CHILDREN)`` from a fresh wrapper process per run);
medians over ``--repeats`` runs and both ratios (ours / PyTorch's) are printed.
"""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from debug_server.tools.synthetic import hang_job

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs one command and reports its wall time and peak RSS; a fresh process per measurement so
# RUSAGE_CHILDREN holds exactly one child.
_WRAPPER = r"""
import resource, subprocess, sys, time
t = time.perf_counter()
p = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
wall = time.perf_counter() - t
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
print(p.returncode, wall, ru.ru_maxrss, ru.ru_utime + ru.ru_stime)
"""


# The job that records the dumps: 5 Python frames per op (reduce_bucket, sync_grads, train_step,
# train, <module>), four gradient buckets per step and a broadcast every tenth step.
_JOB = r"""
import datetime, os, sys, time
import torch, torch.distributed as dist
from debug_server.recording.comms import new_comm
from debug_server.recording.hooks import FlightRecorderHook

rank, entries = int(os.environ["RANK"]), int(sys.argv[1])
dist.init_process_group("gloo")
comm = new_comm("gloo", "cpu", "main_comm", timeout=datetime.timedelta(seconds=120))
hook = FlightRecorderHook(max_entries=entries).register_with_comm(comm)
buckets = [torch.ones(n) for n in (1024, 4096, 256, 65536)]

def reduce_bucket(t):
    comm.all_reduce(t)

def sync_grads():
    for g in buckets:
        reduce_bucket(g)

def train_step(step):
    sync_grads()
    if step % 10 == 0:
        comm.broadcast(buckets[0], root=0)

def train(steps):
    for s in range(steps):
        train_step(s)

train(entries // 4 + 20)  # enough to wrap the ring
if rank == 0:
    work = comm.all_reduce(buckets[0], async_op=True)  # rank 1 never joins this one
# Dump well after that issue, as a post-mortem at the timeout does: an op issued less than
# IN_FLIGHT_GRACE_NS before a rank's dump_time_ns counts as in flight, not as a hang.
dist.barrier()
time.sleep(1.5)
hook.dump_file(rank)
dist.barrier()
os._exit(0)  # rank 0's all_reduce never completes: leave without tearing the group down
"""


def record_real(directory: str, entries: int, src: str = REPO) -> tuple[dict, dict]:
    """Run the 2-rank gloo job with the recorder in ``src``; returns both ranks' dumps."""
    from debug_server.dumpio import load_dump

    job = os.path.join(directory, "job.py")
    with open(job, "w") as f:
        f.write(_JOB)
    from torch.distributed.elastic.utils.distributed import get_free_port

    port = get_free_port()
    procs = []
    for r in range(2):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   TORCHCOMM_FR_DUMP_TEMP_FILE=os.path.join(directory, "rec_"),
                   PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
        procs.append(subprocess.Popen([sys.executable, job, str(entries)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        for p in procs:
            out, _ = p.communicate(timeout=300)
            if p.returncode != 0:
                raise SystemExit(f"recording job failed:\n{out[-3000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    dumps = tuple(load_dump(os.path.join(directory, f"rec_{r}")) for r in range(2))
    for r in range(2):
        os.unlink(os.path.join(directory, f"rec_{r}"))
    os.unlink(job)
    return dumps



def generate(directory: str, ranks: int, entries: int, synthetic: bool,
             record_src: str = REPO) -> str:
    """Write ``rank_0`` ... ``rank_<ranks-1>``; returns a one-line description of the data."""
    if synthetic:
        base = hang_job(2, entries, missing_rank=1)
        full, short = base[0], base[1]
        what = "synthetic entries (2-frame stacks)"
    else:
        full, short = record_real(directory, entries, record_src)
        n_frames = {len(e["frames"]) for e in full["entries"]}
        what = (f"real gloo recording ({len(full['entries'])}/{len(short['entries'])} entries, "
                f"{'/'.join(map(str, sorted(n_frames)))} frames per entry)")
    for dump in (full, short):
        for cfg in dump["pg_config"].values():
            cfg["ranks"] = str(list(range(ranks)))
    prev = 0
    for r in range(ranks):
        dump = short if r == ranks - 1 else full
        for e in dump["entries"]:
            # Real dumps differ per rank (clocks, thread ids): keep files from being identical.
            e["time_created_ns"] += r - prev
            e["thread_id"] = 1000 + r
        prev = r
        with open(os.path.join(directory, f"rank_{r}"), "wb") as f:
            pickle.dump(dump, f, protocol=4)
    return what


def measure(cmd: list[str], timeout: float, src: str = REPO) -> tuple[int, float, float, float]:
    env = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # cwd=/: `python -m` puts the working directory first on sys.path, which would shadow
    # ``src`` with whatever debug_server the caller's directory holds.
    out = subprocess.run(
        [sys.executable, "-c", _WRAPPER, *cmd],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd="/",
    ).stdout.split()
    rc, wall, rss_kb, cpu = int(out[0]), float(out[1]), int(out[2]), float(out[3])
    return rc, wall, rss_kb / 1024.0, cpu


def bench(ranks: int, entries: int, repeats: int, only_ours: bool, timeout: float,
          synthetic: bool, jobs: int | None, baseline: str | None,
          record_src: str = REPO) -> None:
    tmp = tempfile.mkdtemp(prefix=f"bench_fr_{ranks}_")
    try:
        t = time.perf_counter()
        what = generate(tmp, ranks, entries, synthetic, record_src)
        gen_s = time.perf_counter() - t
        size_mb = sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp)) / 1e6
        print(
            f"\n== {ranks} ranks x {entries} entries: {what}; {size_mb:.0f} MB of pickles, "
            f"generated in {gen_s:.1f} s"
        )
        ours = [sys.executable, "-m", "debug_server.tools.fr_trace", tmp, "-p", "rank_", "--json"]
        tools = {"ours": ours + (["--jobs", str(jobs)] if jobs else [])}
        if baseline:  # another checkout of the package (e.g. `git archive HEAD debug_server`)
            tools["baseline"] = tools["ours"]
        if not only_ours:
            tools["pytorch"] = [
                sys.executable,
                "-m",
                "torch.distributed.flight_recorder.fr_trace",
                tmp,
                "-p",
                "rank_",
            ]
        # Repeats interleave the tools, so a busy spell on a shared box hits each about equally.
        runs: dict[str, list[tuple[int, float, float, float]]] = {name: [] for name in tools}
        for _ in range(repeats):
            for name, cmd in tools.items():
                src = baseline if name == "baseline" and baseline else REPO
                runs[name].append(measure(cmd, timeout, src))
        results: dict[str, tuple[float, float, float]] = {}
        med = statistics.median
        for name, rs in runs.items():
            results[name] = (med(r[1] for r in rs), med(r[2] for r in rs), med(r[3] for r in rs))
            print(
                f"{name:8s} median wall {results[name][0]:7.2f} s  CPU {results[name][2]:7.2f} s  "
                f"peak RSS {results[name][1]:6.0f} MB  (exit {rs[-1][0]}; walls: "
                f"{', '.join(f'{r[1]:.2f}' for r in rs)})"
            )
        if "pytorch" in results:
            (ow, orss, ocpu), (pw, prss, pcpu) = results["ours"], results["pytorch"]
            # CPU time varies less than wall time with what else runs on a shared box
            # (ours uses every core, PyTorch's one).
            print(f"ratio    ours/pytorch wall {ow / pw:.3f}x (goal <= 0.1)   "
                  f"RSS {orss / prss:.3f}x (goal <= 0.25)   CPU {ocpu / pcpu:.3f}x")
            if "baseline" in results:
                bw, brss, bcpu = results["baseline"]
                print(f"ratio    baseline/pytorch wall {bw / pw:.3f}x   RSS {brss / prss:.3f}x   "
                      f"CPU {bcpu / pcpu:.3f}x")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[512])
    p.add_argument("--entries", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only-ours", action="store_true")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--synthetic", action="store_true",
                   help="synthetic entries instead of a real gloo recording")
    p.add_argument("--jobs", type=int, default=None, help="pass --jobs N to ours")
    p.add_argument("--baseline-src", default=None, metavar="DIR",
                   help="also time the debug_server package found in DIR (before/after)")
    p.add_argument("--record-src", default=REPO, metavar="DIR",
                   help="record the dumps with the debug_server package in DIR (the pickles' "
                        "layout is the recorder's: compare recorders with the same analyzers)")
    args = p.parse_args()
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    for n in args.ranks:
        bench(n, args.entries, args.repeats, args.only_ours, args.timeout, args.synthetic,
              args.jobs, args.baseline_src, args.record_src)
    return 0


if __name__ == "__main__":
    sys.exit(main())
