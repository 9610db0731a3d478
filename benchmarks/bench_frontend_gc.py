"""The frontend's garbage-collector thresholds: fr + stacks fan-outs over N fake ranks, default
thresholds and ``fanout.GC_THRESHOLDS`` interleaved in one process (same fakes, same load).

    python benchmarks/bench_frontend_gc.py --ranks 4096 --rounds 6
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time

import aiohttp
from fakefleet import start_fleet, stop_fleet

from debug_server.fanout.live import LiveCollector
from debug_server.fanout.transport import GC_THRESHOLDS
from debug_server.frontend.app import CONNECTIONS_PER_RANK
from debug_server.readers.storeview import StaticRegistry

DEFAULT = (700, 10, 10)


async def run(ranks: int, rounds: int, helpers: int) -> dict[tuple[int, int, int], list[float]]:
    fleet, urls = start_fleet(ranks, helpers, memo=True)
    times: dict[tuple[int, int, int], list[float]] = {DEFAULT: [], GC_THRESHOLDS: []}
    try:
        connector = aiohttp.TCPConnector(limit=64, limit_per_host=CONNECTIONS_PER_RANK)
        async with aiohttp.ClientSession(connector=connector) as session:
            c = LiveCollector(session, StaticRegistry(urls), timeout=120)
            await c.fr()  # warm: connections, member lists learnt
            for i in range(2 * rounds):
                th = DEFAULT if i % 2 == 0 else GC_THRESHOLDS
                gc.set_threshold(*th)
                t0 = time.perf_counter()
                await asyncio.gather(c.fr(), c.stacks())
                times[th].append(time.perf_counter() - t0)
    finally:
        gc.set_threshold(*DEFAULT)
        stop_fleet(fleet)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--helpers", type=int, default=4)
    args = p.parse_args()
    times = asyncio.run(run(args.ranks, args.rounds, args.helpers))
    base = statistics.median(times[DEFAULT])
    for th, ts in times.items():
        med = statistics.median(ts)
        print(f"{args.ranks} ranks, gc thresholds {th}: fr + stacks median {med:.2f} s "
              f"({base / med:.2f}x the default's speed) " + " ".join(f"{t:.2f}" for t in ts))


if __name__ == "__main__":
    main()
