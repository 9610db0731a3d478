"""Overview page (``/``) at scale: render time and HTML size, against the 2 s / 2 MB budget.

Two measurements on the same synthetic hang (the last rank never issued the newest all_reduce):

- ``in-process``: analysis + view-model + template over N ranks' records, no HTTP (what the
  page's own code costs);
- ``end-to-end``: a GET of ``/`` from the real frontend process (``python -m
  debug_server.frontend.app``) that fans out to N fake ranks (real worker apps serving a
  2000-entry ring, in a few helper processes; see benchmarks/fakefleet.py), as a browser would.

The baseline in the same run is the ``/fr_trace`` HTML page, the heaviest existing page.

    python benchmarks/bench_ui.py                 # N = 512
    python benchmarks/bench_ui.py --ranks 64 512 --reps 3 --in-process-only
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import fakefleet

from debug_server.fanout.reply import FrData
from debug_server.fanout.transport import RankResult
from debug_server.frontend.app import load_templates
from debug_server.frontend.dumps import analyze_fr
from debug_server.frontend.fetchfacts import FetchFacts
from debug_server.frontend.render import overview_model, render_fr_html
from debug_server.tools import synthetic

BUDGET_S = 2.0
BUDGET_BYTES = 2 * 1024 * 1024


def _records(world: int) -> tuple[FrData, list[RankResult]]:
    two = synthetic.hang_job(2, n_entries=2000, missing_rank=1)
    groups = {"main_comm": list(range(world))}
    active = synthetic.make_dump([e for e in two[0]["entries"] if e["state"] != "completed"], groups)
    late = synthetic.make_dump([], groups)
    recs = [RankResult(r, f"http://10.0.{r // 256}.{r % 256}:41234", "ok", body=fakefleet.STACK)
            for r in range(world)]
    return FrData(recs, {r: (late if r == world - 1 else active) for r in range(world)}), recs


def in_process(world: int, reps: int) -> dict[str, Any]:
    env = load_templates()
    fr, recs = _records(world)
    times, fr_times = [], []
    html = fr_html = ""
    for _ in range(reps):
        t0 = time.perf_counter()
        result = analyze_fr(fr, recs, world)
        model = overview_model(result, recs, dict.fromkeys(range(world), "healthy"), world)
        html = env.get_template("index.html").render(title="Overview", failures=[], **model)
        times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        result = analyze_fr(fr, recs, world)
        fr_html = render_fr_html(env, result, FetchFacts.of(fr), full=False, page=1, whole=False)
        fr_times.append(time.perf_counter() - t0)
    return {"s": statistics.median(times), "bytes": len(html.encode()),
            "fr_s": statistics.median(fr_times), "fr_bytes": len(fr_html.encode())}


def end_to_end(world: int, reps: int, helpers: int) -> dict[str, Any]:
    fleet, urls = fakefleet.start_fleet(world, helpers)
    frontend = None
    try:
        frontend, port = fakefleet.start_frontend(urls, fetch_timeout=60.0)
        base = f"http://127.0.0.1:{port}"
        get, median = fakefleet.timed_get, fakefleet.median_of
        get(f"{base}/stacks")  # warm connections
        s, html = median(lambda: get(f"{base}/", "text/html"), reps)
        fr_s, fr_html = median(lambda: get(f"{base}/fr_trace", "text/html"), reps)
        json_s, _ = median(lambda: get(f"{base}/?format=json"), reps)
        print(f"             overview as JSON (same fan-out and analysis, no HTML): "
              f"{json_s * 1000:.1f} ms", flush=True)
        assert b"is missing from all_reduce" in html, html[:2000]
        return {"s": s, "bytes": len(html), "fr_s": fr_s, "fr_bytes": len(fr_html)}
    finally:
        if frontend is not None:
            fakefleet.end_process(frontend)
        fakefleet.stop_fleet(fleet)


def _line(kind: str, world: int, row: dict[str, Any]) -> str:
    ok = row["s"] <= BUDGET_S and row["bytes"] <= BUDGET_BYTES
    return (f"{kind:>11} N={world:4d}: overview {row['s'] * 1000:7.1f} ms, {row['bytes'] / 1024:7.1f} KiB"
            f" | /fr_trace {row['fr_s'] * 1000:7.1f} ms, {row['fr_bytes'] / 1024:7.1f} KiB"
            f" | overview/fr_trace time x{row['s'] / row['fr_s']:.2f}"
            f"  [{'within' if ok else 'OVER'} {BUDGET_S:g} s / {BUDGET_BYTES // 1024 // 1024} MB]")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[512])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--helpers", type=int, default=4, help="processes serving the fake ranks")
    p.add_argument("--in-process-only", action="store_true")
    args = p.parse_args()
    over = False
    for world in args.ranks:
        row = in_process(world, args.reps)
        print(_line("in-process", world, row), flush=True)
        over |= row["bytes"] > BUDGET_BYTES
        if not args.in_process_only:
            row = end_to_end(world, args.reps, args.helpers)
            print(_line("end-to-end", world, row), flush=True)
            over |= row["s"] > BUDGET_S or row["bytes"] > BUDGET_BYTES
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
