"""The analysis over dumps that ranks doing the same thing share (issue 41), at up to 131072 ranks.

    python benchmarks/bench_analyze_shared.py                         # 4096 .. 131072 ranks
    python benchmarks/bench_analyze_shared.py --sizes 131072 --profile

Per size: ``fakefleet.rank_dumps(world)`` (a 2000-entry ring; one rank, 77777 where it exists,
else world-1, never issues the last all_reduce), shared the way the fan-out shares them (each
rank a shallow copy, ``dict(rep)``, of its behaviour's dump with its own ``dump_time_ns``), then
cut to the job's window (``frwindow.frontier``, ``fanout.reply.cut_all``, which keep the
sharing). Printed: the frontier and cut seconds, ``analyze`` seconds over the shared dumps
(median of ``--repeats``), and, up to ``--baseline-max`` ranks, the same analysis of per-rank
dumps (each rank its own entries list: a digest per rank, the path before issue 41) and the
ratio; the result's JSON size; the verdict line.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from typing import Any

from fakefleet import rank_dumps

from debug_server.analysis.core import analyze
from debug_server.fanout.reply import cut_all
from debug_server.protocol import frwindow

T0 = 1_800_000_000_000_000_000


def shared_fleet(world: int) -> tuple[dict[int, dict[str, Any]], int]:
    """Every rank a shallow copy of one of the two behaviours' dumps, with its own read time."""
    full, missing = rank_dumps(world)
    odd = 77777 if world > 77777 else world - 1
    dumps = {}
    for r in range(world):
        d = dict(missing if r == odd else full)
        d["dump_time_ns"] = T0 + r * 1000
        dumps[r] = d
    return dumps, odd


def unshared(dumps: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Each rank its own entries list (the same entry dicts): digested per rank."""
    return {r: {**d, "entries": list(d["entries"])} for r, d in dumps.items()}


def timed(fn: Any, reps: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(reps):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 16384, 65536, 131072])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--baseline-max", type=int, default=16384,
                    help="largest world whose per-rank-digest baseline is run (it is slow)")
    ap.add_argument("--profile", action="store_true", help="cProfile one shared analysis")
    args = ap.parse_args()
    for world in args.sizes:
        dumps, odd = shared_fleet(world)
        t_front, since = timed(lambda dumps=dumps: frwindow.frontier(dumps), 1)
        t_cut, cut = timed(lambda dumps=dumps, since=since: cut_all(dumps, since), 1)
        distinct = len({id(d["entries"]) for d in cut.values()})
        t_shared, result = timed(lambda cut=cut, world=world: analyze(cut, world_size=world),
                                 args.repeats)
        size_mb = len(json.dumps(result)) / 1e6
        line = (f"{world:>7} ranks ({distinct} distinct cut dumps): frontier {t_front:.3f} s, "
                f"cut {t_cut:.3f} s, analyze shared {t_shared:.3f} s")
        if world <= args.baseline_max:
            per_rank = unshared(cut)
            t_base, base = timed(lambda p=per_rank, world=world: analyze(p, world_size=world),
                                 args.repeats)
            same = "same result" if base == result else "RESULTS DIFFER"
            line += f", per-rank digests {t_base:.3f} s (x{t_base / t_shared:.1f}, {same})"
        line += f"; JSON {size_mb:.1f} MB, {len(result['nccl_calls'])} nccl_calls rows"
        print(line)
        print(f"        verdict: {result['verdict'].splitlines()[0]}")
        assert f"Rank {odd} never" in result["verdict"], result["verdict"]
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            analyze(cut, world_size=world)
            prof.disable()
            pstats.Stats(prof, stream=sys.stdout).sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
