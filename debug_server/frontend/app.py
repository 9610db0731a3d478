"""The rank-0 frontend: one page for the whole job, in its own process.

``start_debug_server`` runs it as ``python -m debug_server.frontend`` with no arguments, its whole
``config.FrontendConfig`` in an inherited file (``rank.server.spawn_frontend``), so it never
inherits the trainer's state; tests build the app with ``make_frontend_app``. It speaks only
JSON to the workers; it never imports the recording side. ``python -m debug_server.frontend
--store HOST:PORT --world-size N`` attaches the same pages to a running job from any machine
that reaches its TCPStore (``attach``).

Pages: ``/`` (ranks, reachability, health, verdict), ``/fr_trace`` (= ``/torchcomms_fr_trace``)
and ``/stacks``; ``/profile``, ``/tcpstore`` and ``/wait_counters`` (``pages_extra``). Each answers HTML to browsers, the plain-text report to curl (``Accept: */*``) and
JSON to ``Accept: application/json``; ``?format=html|text|json`` overrides.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler

from debug_server.auth import TOKEN_HEADER, TokenGate, auth_middleware
from debug_server.config import (
    FRONTEND_CONFIG_FD_ENV,
    ConfigError,
    FrontendConfig,
    ServerConfig,
    read_inherited,
    take_secrets,
)
from debug_server.errors import first_line
from debug_server.fanout import agents
from debug_server.fanout.leanhttp import LeanClient
from debug_server.fanout.pagefirst import in_background
from debug_server.fanout.transport import MAX_BODY_BYTES, OK, Registry, settle_gc
from debug_server.frontend import (
    attach,
    departed,
    export,
    health_held,
    pages_extra,
    render,
    snapshot,
    stragglers,
)
from debug_server.frontend.dumps import Dumper, analyze_fr, fr_trace_text, stacks_report
from debug_server.frontend.fetchfacts import FetchFacts, rank_rows, stack_rows
from debug_server.frontend.hangreport import HangWatch, parse_health
from debug_server.frontend.lastcycle import LastCycle
from debug_server.frontend.metrics import CycleFill, metrics_response, read_now
from debug_server.frontend.pagekit import (  # noqa: F401 (re-exported: app.load_templates, ...)
    COLLECTOR,
    CONFIG,
    FORMATS,
    MAX_PAGE,
    PAGE_ROWS,
    REGISTRY,
    TEMPLATES,
    BadRequest,
    load_templates,
    negotiate,
)
from debug_server.frontend.pagekit import bool01 as _bool01
from debug_server.frontend.pagekit import off_loop as _off_loop
from debug_server.frontend.pagekit import page_number as _page
from debug_server.frontend.pagekit import parse_format as _format
from debug_server.frontend.pagekit import query as _query
from debug_server.frontend.pagekit import respond as _respond
from debug_server.listen import own_server, start_sites
from debug_server.readers import pyspy
from debug_server.readers.storeview import StaticRegistry, StoreRegistry

logger = logging.getLogger(__name__)

CONNECTIONS_PER_RANK = 8
"""Most connections the frontend holds to one worker (in use plus idle keep-alive)."""
BIND_RETRY_S = 3.0
TRACE_WHOLE_RANKS = 64
"""Up to this many ranks the Perfetto download holds whole rings; above, the live window."""
TRACE_MAX_EVENTS = 1_000_000
"""Most FR entries in one Perfetto download (about 300 MB of trace JSON)."""
TRACE_MIN_PER_RANK = 16
"""How long a busy port is retried (an earlier frontend of an elastic restart may hold it)."""

PARENT_PID = web.AppKey("parent_pid", int)
SHUTDOWN = web.AppKey("shutdown", asyncio.Event)
DEPARTURES = web.AppKey("departures", departed.Departures)
ORPHAN_EXIT_S = web.AppKey("orphan_exit_s", float)
ENDING = web.AppKey("ending", list)
"""Why the frontend stops (the watch's or a signal's phrase; empty while it serves)."""
DUMPER = web.AppKey("dumper", Dumper)
HANG_WATCH = web.AppKey("hang_watch", HangWatch)
LAST_CYCLE = web.AppKey("last_cycle", LastCycle)
"""What the dumper, the hang watch and the metrics cycle saw last: ``/metrics`` reads it."""
METRICS_CYCLE = web.AppKey("metrics_cycle", CycleFill)


# ---------------------------------------------------------------------------------------------
# Pages

routes = web.RouteTableDef()


async def _fr_page(request: web.Request) -> web.Response:
    q = _query(request, {"format": _format, "full": _bool01, "page": _page,
                         "onlyactive": _bool01, "refresh": render.parse_refresh})
    fmt = negotiate(request, q.get("format"))
    # Default: each communicator from its frontier on (every entry that can still disagree);
    # onlyactive=false: whole rings. onlyactive=true names the default (it holds every active entry).
    whole = not q.get("onlyactive", True)
    collector = request.app[COLLECTOR]
    started = time.monotonic()
    addrs = await collector.registry.lookup()
    # One request per rank for both where it can (LiveCollector.fr_stacks); whole rings apart.
    fr, stacks = await (asyncio.gather(collector.fr(whole=True, addrs=addrs),
                                       collector.stacks(addrs)) if whole
                        else collector.fr_stacks(addrs))
    # Whole rings are new objects every time: the collector's memo is for its windows.
    result = await _off_loop(analyze_fr, fr, stacks, collector.world_size,
                             None if whole else collector.digest_memo)
    if not whole and LAST_CYCLE in request.app:  # the job's window: /metrics' newest cycle
        request.app[LAST_CYCLE].put_page(fr, result, started)
    if fmt == "json":
        return _respond(fmt, {**result, "ranks": rank_rows(fr.results, stacks),
                              "fr_window": fr.window})
    fetch = FetchFacts.of(fr)  # what the pages show of the fetch itself
    if fmt == "text":
        return _respond(fmt, await _off_loop(fr_trace_text, result, fetch))
    html = await _off_loop(lambda: render.render_fr_html(
        request.app[TEMPLATES], result, fetch, full=q.get("full", False), page=q.get("page", 1),
        whole=whole))
    return _respond(fmt, html)


@routes.get("/fr_trace")
async def fr_trace(request: web.Request) -> web.Response:
    return await _fr_page(request)


@routes.get("/torchcomms_fr_trace")
async def torchcomms_fr_trace(request: web.Request) -> web.Response:
    return await _fr_page(request)


@routes.get("/fr_trace/trace.json")
async def trace_json(request: web.Request) -> web.Response:
    """The FR entries as a Chrome trace-event timeline (Perfetto), as a download."""
    q = _query(request, {"onlyactive": _bool01})
    only_active = q.get("onlyactive", False)
    collector = request.app[COLLECTOR]
    # Whole rings of a big job are GBs (16384 ranks x 2000 entries): above TRACE_WHOLE_RANKS
    # the download is the live window (every entry that can still disagree), and at most
    # TRACE_MAX_EVENTS entries in all (newest and pending first, per rank).
    whole = not only_active and collector.world_size <= TRACE_WHOLE_RANKS
    fr = await (collector.fr(only_active=only_active, whole=whole) if only_active or whole
                else collector.fr())
    now_ns = collector.data_time_ns()
    per_rank = max(TRACE_MIN_PER_RANK, TRACE_MAX_EVENTS // max(1, len(fr.dumps)))

    def build() -> str:
        dumps = {r: snapshot.cap_entries(d, per_rank) for r, d in fr.dumps.items()}
        trace = export.chrome_trace(dumps, end_ns=now_ns)
        if not whole and not only_active:
            trace.setdefault("otherData", {})["scope"] = (
                f"each communicator from its frontier on, at most {per_rank} entries per rank "
                f"({collector.world_size} ranks > {TRACE_WHOLE_RANKS}: whole rings stay in the "
                "per-rank dumps)")
        return json.dumps(trace)

    body = await _off_loop(build)
    stamp = time.strftime("%Y%m%d_%H%M%S")
    return web.Response(text=body, content_type="application/json", headers={
        "Content-Disposition": f'attachment; filename="fr_trace_{stamp}.trace.json"',
        "X-Debug-Server-Trace-Scope": "whole" if whole else "active" if only_active else "window"})


async def _stacks_page(request: web.Request, *, path: str, every: bool,
                       native_default: bool) -> web.Response:
    allowed: dict[str, Callable[[str], Any]] = {
        "format": _format, "refresh": render.parse_refresh, "native": _bool01}
    if every:  # torch's /pyspy_dump page always sends it; reads here never block unless native
        allowed["nonblocking"] = _bool01
    q = _query(request, allowed)
    fmt = negotiate(request, q.get("format"))
    native = q.get("native", native_default)
    results = await request.app[COLLECTOR].stacks(native=native, every=every)
    if fmt == "json":
        return _respond(fmt, {"native": native, "ranks": stack_rows(results)})
    if fmt == "text":
        return _respond(fmt, await _off_loop(lambda: stacks_report(results)))
    html = await _off_loop(lambda: request.app[TEMPLATES].get_template("stacks.html").render(
        title="py-spy stacks" if every else "Stacks",
        failures=[r.line() for r in results if not r.ok],
        **render.stacks_model(results, path=path, native=native)))
    return _respond(fmt, html)


@routes.get("/stacks")
async def stacks(request: web.Request) -> web.Response:
    """Every rank's stacks: the worker's own, py-spy's for a stuck rank; ``native=1``: all
    through py-spy ``--native`` (Python and C/C++ frames interleaved)."""
    return await _stacks_page(request, path="/stacks", every=False, native_default=False)


@routes.get("/pyspy_dump")
async def pyspy_dump(request: web.Request) -> web.Response:
    """PyTorch's page name: every rank through py-spy, native frames unless ``native=0``."""
    return await _stacks_page(request, path="/pyspy_dump", every=True, native_default=True)


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.StreamResponse:
    """From the frontend's last cycle (``LAST_CYCLE``): a scrape asks no rank. The post-mortem
    viewer's app has no cycles; its collector reads files, read on request."""
    _query(request, {})
    app = request.app
    watch = app.get(HANG_WATCH)
    cycle = app.get(LAST_CYCLE)
    if cycle is None:
        cycle = await read_now(app[COLLECTOR])
    slow = stragglers.held(app)
    slow_age = (max(0.0, time.time() - slow.last_at) if slow is not None
                and slow.last_at is not None else None)
    return await metrics_response(request, cycle, app[COLLECTOR].world_size,
                                  len(watch.reports) if watch else 0,
                                  slow.last if slow is not None else None, slow_age)


def _slow(app: web.Application, result: Mapping[str, Any] | None = None) -> Any:
    """From the straggler watch's last poll (frontend/stragglers.py): without ``result``, that
    result (None before its first poll); with the page's analysis ``result``, the overview's
    "Slow: ..." sentences, and when the job hangs, who had been slow before it and how long."""
    from debug_server.frontend import stragglers

    held = stragglers.held(app)
    if result is None:
        return held.last if held else None
    return held.overview_lines(result) if held else []


@routes.get("/")
async def index(request: web.Request) -> web.Response:
    fmt = negotiate(request, _query(request, {"format": _format, "refresh": render.parse_refresh})
                    .get("format"))
    collector = request.app[COLLECTOR]
    started = time.monotonic()
    addrs = await collector.registry.lookup()
    # At scale the health column comes from the hang watch's last poll (health_held), not
    # from one more fan-out over every rank; the page says how old it is.
    held = health_held.held_health(request.app.get(HANG_WATCH))
    if held is None:
        # Through agents, in the same request per host as the FR data and stacks.
        fr, stack_res, health = await collector.fr_stacks_health(addrs)
        parsed = await _off_loop(parse_health, health)
        if HANG_WATCH in request.app:  # the next overviews show it while young (health_held)
            request.app[HANG_WATCH].hold(health, parsed, started)
        texts = health_held.column_texts(parsed, collector.world_size)
    else:
        fr, stack_res = await collector.fr_stacks(addrs)
        health, texts = stack_res, held.texts(stack_res, collector.world_size)
    result = await _off_loop(analyze_fr, fr, stack_res, collector.world_size,
                             collector.digest_memo)
    if LAST_CYCLE in request.app:  # the job's window: /metrics' newest cycle
        request.app[LAST_CYCLE].put_page(fr, result, started)
    if fmt == "html":  # the ranks table (render.overview_model) has its own rows
        model = await _off_loop(render.overview_model, result, stack_res, texts,
                                collector.world_size, held.note() if held else "")
        html = await _off_loop(lambda: request.app[TEMPLATES].get_template("index.html").render(
            title="Overview", failures=[], slow=_slow(request.app, result), **model))
        return _respond(fmt, html)
    reach = {r.rank: r for r in stack_res}
    rows = [{"rank": r.rank, "url": r.url or "", "status": reach[r.rank].status,
             "line": reach[r.rank].line(), "health": texts[r.rank],
             **({"process": reach[r.rank].process} if reach[r.rank].process else {})}
            for r in health]
    reachable = sum(1 for r in stack_res if r.status == OK)  # answered now (not GONE)
    verdict = result.get("verdict", "")
    if fmt == "json":
        return _respond(fmt, {"world_size": collector.world_size, "reachable": reachable,
                              "verdict": verdict, "category": result.get("category"),
                              "next_step": result.get("next_step"),
                              "findings": result.get("findings", []),
                              "slow": _slow(request.app, result),
                              "ranks": rows,
                              **({"health_age_s": round(held.age_s, 1)} if held else {})})
    lines = [f"debug_server: {reachable}/{collector.world_size} ranks reachable",
             f"Verdict: {verdict}", *_slow(request.app, result),
             *([held.note()] if held else []), ""]
    lines += [f"rank {r['rank']}: {r['status']}, {r['health']}  {r['url']}"
              if r["status"] == "ok" else f"{r['line']}" for r in rows]
    return _respond(fmt, "\n".join(lines) + "\n")


# ---------------------------------------------------------------------------------------------
# App


@web.middleware
async def _one_line_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except Exception as e:  # the traceback goes to the log, one line to the reader
        logger.exception("debug_server frontend: %s failed", request.path)
        return web.Response(status=500, text=f"{request.path} failed: {type(e).__name__}: "
                                             f"{first_line(e, empty='')}\n")


def connections_per_rank(world_size: int) -> int:
    """Connections held per worker: CONNECTIONS_PER_RANK while every rank's fit in this
    process's file limit (1024 kept back), fewer for big jobs (16384 ranks x 8 would not)."""
    soft = _nofile_limit()
    return max(1, min(CONNECTIONS_PER_RANK, (soft - 1024) // max(1, world_size)))


def _nofile_limit() -> int:
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return 1 << 20
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def _raise_nofile_limit() -> None:
    # One socket per rank: a 16384-rank job needs more than the usual soft limit of 1024. The
    # hard limit is ours to use in this process (the frontend's own).
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and hard != resource.RLIM_INFINITY and soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, OSError, ValueError) as e:
        logger.info("debug_server frontend: file limit left as it is (%s)", e)


async def _client_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    # aiohttp caps connections in use, not idle ones: without a per-host cap, keep-alive
    # sockets pile up to the peak concurrency of every rank (ranks x max_concurrency fds).
    connector = aiohttp.TCPConnector(limit=config.max_concurrency,
                                     limit_per_host=connections_per_rank(app[REGISTRY].world_size))
    headers = {TOKEN_HEADER: config.auth_token} if config.auth_token else None
    # The fan-outs' requests go through the lean client (leanhttp: a third of aiohttp's CPU
    # per request, and a page of a 4096-rank job sends over 8000); the rest through aiohttp.
    http = LeanClient(headers, per_host=connections_per_rank(app[REGISTRY].world_size),
                      max_body=MAX_BODY_BYTES)
    try:
        async with aiohttp.ClientSession(connector=connector, headers=headers) as session:
            # Through each host's agent where the store names one (fanout.agents), else per rank.
            collector = agents.collector_for(session, app[REGISTRY],
                                                   timeout=config.fetch_timeout,
                                                   max_concurrency=config.max_concurrency,
                                                   http=http)
            # A rank that is gone keeps its last data on every page, dump and report (departed).
            app[COLLECTOR] = departed.KeepLast(collector, app[DEPARTURES])
            yield
            collector.close()  # the agents' directory (its store client's thread)
    finally:
        http.close()
    app[REGISTRY].close()


async def _background_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    tasks = []
    # What /metrics serves (lastcycle): the dumper's, the hang watch's and the metrics
    # cycle's last results; a scrape itself asks no rank.
    cycle = app[LAST_CYCLE] = LastCycle()
    dumper = None
    if config.dump_dir:
        dumper = Dumper(app[COLLECTOR], config.dump_dir, interval=config.dump_interval,
                        enabled=config.enabled_dumps, keep=config.keep_dumps,
                        keep_bytes=config.keep_bytes, cycle=cycle)
        app[DUMPER] = dumper
        # Background work (this and the hang watch): its requests wait behind a page's, not
        # the page behind them (pagefirst).
        tasks.append(in_background(dumper.run_forever(), name="debug_server.dumper"))
    # Health is polled every min(dump_interval, 2 s) whatever the dump interval, so a hang
    # report lands seconds after a rank stalls (written only with a dump_dir, logged always).
    watch = HangWatch(app[COLLECTOR], config.dump_dir, interval=config.dump_interval,
                      keep=config.keep_dumps, per_rank="per_rank" in config.enabled_dumps,
                      cycle=cycle)
    app[HANG_WATCH] = watch
    tasks.append(in_background(watch.run_forever(), name="debug_server.hang_watch"))
    # /metrics' FR part where no dumper fetch brought one for its interval (metrics.CycleFill).
    fill = app[METRICS_CYCLE] = CycleFill(app[COLLECTOR], cycle, interval=config.dump_interval,
                                          dumper_feeds=dumper is not None and dumper.fetches_fr)
    tasks.append(in_background(fill.run_forever(), name="debug_server.metrics_cycle"))
    # Slow ranks while the job runs (frontend/stragglers.py); a hang report says who had been.
    slow = stragglers.watch_of(app)
    watch.before_hang = slow.before_hang
    tasks.append(in_background(slow.run_forever(), name="debug_server.stragglers"))
    if PARENT_PID in app:  # rank 0's frontend outlives rank 0 while the job lives (departed)
        tasks.append(asyncio.create_task(_watch_job(app), name="debug_server.parent"))
    yield
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await t


async def _watch_job(app: web.Application) -> None:
    app[ENDING].append(await departed.watch(app[PARENT_PID], app[REGISTRY], app[DEPARTURES],
                                            app[ORPHAN_EXIT_S], app[SHUTDOWN]))


def make_frontend_app(config: ServerConfig, registry: Registry,
                      *, parent_pid: int | None = None, collector: Any = None,
                      middlewares: Sequence[Any] = (),
                      orphan_exit_s: float = 120.0) -> web.Application:
    """The frontend app over ``registry``'s workers (and, with ``config.dump_dir``, the dumper).

    With ``config.auth_token`` every page requires it (header, cookie, or ``/?token=`` once)
    and the fan-out sends it to the workers. ``collector`` replaces the live fan-out with an
    object of the same methods (the post-mortem viewer's disk-backed twin, ``view.py``): then
    no client session, dumper or hang watch starts. ``middlewares`` run inside the token check.
    """
    guard = ([auth_middleware(TokenGate(config.auth_token), browser=True)]
             if config.auth_token else [])
    app = web.Application(middlewares=[*guard, *middlewares, _one_line_errors])
    app[CONFIG] = config
    app[REGISTRY] = registry
    app[TEMPLATES] = load_templates()
    app[SHUTDOWN] = asyncio.Event()
    app[ENDING] = []
    app[DEPARTURES] = departed.Departures()
    app[ORPHAN_EXIT_S] = orphan_exit_s
    if parent_pid is not None:
        app[PARENT_PID] = parent_pid
    if collector is None:
        app.cleanup_ctx.append(_client_ctx)
        app.cleanup_ctx.append(_background_ctx)
    else:
        app[COLLECTOR] = collector
    app.add_routes(routes)
    pages_extra.setup(app)  # /profile, /tcpstore, /wait_counters
    stragglers.setup(app)  # /stragglers
    return app


# ---------------------------------------------------------------------------------------------
# The frontend process


def _report_ready(fd: int | None, line: str) -> None:
    if fd is None:
        return
    with contextlib.suppress(OSError):
        os.write(fd, (line.strip() + "\n").encode())
        os.close(fd)


async def _bind(runner: web.AppRunner, config: ServerConfig, retry_s: float) -> int:
    # After an elastic restart the previous frontend may hold the port for a moment longer
    # (it polls its dead parent every second, then shuts down), so a busy port is retried
    # briefly before it is reported. One port for every address family (listen.py), so the
    # link rank 0 prints works over IPv4 and IPv6 even with port=0.
    deadline = asyncio.get_running_loop().time() + retry_s
    while True:
        try:
            return await start_sites(runner, config.host, config.port)
        except OSError as e:
            if e.errno != errno.EADDRINUSE or asyncio.get_running_loop().time() >= deadline:
                raise
        await asyncio.sleep(0.25)


def frontend_registry(config: FrontendConfig) -> Registry:
    """Where a frontend process finds the workers: the job's store, or fixed URLs."""
    if config.worker_urls is not None:
        return StaticRegistry(list(config.worker_urls))
    assert config.store is not None  # FrontendConfig holds exactly one of the two
    # Rank 0's own frontend (it has a parent) is its host's reader: it publishes itself so
    # the ranks here let it ptrace them (jobpids); an attached one reads nothing locally.
    return StoreRegistry(config.store[0], config.store[1], config.world_size,
                         config.restart_count, timeout=min(5.0, config.server.fetch_timeout),
                         announce=config.parent_pid is not None)


async def serve(config: FrontendConfig, *, announce: bool = False) -> int:
    """Serve until SIGTERM/SIGINT or the parent's death; returns the process exit code.

    ``announce``: print the pages' address on stdout (the attach command; rank 0's frontend
    shares the trainer's stdout and only logs it).
    """
    server, ready_fd = config.server, config.ready_fd
    registry = frontend_registry(config)
    app = make_frontend_app(server, registry, parent_pid=config.parent_pid,
                            orphan_exit_s=config.orphan_exit_s)
    async with own_server(app) as runner:
        try:
            port = await _bind(runner, server, BIND_RETRY_S)
        except OSError as e:
            where = f"{server.host or '*'}:{server.port}"
            msg = (f"error: port {server.port} is already in use ({where})"
                   if e.errno == errno.EADDRINUSE else f"error: cannot bind port {server.port} "
                   f"({where}): {e.strerror or e}")
            logger.error("debug_server frontend: %s", msg)
            _report_ready(ready_fd, msg)
            return 3
        _stop_on_signals(app)  # our own process: its signals are ours to handle
        logger.info("debug_server frontend on port %d for %d ranks", port, registry.world_size)
        _report_ready(ready_fd, f"ready {port}")
        if announce:
            host = server.host if server.host not in (None, "0.0.0.0", "::") else socket.gethostname()
            print(f"debug_server frontend: http://{_url_host(host)}:{port}/ for "
                  f"{config.world_size} ranks", flush=True)
        await app[SHUTDOWN].wait()
    # The one line of a job's end (the pages' two lines at start are the others): why, and
    # where the dumps are. Not a warning: a job that ended is nothing wrong by itself.
    logger.info("debug_server frontend: %s%s", app[ENDING][0] if app[ENDING] else "stopped",
                f"; dumps in {server.dump_dir}" if server.dump_dir else "")
    return 0


def _stop_on_signals(app: web.Application) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _stopped_by, app, sig)


def _stopped_by(app: web.Application, sig: signal.Signals) -> None:
    if not app[ENDING]:
        app[ENDING].append(f"stopped by {sig.name}")
    app[SHUTDOWN].set()


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the frontend process (``python -m debug_server.frontend``).

    Started by ``start_debug_server`` (``rank.server.spawn_frontend``), it gets its whole
    ``FrontendConfig`` from an inherited file and takes no arguments. Started by hand, it is the
    attach command (``attach.parser``): ``--store HOST:PORT --world-size N [--port 25999]``.
    """
    args = sys.argv[1:] if argv is None else list(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settle_gc()  # this process is the frontend's own
    _raise_nofile_limit()
    config: FrontendConfig | None = None
    try:
        config = read_inherited()
        attached = config is None
        if config is not None and args:
            raise ConfigError(f"a frontend started with {FRONTEND_CONFIG_FD_ENV} takes no "
                              f"arguments (got {' '.join(args)[:80]!r})")
        # Read once, then gone: py-spy and other children of this process must not inherit them.
        # The frontend's settings are read here only and handed down.
        settings = take_secrets()
        pyspy.use_setting(settings.pyspy)
        if config is None:
            config = attach.config_from_args(args, settings.auth_token)
    except ValueError as e:  # ConfigError, attach.AttachError: one line, no traceback
        line = f"error: {first_line(e, 10_000)}"
        _report_ready(config.ready_fd if config is not None else None, line)
        print(line, file=sys.stderr)
        return 2
    return asyncio.run(serve(config, announce=attached))


if __name__ == "__main__":
    sys.exit(main())
