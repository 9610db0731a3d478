"""Rank-0 pages beyond the hang itself, the ones torch's own debug server has, done for a job:

* ``/profile?duration=S[&ranks=0,2-5]``: every selected rank (all by default) records a
  ``torch.profiler`` trace of its whole process for S seconds (0 < S <= 30), all at once; the
  page shows, per rank, how its GPU time split between communication and compute kernels (their
  overlap, the exposed communication; "no GPU activity" on a rank without kernels) and flags
  the ranks that stand out. ``/profile/trace.json`` downloads all ranks as ONE Chrome/Perfetto
  trace, one process per rank. ``/profile`` alone shows the form and the latest capture. A
  second request while one runs gets 409; a rank that cannot profile (stuck, another profiler
  active) is listed with its reason and the others still come back.
* ``/tcpstore[?prefix=P&limit=N&offset=K]``: the job's TCPStore keys under ``debug_server/`` (or
  ``P``; ``prefix=`` for all), values cut short, secrets redacted (``store_keys``).
* ``/wait_counters``: torch's wait counters of every rank as one table, ranks as columns,
  values that stand out marked; one line where the build has none.

Each answers HTML, text or JSON as the other pages do (``frontend.negotiate``). The capture and
the wait counters come from the worker handlers ``torch_profile`` and ``wait_counter_values``
(``rank_capture``); the merge and the GPU split are ``profile_merge``'s pure functions.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from tabulate import tabulate

from debug_server.analysis import profile_merge, wait_counters
from debug_server.analysis.ranks import format_ranks
from debug_server.auth import TOKEN_HEADER
from debug_server.errors import first_line
from debug_server.fanout.collector import Collector
from debug_server.fanout.transport import RankResult, fan_out
from debug_server.frontend import render
from debug_server.frontend.pagekit import (
    COLLECTOR,
    CONFIG,
    REGISTRY,
    TEMPLATES,
    BadRequest,
    negotiate,
    off_loop,
    parse_format,
    query,
    respond,
)
from debug_server.frontend.store_keys import (
    DEFAULT_LIMIT,
    DEFAULT_PREFIX,
    MAX_LIMIT,
    MAX_OFFSET,
    MAX_PREFIX,
    StoreReader,
    StoreReadError,
)
from debug_server.protocol.names import DURATION, PROFILE_HANDLER, WAIT_COUNTERS_HANDLER
from debug_server.rank.rank_capture import MAX_PROFILE_S, parse_duration
from debug_server.readers.storeview import StoreRegistry

logger = logging.getLogger(__name__)

EXPORT_SLACK_S = 15.0
"""Beyond duration + fetch_timeout, how long a rank may take to write and send its trace."""
MAX_RANKS_TEXT = 2000
MAX_MERGE_BYTES = 2 << 30
"""Most trace text one capture merges (the frontend holds it all, parsed, while merging)."""

routes = web.RouteTableDef()


# ---------------------------------------------------------------------------------------------
# State: one capture at a time, the latest one kept for the download; the store reader


@dataclass(slots=True)
class Capture:
    """One finished ``/profile`` run: what the page shows and the merged trace."""

    id: int
    report: dict[str, Any]
    trace: bytes


@dataclass(slots=True)
class PagesState:
    """What these pages keep between requests (one per app)."""

    running: dict[str, Any] | None = None
    """``{"since": monotonic, "duration", "ranks"}`` while a capture runs."""
    last: Capture | None = None
    next_id: int = 1
    session: aiohttp.ClientSession | None = None
    """Its own session: every rank must be asked at once, whatever the fan-out's bound on
    requests in flight, or the ranks' windows would not cover the same seconds."""
    store: StoreReader | None = None
    live: bool = True


STATE = web.AppKey("pages_extra_state", PagesState)


def setup(app: web.Application) -> None:
    """Add the pages to the frontend ``app`` (called by ``frontend.make_frontend_app``)."""
    # A collector set before us is the post-mortem viewer's: nothing live to ask.
    app[STATE] = PagesState(live=COLLECTOR not in app)
    if app[STATE].live:
        app.cleanup_ctx.append(_ctx)
    app.add_routes(routes)


async def _ctx(app: web.Application) -> AsyncIterator[None]:
    state, config, registry = app[STATE], app[CONFIG], app[REGISTRY]
    if isinstance(registry, StoreRegistry):
        addr, port = registry.store_address
        state.store = StoreReader(addr, port, timeout=registry.store_timeout,
                                  world_size=registry.world_size,
                                  restart_count=registry.restart_count)
    headers = {TOKEN_HEADER: config.auth_token} if config.auth_token else None
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     headers=headers) as session:
        state.session = session
        yield
    state.session = None
    if state.store is not None:
        state.store.close()


# ---------------------------------------------------------------------------------------------
# /profile


def parse_rank_list(raw: str) -> list[int]:
    """``0,2,5-7`` -> ``[0, 2, 5, 6, 7]``; ``ValueError`` for anything else."""
    if not raw or len(raw) > MAX_RANKS_TEXT:
        raise ValueError("must list ranks like 0,2,5-7")
    out: set[int] = set()
    for part in raw.split(","):
        m = re.fullmatch(r"\s*(\d{1,7})\s*(?:-\s*(\d{1,7})\s*)?", part)
        if m is None:
            raise ValueError("must list ranks like 0,2,5-7")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise ValueError(f"range {lo}-{hi} runs backwards")
        if hi - lo > 1_000_000:
            raise ValueError("range too long")
        out.update(range(lo, hi + 1))
    return sorted(out)


def build_capture(results: Sequence[RankResult], *, capture_id: int, duration: float,
                  ranks: Sequence[int], started: str) -> Capture:
    """Parse, summarise and merge the ranks' traces (CPU work: run off the loop)."""
    traces: dict[int, dict[str, Any]] = {}
    failed: list[dict[str, Any]] = []
    budget = MAX_MERGE_BYTES
    for r in results:
        if not r.ok:
            failed.append({"rank": r.rank, "reason": r.line()})
            continue
        budget -= len(r.body or "")
        if budget < 0:
            failed.append({"rank": r.rank, "reason": f"rank {r.rank}: not merged: the ranks' "
                           f"traces exceed {MAX_MERGE_BYTES >> 20} MiB; profile fewer ranks "
                           f"or seconds"})
            r.body = None
            continue
        try:
            traces[r.rank] = profile_merge.parse_trace(r.body or "")
        except profile_merge.TraceError as e:
            failed.append({"rank": r.rank, "reason": f"rank {r.rank}: {e}"})
        r.body = None  # the parsed trace is all that is needed from here on
    summaries = [profile_merge.summarize(rank, t) for rank, t in sorted(traces.items())]
    events = {rank: len(profile_merge.events_of(t)) for rank, t in traces.items()}
    merged = profile_merge.merge(traces, in_place=True, other={
        "duration_s": duration, "capture_id": capture_id, "started": started,
        "not_profiled": {str(f["rank"]): f["reason"] for f in failed}})
    body = profile_merge.to_json(merged)
    del merged, traces
    flagged = profile_merge.flag(summaries)
    flagged_ranks = {f["rank"] for f in flagged}
    report = {
        "id": capture_id, "started": started, "duration_s": duration,
        "ranks_requested": format_ranks(ranks), "ranks_profiled": [s.rank for s in summaries],
        "trace_url": f"/profile/trace.json?id={capture_id}", "trace_bytes": len(body),
        "ranks": [s.as_dict() | {"events": events[s.rank], "flagged": s.rank in flagged_ranks}
                  for s in summaries],
        "flagged": flagged, "not_profiled": failed,
    }
    return Capture(capture_id, report, body)


def _pct(v: Any) -> str:
    return f"{v * 100:.1f}" if isinstance(v, int | float) else "-"


PROFILE_HEADERS = ["rank", "comm %", "compute %", "overlap %", "exposed comm %", "idle %",
                   "comm hidden %", "kernels (comm)", "window ms", "events"]


def _profile_rows(report: Mapping[str, Any]) -> list[list[Any]]:
    rows = []
    for r in report["ranks"]:
        kernels = f"{r['kernels']} ({r['comm_kernels']})"
        if not r["gpu"]:
            rows.append([r["rank"], r["note"], "", "", "", "", "", kernels, r["window_ms"],
                         r["events"]])
            continue
        rows.append([r["rank"], _pct(r["comm_frac"]), _pct(r["compute_frac"]),
                     _pct(r["overlap_frac"]), _pct(r["exposed_frac"]), _pct(r["idle_frac"]),
                     _pct(r["hidden_share"]), kernels, r["window_ms"], r["events"]])
    return rows


def profile_text(report: Mapping[str, Any] | None) -> str:
    usage = (f"Usage: /profile?duration=S[&ranks=0,2-5]  (0 < S <= {MAX_PROFILE_S:g}; all ranks "
             f"by default)\n")
    if report is None:
        return "No profile captured yet.\n" + usage
    n_ok, n_bad = len(report["ranks_profiled"]), len(report["not_profiled"])
    lines = [f"Profile #{report['id']}: {report['duration_s']:g} s on ranks "
             f"{report['ranks_requested']}, started {report['started']}; {n_ok} of "
             f"{n_ok + n_bad} ranks profiled",
             f"Merged trace, one process per rank: {report['trace_url']} "
             f"({report['trace_bytes'] / 1e6:.1f} MB; open it in https://ui.perfetto.dev)", ""]
    if report["ranks"]:
        lines.append(tabulate(_profile_rows(report), headers=PROFILE_HEADERS, tablefmt="plain"))
        lines.append("Shares are of each rank's capture window, from its GPU kernels' intervals.")
    if report["flagged"]:
        lines += ["", "Flagged:"] + [f"  rank {f['rank']}: {f['reason']}" for f in report["flagged"]]
    if report["not_profiled"]:
        lines += ["", "Not profiled:"] + [f"  {f['reason']}" for f in report["not_profiled"]]
    return "\n".join(lines) + "\n\n" + usage


def _profile_html(request: web.Request, report: Mapping[str, Any] | None,
                  form: Mapping[str, Any]) -> str:
    table = None
    if report is not None and report["ranks"]:
        classes = ["warn" if r["flagged"] else "" for r in report["ranks"]]
        table = render.html_table(PROFILE_HEADERS, _profile_rows(report), classes)
    return request.app[TEMPLATES].get_template("profile.html").render(
        title="Profile", report=report, table=table, form=form, max_s=MAX_PROFILE_S,
        failures=[f["reason"] for f in report["not_profiled"]] if report else [],
        stamp=time.strftime("%Y-%m-%d %H:%M:%S %Z"))


def _live_collector(request: web.Request, page: str) -> Collector:
    collector = request.app[COLLECTOR]
    if not request.app[STATE].live or not isinstance(collector, Collector):
        raise web.HTTPNotFound(text=f"{page} needs a live job; this frontend serves recorded "
                                    f"dumps\n")
    return collector


@routes.get("/profile")
async def profile(request: web.Request) -> web.Response:
    q = query(request, {"format": parse_format, "duration": parse_duration, "ranks": parse_rank_list,
                         "refresh": render.parse_refresh})
    fmt = negotiate(request, q.get("format"))
    state = request.app[STATE]
    form = {"duration": request.query.get("duration", "2"), "ranks": request.query.get("ranks", "")}
    if "duration" not in q:
        if "ranks" in q:
            raise BadRequest("ranks= needs duration= (the seconds to profile)")
        report = state.last.report if state.last else None
        if fmt == "json":
            return respond(fmt, {"last": report, "running": state.running is not None})
        if fmt == "text":
            return respond(fmt, profile_text(report))
        return respond(fmt, await off_loop(_profile_html, request, report, form))
    collector = _live_collector(request, "/profile")
    world = collector.world_size
    ranks = q.get("ranks") or list(range(world))
    if not ranks or ranks[-1] >= world:
        raise BadRequest(f"bad parameter ranks: rank {ranks[-1] if ranks else 0} is outside "
                         f"0..{world - 1}")
    if state.running is not None:
        run = state.running
        raise web.HTTPConflict(text=(
            f"a profile is already running (started {time.monotonic() - run['since']:.0f} s "
            f"ago: {run['duration']:g} s on ranks {run['ranks']}); try again when it ends\n"))
    duration = q["duration"]
    state.running = {"since": time.monotonic(), "duration": duration,
                     "ranks": format_ranks(ranks)}
    try:
        capture = await _capture(request.app, collector, duration, ranks)
    finally:
        state.running = None
    state.last = capture
    if fmt == "json":
        return respond(fmt, capture.report)
    if fmt == "text":
        return respond(fmt, profile_text(capture.report))
    return respond(fmt, await off_loop(_profile_html, request, capture.report, form))


async def _capture(app: web.Application, collector: Collector, duration: float,
                   ranks: Sequence[int]) -> Capture:
    state = app[STATE]
    assert state.session is not None  # set by _ctx while the app runs
    wanted = set(ranks)
    addrs = [a for a in await collector.registry.lookup() if a.rank in wanted]
    capture_id = state.next_id
    state.next_id += 1
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    results = await fan_out(state.session, addrs, PROFILE_HANDLER, {DURATION: repr(duration)},
                            timeout=duration + collector.timeout + EXPORT_SLACK_S)
    return await off_loop(lambda: build_capture(results, capture_id=capture_id,
                                                 duration=duration, ranks=ranks, started=started))


def _capture_id(raw: str) -> int:
    n = int(raw)
    if not 1 <= n <= 10**12:
        raise ValueError("must be a capture number")
    return n


@routes.get("/profile/trace.json")
async def profile_trace(request: web.Request) -> web.Response:
    """The latest capture, every rank in one Chrome/Perfetto trace, as a download."""
    q = query(request, {"id": _capture_id})
    last = request.app[STATE].last
    if last is None:
        raise web.HTTPNotFound(text="no profile captured yet; run /profile?duration=S first\n")
    if "id" in q and q["id"] != last.id:
        raise web.HTTPNotFound(text=f"profile #{q['id']} is gone; only the latest (#{last.id}) "
                                    f"is kept\n")
    stamp = time.strftime("%Y%m%d_%H%M%S")
    resp = web.Response(body=last.trace, content_type="application/json", headers={
        "Content-Disposition": f'attachment; filename="profile_{last.id}_{stamp}.trace.json"'})
    resp.enable_compression()  # traces are large and compress ~10x
    return resp


# ---------------------------------------------------------------------------------------------
# /tcpstore


def _prefix(raw: str) -> str:
    if len(raw) > MAX_PREFIX or not raw.isprintable():
        raise ValueError(f"must be printable, at most {MAX_PREFIX} characters")
    return raw


def _bounded(lo: int, hi: int) -> Any:
    def parse(raw: str) -> int:
        n = int(raw)
        if not lo <= n <= hi:
            raise ValueError(f"must be {lo}..{hi}")
        return n

    return parse


STORE_HEADERS = ["key", "bytes", "value"]


def _store_rows(page: Mapping[str, Any]) -> list[list[Any]]:
    rows = []
    for k in page["keys"]:
        value = k["value"] + (" …" if k.get("truncated") else "")
        rows.append([k["key"], "" if k["size"] is None else k["size"], value])
    return rows


def store_text(page: Mapping[str, Any]) -> str:
    if not page.get("available"):
        return f"TCPStore: {page['reason']}\n"
    shown = len(page["keys"])
    head = (f"TCPStore keys starting with {page['prefix']!r}: {page['total']}"
            + (f" of {page['all_keys']} in the store" if page["all_keys"] is not None else "")
            + (f"; showing {page['offset'] + 1}-{page['offset'] + shown}" if shown else ""))
    lines = [head]
    if page["note"]:
        lines.append(page["note"])
    if shown:
        lines += ["", tabulate(_store_rows(page), headers=STORE_HEADERS, tablefmt="plain")]
    if page["next_offset"] is not None:
        lines += ["", f"next page: offset={page['next_offset']}"]
    return "\n".join(lines) + "\n"


@routes.get("/tcpstore")
async def tcpstore(request: web.Request) -> web.Response:
    q = query(request, {"format": parse_format, "prefix": _prefix, "refresh": render.parse_refresh,
                         "limit": _bounded(1, MAX_LIMIT), "offset": _bounded(0, MAX_OFFSET)})
    fmt = negotiate(request, q.get("format"))
    prefix = q.get("prefix", DEFAULT_PREFIX)
    limit, offset = q.get("limit", DEFAULT_LIMIT), q.get("offset", 0)
    reader = request.app[STATE].store
    page: dict[str, Any]
    if reader is None:
        page = {"available": False, "reason": "this frontend has no TCPStore (it was given the "
                                              "workers' URLs, or it serves recorded dumps)"}
    else:
        config = request.app[CONFIG]
        try:
            got = await reader.read(prefix, offset, limit,
                                    [config.auth_token] if config.auth_token else [])
        except StoreReadError as e:
            raise web.HTTPServiceUnavailable(text=f"/tcpstore: {e}\n") from None
        page = got.as_dict()
    if fmt == "json":
        return respond(fmt, page)
    if fmt == "text":
        return respond(fmt, store_text(page))
    table = render.html_table(STORE_HEADERS, _store_rows(page),
                             ["warn" if k["redacted"] else "" for k in page["keys"]]
                             ) if page.get("keys") else None
    html = request.app[TEMPLATES].get_template("tcpstore.html").render(
        title="TCPStore", page=page, table=table, prefix=prefix, limit=limit, failures=[],
        stamp=time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    return respond(fmt, html)


# ---------------------------------------------------------------------------------------------
# /wait_counters


def wait_counters_model(results: Sequence[RankResult]) -> dict[str, Any]:
    """The table, the ranks without data, and the one line when no rank has wait counters."""
    per_rank: dict[int, wait_counters.Counters] = {}
    failed: list[str] = []
    for r in results:
        if not r.ok:
            failed.append(r.line())
            continue
        try:
            per_rank[r.rank] = wait_counters.parse_counters(r.body or "")
        except ValueError as e:
            failed.append(f"rank {r.rank}: {first_line(e, 200)}")
    answered_404 = [r for r in results if r.http_status == 404]
    if not per_rank and answered_404:
        # The workers' reason is the page's one line; only other failures are listed under it.
        why = (answered_404[0].error or "").removeprefix("HTTP 404: ")
        if not why.startswith("wait counters are not available"):
            why = f"wait counters are not available: {why}"
        return {"available": False, "reason": why,
                "failed": [r.line() for r in results if not r.ok and r.http_status != 404]}
    out = {"available": bool(per_rank), "failed": failed, **wait_counters.table(per_rank)}
    if not per_rank:
        out["reason"] = "no rank answered"
    elif not out["rows"]:
        out["reason"] = "no wait counter has recorded anything on any rank yet"
    return out


_MARK = {"high": " ▲", "low": " ▼"}


def _wc_headers(model: Mapping[str, Any]) -> list[str]:
    return ["counter", "field"] + [f"rank {r}" for r in model["ranks"]]


def _num_text(v: float | None) -> str:
    if v is None:
        return "-"
    return str(int(v)) if v == int(v) else f"{v:.3f}"


def _wc_rows(model: Mapping[str, Any]) -> list[list[Any]]:
    rows = []
    for row in model["rows"]:
        cells = [f"{_num_text(row['values'][r])}{_MARK.get(row['marks'].get(r, ''), '')}"
                 for r in model["ranks"]]
        rows.append([wait_counters.short_name(row["counter"]), row["field"], *cells])
    return rows


def wait_counters_text(model: Mapping[str, Any]) -> str:
    if not model["available"] or not model.get("rows"):
        lines = [f"Wait counters: {model['reason']}"]
    else:
        lines = [f"Wait counters of {len(model['ranks'])} ranks (names without "
                 f"{wait_counters.NAME_PREFIX!r}; ▲/▼: stands out from the other ranks)", "",
                 tabulate(_wc_rows(model), headers=_wc_headers(model), tablefmt="plain")]
        if model["truncated_counters"]:
            lines.append(f"... {model['truncated_counters']} more counters not shown")
    if model["failed"]:
        lines += ["", "Ranks without data:"] + [f"  {line}" for line in model["failed"]]
    return "\n".join(lines) + "\n"


@routes.get("/wait_counters")
async def wait_counters_page(request: web.Request) -> web.Response:
    q = query(request, {"format": parse_format, "refresh": render.parse_refresh})
    fmt = negotiate(request, q.get("format"))
    results = await request.app[COLLECTOR].fetch(WAIT_COUNTERS_HANDLER)
    model = await off_loop(wait_counters_model, results)
    if fmt == "json":
        body = {k: v for k, v in model.items() if k != "rows"}
        if "rows" in model:
            body["counters"] = [{"counter": row["counter"], "field": row["field"],
                                 "values": {str(r): v for r, v in row["values"].items()},
                                 "marked": {str(r): d for r, d in row["marks"].items()}}
                                for row in model["rows"]]
        return respond(fmt, body)
    if fmt == "text":
        return respond(fmt, wait_counters_text(model))
    table = (render.html_table(_wc_headers(model), _wc_rows(model),
                              ["warn" if row["marks"] else "" for row in model["rows"]])
             if model.get("rows") else None)
    html = await off_loop(lambda: request.app[TEMPLATES].get_template(
        "wait_counters.html").render(
        title="Wait counters", model=model, table=table, failures=model["failed"],
        prefix=wait_counters.NAME_PREFIX, stamp=time.strftime("%Y-%m-%d %H:%M:%S %Z")))
    return respond(fmt, html)
