"""Frontend pages through one agent per fake host, against the same fleet without agents.

Fake ranks are real worker apps serving 2000-entry rings (``benchmarks/fakefleet.py``, replies
memoised per helper process: a real rank cuts its own ring on its own CPU); fake hosts are real
agent apps (``debug_server.agent.app``) over 8 fake ranks each, many on one event loop per
helper process. Ranks and agents register in a real TCPStore exactly as a job's do
(``debug_server/rank{N}`` with a sidecar naming the host's agent, ``debug_server/agent/<id>``),
and the frontend is a real process started as ``start_debug_server`` starts it, reading that
store. Baseline: the same fleet and store before any agent registered (every rank asked
directly: the fall-back path). Each row: end-to-end seconds of ``/fr_trace``, the overview and
``/stacks`` (HTML, medians), the frontend's peak RSS and its CPU while idle, and the ratio
agents / direct.

    python benchmarks/bench_agents.py --ranks 512 4096 --reps 3
    python benchmarks/bench_agents.py --ranks 16384 --reps 1 --helpers 4 --idle-s 70

The idle window should cover a few health polls: the poll interval grows past 1024 ranks
(``hangreport.MAX_POLLS_PER_S``: 32 s at 16384). Where it does, the timed pages wait for the hang
watch's first poll (as on the frontend of a job that has run a while), since the overview then
takes its health column from that poll (``frontend.health_held``); each row says which it used.
At 16384 the watch's second poll (2048 agent requests) falls in the overview's timed pages (they
follow three /fr_trace pages); a page that a poll overlaps pays part of the poll's cost on this
box (its requests go first, ``fanout.pagefirst``, but the poll's agents and fakes share the
cores), as a user's page would. The CPU seconds per page of each kind of
process are printed too: on this box the fake ranks, the agents and the frontend share two
cores, so end-to-end seconds include the agents' work, which a real job spreads over its hosts.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import fakefleet as ff
from torch.distributed.elastic.utils.distributed import get_free_port

from debug_server.config import ServerConfig
from debug_server.frontend import hangreport

PER_HOST = 8
PAGES = (("fr_s", "/fr_trace"), ("overview_s", "/"), ("stacks_s", "/stacks"))


async def _serve_agents(first: int, last: int, world: int, urls_file: str) -> None:
    """Agents of fake hosts ``first..last - 1`` (8 ranks each) on this loop (``serve_apps``)."""
    from debug_server.agent import app as agent
    from debug_server.agent.registry import StaticHostRegistry
    from debug_server.fanout import transport

    urls = Path(urls_file).read_text().split(",")
    apps = []
    for h in range(first, last):
        lo = h * PER_HOST
        apps.append(agent.make_agent_app(StaticHostRegistry(urls[lo:lo + PER_HOST], lo, world),
                                         f"fh{h}", fetch_timeout=120.0, max_concurrency=PER_HOST))
    transport.settle_gc()  # as an agent's own process does (agent.main)
    await ff.serve_apps(apps)


def _start_agents(world: int, urls: list[str], helpers: int,
                  tmp: Path) -> tuple[list[subprocess.Popen[str]], list[str]]:
    """One agent per fake host of ``PER_HOST`` ranks, spread over ``helpers`` processes."""
    (tmp / "urls").write_text(",".join(urls))  # 16384 URLs exceed one argument's limit
    return ff.start_helpers(__file__, [["--serve-agents", str(lo), str(hi), str(world),
                                     str(tmp / "urls")]
                                    for lo, hi in ff.split(world // PER_HOST, helpers)])


def _cpu(pids: list[int]) -> float:
    return sum(ff.cpu_s(p) for p in pids)


def _measure(world: int, store_port: int, reps: int, idle_s: float,
             helpers: dict[str, list[int]]) -> dict[str, Any]:
    started = time.monotonic()
    proc, port = ff.start_frontend(store=("127.0.0.1", store_port), world_size=world,
                                fetch_timeout=120.0)
    base = f"http://127.0.0.1:{port}"
    try:
        ff.timed_get(f"{base}/stacks")  # warm: connections, member lists, agent lookups
        row: dict[str, Any] = {}
        # The first FR page: no agent reply held yet, so no conditional ask (agentwire.TAG) can be
        # answered "unchanged"; the timed pages after it can, as reloads of a hung job's are.
        row["first_fr_json_s"], _ = ff.timed_get(f"{base}/fr_trace?format=json")
        # A frontend that has run a while holds its hang watch's last health poll, which the
        # overview uses where the watch rations its polls (frontend.health_held): wait for the
        # first one, as a user opening the page of a running job would find it.
        poll_s = _poll_interval(world)
        if poll_s > hangreport.MAX_POLL_INTERVAL:
            time.sleep(max(0.0, started + poll_s + POLL_SETTLE_S - time.monotonic()))
        groups = {"frontend": [proc.pid], **helpers}
        for key, path in PAGES:
            before = {g: _cpu(p) for g, p in groups.items()}
            row[key], body = ff.median_of(lambda path=path: ff.timed_get(f"{base}{path}", "text/html"), reps)
            if path == "/":
                m = re.search(rb"Health column: (.*?) of (\d+) s ago", body)
                row["overview_health"] = (f"held: {m.group(1).decode().replace('&#39;', chr(39))}"
                                          f", {int(m.group(2))} s old" if m else "fetched per page")
            # CPU seconds per page of each kind of process: on this box fakes, agents and the
            # frontend share 2 cores, so wall time includes work a real job spreads over hosts.
            row[key + "_cpu"] = {g: (_cpu(p) - before[g]) / reps for g, p in groups.items()}
        _, body = ff.timed_get(f"{base}/fr_trace?format=json")
        fr = json.loads(body)
        row["verdict"] = fr["verdict"]
        row["via_agent"] = sum(1 for r in fr["ranks"] if (r.get("note") or "").startswith("via agent"))
        row["rss_mb"] = ff.status_kb(proc.pid, "VmHWM") / 1024
        c0, t0 = ff.cpu_s(proc.pid), time.monotonic()
        time.sleep(idle_s)
        row["idle_cpu"] = (ff.cpu_s(proc.pid) - c0) / (time.monotonic() - t0)
        return row
    finally:
        ff.end_process(proc)


def _first_page(world: int, store_port: int) -> float:
    """A second frontend's first FR page (restarted, or attached from elsewhere): it holds no
    agent reply, but the agents answered the first frontend already (``agent.LAST_FULL``)."""
    proc, port = ff.start_frontend(store=("127.0.0.1", store_port), world_size=world,
                                   fetch_timeout=120.0)
    base = f"http://127.0.0.1:{port}"
    try:
        ff.timed_get(f"{base}/stacks")  # warm as the first frontend was (_measure)
        seconds, _ = ff.timed_get(f"{base}/fr_trace?format=json")
        return seconds
    finally:
        ff.end_process(proc)


POLL_SETTLE_S = 12.0
"""Seconds after the hang watch's first poll is due by which it has come back (16384 ranks)."""


def _poll_interval(world: int) -> float:
    """The frontend's health poll interval at ``world`` ranks (``HangWatch.poll_interval``)."""
    interval = min(ServerConfig().dump_interval, hangreport.MAX_POLL_INTERVAL)
    return max(interval, world / hangreport.MAX_POLLS_PER_S)


def bench(world: int, reps: int, helpers: int, idle_s: float, store_port: int,
          tmp: Path) -> dict[str, Any]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", store_port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    ds = dist.PrefixStore("debug_server", store)
    fleet, urls = ff.start_fleet(world, helpers, memo=True)
    agents: list[subprocess.Popen[str]] = []
    try:
        for r, u in enumerate(urls):
            ds.set(f"rank{r}", u)
            ds.set(f"rank{r}_meta", json.dumps({"restart": 0, "pid": 0, "host": "fake",
                                                "agent": f"fh{r // PER_HOST}"}))
        pids = {"ranks": [p.pid for p in fleet]}
        direct = _measure(world, store_port, reps, idle_s, pids)
        agents, agent_urls = _start_agents(world, urls, helpers, tmp)
        pids["agents"] = [p.pid for p in agents]
        for h, u in enumerate(agent_urls):
            lo = h * PER_HOST
            ds.set(f"agent/fh{h}", json.dumps({"url": u, "ranks": f"{lo}-{lo + PER_HOST - 1}",
                                               "restart": 0, "pid": 0, "host": "fake"}))
        through = _measure(world, store_port, reps, idle_s, pids)
        through["second_first_fr_s"] = _first_page(world, store_port)
        return {"ranks": world, "direct": direct, "agents": through}
    finally:
        ff.stop_fleet(agents)
        ff.stop_fleet(fleet)
        del store


def _print(row: dict[str, Any]) -> None:
    d, a = row["direct"], row["agents"]
    print(f"\nN={row['ranks']} ({row['ranks'] // PER_HOST} fake hosts): ranks via agents "
          f"{a['via_agent']} / {row['ranks']}; same verdict: {a['verdict'] == d['verdict']}")
    print(f"  verdict: {a['verdict'][:160]}")
    print(f"  {'':>12} {'direct':>10} {'agents':>10} {'agents/direct':>14}")
    for key, path in PAGES:
        print(f"  {path:>12} {d[key]:>8.2f} s {a[key]:>8.2f} s {a[key] / d[key]:>13.2f}x"
              f"   CPU s/page: frontend {d[key + '_cpu']['frontend']:.2f} -> "
              f"{a[key + '_cpu']['frontend']:.2f}, fake ranks {d[key + '_cpu']['ranks']:.2f} -> "
              f"{a[key + '_cpu']['ranks']:.2f}, agents {a[key + '_cpu']['agents']:.2f}")
    print(f"  {'':>12} overview's health column: direct {d['overview_health']}, "
          f"agents {a['overview_health']}")
    print(f"  {'RSS peak':>12} {d['rss_mb']:>7.0f} MB {a['rss_mb']:>7.0f} MB "
          f"{a['rss_mb'] / d['rss_mb']:>13.2f}x")
    print(f"  {'first FR':>12} {d['first_fr_json_s']:>8.2f} s {a['first_fr_json_s']:>8.2f} s "
          f"{a['first_fr_json_s'] / d['first_fr_json_s']:>13.2f}x   (/fr_trace?format=json, "
          "cold: the frontend holds no agent reply to ask conditionally)")
    print(f"  {'2nd frontend':>12} {'':>10} {a['second_first_fr_s']:>8.2f} s {'':>14}   (its first "
          "/fr_trace?format=json: agents send their last full replies again)")
    ratio = f"{a['idle_cpu'] / d['idle_cpu']:.2f}x" if d["idle_cpu"] else "n/a"
    print(f"  {'idle CPU':>12} {d['idle_cpu']:>9.1%} {a['idle_cpu']:>9.1%} {ratio:>14}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[512])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--helpers", type=int, default=2)
    p.add_argument("--idle-s", type=float, default=10.0)
    p.add_argument("--store-port", type=int, default=0, help="the TCPStore's port (0: a free one)")
    p.add_argument("--serve-agents", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_agents:
        first, last, world, urls_file = args.serve_agents
        asyncio.run(_serve_agents(int(first), int(last), int(world), urls_file))
        return
    import tempfile

    print(f"fake ranks: 2000-entry rings, {PER_HOST} per fake host (one agent each); "
          f"{args.helpers} helper processes for ranks and {args.helpers} for agents; "
          f"medians of {args.reps}; idle CPU over {args.idle_s:g} s")
    for n in args.ranks:
        with tempfile.TemporaryDirectory() as tmp:
            _print(bench(n, args.reps, args.helpers, args.idle_s, args.store_port or get_free_port(),
                         Path(tmp)))


if __name__ == "__main__":
    main()
