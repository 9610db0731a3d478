"""One agent per host: asks the rank workers on its host, answers rank 0's frontend once.

Without agents, rank 0's frontend sends one request per rank for every page and every health
poll (16384 requests from one host that also trains). With them, each host's local rank 0
starts one small process (``python -m debug_server.agent``, started by
``rank.agent_launch.start_for_rank``)
that outlives a stuck trainer; the frontend asks it once per page and it asks the ranks on its
host (the frontend's own ``fanout.Collector``, so the same timeouts, py-spy fallback for a
stuck rank, member-list sharing and c10d fallback apply). It answers with one merged,
already-digested reply for the host:

- ``agent_fr``: per-rank status and each rank's FR entries near every communicator's frontier
  (``frwindow``: the host's frontier; the frontend computes the job's and asks again with
  ``since=`` only for the ranks whose cut lies above it, exactly its own re-ask protocol;
  ``stacks=true``: the ranks' stacks too, asked in the same request per rank and sent as
  ``agent_stacks`` sends them, with every reply, "unchanged" ones included),
  each distinct call-site stack once per reply (entries name it by index: ``"frames"``),
  long member lists once per reply (``"lists"``, references in the dumps, and none the frontend
  already holds: ``pgknown``), and the host's **mismatch signatures**: per communicator and
  sequence number, each distinct (op, sizes, dtypes) with the ranks that issued it. Every reply
  has a ``tag`` (:func:`fr_tag`); asked again with ``tag=`` and nothing but the ranks' read
  times changed since (a hung host), the reply is ``"unchanged": true`` with the rank records
  and each rank's ``dump_time_ns`` only (the frontend uses the dumps it holds); an asker
  without that tag (a restarted or attached frontend) gets the agent's last full reply for the
  same data again, with this ask's records and read times (``LAST_FULL``), not a new one;
- ``agent_stacks``: per-rank status and the stacks grouped by identity (each distinct text
  once, with the ranks that have it);
- ``agent_fetch?handler=<name>``: the same grouping for ``ping``, the health check and the
  pickle dump (the frontend's health poll becomes one request per host);
- ``agent_info``: which ranks it serves and how many requests of each kind it answered.

Routes and access control are the workers' own (``POST /handler/<name>``, the job's token in
``X-Debug-Server-Token``); bad parameters get 400 with one line. Agents register in the job's
TCPStore as ``debug_server/agent/<host id>`` (:func:`agent_key`: JSON ``url``, ``ranks``,
``restart``, ``pid``); every rank names its host's agent in its own registration sidecar
(``"agent": <host id>``, ``agent_launch.rank_meta``), and ranks keep registering
``debug_server/rank{N}`` as before, so torch's own tools still find every rank. The frontend's
side (which ranks go through which agent, and the fall-back to the rank workers directly when an
agent is missing, dead or slow) is ``agent_fanout``.

The host id is ``$AGENT_ID_ENV`` or else the host name. An agent starts on jobs that span
several hosts; ``$AGENT_ENV=1`` starts one on a single-host job too, ``=0`` never
(``docs/settings.md``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import os
import re
import signal
import socket
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from debug_server import auth
from debug_server.analysis.digest import SNAPSHOT_TIME_KEY
from debug_server.config import take_secrets
from debug_server.errors import first_line
from debug_server.fanout import fastjson
from debug_server.fanout.leanhttp import LeanClient
from debug_server.fanout.live import LiveCollector
from debug_server.fanout.reply import INLINE_DUMPS, FrData
from debug_server.fanout.transport import MAX_BODY_BYTES, RankResult, settle_gc
from debug_server.listen import start_sites
from debug_server.protocol import frwindow, members
from debug_server.protocol.agentwire import FETCH, FETCHABLE, FR, INFO, STACKS, TAG
from debug_server.protocol.wire import WITH_STACKS, HandlerError, handler_routes
from debug_server.rank import discovery, jobpids
from debug_server.rank.agent_launch import (
    AGENT_ENV,
    AGENT_ID_ENV,
    META_KEY,
    agent_key,
    format_ranks,
    host_id,
    parse_ranks,
)
from debug_server.rank.discovery import NOT_REGISTERED, WorkerAddr

if TYPE_CHECKING:
    import torch.distributed as dist

logger = logging.getLogger(__name__)

PARENT_POLL_S = 1.0
REGISTER_TIMEOUT_S = 300.0


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
# Where this host's ranks are


class HostRegistry:
    """This host's ranks' workers, read from the job's store (only these ranks' keys)."""

    def __init__(self, master_addr: str, master_port: int, world_size: int, restart: int,
                 ranks: Sequence[int], my_id: str, timeout: float) -> None:
        self.world_size = world_size
        self.ranks = list(ranks)
        self._addr = (master_addr, master_port)
        self._restart = restart
        self._id = my_id
        self._timeout = timeout
        self._store: dist.Store | None = None
        # One thread: a TCPStore client is not to be shared between threads (fr and stacks
        # of one page arrive together).
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="debug_server.agent")

    def store(self) -> dist.Store:
        if self._store is None:
            self._store = discovery.store_client(*self._addr, timeout=self._timeout)
        return self._store

    def _lookup_sync(self) -> list[WorkerAddr]:
        try:
            store = self.store()
            keys = [discovery.url_key(r) for r in self.ranks]
            present = self.ranks if store.check(keys) else [
                r for r in self.ranks if store.check([discovery.url_key(r)])]
            metas_keys = [discovery.meta_key(r) for r in present]
            # One round trip to the job's store where every rank has its sidecar (ours do).
            with_meta = present if present and store.check(metas_keys) else [
                r for r in present if store.check([discovery.meta_key(r)])]
            urls = dict(zip(present, store.multi_get([discovery.url_key(r) for r in present]),
                            strict=True)) if present else {}
            metas = dict(zip(with_meta, store.multi_get([discovery.meta_key(r) for r in with_meta]),
                             strict=True)) if with_meta else {}
        except Exception as e:  # the store is gone: every rank unknown, one reason
            self._store = None
            reason = f"{NOT_REGISTERED} (agent: store unavailable: {first_line(e, 200)})"
            return [WorkerAddr(r, None, reason) for r in self.ranks]
        out = []
        for r in self.ranks:
            if r not in urls:
                out.append(WorkerAddr(r, None, NOT_REGISTERED))
                continue
            meta = discovery.meta_dict(metas.get(r))
            if r in metas and (meta is None or meta.get("restart") != self._restart):
                out.append(WorkerAddr(r, None, f"{NOT_REGISTERED} (stale or unreadable sidecar)"))
            elif meta is not None and meta.get(META_KEY) not in (None, self._id):
                continue  # another host's agent serves it
            else:
                out.append(WorkerAddr(r, urls[r].decode(errors="replace").rstrip("/"), meta=meta))
        return out

    async def lookup(self) -> list[WorkerAddr]:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._lookup_sync)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class StaticHostRegistry:
    """Fixed URLs for ranks ``first..`` (benchmarks, and tests without a store)."""

    def __init__(self, urls: Sequence[str], first: int, world_size: int) -> None:
        self.world_size = world_size
        self.ranks = list(range(first, first + len(urls)))
        self._urls = [u.rstrip("/") for u in urls]

    async def lookup(self) -> list[WorkerAddr]:
        return [WorkerAddr(r, u) for r, u in zip(self.ranks, self._urls, strict=True)]

    def close(self) -> None:
        pass


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
LAST_FULL_KEPT = 4
FROM_LAST = "agent_fr (from its last full reply)"
"""``agent_info``'s count of full replies sent from :data:`LAST_FULL` (a new asker, same data)."""


async def _addrs(request: web.Request, q: Mapping[str, str]) -> list[WorkerAddr]:
    addrs = await request.app[REGISTRY].lookup()
    if "ranks" in q:
        try:
            wanted_ranks = set(parse_ranks(q["ranks"]))
        except ValueError as e:
            raise BadParam(f"bad parameter ranks={q['ranks'][:40]!r}: {e}") from None
        addrs = [a for a in addrs if a.rank in wanted_ranks]
    return addrs


def _records(results: Sequence[RankResult], with_body: bool) -> tuple[list[dict[str, Any]],
                                                                      list[str]]:
    """Per-rank summaries, and with ``with_body`` each distinct body once (``"body"``: index)."""
    texts: list[str] = []
    index: dict[str, int] = {}
    rows = []
    for r in results:
        row = r.summary()
        if with_body and r.body is not None:
            i = index.get(r.body)
            if i is None:
                i = index[r.body] = len(texts)
                texts.append(r.body)
            row["body"] = i
        rows.append(row)
    return rows, texts


def signatures(dumps: Mapping[int, Mapping[str, Any]]) -> dict[str, dict[str, dict[str, list[int]]]]:
    """Per group and collective seq, each distinct ``op sizes dtypes`` with the ranks that issued
    it: the host's part of the mismatch check, in a few bytes per op."""
    out: dict[str, dict[str, dict[str, list[int]]]] = {}
    texts: dict[str, str] = {}  # repr of the fields -> their JSON (one encode per distinct op)
    for rank, d in sorted(dumps.items()):
        entries = d.get("entries")
        for e in entries if isinstance(entries, list) else ():
            try:
                g = str(e["process_group"][0])
                seq = int(e["collective_seq_id"])
                name = str(e["profiling_name"]).partition(":")[2] or str(e["profiling_name"])
            except (KeyError, TypeError, ValueError, IndexError):
                continue
            if name.partition(" ")[0] in ("send", "recv"):
                continue
            fields = [name, e.get("input_sizes"), e.get("input_dtypes"), e.get("output_sizes")]
            key = repr(fields)
            sig = texts.get(key)
            if sig is None:
                sig = texts[key] = json.dumps(fields, separators=(",", ":"))
            out.setdefault(g, {}).setdefault(str(seq), {}).setdefault(sig, []).append(rank)
    return out


def _share_lists(dumps: Mapping[int, Mapping[str, Any]],
                 known: frozenset[str]) -> tuple[dict[str, Mapping[str, Any]], dict[str, str]]:
    """Dumps with each long member list as a reference, and the lists the frontend lacks."""
    lists: dict[str, str] = {}

    def ref(text: str) -> str:
        d = members.digest(text)
        if d not in known:
            lists[d] = text
        return d

    return {str(r): members.map_lists(d, ref) for r, d in dumps.items()}, lists


def share_frames(dumps: Mapping[str, Mapping[str, Any]]) -> tuple[dict[str, Any], list[Any]]:
    """Dumps whose entries name their call-site stack by index into one list of the distinct
    stacks: the ranks of a host issue the same ops from the same lines, and a real stack is
    most of an entry's bytes."""
    frame_sets: list[Any] = []
    index: dict[str, int] = {}
    out: dict[str, Any] = {}
    for r, d in dumps.items():
        entries = d.get("entries")
        if not isinstance(entries, list):
            out[r] = d
            continue
        shared = []
        for e in entries:
            frames = e.get("frames") if isinstance(e, dict) else None
            if not isinstance(frames, list):
                shared.append(e)
                continue
            key = repr(frames)  # equal stacks read from JSON print alike
            i = index.get(key)
            if i is None:
                i = index[key] = len(frame_sets)
                frame_sets.append(frames)
            shared.append({**e, "frames": i})
        out[r] = {**d, "entries": shared}
    return out, frame_sets


_SNAP_RE = re.compile(r'"' + SNAPSHOT_TIME_KEY + r'"\s*:\s*-?\d+')


def fr_tag(q: Mapping[str, str], results: Sequence[RankResult]) -> str:
    """What one ``agent_fr`` reply for query ``q`` holds, as a short hash: the question, this
    agent's member lists, and each rank's status and reply text less its read time
    (``dump_time_ns`` changes on every ask of a live rank; a hung one's ring does not). For the
    default ask, ``results`` are the first round's (the rest follows from them)."""
    h = hashlib.blake2b(digest_size=12)
    h.update(json.dumps(sorted((k, v) for k, v in q.items() if k not in (TAG, WITH_STACKS)),
                        separators=(",", ":")).encode())
    h.update((members.known_param() or "").encode())
    for r in results:
        h.update(f"\0{r.rank}\0{r.status}\0".encode())
        h.update(_SNAP_RE.sub("", r.body or "").encode(errors="replace"))
    return h.hexdigest()


def _stacks_part(stacks: Sequence[RankResult] | None) -> dict[str, Any]:
    """``stacks=true``: the ranks' stacks as ``agent_stacks`` sends them, under ``"stacks"``."""
    if stacks is None:
        return {}
    rows, texts = _records(stacks, with_body=True)
    return {"stacks": {"ranks": rows, "bodies": texts}}


def _read_times(results: Sequence[RankResult]) -> dict[str, int | None]:
    """Each answering rank's read time (``dump_time_ns``), read off its reply text (no parse)."""
    snap: dict[str, int | None] = {}
    for r in results:
        if r.ok:
            m = _SNAP_RE.search(r.body or "")
            snap[str(r.rank)] = int(m.group(0).rpartition(":")[2]) if m else None
    return snap


def _unchanged_reply(app: web.Application, results: Sequence[RankResult], tag: str,
                     stacks: Sequence[RankResult] | None = None) -> str:
    """The records and each rank's read time, read off its reply text (no parse)."""
    rows, _ = _records(results, with_body=False)
    return fastjson.dumps({"host": app[HOST_ID], "ranks": rows, TAG: tag, "unchanged": True,
                           "snap": _read_times(results), **_stacks_part(stacks)})


def _fr_part(app: web.Application, fr: FrData, known: frozenset[str]) -> str:
    """A full reply's data, as JSON text: what its tag stands for (the ranks' windows and the
    asker's lists), so the same text serves any asker of the same tag (:data:`LAST_FULL`)."""
    for r, d in fr.dumps.items():
        app[GROUPS][r] = sorted(frwindow.rank_groups(d))
    dumps, lists = _share_lists(fr.dumps, known)
    dumps, frame_sets = share_frames(dumps)
    return fastjson.dumps({"dumps": dumps, "lists": lists, "frames": frame_sets,
                           "window": fr.window, "signatures": signatures(fr.dumps)}, default=str)


def _with_part(app: web.Application, results: Sequence[RankResult], tag: str, part: str,
               stacks: Sequence[RankResult] | None, snap: Mapping[str, int | None] | None,
               ) -> str:
    """A full reply: this ask's records (and stacks, and read times where the data part was
    made for an earlier ask) around the data part's text."""
    rows, _ = _records(results, with_body=False)
    head = fastjson.dumps({"host": app[HOST_ID], "ranks": rows, TAG: tag,
                           **({"snap": snap} if snap is not None else {}),
                           **_stacks_part(stacks)}, default=str)
    return head[:-1] + "," + part[1:]


def _fr_reply(app: web.Application, fr: FrData, known: frozenset[str], tag: str,
              stacks: Sequence[RankResult] | None = None, keep: bool = False) -> str:
    part = _fr_part(app, fr, known)
    if keep:  # a new asker of the same tag gets it again (LAST_FULL)
        last = app[LAST_FULL]
        last.pop(tag, None)
        last[tag] = part
        while len(last) > LAST_FULL_KEPT:
            last.pop(next(iter(last)))
    return _with_part(app, fr.results, tag, part, stacks, None)


async def _agent_fr(request: web.Request, q: Mapping[str, str]) -> web.Response:
    _only(q, {"ranks", "window", "since", "whole", "onlyactive", members.PARAM, TAG,
              WITH_STACKS})
    want_stacks = _flag(q, WITH_STACKS)
    if want_stacks and ("since" in q or _flag(q, "whole") or _flag(q, "onlyactive")):
        raise BadParam(f"bad parameter {WITH_STACKS}=true: only with the default window "
                       "(no since, whole or onlyactive)")
    collector = request.app[COLLECTOR]
    addrs = await _addrs(request, q)
    try:
        known = members.parse_known(q.get(members.PARAM, ""))
    except ValueError as e:
        raise BadParam(f"bad parameter {members.PARAM}: {e}") from None
    loop = asyncio.get_running_loop()
    tag: str | None = None
    stacks: Sequence[RankResult] | None = None
    keep = False  # the default ask's full reply is kept for a new asker (LAST_FULL)
    if "since" in q:
        try:
            since = frwindow.parse_since(q["since"])
        except ValueError as e:
            raise BadParam(f"bad parameter since: {e}") from None
        groups = request.app[GROUPS]
        fr = await collector.since_round(since, addrs, {a.rank: set(groups.get(a.rank, since))
                                                     for a in addrs})
    elif _flag(q, "whole") or _flag(q, "onlyactive"):
        fr = await collector.fr(whole=_flag(q, "whole"), only_active=_flag(q, "onlyactive"),
                                addrs=addrs)
    else:
        if "window" in q and q["window"] != str(frwindow.LOCAL_SLACK):
            raise BadParam(f"bad parameter window={q['window'][:20]!r}: only "
                           f"{frwindow.LOCAL_SLACK} is supported")
        # Cut at this host's frontier; a host whose ranks' windows did not change since the
        # asker's tag is answered before any of them is parsed.
        # With stacks=true the ranks' stacks come in the same requests (Collector.fr_stacks),
        # and go with every reply, "unchanged" ones too: stacks are always read fresh.
        texts: dict[int, str] | None = {} if want_stacks else None
        first = await collector.first_round(addrs, texts)
        stacks_read = (asyncio.ensure_future(collector.stacks_after_fr(addrs, first, texts))
                       if texts is not None else None)
        tag = fr_tag(q, first)
        if q.get(TAG) == tag:
            stacks = await stacks_read if stacks_read is not None else None
            return web.Response(text=_unchanged_reply(request.app, first, tag, stacks),
                                content_type="application/json")
        part = request.app[LAST_FULL].get(tag)
        if part is not None:
            # Another asker (a restarted or attached frontend) of data this agent sent whole
            # already: the same data part, this ask's records and read times.
            stacks = await stacks_read if stacks_read is not None else None
            request.app[COUNTS][FROM_LAST] = request.app[COUNTS].get(FROM_LAST, 0) + 1
            return web.Response(text=_with_part(request.app, first, tag, part, stacks,
                                                _read_times(first)),
                                content_type="application/json")
        fr = await collector.complete(addrs, first)
        stacks = await stacks_read if stacks_read is not None else None
        keep = True
    if tag is None:
        tag = fr_tag(q, fr.results)
        if q.get(TAG) == tag:
            return web.Response(text=_unchanged_reply(request.app, fr.results, tag),
                                content_type="application/json")
    # A host's few ranks: encoded here (a thread hop would cost more than the work).
    body = _fr_reply(request.app, fr, known, tag, stacks, keep) \
        if len(fr.dumps) <= INLINE_DUMPS else await loop.run_in_executor(
            None, _fr_reply, request.app, fr, known, tag, stacks, keep)
    return web.Response(text=body, content_type="application/json")


async def _agent_stacks(request: web.Request, q: Mapping[str, str]) -> web.Response:
    _only(q, {"ranks", "native", "every"})
    addrs = await _addrs(request, q)
    results = await request.app[COLLECTOR].stacks(addrs, native=_flag(q, "native"),
                                                  every=_flag(q, "every"))
    rows, texts = _records(results, with_body=True)
    return web.json_response({"host": request.app[HOST_ID], "ranks": rows, "bodies": texts})


async def _agent_fetch(request: web.Request, q: Mapping[str, str]) -> web.Response:
    _only(q, {"ranks", "handler"})
    handler = q.get("handler", "")
    if handler not in FETCHABLE:
        raise BadParam(f"bad parameter handler={handler[:40]!r}: must be one of "
                       f"{', '.join(sorted(FETCHABLE))}")
    addrs = await _addrs(request, q)
    results = await request.app[COLLECTOR].fetch(handler, None, addrs)
    rows, texts = _records(results, with_body=True)
    return web.json_response({"host": request.app[HOST_ID], "ranks": rows, "bodies": texts})


async def _agent_info(request: web.Request, q: Mapping[str, str]) -> web.Response:
    _only(q, set())
    addrs = await request.app[REGISTRY].lookup()
    return web.json_response({"host": request.app[HOST_ID], "pid": os.getpid(),
                              "ranks": [a.rank for a in addrs],
                              "requests": dict(request.app[COUNTS])})


HANDLERS = {FR: _agent_fr, STACKS: _agent_stacks, FETCH: _agent_fetch, INFO: _agent_info}


def _counted(request: web.Request) -> web.Request:
    """What the agent's handlers take: the request; each call is counted (``INFO`` shows it)."""
    name = request.match_info["name"]
    request.app[COUNTS][name] = request.app[COUNTS].get(name, 0) + 1
    return request


routes = handler_routes(HANDLERS, _counted, "agent")


def make_agent_app(registry: Any, my_id: str, *, fetch_timeout: float,
                   max_concurrency: int = 64, token: str | None = None) -> web.Application:
    """The agent app over ``registry`` (its host's ranks); with ``token`` every request must
    carry it, and the agent sends it to the workers."""
    guard = [auth.auth_middleware(auth.TokenGate(token), browser=False)] if token else []
    app = web.Application(middlewares=guard)
    app[REGISTRY] = registry
    app[HOST_ID] = my_id
    app[COUNTS] = {}
    app[GROUPS] = {}
    app[LAST_FULL] = {}
    app[SETTINGS] = {"timeout": fetch_timeout, "concurrency": max_concurrency, "token": token}
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
                                       prime_ranks=2)
            yield
    finally:
        http.close()
    app[REGISTRY].close()


# ---------------------------------------------------------------------------------------------
# Starting it from a rank, and the agent process


def _register(store: dist.Store, my_id: str, url: str, ranks: Sequence[int],
              restart: int) -> None:
    store.set(agent_key(my_id), json.dumps({"url": url, "ranks": format_ranks(ranks),
                                            "restart": restart, "pid": os.getpid(),
                                            "host": socket.gethostname(),
                                            # ranks here name this pid their tracer (jobpids)
                                            "start": jobpids.start_time(os.getpid())}))


async def _serve(args: argparse.Namespace, registry: Any, token: str | None,
                 store: dist.Store | None) -> int:
    app = make_agent_app(registry, args.host_id, fetch_timeout=args.fetch_timeout,
                         max_concurrency=args.max_concurrency, token=token)
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=2.0, access_log=None)
    await runner.setup()
    done = asyncio.Event()
    try:
        port = await start_sites(runner, args.host, args.port)
        host = args.advertise or "127.0.0.1"
        url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        if store is not None:
            await asyncio.get_running_loop().run_in_executor(
                None, _register, store, args.host_id, url, registry.ranks, args.restart_count)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, done.set)
        if args.ready_fd is not None:
            with contextlib.suppress(OSError):
                os.write(args.ready_fd, f"ready {port}\n".encode())
                os.close(args.ready_fd)
        logger.info("debug_server agent %s at %s for ranks %s", args.host_id, url,
                    format_ranks(registry.ranks))
        watch = (asyncio.create_task(_watch_parent(args.parent_pid, done, registry))
                 if args.parent_pid else None)
        await done.wait()
        if watch is not None:
            watch.cancel()
        return 0
    finally:
        await runner.cleanup()


async def _watch_parent(pid: int, done: asyncio.Event, registry: Any = None) -> None:
    """A stuck trainer keeps its agent (that is the point); so does a dead local rank 0 while
    other ranks of this host still run (rank 0 finished early, or was killed, while they hang:
    the frontend still asks through this agent); once none runs, the agent exits."""
    was_child = os.getppid() == pid
    known: list[WorkerAddr] = []
    polls = 0
    while True:
        await asyncio.sleep(PARENT_POLL_S)
        alive = True
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            alive = False
        except PermissionError:
            pass
        parent_here = alive and not (was_child and os.getppid() != pid)
        if registry is not None and (polls % 10 == 0 or not parent_here):
            with contextlib.suppress(Exception):  # the store may be gone with rank 0
                fresh = await registry.lookup()
                known = fresh if any(a.meta for a in fresh) else known
        polls += 1
        if parent_here:
            continue
        if jobpids.running_here(known):
            continue
        logger.warning("debug_server agent: parent process %d is gone and no rank of this "
                       "host runs; exiting", pid)
        done.set()
        return


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m debug_server.agent",
                                description="One host's debug_server agent.")
    p.add_argument("--host-id", default=None, help=f"default ${AGENT_ID_ENV} or the host name")
    p.add_argument("--ranks", required=True, help="this host's ranks, e.g. 0-7")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--master-addr")
    p.add_argument("--master-port", type=int)
    p.add_argument("--restart-count", type=int, default=0)
    p.add_argument("--worker-urls", help="comma-separated URLs of --ranks' workers instead of "
                                         "the store (@FILE: read them from FILE)")
    p.add_argument("--host", default=None, help="bind address (default: all interfaces)")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--advertise", help="address registered for the frontend")
    p.add_argument("--fetch-timeout", type=float, default=5.0)
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--parent-pid", type=int)
    p.add_argument("--ready-fd", type=int)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the agent process."""
    args = _parser().parse_args(argv)
    settle_gc()  # this process is the agent's own
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args.host_id = args.host_id or host_id()
    try:
        ranks = parse_ranks(args.ranks)
    except ValueError as e:
        print(f"error: --ranks: {e}", file=sys.stderr)
        return 2
    settings = take_secrets()
    token, from_store = settings.auth_token, settings.agent_token_from_store
    store = None
    registry: Any
    if args.worker_urls:
        urls = args.worker_urls
        if urls.startswith("@"):
            urls = Path(urls[1:]).read_text().strip()
        url_list = urls.split(",")
        if len(url_list) != len(ranks) or ranks != list(range(ranks[0], ranks[0] + len(ranks))):
            print("error: --worker-urls needs one URL per rank of a contiguous --ranks",
                  file=sys.stderr)
            return 2
        registry = StaticHostRegistry(url_list, ranks[0], args.world_size)
    else:
        if not args.master_addr or not args.master_port:
            print("error: give --master-addr/--master-port or --worker-urls", file=sys.stderr)
            return 2
        registry = HostRegistry(args.master_addr, args.master_port, args.world_size,
                                args.restart_count, ranks, args.host_id,
                                timeout=min(5.0, args.fetch_timeout))
        try:
            store = discovery.store_client(args.master_addr, args.master_port, REGISTER_TIMEOUT_S)
            if token is None and from_store:
                # Like the other ranks: rank 0 puts the job's token in the store.
                token = auth.read_token(store, args.restart_count)
        except Exception as e:
            logger.error("debug_server agent %s: cannot reach the store %s:%s: %s", args.host_id,
                         args.master_addr, args.master_port, first_line(e, 200))
            return 2
    return asyncio.run(_serve(args, registry, token, store))


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["AGENT_ENV", "AGENT_ID_ENV", "FETCHABLE", "META_KEY", "agent_key", "format_ranks",
           "host_id", "make_agent_app", "parse_ranks", "signatures"]
