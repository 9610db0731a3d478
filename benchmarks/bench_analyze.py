"""Analyzer speed and memory against PyTorch's fr_trace, on the same files, in the same run.

    python benchmarks/bench_analyze.py                    # 64 and 512 ranks, both analyzers
    python benchmarks/bench_analyze.py --ranks 4096 --only-ours

For each rank count it writes synthetic per-rank pickles (2000 entries each, one rank missing the
last all_reduce, timestamps and thread ids varying per rank like real dumps) into a temp dir, then
runs ``python -m torch.distributed.flight_recorder.fr_trace DIR -p rank_`` (its build_db path) and
``python -m debug_server.fr_trace DIR -p rank_`` as subprocesses, measuring wall time and peak
RSS of each child (``resource.getrusage(RUSAGE_CHILDREN)`` from a fresh wrapper process), and
prints medians over ``--repeats`` runs and the ratios.
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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from debug_server.synthetic import hang_job  # noqa: E402

# Runs one command and reports its wall time and peak RSS; a fresh process per measurement so
# RUSAGE_CHILDREN holds exactly one child.
_WRAPPER = r"""
import resource, subprocess, sys, time
t = time.perf_counter()
p = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
wall = time.perf_counter() - t
print(p.returncode, wall, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def generate(directory: str, ranks: int, entries: int) -> None:
    base = hang_job(2, entries, missing_rank=1)
    full, short = base[0], base[1]
    for r in range(ranks):
        dump = short if r == ranks - 1 else full
        dump["pg_config"]["main_comm"]["ranks"] = str(list(range(ranks)))
        for e in dump["entries"]:
            # Real dumps differ per rank (clocks, thread ids): keep files from being identical.
            e["time_created_ns"] = 1_700_000_000_000_000_000 + e["record_id"] * 1000 + r
            e["thread_id"] = 1000 + r
        with open(os.path.join(directory, f"rank_{r}"), "wb") as f:
            pickle.dump(dump, f, protocol=4)


def measure(cmd: list[str], timeout: float) -> tuple[int, float, float]:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, "-c", _WRAPPER, *cmd],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    ).stdout.split()
    rc, wall, rss_kb = int(out[0]), float(out[1]), int(out[2])
    return rc, wall, rss_kb / 1024.0


def bench(ranks: int, entries: int, repeats: int, only_ours: bool, timeout: float) -> None:
    tmp = tempfile.mkdtemp(prefix=f"bench_fr_{ranks}_")
    try:
        t = time.perf_counter()
        generate(tmp, ranks, entries)
        gen_s = time.perf_counter() - t
        size_mb = sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp)) / 1e6
        print(
            f"\n== {ranks} ranks x {entries} entries ({size_mb:.0f} MB of pickles, generated in {gen_s:.1f} s)"
        )
        tools = {"ours": [sys.executable, "-m", "debug_server.fr_trace", tmp, "-p", "rank_"]}
        if not only_ours:
            tools["pytorch"] = [
                sys.executable,
                "-m",
                "torch.distributed.flight_recorder.fr_trace",
                tmp,
                "-p",
                "rank_",
            ]
        results: dict[str, tuple[float, float]] = {}
        for name, cmd in tools.items():
            walls, rsss = [], []
            for _ in range(repeats):
                rc, wall, rss = measure(cmd, timeout)
                walls.append(wall)
                rsss.append(rss)
            results[name] = (statistics.median(walls), statistics.median(rsss))
            print(
                f"{name:8s} median wall {results[name][0]:7.2f} s  peak RSS {results[name][1]:8.0f} MB  (exit {rc}; runs: {', '.join(f'{w:.2f}' for w in walls)})"
            )
        if "pytorch" in results:
            (ow, orss), (pw, prss) = results["ours"], results["pytorch"]
            print(f"ratio    pytorch/ours wall {pw / ow:5.1f}x   RSS {prss / orss:5.1f}x")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[64, 512])
    p.add_argument("--entries", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only-ours", action="store_true")
    p.add_argument("--timeout", type=float, default=900.0)
    args = p.parse_args()
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    for n in args.ranks:
        bench(n, args.entries, args.repeats, args.only_ours, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
