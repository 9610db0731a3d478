"""cProfile of the frontend's pages against N fake ranks, every frontend cost in one profile.

The frontend runs in this process with its executor replaced by an inline one, so the work it
normally hands to threads (parsing replies, analysis, rendering) shows in the same profile as
the fetch; the HTTP client runs on another thread and is not profiled. Fake ranks are the same
helper processes as ``bench_frontend.py`` (``benchmarks/fakefleet.py``: real worker apps serving
2000-entry rings).

    python benchmarks/profile_frontend.py --ranks 2048 --page /fr_trace --accept text/html
    python benchmarks/profile_frontend.py --ranks 4096 --page / --top 25
    python benchmarks/profile_frontend.py --ranks 256 --c10d --reps 3
    python benchmarks/profile_frontend.py --ranks 4096 --c10d-nccl --page '/fr_trace?format=json'
    python benchmarks/profile_frontend.py --ranks 4096 --c10d-nccl --page / --cpu --warm /stacks /
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import cProfile
import pstats
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

from fakefleet import start_fleet, stop_fleet

from debug_server.config import ServerConfig
from debug_server.fanout.transport import settle_gc
from debug_server.frontend.app import make_frontend_app
from debug_server.readers.storeview import StaticRegistry


class InlineExecutor(concurrent.futures.ThreadPoolExecutor):
    """Runs each submitted call at once on the calling (profiled) thread."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:  # handed to the awaiting coroutine, as a pool would
            fut.set_exception(e)
        return fut


def _client(url: str, accept: str, reps: int, out: list[float], ready: threading.Event) -> None:
    ready.wait()
    for _ in range(reps):
        t0 = time.perf_counter()
        with urllib.request.urlopen(urllib.request.Request(url, headers={"Accept": accept}),
                                    timeout=900) as r:
            r.read()
        out.append(time.perf_counter() - t0)


async def _run(urls: list[str], page: str, accept: str, reps: int, prof: cProfile.Profile,
               warm_pages: list[str]) -> list[float]:
    from aiohttp import web

    asyncio.get_running_loop().set_default_executor(InlineExecutor())
    settle_gc()  # as the frontend process does
    config = ServerConfig(port=0, host="127.0.0.1", fetch_timeout=120.0)
    app = make_frontend_app(config, StaticRegistry(list(urls)))
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    times: list[float] = []
    warm: list[float] = []
    ready = threading.Event()
    ready.set()
    # One unprofiled warm-up (connections, template compilation), then the profiled reps.
    for w in warm_pages:
        t = threading.Thread(target=_client, args=(f"http://127.0.0.1:{port}{w}", accept, 1, warm,
                                                   ready))
        t.start()
        while t.is_alive():
            await asyncio.sleep(0.05)
    go = threading.Event()
    t = threading.Thread(target=_client, args=(f"http://127.0.0.1:{port}{page}", accept, reps, times, go))
    t.start()
    prof.enable()
    go.set()
    while t.is_alive():
        await asyncio.sleep(0.01)
    prof.disable()
    await runner.cleanup()
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=512)
    p.add_argument("--page", default="/fr_trace")
    p.add_argument("--accept", default="text/html")
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--helpers", type=int, default=2)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--sort", default="cumulative")
    p.add_argument("--out", help="write the raw pstats here")
    p.add_argument("--warm", nargs="*", default=["/stacks"],
                   help="pages asked once, unprofiled, before the profiled reps (default: /stacks;"
                        " name the profiled page too for its steady state)")
    p.add_argument("--cpu", action="store_true",
                   help="profile this process's CPU time instead of wall time (on a shared box "
                        "wall time counts every other process's turn as the frontend's)")
    p.add_argument("--memo", action="store_true", help="fake ranks memoise replies (fakefleet)")
    p.add_argument("--c10d", action="store_true",
                   help="fake ranks answer as torch's C++ worker (whole rings, c10d schema)")
    p.add_argument("--c10d-nccl", action="store_true",
                   help="fake ranks answer as torch's C++ worker on a CUDA build (its NCCL recorder)")
    args = p.parse_args()
    fleet, urls = start_fleet(args.ranks, args.helpers, args.memo, c10d=args.c10d, c10d_nccl=args.c10d_nccl)
    prof = cProfile.Profile(time.process_time) if args.cpu else cProfile.Profile()
    try:
        times = asyncio.run(_run(urls, args.page, args.accept, args.reps, prof, args.warm))
    finally:
        stop_fleet(fleet)
    print(f"{args.page} ({args.accept}) at {args.ranks} ranks: "
          + ", ".join(f"{t:.2f} s" for t in times) + " (profiled, so slower than bench_frontend)")
    if args.out:
        prof.dump_stats(args.out)
    stats = pstats.Stats(prof)
    stats.sort_stats(args.sort).print_stats(args.top)
    stats.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
