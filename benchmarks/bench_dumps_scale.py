"""The dump cycle's files at scale (issue 41): sizes and build seconds at 4096 .. 131072 ranks.

    python benchmarks/bench_dumps_scale.py                  # 4096 and 131072 ranks
    python benchmarks/bench_dumps_scale.py --sizes 4096

Per size, :func:`fleet` (``fakefleet.rank_dumps``: a 2000-entry ring cut to the job's window,
shared the way the fan-out shares it; rank 77777, or world-1, never issues the last all_reduce
and sleeps; ranks 100-199 were unreachable), then each file the dumper writes, built by
``frontend.dumps``' builders: ``fr_snapshot`` (classes, ``snapshot.encode``; before: one dump per
rank, ``snapshot.encode_per_rank``), ``stacks`` (``stacks_file``; before: ``stacks_report``, a
section per rank), the "Dump File" section (``dump_file_lines`` grouped; before: per rank) and
the hang report the hang watch writes (``hangreport.render_text`` and its JSON, every rank but
the odd one stalled in the all_reduce with its own age; before: its health listing per rank,
``health_lines``/``health_json`` ungrouped, alone). Printed: bytes and seconds of each, and the
seconds to read the snapshot back (``expand``).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from fakefleet import rank_dumps

from debug_server.fanout.reply import FrData, cut_all
from debug_server.fanout.transport import OK, UNREACHABLE, RankResult
from debug_server.frontend import dumps as dumper
from debug_server.frontend import hangreport, snapshot
from debug_server.frontend.fetchfacts import FetchFacts
from debug_server.protocol import frwindow

T0 = 1_800_000_000_000_000_000
UNREACHABLE_RANKS = range(100, 200)
_STACK = """Thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3/threading.py", line 331 in wait
  File "/usr/lib/python3/threading.py", line 629 in wait

Current thread 0x00007f0000000000 (most recent call first):
  File "/opt/torch/distributed/distributed_c10d.py", line 2801 in all_reduce
  File "/job/train.py", line 88 in step
  File "/job/train.py", line 120 in <module>
"""
_SLEEPING = _STACK.replace("/opt/torch/distributed/distributed_c10d.py\", line 2801 in all_reduce",
                           "/job/wait.py\", line 1 in sleep")


def fleet(world: int) -> tuple[FrData, list[RankResult], list[RankResult], int]:
    """(the FR fetch, the stacks, the per-rank pickles' answers, the odd rank) of ``world``
    ranks in three classes: the ranks that issued the hang, one that never joined it (77777,
    or ``world - 1``), ranks 100-199 unreachable. Dumps and texts shared as the fan-out shares
    them (``dict(rep)`` copies with their own ``dump_time_ns``; one text object per class)."""
    full, missing = rank_dumps(world)
    odd = 77777 if world > 77777 else world - 1
    down = {r for r in UNREACHABLE_RANKS if r < world and r != odd}
    dumps: dict[int, dict[str, Any]] = {}
    for r in range(world):
        if r in down:
            continue
        d = dict(missing if r == odd else full)
        d["dump_time_ns"] = T0 + r * 1000
        dumps[r] = d
    dumps = cut_all(dumps, frwindow.frontier(dumps))
    why = "unreachable after 2.0 s (ConnectTimeout)"
    fr_results, stacks, pickles = [], [], []
    for r in range(world):
        url = f"http://h{r // 8}:2{r % 8:04d}"
        if r in down:
            fr_results.append(RankResult(r, url, UNREACHABLE, error=why))  # as the transport's
            stacks.append(RankResult(r, url, UNREACHABLE, error=why))
            pickles.append(RankResult(r, url, UNREACHABLE, error=why))
            continue
        fr_results.append(RankResult(r, url, OK, body="", dump=dumps[r]))
        stacks.append(RankResult(r, url, OK, body=_SLEEPING if r == odd else _STACK))
        pickles.append(RankResult(r, url, OK, body=json.dumps(
            {"path": f"/nonexistent/dump/per_rank/rank_{r}", "host": f"h{r // 8}"})))
    return FrData(fr_results, dumps), stacks, pickles, odd


def _timed(fn: Any) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def _row(name: str, before: tuple[float, Any] | None, after: tuple[float, Any]) -> str:
    def size(x: Any) -> int:
        return len(x.encode()) if isinstance(x, str) else sum(len(s) + 1 for s in x)

    b = f"{size(before[1]) / 1e6:9.2f} MB {before[0]:6.2f} s" if before else f"{'':>21}"
    return f"  {name:<12} before {b}   after {size(after[1]) / 1e3:9.1f} KB {after[0]:6.2f} s"


def run_size(world: int, before: bool = True) -> None:
    t, (fr, stacks, pickles, odd) = _timed(lambda: fleet(world))
    print(f"{world} ranks (fleet built in {t:.1f} s; odd rank {odd})")
    items = [(r.rank, fr.dumps.get(r.rank) if r.body is not None else None, r.line())
             for r in fr.results]
    old = _timed(lambda: snapshot.encode_per_rank(items)) if before else None
    new = _timed(lambda: dumper.snapshot_json(fr))
    print(_row("fr_snapshot", old, new))
    t_read, back = _timed(lambda: snapshot.expand(json.loads(new[1])))
    print(f"  {'':<12} read back (json.loads + expand): {t_read:.2f} s, {len(back)} ranks")
    old = _timed(lambda: dumper.stacks_report(stacks)) if before else None
    print(_row("stacks", old, _timed(lambda: dumper.stacks_file(stacks))))
    old = _timed(lambda: dumper.dump_file_lines(pickles, grouped=False)) if before else None
    print(_row("Dump File", old, _timed(lambda: dumper.dump_file_lines(pickles))))
    health = _health(stacks, odd)
    old = _timed(lambda: [*hangreport.health_lines(health, grouped=False),
                          json.dumps(hangreport.health_json(health, grouped=False))]
                 ) if before else None
    print(_row("hang report", old, _timed(lambda: _report(fr, stacks, pickles, health))))


def _health(stacks: list[RankResult], odd: int) -> list[hangreport.RankHealth]:
    """A hang polled: the odd rank healthy, the unreachable ones unknown, every other stalled in
    all_reduce #1999 with its own age (ms apart)."""
    out = []
    for r in stacks:
        if not r.ok:
            out.append(hangreport.RankHealth(r.rank, False, None, error=r.error))
        elif r.rank == odd:
            out.append(hangreport.RankHealth(r.rank, True, True, None, {"in_flight": 0}))
        else:
            age = round(120 + r.rank * 37e-6, 3)
            op = {"group": "main_comm", "seq": 1999, "op": "all_reduce", "age_s": age}
            out.append(hangreport.RankHealth(r.rank, True, False, op, {"in_flight": 1}))
    return out


def _report(fr: FrData, stacks: list[RankResult], pickles: list[RankResult],
            health: list[hangreport.RankHealth]) -> list[str]:
    """The hang report's two files (``HangWatch.write_report``'s, less the fetch)."""
    result = dumper.analyze_fr(fr, stacks, len(stacks))
    texts = {r.rank: r.body for r in stacks if r.ok and r.body is not None}
    rep = hangreport.HangReport("20261128_000000", time.time(), [h for h in health if h.healthy
                                is False], health, result,
                                hangreport.culprits_of(result, texts))
    fetch = FetchFacts.of(fr)
    rep.text = hangreport.render_text(rep, fetch, stacks, pickles)
    return [rep.text, hangreport.report_json(rep, fetch, pickles)]


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 131072])
    p.add_argument("--no-before", action="store_true", help="skip the per-rank builders")
    args = p.parse_args()
    for world in args.sizes:
        run_size(world, not args.no_before)


if __name__ == "__main__":
    main()
