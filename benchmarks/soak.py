"""Soak: the frontend's memory and the dump directory over minutes of fast dump cycles (not CI).

Eight fake ranks (real worker apps in this process) serve a hanging job; the frontend runs as its
own process (as ``start_debug_server`` starts it; ``benchmarks/fakefleet.py``) with
``dump_interval=0.2`` and ``keep_dumps``; a page is fetched every second on top. Every few
seconds this samples the frontend's resident memory, open file descriptors, and the dump
directory's file count and bytes.

    python benchmarks/soak.py                   # 5 minutes
    python benchmarks/soak.py --seconds 60 --warmup 15

Pass criteria (printed at the end): RSS growth after warm-up <= 10 %, and the dump directory
bounded by retention (file count never above (keep + 1) * 3 report files + 2 files per rank:
its pickle and, for a moment, the pickle's temp file).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from fakefleet import frontend_over, open_fds, status_kb

from debug_server.tools import synthetic


def _dir_usage(path: Path) -> tuple[int, int]:
    count = size = 0
    for p in path.rglob("*"):
        try:  # a temp file may be renamed away between the listing and the stat
            st = p.stat()
        except FileNotFoundError:
            continue
        if p.is_file():
            count, size = count + 1, size + st.st_size
    return count, size


def _soak(pid: int, port: int, dump_dir: Path, seconds: float,
          ranks: int) -> tuple[list[tuple[float, int, int, int, int]], int]:
    """A page a second for ``seconds``; every 10 s a sample (t, RSS kB, fds, dump files,
    dump bytes). Returns the samples and the pages fetched."""
    start = time.monotonic()
    next_sample = start
    samples: list[tuple[float, int, int, int, int]] = []
    pages = 0
    while (now := time.monotonic()) - start < seconds:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/fr_trace", timeout=30) as r:
            assert f"Rank {ranks - 1} never joined" in r.read().decode()
        pages += 1
        if now >= next_sample:
            files, size = _dir_usage(dump_dir) if dump_dir.exists() else (0, 0)
            samples.append((now - start, status_kb(pid), open_fds(pid), files, size))
            t, rss, fds, files, size = samples[-1]
            print(f"t={t:6.1f}s rss={rss / 1024:7.1f} MiB fds={fds:4d} "
                  f"dump files={files:4d} bytes={size / 1e6:6.2f} MB", flush=True)
            next_sample += 10.0
        time.sleep(1.0)
    return samples, pages


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--warmup", type=float, default=60.0)
    ap.add_argument("--interval", type=float, default=0.2, help="dump interval, s")
    ap.add_argument("--keep", type=int, default=20, help="dump cycles kept")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--entries", type=int, default=200, help="FR entries per rank")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="debug_server_soak_"))
    dump_dir = tmp / "dumps"
    dumps = synthetic.hang_job(args.ranks, n_entries=args.entries, missing_rank=args.ranks - 1)
    with frontend_over(dumps, dump_dir=dump_dir, dump_interval=args.interval,
                       keep_dumps=args.keep, fetch_timeout=5.0) as (proc, port):
        print(f"frontend pid {proc.pid} port {port}; {args.ranks} fake ranks; dump_interval "
              f"{args.interval} s; keep {args.keep}; {args.seconds:.0f} s", flush=True)
        samples, pages = _soak(proc.pid, port, dump_dir, args.seconds, args.ranks)
    warm = [s for s in samples if s[0] >= args.warmup]
    if not warm:
        print("run longer than --warmup to judge growth")
        return 1
    base, last = warm[0][1], warm[-1][1]
    peak = max(s[1] for s in warm)
    growth = (last - base) / base * 100
    peak_growth = (peak - base) / base * 100
    max_files = max(s[3] for s in samples)
    # A cycle writes its files before pruning the oldest, and pickles go through temp names.
    bound = (args.keep + 1) * 3 + 2 * args.ranks
    cycles = len([n for n in os.listdir(dump_dir) if n.startswith("stacks_")])
    print(f"\nRSS after warm-up {base / 1024:.1f} MiB -> end {last / 1024:.1f} MiB "
          f"({growth:+.1f} %), peak {peak / 1024:.1f} MiB ({peak_growth:+.1f} %)")
    print(f"fds {warm[0][2]} -> {warm[-1][2]}; pages fetched {pages}")
    print(f"dump dir: max {max_files} files (bound {bound}), stacks files now {cycles}, "
          f"max {max(s[4] for s in samples) / 1e6:.2f} MB")
    ok = growth <= 10.0 and max_files <= bound
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1

if __name__ == "__main__":
    sys.exit(main())
