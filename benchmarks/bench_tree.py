"""The pages of a 4096- to 131072-rank job through the tree (``agent/tree.py``): the frontend asks
one aggregator per 128 hosts, each aggregator asks its hosts' agents.

What is real and what is fake. Real: the TCPStore (every rank's ``debug_server/rank{N}`` key and
sidecar naming its host's agent, every host agent's key, the tree's places, size and group
records, as a job's agents write them); the aggregators (``agent.app.make_agent_app`` over a
``tree.GroupRegistry`` read from that store, through ``fanout.agents.AgentRoute`` over their
hosts' agents: the code an aggregator process runs, many on one loop per helper process); the
frontend (a process started as ``start_debug_server`` starts it, reading the store). Fake: the
hosts and their ranks. A fake host answers ``agent_fr`` (default window, ``stacks=true``,
conditional on its tag), ``agent_stacks`` and ``agent_fetch`` with bodies made once at start by
the real agent's reply code (``agent.hostreply``) from 8 fake ranks' windows (2000-entry rings of
``fakefleet.rank_dumps``, cut as a worker and its agent cut them), with fresh read times on each
"unchanged" reply. So the fake host's own work per page (its agent asking 8 ranks: ~15-40 ms on
its own host, in parallel with every other host) is not on this box; one host agent's page is
timed apart (``bench_agents.py``). Rank 77777 (else the last rank) never issued the newest
all_reduce. What the fake ranks answer is what a real hung job's ranks answer: each its own
stack text (its own thread ids; three threads with source lines, 1.8 KB), and health stalled in
that all_reduce with its own age (ms apart), the missing rank healthy; so the hang watch's first
poll writes a hang report (into a dump dir of the bench's), which the bench waits for, times
and checks before it times the overview from that poll (``--wait-poll``).

    python benchmarks/bench_tree.py --ranks 4096 16384 65536 131072 --reps 3

Each row: the first ``/fr_trace`` of a new frontend (the agents and aggregators have answered
another frontend before, as in a job that has run a while; asked once the frontend's start has
settled, its start's CPU shown apart), reloads of ``/fr_trace``, the
overview and ``/stacks`` (HTML, medians), the frontend's CPU per page and its peak RSS, the
CPU per page of the aggregators and of the fake hosts, the bytes each level sent per page, and
the verdict. ``--cold`` also times the very first page of the first frontend (every level
building its first reply).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any

import fakefleet as ff
from torch.distributed.elastic.utils.distributed import get_free_port

PER_HOST = 8
TREE_HOSTS = 128
PAGES = (("fr_s", "/fr_trace"), ("overview_s", "/"), ("stacks_s", "/stacks"))
CLOSED_URL = "http://127.0.0.1:9"  # a rank's own worker: never asked while its host answers


_BOOTSTRAP = (
    '  File "/usr/lib/python3.11/threading.py", line 975 in run\n'
    "    self._target(*self._args, **self._kwargs)\n"
    '  File "/usr/lib/python3.11/threading.py", line 1038 in _bootstrap_inner\n'
    "    self.run()\n"
    '  File "/usr/lib/python3.11/threading.py", line 995 in _bootstrap\n'
    "    self._bootstrap_inner()\n"
)
"""The outer frames of every thread a rank's Python started (``threading``)."""
_THREADS = (
    "Current thread 0x{t1} (most recent call first):\n"
    '  File "/opt/debug_server/stacks.py", line 37 in capture_stacks\n'
    "    faulthandler.dump_traceback(file=f, all_threads=True)\n"
    '  File "/opt/debug_server/rank/worker.py", line 212 in stacks\n'
    "    return capture_stacks()\n"
    '  File "/usr/lib/python3.11/asyncio/events.py", line 80 in _run\n'
    "    self._context.run(self._callback, *self._args)\n"
    '  File "/usr/lib/python3.11/asyncio/base_events.py", line 1922 in _run_once\n'
    "    handle._run()\n"
    + _BOOTSTRAP +
    "\n"
    "Thread 0x{t2} (most recent call first):\n"
    '  File "/usr/lib/python3.11/threading.py", line 324 in wait\n'
    "    gotit = waiter.acquire(True, timeout)\n"
    '  File "/usr/lib/python3.11/threading.py", line 622 in wait\n'
    "    signaled = self._cond.wait(timeout)\n"
    '  File "/opt/debug_server/recording/comms.py", line 301 in _watch\n'
    "    self._wake.wait(self.interval)\n"
    + _BOOTSTRAP +
    "\n"
    "Thread 0x{t0} (most recent call first):\n"
)
WAITING_STACK = _THREADS + (
    '  File "/torch/distributed/distributed_c10d.py", line 2806 in all_reduce\n'
    "    work = group.allreduce([tensor], opts)\n"
    '  File "/torch/distributed/c10d_logger.py", line 81 in wrapper\n'
    "    return func(*args, **kwargs)\n"
    '  File "/job/train.py", line 95 in step\n'
    "    dist.all_reduce(grad)\n"
    '  File "/job/train.py", line 120 in <module>\n'
    "    step(model)\n"
)
"""Where every rank but the missing one is: in the all_reduce it never joined, as a rank's worker
answers (faulthandler's text with source lines: the worker's own thread that dumped, a watchdog
thread, the main thread), each rank with its own thread ids (``_stack``)."""
MISSING_STACK = _THREADS + (
    '  File "/job/train.py", line 88 in hang_phase\n'
    "    time.sleep(3600)\n"
    '  File "/job/train.py", line 120 in <module>\n'
    "    step(model)\n"
)
"""The missing rank's: ``hang_phase`` at train.py:88."""


def _stack(world: int, rank: int) -> str:
    """Rank ``rank``'s stacks text: its own thread ids, as each process has (so no two ranks'
    texts are equal; ranks alike differ only in their ids)."""
    base = 0x7F0000000000 + rank * 0x100000
    ids = {f"t{i}": f"{base + i * 0x1000:016x}" for i in range(3)}
    return (MISSING_STACK if rank == _missing(world) else WAITING_STACK).format(**ids)


def _missing(world: int) -> int:
    return 77777 if world > 77777 else world - 1


# ---------------------------------------------------------------------------------------------
# Fake hosts: one app per helper process, each host under its own path (/fh<h>)


def _host_bodies(world: int, host: int, full: Mapping[str, Any], missing: Mapping[str, Any],
                 ) -> dict[str, Any]:
    """One host's replies, made by the agent's own reply code (``hostreply``)."""
    from debug_server.agent import hostreply
    from debug_server.fanout.reply import FrData
    from debug_server.fanout.transport import OK, RankResult
    from debug_server.protocol import frwindow

    lo = host * PER_HOST
    ranks = range(lo, min(world, lo + PER_HOST))
    now = time.time_ns()
    # What each rank's worker sends in round 1 (its ring cut at its own frontier less a slack),
    # cut once per kind of rank: every rank but the missing one holds the same ring.
    local = {r: missing if r == _missing(world) else full for r in ranks}
    since = frwindow.frontier(local)
    dumps = {r: {**frwindow.window(d, since), "dump_time_ns": now} for r, d in local.items()}
    url = f"{CLOSED_URL}/r"
    results = [RankResult(r, url, OK, "", None, 0.002, 200) for r in ranks]
    stacks = [RankResult(r, url, OK, _stack(world, r), None,
                         0.002, 200) for r in ranks]
    # What a host agent sends an aggregator, which asks for stacks by class (agentwire.CLASSES)
    classes = [dataclasses.replace(r) for r in stacks]
    hostreply.fold_stacks(classes)
    health = list(ranks)  # answered per request (``_health_rows``): ages grow between polls
    fr = FrData(results, dumps, since)
    tag = f"fh{host}-{world}"
    return {"fr": fr, "results": results, "stacks": stacks, "classes": classes, "tag": tag,
            "health": health, "parts": {}}


HANG_T0 = time.time() - 120.0
"""When the other ranks entered the all_reduce the missing rank never joins (a hang of 2 min
when the bench starts): each a few µs apart (``_health_rows``)."""


def _health_rows(world: int, ranks: list[int]) -> list[Any]:
    """The ranks' health replies now, as a real job's ``torchcomms_health_check`` gives them: the
    missing rank healthy with nothing in flight, every other one stalled in ``all_reduce``
    #1999 with its own age (ms apart: one reply text per rank, as in a real job)."""
    from debug_server.fanout.transport import OK, RankResult

    now, gone = time.time(), _missing(world)
    out = []
    for r in ranks:
        if r == gone:
            text = HEALTHY_TEXT
        else:
            age = round(now - HANG_T0 - (r % 4096) * 37e-6, 3)
            text = STALLED_TEXT % (age, age)
        out.append(RankResult(r, f"{CLOSED_URL}/r", OK, text, None, 0.001, 200))
    return out


HEALTHY_TEXT = json.dumps({"healthy": True, "stalled_op": None, "in_flight": 0,
                           "oldest_in_flight_s": None})
STALLED_TEXT = json.dumps(
    {"healthy": False, "stalled_op": {"group": "main_comm", "seq": 1999, "op": "all_reduce",
                                      "age_s": 0.5}, "in_flight": 1, "oldest_in_flight_s": 0.5},
).replace("0.5", "%r")
"""What ``json.dumps`` writes for a rank stalled with its age (``%r``: a float as JSON writes
it), made by formatting, not encoding: making a fake rank's reply is the rank's own work, which
the bench keeps off this box as it keeps the ranks' FR windows (made once at start)."""


def _recent_reply(world: int, host: int, ops: int) -> dict[str, Any]:
    """What a host's agent answers the straggler poll (``fanout.recent.encode``): its 8 ranks'
    newest ``ops`` all_reduces on main_comm, 100 ms apart, each rank 0-2 ms late at random and
    rank 77777 40 ms more (the rank that later hangs had been arriving last), on the host's
    clock within 20 µs."""
    import random

    rnd = random.Random(host)
    seqs = list(range(2000 - ops, 2000))
    t0 = 1_700_000_000 * 10**9  # every host's ranks issue the same collectives at once
    rows = []
    for r in range(host * PER_HOST, min(world, (host + 1) * PER_HOST)):
        times = [t0 + i * 100_000_000 + int((rnd.uniform(0, 2) + (40 if r == _missing(world)
                                                                  else 0)) * 1e6)
                 for i in range(ops)]
        deltas = [times[0], *(b - a for a, b in zip(times, times[1:], strict=False))]
        rows.append([r, 0, 20_000, {"main_comm": [0, 0, deltas, None]}])
    return {"groups": {"main_comm": {"desc": "default", "ranks": [[0, world - 1]]}},
            "seqs": [seqs], "ops": [["all_reduce"] * ops], "ranks": rows, "failed": []}


def _host_app(world: int, first: int, last: int) -> Any:
    from aiohttp import web

    from debug_server.agent import hostreply
    from debug_server.protocol import agentwire, frwindow, members

    full, missing = (frwindow.local_window(d) for d in ff.rank_dumps(world))
    hosts = {h: _host_bodies(world, h, full, missing) for h in range(first, last)}
    grouped: dict[tuple[int, str], bytes] = {}
    sent = {"bytes": 0, "requests": 0}

    def grouped_body(h: int, kind: str) -> bytes:
        body = grouped.get((h, kind))
        if kind == "health":  # a reply of its own each poll, as ages grow
            rows, texts = hostreply.records(_health_rows(world, hosts[h][kind]), with_body=True)
            return json.dumps({"host": f"fh{h}", "ranks": rows, "bodies": texts}).encode()
        if body is None:
            rows, texts = hostreply.records(hosts[h][kind], with_body=True)
            body = grouped[(h, kind)] = json.dumps(
                {"host": f"fh{h}", "ranks": rows, "bodies": texts}).encode()
        return body

    async def handle(request: web.Request) -> web.Response:
        h = port_host[request.transport.get_extra_info("sockname")[1]]  # type: ignore[union-attr]
        name = request.match_info["name"]
        q = request.query
        b = hosts.get(h)
        if b is None:
            raise web.HTTPNotFound()
        classes = q.get(agentwire.CLASSES) == "true"
        if name == "agent_fr":
            stacks = b["classes" if classes else "stacks"] if q.get("stacks") == "true" else None
            # What the host's agent reads with the FR (agentwire.READ_PARTS): health fresh
            parts = None if stacks is None else {"stacks": stacks, **(
                {"health": _health_rows(world, b["health"])}
                if q.get(agentwire.WITH_HEALTH) == "true" else {})}
            if q.get("tag") == b["tag"]:
                t = time.time_ns()
                for r in b["results"]:
                    b["fr"].dumps[r.rank]["dump_time_ns"] = t
                text = hostreply.unchanged_reply(f"fh{h}", b["results"], b["tag"], parts,
                                                 hostreply.dump_times(b["fr"].dumps))
            else:
                known = members.parse_known(q.get(members.PARAM, ""))
                part = b["parts"].get(known)
                if part is None:
                    part = b["parts"][known] = hostreply.data_part(b["fr"], known)
                text = hostreply.with_part(f"fh{h}", b["results"], b["tag"], part, parts,
                                           hostreply.dump_times(b["fr"].dumps))
            body = text.encode()
        elif name == "agent_stacks":
            body = grouped_body(h, "classes" if classes else "stacks")
        elif name == "agent_fetch":
            body = grouped_body(h, "health")
        elif name == agentwire.RECENT:
            body = json.dumps({"dump_time_ns": time.time_ns()} if q.get(agentwire.CLOCK) == "true"
                              else _recent_reply(world, h, int(q.get(agentwire.OPS, "16")))).encode()
        else:
            raise web.HTTPNotFound()
        sent["bytes"] += len(body)
        sent["requests"] += 1
        return web.Response(body=body, content_type="application/json")

    async def counters(_: web.Request) -> web.Response:
        return web.json_response(sent)

    port_host: dict[int, int] = {}
    app = web.Application()
    app.router.add_post("/handler/{name}", handle)
    app.router.add_get("/sent", counters)
    return app, port_host


async def _serve_hosts(first: int, last: int, world: int) -> None:
    """Each fake host on a port of its own (as each host's agent is): one app, one site per
    host; prints the ports (the first: the counters), serves until stdin closes."""
    import gc
    import sys

    from aiohttp import web

    from debug_server.fanout import transport

    _more_files()
    app, port_host = _host_app(world, first, last)
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    ports = []
    for h in range(first - 1, last):  # first - 1: the counters' own port
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=128)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        port_host[port] = h
        ports.append(port)
    transport.settle_gc()
    gc.freeze()
    print(json.dumps(ports), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await runner.cleanup()


# ---------------------------------------------------------------------------------------------
# Aggregators: real agent apps over the store, many on one loop


def _more_files() -> None:
    """Thousands of hosts' ports and connections in one helper process."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 1 << 20)), hard))


async def _serve_groups(first: int, last: int, world: int, store_port: int) -> None:
    _more_files()
    from aiohttp import web

    from debug_server.agent import tree
    from debug_server.agent.app import make_agent_app
    from debug_server.fanout import transport
    from debug_server.fanout.agentdir import AgentDirectory
    from debug_server.fanout.agents import agent_route

    apps = []
    registries = []
    sent = {"bytes": 0, "requests": 0}

    @web.middleware
    async def count(request: web.Request, handler: Any) -> Any:
        resp = await handler(request)
        body = getattr(resp, "body", None)
        if isinstance(body, bytes | bytearray):
            sent["bytes"] += len(body)
        sent["requests"] += 1
        return resp

    for g in range(first, last):
        registry = tree.GroupRegistry("127.0.0.1", store_port, world, 0, g * TREE_HOSTS,
                                      TREE_HOSTS, timeout=30.0)
        directory = AgentDirectory("127.0.0.1", store_port, 0, timeout=30.0, tree=False)
        app = make_agent_app(registry, tree.group_id(g), fetch_timeout=120.0,
                             max_concurrency=TREE_HOSTS, route=agent_route(directory, classes=True))
        app.middlewares.append(count)
        apps.append(app)
        registries.append(registry)

    async def counters(_: web.Request) -> web.Response:
        return web.json_response(sent)

    side = web.Application()
    side.router.add_get("/sent", counters)
    transport.settle_gc()
    await ff.serve_apps([side, *apps])


# ---------------------------------------------------------------------------------------------
# The store, as a job's ranks and agents fill it


def _fill_store(ds: Any, world: int, host_urls: list[str]) -> None:
    hosts = len(host_urls)
    keys, values = [], []
    for r in range(world):
        keys += [f"rank{r}", f"rank{r}_meta"]
        values += [CLOSED_URL.encode(), json.dumps(
            {"restart": 0, "pid": 0, "host": f"fh{r // PER_HOST}",
             "agent": f"fh{r // PER_HOST}"}).encode()]
    for h, u in enumerate(host_urls):
        lo = h * PER_HOST
        keys += [f"agent/fh{h}", f"tree/0/place/{h}"]
        values += [json.dumps({"url": u, "ranks": f"{lo}-{min(world, lo + PER_HOST) - 1}",
                               "restart": 0, "pid": 0, "host": "fake"}).encode(),
                   f"fh{h}".encode()]
    for i in range(0, len(keys), 8192):
        ds.multi_set(keys[i:i + 8192], values[i:i + 8192])
    ds.set("tree/0/size", str(TREE_HOSTS))
    ds.add("tree/0/hosts", hosts)


def _register_groups(ds: Any, world: int, groups: int, urls: list[str]) -> None:
    """Each aggregator's record, as its process registers it once its ranks are read
    (``tree.GroupRegistry.record``)."""
    from debug_server.agent import tree
    from debug_server.protocol.addrs import format_ranks

    hosts = (world + PER_HOST - 1) // PER_HOST
    for g in range(groups):
        lo, hi = g * TREE_HOSTS * PER_HOST, min(world, (g + 1) * TREE_HOSTS * PER_HOST)
        tree.register(ds, 0, g, json.dumps({
            "url": urls[g], "ranks": format_ranks(range(lo, hi)),
            "hosts": [f"fh{h}" for h in range(g * TREE_HOSTS, min(hosts, (g + 1) * TREE_HOSTS))],
            "restart": 0, "pid": 0}))


# ---------------------------------------------------------------------------------------------
# Measuring


def _sent(urls: list[str]) -> int:
    total = 0
    for u in urls:
        _, body = ff.timed_get(f"{u}/sent")
        total += json.loads(body)["bytes"]
    return total


POLL_SETTLE_S = 20.0
"""Seconds after the hang watch's first poll is due by which it has come back."""


def _poll_interval(world: int) -> float:
    """The frontend's health poll interval at ``world`` ranks (``HangWatch.poll_interval``)."""
    from debug_server.config import ServerConfig
    from debug_server.frontend import hangreport

    interval = min(ServerConfig().dump_interval, hangreport.MAX_POLL_INTERVAL)
    return max(interval, world / hangreport.MAX_POLLS_PER_S)


def _measure(world: int, store_port: int, reps: int, pids: dict[str, list[int]],
             side: dict[str, list[str]], cold: bool, wait_poll: bool) -> dict[str, Any]:
    row: dict[str, Any] = {}
    if cold:  # the very first page: every level builds its first reply
        proc, port = ff.start_frontend(store=("127.0.0.1", store_port), world_size=world,
                                       fetch_timeout=120.0)
        try:
            row["cold_fr_s"], _ = ff.timed_get(f"http://127.0.0.1:{port}/fr_trace?format=json")
        finally:
            ff.end_process(proc)
    else:  # the levels have answered a frontend before (a job that ran a while)
        proc, port = ff.start_frontend(store=("127.0.0.1", store_port), world_size=world,
                                       fetch_timeout=120.0)
        try:
            ff.timed_get(f"http://127.0.0.1:{port}/fr_trace?format=json")
            ff.timed_get(f"http://127.0.0.1:{port}/stacks")
        finally:
            ff.end_process(proc)
    started = time.monotonic()
    # With a dump dir, for the hang report the watch writes at its first poll of the hung job;
    # the periodic dumps are left out (no kind enabled: their cycles fetch nothing; a cycle of
    # every kind at 131072 ranks is a fan-out of its own, which the dumper runs at its start
    # and every dump_interval, and which pages it overlaps then share the box with).
    report_dir = tempfile.mkdtemp(prefix="bench_tree_")
    proc, port = ff.start_frontend(store=("127.0.0.1", store_port), world_size=world,
                                   fetch_timeout=120.0, dump_dir=report_dir,
                                   enabled_dumps=frozenset())
    ready_at = time.time()
    base = f"http://127.0.0.1:{port}"
    try:
        groups = {"frontend": [proc.pid], **pids}
        # Its start's own work first (importing torch for the store client and connecting, in
        # the background once it is ready: ``storeview.StoreRegistry``), as in a job, where the
        # first page comes long after the frontend started; timed apart.
        row["startup_cpu"] = _settled(proc.pid)
        before = {g: ff_cpu(p) for g, p in groups.items()}
        _rss_samples(proc)
        _trace("first /fr_trace")
        spy = _profile(groups, "first_fr_s")
        row["first_fr_s"], body = ff.timed_get(f"{base}/fr_trace?format=json")
        row["first_fr_cpu"] = {g: ff_cpu(p) - before[g] for g, p in groups.items()}
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(30)
        row["rss_first_mb"] = ff.status_kb(proc.pid, "VmHWM") / 1024
        fr = json.loads(body)
        row["verdict"] = fr["verdict"]
        row["json_mb"] = len(body) / 1e6
        row["via_agg"] = _via_aggregator(fr["ranks"])
        for key, path in PAGES:
            _trace(path)
            spy = _profile(groups, key)
            before = {g: ff_cpu(p) for g, p in groups.items()}
            sent0 = {k: _sent(v) for k, v in side.items()}
            times: list[tuple[float, float]] = []  # each rep's seconds and frontend CPU
            row[key], body = ff.median_of(
                lambda path=path, times=times: _kept(times, proc.pid, lambda path=path: (
                    ff.timed_get(f"{base}{path}", "text/html"))), reps)
            row[key + "_reps"] = times
            row[key + "_cpu"] = {g: (ff_cpu(p) - before[g]) / reps for g, p in groups.items()}
            row[key + "_bytes"] = {k: (_sent(v) - sent0[k]) / reps for k, v in side.items()}
            row[key + "_hwm_mb"] = ff.status_kb(proc.pid, "VmHWM") / 1024
            row[key + "_page_kb"] = len(body) / 1024
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                spy.wait(30)
            if path == "/stacks":
                row["stacks_apart"] = _stacks_apart(body, world)
        if wait_poll:
            # The overview as a user finds it on a frontend that has run a while: its health
            # column from the hang watch's last poll (``health_held``), not a fan-out of its own.
            poll_s = _poll_interval(world)
            time.sleep(max(0.0, started + poll_s + POLL_SETTLE_S - time.monotonic()))
            # The watch's first poll finds the job hung and writes its one hang report: the
            # held pages are timed after it (a report is once per stall, pages are every day).
            row.update(_hang_report(report_dir, ready_at + poll_s, world))
            time.sleep(POLL_SETTLE_S / 4)
            _trace("/ (held)")
            spy = _profile(groups, "overview_held_s")
            before = {g: ff_cpu(p) for g, p in groups.items()}
            row["overview_held_s"], body = ff.median_of(
                lambda: ff.timed_get(f"{base}/", "text/html"), reps)
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                spy.wait(30)
            row["overview_held_cpu"] = {g: (ff_cpu(p) - before[g]) / reps
                                        for g, p in groups.items()}
            m = re.search(rb"Health column: (.*?) of (\d+) s ago", body)
            row["overview_health"] = (f"held: {m.group(1).decode().replace('&#39;', chr(39))}, "
                                      f"{int(m.group(2))} s old" if m else "fetched")
            row["overview_held_page_kb"] = len(body) / 1024
        # Last: with --wait-poll minutes into the job's life, as a user meets it (each level's
        # book holds clock samples taken at quiet moments: fanout.recent.sample_clocks).
        row.update(_straggler_poll(base, groups, side, world))
        row.update(_metrics(base, groups, world))
        _trace("done")
        row["rss_mb"] = ff.status_kb(proc.pid, "VmHWM") / 1024
        return row
    finally:
        ff.end_process(proc)
        shutil.rmtree(report_dir, ignore_errors=True)


def _straggler_poll(base: str, groups: dict[str, list[int]], side: dict[str, list[str]],
                    world: int) -> dict[str, Any]:
    """``/stragglers?format=json`` once: the page's own poll (``fanout.recent``: the frontend
    asks each aggregator for its clock and its ranks' times, each aggregator its hosts), its
    seconds, CPU and bytes per level, and whether it names the slow rank alone."""
    _trace("/stragglers")
    spy = _profile(groups, "stragglers_s")
    before = {g: ff_cpu(p) for g, p in groups.items()}
    sent0 = {k: _sent(v) for k, v in side.items()}
    secs, body = ff.timed_get(f"{base}/stragglers?format=json")
    if spy is not None:
        spy.send_signal(signal.SIGINT)
        spy.wait(30)
    named = [s["rank"] for s in json.loads(body)["stragglers"]]
    return {"stragglers_s": secs, "stragglers_cpu": {g: ff_cpu(p) - before[g]
                                                     for g, p in groups.items()},
            "stragglers_bytes": {k: _sent(v) - sent0[k] for k, v in side.items()},
            "stragglers_named": named == [_missing(world)], "stragglers_ranks": named[:8]}


def _metrics(base: str, groups: dict[str, list[int]], world: int) -> dict[str, Any]:
    """``/metrics`` as Prometheus scrapes it (``Accept-Encoding: gzip``), twice, after every
    other page (the last cycle's FR analysis, the hang watch's poll where ``--wait-poll``
    waited for it, the straggler poll just made), then once plain (``curl``): a scrape asks no
    rank; the first renders the families of that cycle and compresses them, the others find
    them made. Each scrape's seconds and frontend CPU, the sizes, and whether the text names
    the missing rank alone (``debug_server_missing_ranks{...,rank="77777"} 1``)."""
    _trace("/metrics")
    spy = _profile(groups, "metrics_s")
    out: list[tuple[float, float]] = []
    sizes: list[int] = []
    text = b""
    for accept in ("gzip", "gzip", "identity"):
        before = ff_cpu(groups["frontend"])
        t0 = time.perf_counter()
        req = urllib.request.Request(f"{base}/metrics", headers={"Accept-Encoding": accept})
        with urllib.request.urlopen(req, timeout=600) as r:
            body = r.read()
            gz = r.headers.get("Content-Encoding") == "gzip"
        out.append((time.perf_counter() - t0, ff_cpu(groups["frontend"]) - before))
        sizes.append(len(body))
        text = gzip.decompress(body) if gz else body
    if spy is not None:
        spy.send_signal(signal.SIGINT)
        spy.wait(30)
    missing = re.findall(rb'^debug_server_missing_ranks\{[^}]*rank="(\d+)"[^}]*\} 1', text,
                         re.MULTILINE)
    return {"metrics_reps": out, "metrics_sizes": sizes,
            "metrics_names": [int(m) for m in missing] == [_missing(world)]}


REPORT_WAIT_S = 240.0
SETTLE_S = 0.5
"""A process whose CPU grew less than a tenth of this over this long has settled."""


def _settled(pid: int, within_s: float = 60.0) -> float:
    """Waits until process ``pid`` is idle (``SETTLE_S``; at most ``within_s``); its CPU
    seconds so far."""
    deadline = time.monotonic() + within_s
    last = ff.cpu_s(pid)
    while time.monotonic() < deadline:
        time.sleep(SETTLE_S)
        now = ff.cpu_s(pid)
        if now - last < SETTLE_S / 10:
            return now
        last = now
    return last


def _kept(times: list[tuple[float, float]], pid: int,
          page: Callable[[], tuple[float, Any]]) -> tuple[float, Any]:
    """``page()``, its seconds and the frontend's CPU seconds kept in ``times``."""
    cpu = ff.cpu_s(pid)
    got = page()
    times.append((got[0], ff.cpu_s(pid) - cpu))
    return got


def _hang_report(report_dir: str, due: float, world: int) -> dict[str, Any]:
    """The hang report of the watch's first poll: seconds from that poll being due to its
    ``.txt`` (bounded wait), both files' sizes, and whether it names the missing rank."""
    _trace("waiting for the hang report")
    deadline = time.monotonic() + REPORT_WAIT_S
    while time.monotonic() < deadline:
        txt = [f for f in os.listdir(report_dir) if f.startswith("hang_report_")
               and f.endswith(".txt")]
        if txt:
            path = os.path.join(report_dir, txt[0])
            text = open(path).read()
            size_json = os.path.getsize(path[:-4] + ".json")
            return {"report_s": os.path.getmtime(path) - due, "report_kb": len(text) / 1024,
                    "report_json_kb": size_json / 1024,
                    "report_names": f"rank {_missing(world)}: missing_ranks" in text}
        time.sleep(0.5)
    return {"report_s": None}


def _trace(what: str) -> None:
    """``BENCH_TRACE=1``: when each phase starts, on stderr (to line up with samples taken
    of the frontend meanwhile)."""
    if os.environ.get("BENCH_TRACE"):
        print(f"{time.strftime('%H:%M:%S')} {what}", file=sys.stderr, flush=True)


def _rss_samples(proc: subprocess.Popen[bytes]) -> None:
    """``BENCH_TRACE=1``: the frontend's resident and peak MB each second they move by 16 MB
    or more, on stderr (which page or poll holds what)."""
    if not os.environ.get("BENCH_TRACE"):
        return

    def sample() -> None:
        last = 0
        while proc.poll() is None:
            try:
                rss, hwm = ff.status_kb(proc.pid) // 1024, ff.status_kb(proc.pid, "VmHWM") // 1024
            except (OSError, RuntimeError):  # the frontend ended
                return
            if abs(rss - last) >= 16:
                _trace(f"  RSS {rss} MB (peak {hwm} MB)")
                last = rss
            time.sleep(1.0)

    threading.Thread(target=sample, daemon=True).start()


def _profile(groups: dict[str, list[int]], key: str) -> subprocess.Popen[bytes] | None:
    """``BENCH_PROFILE=<dir>``: py-spy's raw stacks of the frontend during one kind of page
    (``BENCH_PROFILE_GIL=1``: of the thread holding the GIL only; ``BENCH_PROFILE_OF=aggregators``
    or ``fake hosts``: of that level's first helper process instead)."""
    out = os.environ.get("BENCH_PROFILE")
    if not out:
        return None
    pid = groups[os.environ.get("BENCH_PROFILE_OF", "frontend")][0]
    # BENCH_PROFILE_GIL=1: only the thread holding the GIL (where the CPU goes, not who waits).
    gil = ["--gil"] if os.environ.get("BENCH_PROFILE_GIL") else []
    spy = subprocess.Popen(["py-spy", "record", "-p", str(pid), "-r", "200", "--format", "raw",
                            *gil, "-o", f"{out}/{key}.txt"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # attached
    return spy


def ff_cpu(pids: list[int]) -> float:
    return sum(ff.cpu_s(p) for p in pids)


def _via_aggregator(rows: list[dict[str, Any]]) -> int:
    """Ranks the JSON page's rows say came through an aggregator (a row of ranks alike names
    them as ``global_ranks``: ``fetchfacts.rank_rows``)."""
    from debug_server.protocol.addrs import parse_ranks

    return sum(len(parse_ranks(r["global_ranks"])) if "global_ranks" in r else 1
               for r in rows if "via agent agg-" in (r.get("note") or ""))


def _stacks_apart(html: bytes, world: int) -> bool:
    """The stacks page shows the missing rank apart from the others: a group of its own, the
    first (odd ones first), at train.py:88 (``hang_phase``)."""
    h2 = re.findall(r"<h2>(.*?)</h2>", html.decode(errors="replace"))
    heads = [m.groups() for h in h2 if (m := re.match(r"(rank \d+|\d+ ranks): (.*)", h))]
    return bool(heads) and heads[0][0] == f"rank {_missing(world)}" and \
        "train.py:88" in heads[0][1] and len(heads) == 2


def bench(world: int, reps: int, helpers: int, store_port: int, cold: bool,
          wait_poll: bool) -> dict[str, Any]:
    import torch.distributed as dist

    hosts = (world + PER_HOST - 1) // PER_HOST
    groups = (hosts + TREE_HOSTS - 1) // TREE_HOSTS
    store = dist.TCPStore("127.0.0.1", store_port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    ds = dist.PrefixStore("debug_server", store)
    host_procs: list[subprocess.Popen[str]] = []
    group_procs: list[subprocess.Popen[str]] = []
    try:
        t0 = time.monotonic()
        host_procs, host_bases = ff.start_helpers(
            __file__, [["--serve-hosts", str(lo), str(hi), str(world)]
                       for lo, hi in ff.split(hosts, helpers)])
        host_urls, counter_urls = [], []
        it = iter(host_bases)
        for lo, hi in ff.split(hosts, helpers):
            counter_urls.append(next(it))
            host_urls += [next(it) for _ in range(lo, hi)]
        _fill_store(ds, world, host_urls)
        group_procs, group_bases = ff.start_helpers(
            __file__, [["--serve-groups", str(lo), str(hi), str(world), str(store_port)]
                       for lo, hi in ff.split(groups, helpers)])
        side_urls, group_urls = [], []
        it = iter(group_bases)
        for lo, hi in ff.split(groups, helpers):
            side_urls.append(next(it))
            group_urls += [next(it) for _ in range(lo, hi)]
        _register_groups(ds, world, groups, group_urls)
        setup_s = time.monotonic() - t0
        row = _measure(world, store_port, reps,
                       {"aggregators": [p.pid for p in group_procs],
                        "fake hosts": [p.pid for p in host_procs]},
                       {"aggregators": side_urls, "fake hosts": counter_urls}, cold, wait_poll)
        row.update(ranks=world, hosts=hosts, groups=groups, setup_s=setup_s)
        return row
    finally:
        ff.stop_fleet(group_procs)
        ff.stop_fleet(host_procs)
        del store


def _print(row: dict[str, Any]) -> None:
    print(f"\nN={row['ranks']}: {row['hosts']} fake hosts, {row['groups']} aggregators "
          f"(setup {row['setup_s']:.0f} s); ranks via an aggregator {row['via_agg']}")
    print(f"  verdict: {row['verdict'][:170]}")
    if "cold_fr_s" in row:
        print(f"  cold first /fr_trace (every level's first reply): {row['cold_fr_s']:.2f} s")
    cpu = row["first_fr_cpu"]
    print(f"  new frontend's first /fr_trace?format=json: {row['first_fr_s']:.2f} s; CPU s "
          + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items())
          + f"; JSON {row['json_mb']:.1f} MB (its start before it: {row['startup_cpu']:.2f} "
          "CPU s)")
    for key, path in PAGES:
        c, b = row[key + "_cpu"], row[key + "_bytes"]
        print(f"  {path:>10} {row[key]:6.2f} s   CPU s/page "
              + ", ".join(f"{k} {v:.2f}" for k, v in c.items())
              + "   bytes/page " + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in b.items())
              + f"   RSS peak so far {row[key + '_hwm_mb']:.0f} MB; page {row[key + '_page_kb']:.0f} KB"
              + "; each (frontend CPU): "
              + ", ".join(f"{t:.2f} ({c:.2f})" for t, c in row[key + "_reps"]))
    c, b = row["stragglers_cpu"], row["stragglers_bytes"]
    print(f"  {'/stragglers':>10} {row['stragglers_s']:6.2f} s   CPU s "
          + ", ".join(f"{k} {v:.2f}" for k, v in c.items())
          + "   bytes " + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in b.items())
          + f"   (its own poll through the tree; names rank {_missing(row['ranks'])} alone: "
          f"{row['stragglers_named']}"
          + ("" if row["stragglers_named"] else f"; named {row['stragglers_ranks']}") + ")")
    print(f"  {'/metrics':>10} gzip, gzip, plain: " + ", ".join(
        f"{t:.2f} s ({c:.2f} CPU s; {n / 1e6:.1f} MB)"
        for (t, c), n in zip(row["metrics_reps"], row["metrics_sizes"], strict=True))
          + f"; names rank {_missing(row['ranks'])} missing alone: {row['metrics_names']}")
    if "overview_held_s" in row:
        c = row["overview_held_cpu"]
        print(f"  {'/ (held)':>10} {row['overview_held_s']:6.2f} s   CPU s/page "
              + ", ".join(f"{k} {v:.2f}" for k, v in c.items())
              + f"   ({row['overview_health']}; page {row['overview_held_page_kb']:.0f} KB)")
    if row.get("report_s") is not None:
        print(f"  hang report: written {row['report_s']:.1f} s after the watch's first poll was "
              f"due; .txt {row['report_kb']:.0f} KB, .json {row['report_json_kb']:.0f} KB; "
              f"names rank {_missing(row['ranks'])} as missing: {row['report_names']}")
    elif "report_s" in row:
        print(f"  hang report: none within {REPORT_WAIT_S:.0f} s of the first poll")
    print(f"  frontend RSS peak {row['rss_mb']:.0f} MB (after the first page "
          f"{row['rss_first_mb']:.0f} MB); /stacks shows rank "
          f"{_missing(row['ranks'])} apart: {row['stacks_apart']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[4096])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--helpers", type=int, default=2)
    p.add_argument("--cold", action="store_true")
    p.add_argument("--wait-poll", action="store_true",
                   help="also time the overview once the hang watch's first poll is held")
    p.add_argument("--serve-hosts", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--serve-groups", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_hosts:
        first, last, world = map(int, args.serve_hosts)
        asyncio.run(_serve_hosts(first, last, world))
        return
    if args.serve_groups:
        first, last, world, port = map(int, args.serve_groups)
        asyncio.run(_serve_groups(first, last, world, port))
        return
    print(f"fake hosts of {PER_HOST} ranks, {TREE_HOSTS} hosts per aggregator; "
          f"{args.helpers} helper processes for hosts and {args.helpers} for aggregators; "
          f"medians of {args.reps}")
    for n in args.ranks:
        _print(bench(n, args.reps, args.helpers, get_free_port(), args.cold, args.wait_poll))


if __name__ == "__main__":
    main()
