"""One agent per host: asks the rank workers on its host, answers rank 0's frontend once.

Without agents, rank 0's frontend sends one request per rank for every page and every health
poll (16384 requests from one host that also trains). With them, each host's local rank 0
starts one small process (``python -m debug_server.agent``, started by
``rank.agent_launch.start_for_rank``)
that outlives a stuck trainer; the frontend asks it once per page and it asks the ranks on its
host (the frontend's own ``fanout.live.LiveCollector``, so the same timeouts, py-spy fallback for a
stuck rank, member-list sharing and c10d fallback apply). It answers with one merged,
already-digested reply for the host:

- ``agent_fr``: per-rank status and each rank's FR entries near every communicator's frontier
  (``frwindow``: the host's frontier; the frontend computes the job's and asks again with
  ``since=`` only for the ranks whose cut lies above it, exactly its own re-ask protocol;
  ``stacks=true``: the ranks' stacks too, asked in the same request per rank and sent as
  ``agent_stacks`` sends them, with every reply, "unchanged" ones included; with
  ``health=true`` their health replies too, under ``"health"``: the overview's three reads in
  one request per host),
  each distinct call-site stack once per reply (entries name it by index: ``"frames"``),
  long member lists once per reply (``"lists"``, references in the dumps, and none the frontend
  already holds: ``pgknown``), and the host's **mismatch signatures**: per communicator and
  sequence number, each distinct (op, sizes, dtypes) with the ranks that issued it (range
  text). Every reply
  has a ``tag`` (:func:`fr_tag`); asked again with ``tag=`` and nothing but the ranks' read
  times changed since (a hung host), the reply is ``"unchanged": true`` with the rank records
  and each rank's ``dump_time_ns`` only (the frontend uses the dumps it holds); an asker
  without that tag (a restarted or attached frontend) gets the agent's last full reply for the
  same data again, with this ask's records and read times (``LAST_FULL``), not a new one;
- ``agent_stacks``: per-rank status and the stacks grouped by identity (each distinct text
  once, with the ranks that have it);
- in every reply, records of ranks that answered alike share one row (``"ranks"``: their range
  text), and in ``agent_fr`` ranks whose windows read the same share one dump (``"same"``:
  ``[[the rank whose dump they have, their range text, their own read times]]``,
  ``agentwire.classes_obj``; read times apart from dumps, ``"snap"``, as
  ``agentwire.times_obj``): an aggregator's thousand ranks (``tree``) go up as a few dumps and
  rows;
- ``agent_fetch?handler=<name>``: the same grouping for ``ping``, the health check and the
  pickle dump (the frontend's health poll becomes one request per host);
- ``agent_info``: which ranks it serves and how many requests of each kind it answered.

Routes and access control are the workers' own (``POST /handler/<name>``, the job's token in
``X-Debug-Server-Token``); bad parameters get 400 with one line. Agents register in the job's
TCPStore as ``debug_server/agent/<host id>`` (``agent_launch.agent_key``: JSON ``url``, ``ranks``,
``restart``, ``pid``); every rank names its host's agent in its own registration sidecar
(``"agent": <host id>``, ``agent_launch.rank_meta``), and ranks keep registering
``debug_server/rank{N}`` as before, so torch's own tools still find every rank. The frontend's
side (which ranks go through which agent, and the fall-back to the rank workers directly when an
agent is missing, dead or slow) is ``fanout.agents``.

The host id is ``$AGENT_ID_ENV`` or else the host name. An agent starts on jobs that span
several hosts; ``$AGENT_ENV=1`` starts one on a single-host job too, ``=0`` never
(``docs/settings.md``).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
from aiohttp import web

from debug_server import auth
from debug_server.agent import hostreply
from debug_server.fanout import recent
from debug_server.fanout.leanhttp import LeanClient
from debug_server.fanout.live import LiveCollector, RouteFor
from debug_server.fanout.reply import INLINE_DUMPS, FrData
from debug_server.fanout.transport import MAX_BODY_BYTES, RankResult
from debug_server.protocol import frwindow, members
from debug_server.protocol.addrs import WorkerAddr, parse_ranks
from debug_server.protocol.agentwire import (
    CLASSES,
    CLOCK,
    EVERY,
    FETCH,
    FETCHABLE,
    FR,
    HANDLER,
    INFO,
    MAX_OPS,
    OPS,
    RANKS,
    RECENT,
    STACKS,
    TAG,
    WHOLE,
    WITH_HEALTH,
)
from debug_server.protocol.names import (
    HEALTH_HANDLER,
    NATIVE,
    ONLY_ACTIVE,
    SINCE,
    WINDOW,
    WITH_STACKS,
)
from debug_server.protocol.wire import HandlerError, handler_routes

# ---------------------------------------------------------------------------------------------
# Parameters


class BadParam(HandlerError):
    """A bad query parameter: 400 with a one-line reason."""

    def __init__(self, reason: str) -> None:
        super().__init__(400, reason)


def _only(q: Mapping[str, str], allowed: set[str]) -> None:
    for k in q:
        if k not in allowed:
            raise BadParam(f"unknown parameter {k!r} "
                           f"(allowed: {', '.join(sorted(allowed)) or 'none'})")


def _flag(q: Mapping[str, str], name: str) -> bool:
    raw = q.get(name, "false").lower()
    if raw not in ("true", "false", "1", "0"):
        raise BadParam(f"bad parameter {name}={raw[:20]!r}: must be true/false")
    return raw in ("true", "1")


# ---------------------------------------------------------------------------------------------
# The agent app

COLLECTOR = web.AppKey("collector", LiveCollector)
REGISTRY = web.AppKey("registry", Any)
HOST_ID = web.AppKey("host_id", str)
COUNTS = web.AppKey("counts", dict)
SETTINGS = web.AppKey("settings", dict)
GROUPS = web.AppKey("groups", dict)
"""rank -> the groups its last reply named (``since`` for a re-ask is cut to them)."""
LAST_FULL = web.AppKey("last_full", dict)
"""tag -> the data part of the last full ``agent_fr`` replies (:func:`_fr_part`), newest last."""
CLOCKS = web.AppKey("clocks", recent.ClockBook)
"""Each asked rank's (or host agent's) clock estimates, kept between straggler polls."""
ASKED = web.AppKey("asked", list)
"""The registry's last read, the last ``ranks`` asked of it, and those ranks (``_addrs``)."""
LAST_FULL_KEPT = 4
FROM_LAST = "agent_fr (from its last full reply)"
"""``agent_info``'s count of full replies sent from :data:`LAST_FULL` (a new asker, same data)."""


async def _addrs(request: web.Request, q: Mapping[str, str]) -> list[WorkerAddr]:
    """The ranks asked (``ranks``; all by default) as the registry has them. The same
    question of the same read gives the same list again (``ASKED``): an aggregator's route
    splits a list it saw before by the same lists as before, and holds what it made of them
    (``agentreply.ranks_param``...), not made again for each of its 128 hosts each page."""
    addrs = await request.app[REGISTRY].lookup()
    if RANKS in q:
        held = request.app[ASKED]
        if held and held[0] is addrs and held[1] == q[RANKS]:
            return held[2]
        try:
            wanted_ranks = set(parse_ranks(q[RANKS]))
        except ValueError as e:
            raise BadParam(f"bad parameter ranks={q['ranks'][:40]!r}: {e}") from None
        got = [a for a in addrs if a.rank in wanted_ranks]
        request.app[ASKED][:] = [addrs, q[RANKS], got]
        return got
    return addrs


def _fr_part(app: web.Application, fr: FrData, known: frozenset[str]) -> str:
    """``hostreply.data_part``; each rank's groups kept for a later ``since`` ask (``GROUPS``)."""
    for r, d in fr.dumps.items():
        app[GROUPS][r] = sorted(frwindow.rank_groups(d))
    return hostreply.data_part(fr, known)


def _fr_reply(app: web.Application, fr: FrData, known: frozenset[str], tag: str,
              parts: hostreply.Parts | None = None, keep: bool = False) -> str:
    part = _fr_part(app, fr, known)
    if keep:  # a new asker of the same tag gets it again (LAST_FULL)
        last = app[LAST_FULL]
        last.pop(tag, None)
        last[tag] = part
        while len(last) > LAST_FULL_KEPT:
            last.pop(next(iter(last)))
    return hostreply.with_part(app[HOST_ID], fr.results, tag, part, parts, None)


async def _agent_fr(request: web.Request, q: Mapping[str, str]) -> web.Response:
    _only(q, {RANKS, WINDOW, SINCE, WHOLE, ONLY_ACTIVE, members.PARAM, TAG,
              WITH_STACKS, WITH_HEALTH, CLASSES})
    want_stacks, want_health = _flag(q, WITH_STACKS), _flag(q, WITH_HEALTH)
    if want_stacks and (SINCE in q or _flag(q, WHOLE) or _flag(q, ONLY_ACTIVE)):
        raise BadParam(f"bad parameter {WITH_STACKS}=true: only with the default window "
                       "(no since, whole or onlyactive)")
    if want_health and not want_stacks:
        raise BadParam(f"bad parameter {WITH_HEALTH}=true: only with {WITH_STACKS}=true")
    collector = request.app[COLLECTOR]
    addrs = await _addrs(request, q)
    try:
        known = members.parse_known(q.get(members.PARAM, ""))
    except ValueError as e:
        raise BadParam(f"bad parameter {members.PARAM}: {e}") from None
    loop = asyncio.get_running_loop()
    tag: str | None = None
    parts: hostreply.Parts | None = None
    keep = False  # the default ask's full reply is kept for a new asker (LAST_FULL)
    routed = collector.route is not None  # an aggregator: through its group's host agents
    if SINCE in q and routed:
        try:
            since = frwindow.parse_since(q[SINCE])
        except ValueError as e:
            raise BadParam(f"bad parameter since: {e}") from None
        fr = await collector.routed_since(since, addrs)
        hostreply.fold_notes(fr.results)
    elif routed and not (_flag(q, WHOLE) or _flag(q, ONLY_ACTIVE)):
        _default_window(q)
        # Its hosts' windows cut at the group's frontier; its tag folds its hosts' tags, so a
        # group none of whose hosts changed answers "unchanged" (nothing encoded).
        fr, parts = await _group_read(collector, addrs, want_stacks, want_health)
        tag = hostreply.group_tag(q, fr.results, collector.route.last_key())
        if tag and q.get(TAG) == tag:
            return web.Response(text=hostreply.unchanged_reply(
                request.app[HOST_ID], fr.results, tag, parts, hostreply.dump_times(fr.dumps)),
                content_type="application/json")
        part = request.app[LAST_FULL].get(tag) if tag else None
        if part is not None:
            request.app[COUNTS][FROM_LAST] = request.app[COUNTS].get(FROM_LAST, 0) + 1
            return web.Response(text=hostreply.with_part(
                request.app[HOST_ID], fr.results, tag, part, parts,
                hostreply.dump_times(fr.dumps)), content_type="application/json")
        keep = bool(tag)  # "": some ranks came another way; no conditional ask then
    elif SINCE in q:
        try:
            since = frwindow.parse_since(q[SINCE])
        except ValueError as e:
            raise BadParam(f"bad parameter since: {e}") from None
        groups = request.app[GROUPS]
        fr = await collector.since_round(since, addrs, {a.rank: set(groups.get(a.rank, since))
                                                     for a in addrs})
    elif _flag(q, WHOLE) or _flag(q, ONLY_ACTIVE):
        fr = await collector.fr(whole=_flag(q, WHOLE), only_active=_flag(q, ONLY_ACTIVE),
                                addrs=addrs)
    else:
        _default_window(q)
        # Cut at this host's frontier; a host whose ranks' windows did not change since the
        # asker's tag is answered before any of them is parsed.
        # With stacks=true the ranks' stacks come in the same requests (LiveCollector.fr_stacks),
        # and go with every reply, "unchanged" ones too: stacks are always read fresh; so is
        # health (health=true), asked of the ranks alongside.
        health_read = asyncio.ensure_future(collector.fetch(HEALTH_HANDLER, None, addrs)) \
            if want_health else None
        texts: dict[int, str] | None = {} if want_stacks else None
        first = await collector.first_round(addrs, texts)
        stacks_read = (asyncio.ensure_future(collector.stacks_after_fr(addrs, first, texts))
                       if texts is not None else None)
        tag = hostreply.fr_tag(q, first)
        if q.get(TAG) == tag:
            parts = await _read_parts(stacks_read, health_read, q)
            return web.Response(text=hostreply.unchanged_reply(request.app[HOST_ID], first, tag, parts),
                                content_type="application/json")
        part = request.app[LAST_FULL].get(tag)
        if part is not None:
            # Another asker (a restarted or attached frontend) of data this agent sent whole
            # already: the same data part, this ask's records and read times.
            parts = await _read_parts(stacks_read, health_read, q)
            request.app[COUNTS][FROM_LAST] = request.app[COUNTS].get(FROM_LAST, 0) + 1
            return web.Response(text=hostreply.with_part(request.app[HOST_ID], first, tag, part,
                                                         parts, hostreply.read_times(first)),
                                content_type="application/json")
        fr = await collector.complete(addrs, first)
        parts = await _read_parts(stacks_read, health_read, q)
        keep = True
    if tag is None:
        tag = hostreply.fr_tag(q, fr.results)
        if q.get(TAG) == tag:
            return web.Response(text=hostreply.unchanged_reply(request.app[HOST_ID], fr.results, tag),
                                content_type="application/json")
    # A host's few ranks: encoded here (a thread hop would cost more than the work).
    body = _fr_reply(request.app, fr, known, tag, parts, keep) \
        if len(fr.dumps) <= INLINE_DUMPS else await loop.run_in_executor(
            None, _fr_reply, request.app, fr, known, tag, parts, keep)
    return web.Response(text=body, content_type="application/json")


def _default_window(q: Mapping[str, str]) -> None:
    if WINDOW in q and q[WINDOW] != str(frwindow.LOCAL_SLACK):
        raise BadParam(f"bad parameter window={q['window'][:20]!r}: only "
                       f"{frwindow.LOCAL_SLACK} is supported")


async def _group_read(collector: LiveCollector, addrs: list[WorkerAddr], want_stacks: bool,
                      want_health: bool) -> tuple[FrData, hostreply.Parts | None]:
    """An aggregator's default window of its group's ranks, with their stacks (and health)
    where asked, through its hosts' agents; notes and stacks folded for the way up."""
    parts: hostreply.Parts | None = None
    if want_health:
        fr, got, health = await collector.fr_stacks_health(addrs)
        parts = {WITH_STACKS: got, WITH_HEALTH: health}
    elif want_stacks:
        fr, got = await collector.fr_stacks(addrs)
        parts = {WITH_STACKS: got}
    else:
        fr = await collector.fr(addrs=addrs)
    hostreply.fold_notes(fr.results)
    if parts:
        hostreply.fold_stacks(parts[WITH_STACKS])
        hostreply.fold_notes(parts.get(WITH_HEALTH))
    return fr, parts


async def _read_parts(stacks: asyncio.Future[list[RankResult]] | None,
                     health: asyncio.Future[list[RankResult]] | None, q: Mapping[str, str],
                     ) -> hostreply.Parts | None:
    """A host's ranks' stacks (and health), read alongside their FR; stacks by class where the
    asker (an aggregator) asks so (``agentwire.CLASSES``)."""
    if stacks is None:
        return None
    got = await stacks
    if _flag(q, CLASSES):
        hostreply.fold_stacks(got)
    return {WITH_STACKS: got, **({WITH_HEALTH: await health} if health is not None else {})}


async def _agent_stacks(request: web.Request, q: Mapping[str, str]) -> web.Response:
    _only(q, {RANKS, NATIVE, EVERY, CLASSES})
    addrs = await _addrs(request, q)
    results = await request.app[COLLECTOR].stacks(addrs, native=_flag(q, NATIVE),
                                                  every=_flag(q, EVERY))
    if request.app[COLLECTOR].route is not None or _flag(q, CLASSES):
        hostreply.fold_stacks(results)
    rows, texts = hostreply.records(results, with_body=True)
    return web.json_response({"host": request.app[HOST_ID], RANKS: rows, "bodies": texts})


async def _agent_fetch(request: web.Request, q: Mapping[str, str]) -> web.Response:
    _only(q, {RANKS, HANDLER})
    handler = q.get(HANDLER, "")
    if handler not in FETCHABLE:
        raise BadParam(f"bad parameter handler={handler[:40]!r}: must be one of "
                       f"{', '.join(sorted(FETCHABLE))}")
    addrs = await _addrs(request, q)
    results = await request.app[COLLECTOR].fetch(handler, None, addrs)
    if request.app[COLLECTOR].route is not None:
        hostreply.fold_notes(results)
    rows, texts = hostreply.records(results, with_body=True)
    return web.json_response({"host": request.app[HOST_ID], RANKS: rows, "bodies": texts})


async def _agent_recent(request: web.Request, q: Mapping[str, str]) -> web.Response:
    """The straggler poll's read over the asked ranks (``fanout.recent``): ``clock=true``, this
    agent's clock at once; else ``ops`` collectives per group of each rank, with its clock."""
    _only(q, {RANKS, OPS, CLOCK})
    if _flag(q, CLOCK):
        return web.json_response(recent.now_reply())
    raw = q.get(OPS, "")
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_OPS:
        raise BadParam(f"bad parameter {OPS}={raw[:20]!r}: must be 1..{MAX_OPS}")
    addrs = await _addrs(request, q)
    got = await recent.read(request.app[COLLECTOR], int(raw), addrs, request.app[CLOCKS])
    body = await asyncio.get_running_loop().run_in_executor(None, recent.encode_bytes, got) \
        if recent.big(got) else recent.encode_bytes(got)
    return web.Response(body=body, content_type="application/json")


async def _agent_info(request: web.Request, q: Mapping[str, str]) -> web.Response:
    _only(q, set())
    addrs = await request.app[REGISTRY].lookup()
    return web.json_response({"host": request.app[HOST_ID], "pid": os.getpid(),
                              RANKS: [a.rank for a in addrs],
                              "requests": dict(request.app[COUNTS])})


HANDLERS = {FR: _agent_fr, STACKS: _agent_stacks, FETCH: _agent_fetch, INFO: _agent_info,
            RECENT: _agent_recent}


def _counted(request: web.Request) -> web.Request:
    """What the agent's handlers take: the request; each call is counted (``INFO`` shows it)."""
    name = request.match_info["name"]
    request.app[COUNTS][name] = request.app[COUNTS].get(name, 0) + 1
    return request


routes = handler_routes(HANDLERS, _counted, "agent")


def make_agent_app(registry: Any, my_id: str, *, fetch_timeout: float,
                   max_concurrency: int = 64, token: str | None = None,
                   route: RouteFor | None = None) -> web.Application:
    """The agent app over ``registry`` (its host's ranks); with ``token`` every request must
    carry it, and the agent sends it to the workers. ``route``: an aggregator's
    (``agent.tree``), whose collector asks its group's host agents (``fanout.agents``)."""
    guard = [auth.auth_middleware(auth.TokenGate(token), browser=False)] if token else []
    app = web.Application(middlewares=guard)
    app[REGISTRY] = registry
    app[HOST_ID] = my_id
    app[COUNTS] = {}
    app[GROUPS] = {}
    app[LAST_FULL] = {}
    app[ASKED] = []
    app[CLOCKS] = recent.ClockBook()
    app[SETTINGS] = {"timeout": fetch_timeout, "concurrency": max_concurrency, "token": token,
                     "route": route}
    app.cleanup_ctx.append(_client_ctx)
    app.add_routes(routes)
    return app


async def _client_ctx(app: web.Application) -> AsyncIterator[None]:
    s = app[SETTINGS]
    connector = aiohttp.TCPConnector(limit=s["concurrency"], limit_per_host=4)
    headers = {auth.TOKEN_HEADER: s["token"]} if s["token"] else None
    http = LeanClient(headers, per_host=4, max_body=MAX_BODY_BYTES)  # as the frontend's (app.py)
    try:
        async with aiohttp.ClientSession(connector=connector, headers=headers) as session:
            # A host's few ranks: one asked first on the first FR ask (fanout.PRIME_RANKS).
            app[COLLECTOR] = LiveCollector(session, app[REGISTRY], timeout=s["timeout"],
                                       max_concurrency=s["concurrency"], http=http,
                                       prime_ranks=2, route=s["route"])
            # An aggregator's host agents' clocks, sampled at quiet moments (fanout.recent).
            sampler = asyncio.ensure_future(recent.sample_clocks(app[COLLECTOR], app[CLOCKS]))
            try:
                yield
            finally:
                sampler.cancel()
                app[COLLECTOR].close()  # its background reads of quiet ranks (fanout.outside)
    finally:
        http.close()
    app[REGISTRY].close()


__all__ = ["COLLECTOR", "FETCHABLE", "LAST_FULL", "make_agent_app", "routes"]
