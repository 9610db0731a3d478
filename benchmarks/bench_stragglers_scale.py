"""The straggler poll's replies at scale (issue 41): what the frontend holds of them, and the
analysis over them, kept whole against kept as their times (``stragglers.compact``).

    python benchmarks/bench_stragglers_scale.py --ranks 16384
    python benchmarks/bench_stragglers_scale.py --ranks 131072 --how compact

The poll (``frontend.stragglers.StragglerWatch``) asks every rank for its newest entries without
stacks, ``window_for(world)`` per group (16 from 2048 ranks on). Here each of ``--ranks`` fake
ranks' replies is that JSON text (one group of every rank, each entry as a worker writes it; rank
77777, or the last, 40 ms late at every collective), parsed as the fan-out parses it
(``fastjson``), its member list put back as the one shared text (``members.inline`` does so),
then kept whole (before) or as ``compact`` keeps it as it arrives (now). Printed per way: the
memory held once every reply is in (``ru_maxrss`` growth, this process alone: one way per
process, so ``--how`` runs one; without it both run, each in a process of its own), the
analysis' seconds and its peak, who it names, and the ratios of the two.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from typing import Any

OPS = 16
T0 = 1_700_000_000_000_000_000
LATE_NS = 40_000_000


def _reply(rank: int, late: int) -> str:
    """One rank's reply text, as its worker writes it for ``window=16&includestacktraces=false``."""
    entries = []
    for s in range(100, 100 + OPS):
        entries.append({
            "record_id": s, "pg_id": 0, "process_group": ["0", "default_pg"],
            "collective_seq_id": s, "p2p_seq_id": 0, "op_id": s,
            "profiling_name": "nccl:all_reduce",
            "time_created_ns": T0 + s * 10**8 + (rank % 97) * 1000 + (LATE_NS if rank == late
                                                                       else 0),
            "time_discovered_started_ns": None, "time_discovered_completed_ns": None,
            "duration_ms": 1.0, "state": "completed", "retired": True, "timeout_ms": 600000,
            "is_p2p": False, "input_sizes": [[1024]], "output_sizes": [[1024]],
            "input_dtypes": ["Float"], "output_dtypes": ["Float"], "frames": []})
    return json.dumps({"version": "2.10", "dump_time_ns": T0 + 10**12, "entries": entries})


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(world: int, how: str) -> dict[str, Any]:
    from debug_server.analysis import stragglers
    from debug_server.fanout.transport import settle_gc
    from debug_server.protocol import fastjson

    settle_gc()  # as the frontend's process does
    members = str(list(range(world)))
    late = 77777 if world > 77777 else world - 1
    base = _rss_mb()
    t0 = time.perf_counter()
    dumps: dict[int, dict[str, Any]] = {}
    for r in range(world):
        d = fastjson.loads(_reply(r, late))
        d["pg_config"] = {"0": {"name": "0", "desc": "default_pg", "ranks": members}}
        dumps[r] = stragglers.compact(d) if how == "compact" else d
    t1 = time.perf_counter()
    held = _rss_mb()
    res = stragglers.analyze(dumps, {}, stragglers.Rule(window_ops=OPS))
    t2 = time.perf_counter()
    return {"how": how, "replies_s": t1 - t0, "held_mb": held - base, "analyze_s": t2 - t1,
            "peak_mb": _rss_mb() - base,
            "named": [(s["rank"], s["median_lag_ms"]) for s in res["stragglers"]]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=16384)
    p.add_argument("--how", choices=("whole", "compact"),
                   help="one way in this process (default: both, each in its own)")
    args = p.parse_args()
    if args.how:
        print(json.dumps(run(args.ranks, args.how)))
        return
    rows = {}
    for how in ("whole", "compact"):
        out = subprocess.run([sys.executable, __file__, "--ranks", str(args.ranks), "--how", how],
                             capture_output=True, text=True, timeout=1800, check=True)
        rows[how] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{args.ranks} ranks, {OPS} collectives each:")
    for how, r in rows.items():
        print(f"  {how:>7}: replies in {r['replies_s']:.1f} s, held +{r['held_mb']:.0f} MB; "
              f"analysis {r['analyze_s']:.2f} s, peak +{r['peak_mb']:.0f} MB; names {r['named']}")
    w, c = rows["whole"], rows["compact"]
    print(f"  compact / whole: held {c['held_mb'] / w['held_mb']:.3f}, analysis "
          f"{c['analyze_s'] / w['analyze_s']:.2f}, peak {c['peak_mb'] / w['peak_mb']:.3f}; "
          f"the same ranks named: {c['named'] == w['named']}")


if __name__ == "__main__":
    main()
