"""Frontend latency against N fake ranks, next to PyTorch's build-and-render path on the same data.

Fake ranks are real worker apps (``debug_server.rank.worker``) serving a 2000-entry ring from
``synthetic.hang_job`` (the last rank never issued the newest all_reduce), spread over a few
helper processes (``benchmarks/fakefleet.py``, shared with the other benchmarks). The frontend runs as its own process (``python -m debug_server.frontend``),
exactly as ``start_debug_server`` starts it; this script times HTTP GETs end to end.

PyTorch's baseline: ``FlightRecorderHandler._build_db`` plus the four tabulate HTML tables of
its ``/torchcomms_fr_trace`` page, called in-process on the very JSON bodies the workers serve
(so it gets no fetch cost; ours does).

    python benchmarks/bench_frontend.py              # N = 8, 64, 512
    python benchmarks/bench_frontend.py --ranks 8 64 --reps 5
    python benchmarks/bench_frontend.py --per-rank --ranks 512 2048 4096 16384 --helpers 4 --reps 1
    python benchmarks/bench_frontend.py --c10d --ranks 64 256 512 --reps 3
    python benchmarks/bench_frontend.py --c10d-nccl --per-rank --ranks 256 4096 --reps 3

``--c10d``: the fake ranks answer as PyTorch's own C++ worker does (``fakefleet.c10d_dump``:
c10d's schema, and the whole ring whatever the parameters, since that worker ignores them), so
the frontend takes its fall-back path (our handler 404, then ``fr_trace_json``, cut here).
``--c10d-nccl``: as that worker on a CUDA build, the ring in its NCCL recorder
(``dump_nccl_trace_json``, which honours ``onlyactive``) and an empty CPU recorder; the frontend
asks the NCCL recorder for active entries first (``analysis.activecover``).

``--stragglers`` adds, per row, what the straggler detection (``frontend/stragglers.py``)
costs against the overview page: the lag computation alone (``analysis.stragglers.analyze``,
timed here in-process on the very window the frontend's poll fetches: ``window_for(N)``
collectives per rank) as a share of the overview page's time, and the whole ``/stragglers``
JSON page (its clock round, its fetch and the computation) against the overview.

    python benchmarks/bench_frontend.py --stragglers --per-rank --ranks 512 4096 --reps 3

``--per-rank`` prints, per row, each page's seconds, its cost per rank and that cost against the
first row's (1.00x: linear in ranks; above: superlinear), the frontend's peak RSS and the CPU it
uses while idle (health polls only). Fake ranks share this machine's cores, so at large N the
page times include the fakes' own serving work, which a real job spreads over its hosts.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import statistics
import time
import urllib.request
from typing import Any

from fakefleet import (
    NCCL_TIMING_ENV,
    RING,
    cpu_s,
    end_process,
    median_of,
    start_fleet,
    start_frontend,
    status_kb,
    stop_fleet,
    timed_get,
)


def _torch_baseline(urls: list[str], bodies: list[str]) -> float | None:
    try:
        from tabulate import tabulate
        from torch.distributed.debug._debug_handlers import FlightRecorderHandler
        from torch.distributed.debug._frontend import Response
        from torch.distributed.flight_recorder.components.types import (
            Collective,
            Group,
            Membership,
            NCCLCall,
        )
    except ImportError:
        return None
    _quiet_torch_logger()
    resps = [Response(200, b) for b in bodies]
    t0 = time.perf_counter()
    try:
        db = FlightRecorderHandler._build_db(urls, resps)
    except Exception as e:  # noqa: BLE001 - torch's analyzer on its own gloo schema (KeyError)
        print(f"  torch's _build_db failed: {type(e).__name__}: {str(e)[:100]}")
        return None
    for rows, fields in ((db.groups, Group._fields), (db.memberships, Membership._fields),
                         (db.collectives, Collective._fields), (db.ncclcalls, NCCLCall._fields)):
        tabulate(rows, headers=fields, tablefmt="html")
    return time.perf_counter() - t0


def _quiet_torch_logger() -> None:
    # torch's analyzer logs every finding to stderr; keep the formatting cost, drop the noise.
    for h in logging.getLogger("Flight Recorder").handlers:
        if isinstance(h, logging.StreamHandler):
            h.setStream(io.StringIO())


def _fetch_bodies(urls: list[str], only_active: bool, c10d: bool = False,
                  c10d_nccl: bool = False) -> list[str]:
    q = "true" if only_active else "false"
    handler = ("dump_nccl_trace_json" if c10d_nccl else "fr_trace_json" if c10d
               else "torchcomms_fr_trace_json")
    out = []
    for u in urls:
        req = urllib.request.Request(f"{u}/handler/{handler}?onlyactive={q}", method="POST")
        with urllib.request.urlopen(req, timeout=60) as r:
            out.append(r.read().decode())
    return out


def _idle_cpu(pid: int, seconds: float) -> float | None:
    """Fraction of one core the frontend uses with no page open (its health poll and timers)."""
    if seconds <= 0:
        return None
    c0, t0 = cpu_s(pid), time.monotonic()
    time.sleep(seconds)
    return (cpu_s(pid) - c0) / (time.monotonic() - t0)


def bench(world: int, reps: int, helpers: int, whole_ring_max: int, *, idle_s: float = 0.0,
          skip_torch: bool = False, memo: bool = False, c10d: bool = False,
          c10d_nccl: bool = False, stragglers: bool = False) -> dict[str, Any]:
    fleet, urls = start_fleet(world, helpers, memo, c10d, c10d_nccl)
    frontend = None
    try:
        frontend, port = start_frontend(urls, fetch_timeout=120.0)
        base = f"http://127.0.0.1:{port}"
        timed_get(f"{base}/stacks")  # warm connections
        row: dict[str, Any] = {"ranks": world}
        pid = frontend.pid
        cpu: dict[str, list[float]] = {}

        def page(key: str, url: str, accept: str = "*/*") -> tuple[float, Any]:
            # The frontend's own CPU seconds for the page too: on a shared box the wall time
            # counts whatever else ran (the fakes, other jobs), the frontend's CPU does not.
            c0 = cpu_s(pid)
            out = timed_get(url, accept)
            cpu.setdefault(key, []).append(cpu_s(pid) - c0)
            return out

        row["fr_json_s"], body = median_of(lambda: page("fr_json_s", f"{base}/fr_trace?format=json"), reps)
        verdict = json.loads(body)["verdict"]
        row["fr_html_s"], html = median_of(lambda: page("fr_html_s", f"{base}/fr_trace", "text/html"), reps)
        row["html_bytes"] = len(html)
        row["fr_text_s"], _ = median_of(lambda: page("fr_text_s", f"{base}/fr_trace"), reps)
        row["stacks_s"], _ = median_of(lambda: page("stacks_s", f"{base}/stacks"), reps)
        row["overview_s"], _ = median_of(lambda: page("overview_s", f"{base}/", "text/html"), reps)
        row["cpu"] = {k: statistics.median(v) for k, v in cpu.items()}
        if stragglers:
            _straggler_cost(row, base, urls, reps)
        row["rss_mb"] = status_kb(frontend.pid, "VmHWM") / 1024
        row["idle_cpu"] = _idle_cpu(frontend.pid, idle_s)
        if skip_torch:
            row["torch_active_s"] = None
            row["verdict"] = verdict
            return row
        row["torch_active_s"] = _torch_baseline(urls, _fetch_bodies(urls, True, c10d, c10d_nccl))
        if world <= whole_ring_max:
            row["fr_whole_json_s"], _ = median_of(
                lambda: timed_get(f"{base}/fr_trace?format=json&onlyactive=false"), max(1, reps // 2))
            row["torch_whole_s"] = _torch_baseline(urls, _fetch_bodies(urls, False, c10d,
                                                                       c10d_nccl))
        row["verdict"] = verdict
        return row
    finally:
        if frontend is not None:
            end_process(frontend)
        stop_fleet(fleet)


def _straggler_cost(row: dict[str, Any], base: str, urls: list[str], reps: int) -> None:
    """``--stragglers``: the lag computation alone, and the ``/stragglers`` page, timed."""
    from concurrent.futures import ThreadPoolExecutor

    from debug_server.analysis import stragglers
    from debug_server.frontend.stragglers import window_for

    ops = window_for(len(urls))

    def fetch(u: str) -> dict[str, Any]:
        req = urllib.request.Request(f"{u}/handler/torchcomms_fr_trace_json?window={ops}",
                                     method="POST")
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())

    with ThreadPoolExecutor(16) as pool:
        dumps = dict(enumerate(pool.map(fetch, urls)))
    rule = stragglers.Rule(window_ops=ops)

    def compute() -> tuple[float, Any]:
        t0 = time.perf_counter()
        res = stragglers.analyze(dumps, None, rule)
        return time.perf_counter() - t0, res

    row["lag_compute_s"], res = median_of(compute, reps)
    row["lag_window"] = ops
    row["lag_ops"] = max((g["ops"] for g in res["groups"]), default=0)
    row["stragglers_s"], _ = median_of(
        lambda: timed_get(f"{base}/stragglers?format=json"), reps)


def _print_stragglers(r: dict[str, Any]) -> None:
    share = r["lag_compute_s"] / r["overview_s"]
    print(f"  stragglers: lag computation over {r['lag_ops']} collectives x {r['ranks']} ranks "
          f"(window {r['lag_window']}) {_fmt(r['lag_compute_s'])} = {share:.1%} of the overview "
          f"page ({_fmt(r['overview_s'])}); /stragglers JSON page {_fmt(r['stragglers_s'])} = "
          f"{r['stragglers_s'] / r['overview_s']:.2f}x the overview")


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1000:.0f} ms"


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None or a == 0 else f"{b / a:.2f}x"


PER_RANK_PAGES = (("fr_html_s", "/fr_trace html"), ("fr_json_s", "/fr_trace json"),
                  ("overview_s", "overview"), ("stacks_s", "/stacks"))


def _print_per_rank(rows: list[dict[str, Any]]) -> None:
    """Seconds per page, microseconds per rank, and that against the first row (1.00x = linear)."""
    base = rows[0]
    print(f"  {'ranks':>6}  " + "  ".join(f"{name:>28}" for _, name in PER_RANK_PAGES)
          + "  rss_peak_MB  idle_cpu")
    for r in rows:
        cells = []
        for key, _ in PER_RANK_PAGES:
            per = r[key] / r["ranks"] * 1e6
            ratio = per / (base[key] / base["ranks"] * 1e6)
            cells.append(f"{r[key]:6.2f} s {per:6.0f} us/rank {ratio:4.2f}x")
        idle = r.get("idle_cpu")
        print(f"  {r['ranks']:>6}  " + "  ".join(f"{c:>28}" for c in cells)
              + f"  {r['rss_mb']:>11.0f}  {'n/a' if idle is None else f'{idle:.1%}':>8}")
        print(f"  {'':>6}  " + "  ".join(f"{'frontend CPU ' + format(r['cpu'][key], '.2f') + ' s':>28}"
                                         for key, _ in PER_RANK_PAGES))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 512])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--helpers", type=int, default=2, help="fake-rank helper processes")
    p.add_argument("--whole-ring-max", type=int, default=8,
                   help="also time whole-ring fetches (onlyactive=false) up to this many ranks")
    p.add_argument("--per-rank", action="store_true",
                   help="scaling rows: cost per rank of each page against the first row (no torch "
                        "baseline), the frontend's peak RSS and its CPU while idle")
    p.add_argument("--idle-s", type=float, default=10.0,
                   help="with --per-rank: seconds of idle frontend CPU measured per row")
    p.add_argument("--memo", action="store_true",
                   help="fake ranks answer each distinct question once (their own serving cost "
                        "out of the page time: a real job spreads it over its hosts)")
    p.add_argument("--c10d", action="store_true",
                   help="fake ranks answer as torch's C++ worker (c10d schema, whole rings)")
    p.add_argument("--c10d-nccl", action="store_true",
                   help="fake ranks answer as torch's C++ worker on a CUDA build (the ring in "
                        "its NCCL recorder, which honours onlyactive; an empty CPU recorder)")
    p.add_argument("--nccl-timing", action="store_true",
                   help="with --c10d-nccl: the fakes' groups record c10d's start events (ops "
                        "'started'), as the fakes wrote before issue 31; default: torch's default, none")
    p.add_argument("--stragglers", action="store_true",
                   help="also time the straggler detection against the overview page")
    args = p.parse_args()
    if args.nccl_timing:
        os.environ[NCCL_TIMING_ENV] = "1"  # read by the fake ranks' helper processes
    print(f"fake ranks: {RING}-entry rings from synthetic.hang_job; last rank missing from the "
          f"newest all_reduce; {args.helpers} helper processes; medians of {args.reps}"
          + ("; replies memoised per helper (--memo)" if args.memo else "")
          + ("; ranks answer as torch's C++ worker (--c10d)" if args.c10d else "")
          + ("; ranks answer as torch's C++ worker on a CUDA build (--c10d-nccl)"
             if args.c10d_nccl else ""))
    rows = []
    for n in args.ranks:
        reps = args.reps if n <= 64 or args.per_rank else max(3, args.reps // 2)
        row = bench(n, reps, args.helpers, 0 if args.per_rank else args.whole_ring_max,
                    idle_s=args.idle_s if args.per_rank else 0.0, skip_torch=args.per_rank,
                    memo=args.memo, c10d=args.c10d, c10d_nccl=args.c10d_nccl,
                    stragglers=args.stragglers)
        rows.append(row)
        print(f"\nN={n}: verdict: {row['verdict']}")
        if args.stragglers:
            _print_stragglers(row)
        if args.per_rank:
            _print_per_rank(rows)
            continue
        print(f"  /fr_trace JSON {_fmt(row['fr_json_s'])}  HTML {_fmt(row['fr_html_s'])} "
              f"({row['html_bytes'] / 1e6:.2f} MB)  text {_fmt(row['fr_text_s'])}  "
              f"/stacks {_fmt(row['stacks_s'])}")
        print(f"  torch _build_db + tabulate html on the same active data (no fetch): "
              f"{_fmt(row['torch_active_s'])}  -> ours end to end (HTML) is "
              f"{_ratio(row['fr_html_s'], row['torch_active_s'])} torch's speed")
        if "fr_whole_json_s" in row:
            print(f"  whole rings: ours /fr_trace?onlyactive=false JSON {_fmt(row['fr_whole_json_s'])}"
                  f"; torch _build_db + html {_fmt(row['torch_whole_s'])} -> "
                  f"{_ratio(row['fr_whole_json_s'], row['torch_whole_s'])}")
    if args.per_rank:
        return
    print("\nranks  fr_json   fr_html   html_MB  stacks   torch(active)  torch/ours(html)")
    for r in rows:
        print(f"{r['ranks']:>5}  {_fmt(r['fr_json_s']):>8}  {_fmt(r['fr_html_s']):>8}  "
              f"{r['html_bytes'] / 1e6:>7.2f}  {_fmt(r['stacks_s']):>7}  {_fmt(r['torch_active_s']):>13}  "
              f"{_ratio(r['fr_html_s'], r['torch_active_s']):>8}")


if __name__ == "__main__":
    main()
