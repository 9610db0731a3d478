"""Post-mortem viewer: ``python -m debug_server.view DUMP_DIR [--port 25999]``.

Most hangs are read after the job was killed. This serves the live frontend's pages (overview
``/``, ``/fr_trace``, ``/stacks``, ``/fr_trace/trace.json``; HTML, text or JSON as negotiated)
from what a dump directory holds:

- ``fr_snapshot_<ts>.json`` (every rank's FR dump of one dump cycle) and ``stacks_<ts>.txt``;
- per-rank dumps, ``per_rank/rank_<N>`` or a directory of ``<prefix><rank>[.json]`` files,
  pickled or JSON, ours or PyTorch's: one more cycle, dated by its newest file;
- ``hang_report_<ts>.json`` and the ``.txt`` reports, listed with their verdicts and served as
  files (``/postmortem/files/<name>``).

Every page carries a banner ("job ended; data from <ts>") with a picker of the dump cycles;
``?cycle=<ts>`` picks one (a cookie keeps the choice while you follow links), the newest by
default. Nothing here talks to a job, a TCPStore or a GPU. Files are read the analyzer's way
(JSON, or pickles of plain containers only), so a hostile file is refused, never run; a file
that cannot be used is one line on the page and in the log.

The pages are the frontend's own handlers and templates: :class:`DiskCollector` has the
methods of ``fanout.Collector`` and answers them from the chosen cycle's files.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import logging
import os
import re
import sys
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jinja2
from aiohttp import web
from aiohttp.typedefs import Handler

from debug_server.analysis import stackparse
from debug_server.auth import TOKEN_ENV, new_token, token_required
from debug_server.config import ConfigError, ServerConfig
from debug_server.dumpio import (
    MAX_RANK,
    DumpError,
    load_dump,
    parse_ranks,
    rank_files,
    validate_dump,
)
from debug_server.errors import first_line
from debug_server.frontend import snapshot
from debug_server.frontend.app import make_frontend_app
from debug_server.frontend.dumps import (
    FR_TRACE_PREFIX,
    HANG_REPORT_PREFIX,
    SNAPSHOT_PREFIX,
    STACKS_PREFIX,
    STAMP_FORMAT,
)
from debug_server.frontend.fanout import (
    C10D_FR_HANDLER,
    FAILED,
    FR_HANDLER,
    OK,
    STACKS_HANDLER,
    FrData,
    RankResult,
    RankStates,
)
from debug_server.listen import own_server, start_sites, stop_on_signals
from debug_server.rank.discovery import WorkerAddr

logger = logging.getLogger(__name__)

DEFAULT_PORT = 25999
PER_RANK = "per_rank"
"""The cycle id of the per-rank dumps (``<dir>/per_rank/`` or ``<dir>`` itself)."""
MAX_FILE_BYTES = 4 << 30
"""A dump file larger than this is refused rather than read into memory."""
CACHED_CYCLES = 4
COOKIE = "debug_server_cycle"
DECORATED = frozenset({"/", "/fr_trace", "/torchcomms_fr_trace", "/stacks"})
"""Pages that get the post-mortem banner (HTML), first line (text) or key (JSON)."""

_STAMP = r"\d{8}_\d{6}(?:_\d+)?"
_CYCLE_FILE = re.compile(
    rf"^({FR_TRACE_PREFIX}|{STACKS_PREFIX}|{SNAPSHOT_PREFIX}|{HANG_REPORT_PREFIX})_({_STAMP})"
    r"\.(txt|json)$", re.ASCII)
_STAMP_RE = re.compile(rf"^{_STAMP}$", re.ASCII)
_FAILED_SECTION = re.compile(r"^rank \d+: .+$")


# ---------------------------------------------------------------------------------------------
# What is on disk


@dataclass(slots=True)
class Cycle:
    """One dump cycle: the files that share a stamp (or the per-rank dumps)."""

    stamp: str
    snapshot: str | None = None
    stacks: str | None = None
    fr_text: str | None = None
    rank_files: dict[int, str] | None = None
    mtime: float = 0.0
    """The newest file's modification time (what "data from" means for per-rank dumps)."""

    def files(self) -> list[str]:
        named = [self.snapshot, self.stacks, self.fr_text]
        return [p for p in named if p] + sorted((self.rank_files or {}).values())

    def when(self) -> str:
        """``2026-11-26 05:26:16`` from the stamp (local time, as the dumper wrote it)."""
        if self.stamp == PER_RANK:
            return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.mtime))
        t = time.strptime(self.stamp[:15], STAMP_FORMAT)
        n = self.stamp[16:]  # the dumper's _1, _2... for cycles in one second
        return time.strftime("%Y-%m-%d %H:%M:%S", t) + (f" #{n}" if n else "")

    def label(self) -> str:
        if self.stamp == PER_RANK:
            return f"{self.when()}: per-rank dumps ({len(self.rank_files or {})} files)"
        what = [k for k, p in (("FR", self.snapshot), ("stacks", self.stacks)) if p]
        return f"{self.when()}: {' + '.join(what) or 'text report only'}"


@dataclass(slots=True)
class HangReportInfo:
    stamp: str
    txt: str | None
    verdict: str


@dataclass(slots=True)
class Scan:
    """The directory's cycles (oldest first), hang reports, and why anything is unusable."""

    cycles: list[Cycle]
    hang_reports: list[HangReportInfo]
    problems: list[str]

    def find(self, stamp: str) -> Cycle | None:
        return next((c for c in self.cycles if c.stamp == stamp), None)


def _stamp_key(stamp: str) -> tuple[str, int]:
    base, n = stamp[:15], stamp[16:]
    return base, int(n) if n else 0


def _read_bounded(path: str) -> bytes:
    size = os.path.getsize(path)
    if size > MAX_FILE_BYTES:
        raise DumpError(f"{os.path.basename(path)}: {size} bytes is over the "
                        f"{MAX_FILE_BYTES >> 30} GiB limit")
    with open(path, "rb") as f:
        return f.read()


def scan_dir(path: str) -> Scan:
    """Every dump cycle in ``path``; never raises (an unusable dir is a problem line)."""
    problems: list[str] = []
    try:
        names = sorted(os.listdir(path))
    except OSError as e:
        return Scan([], [], [f"{path}: cannot list ({e.strerror or e})"])
    cycles: dict[str, Cycle] = {}
    reports: dict[str, dict[str, str]] = {}
    for name in names:
        m = _CYCLE_FILE.match(name)
        if m is None:
            continue
        kind, stamp, ext = m.groups()
        full = os.path.join(path, name)
        if kind == HANG_REPORT_PREFIX:
            reports.setdefault(stamp, {})[ext] = full
            continue
        c = cycles.setdefault(stamp, Cycle(stamp))
        if kind == SNAPSHOT_PREFIX and ext == "json":
            c.snapshot = full
        elif kind == STACKS_PREFIX and ext == "txt":
            c.stacks = full
        elif kind == FR_TRACE_PREFIX and ext == "txt":
            c.fr_text = full
        else:
            continue
        c.mtime = max(c.mtime, _mtime(full))
    per_rank_dir = os.path.join(path, PER_RANK)
    if os.path.isdir(per_rank_dir):
        rank_dir: str | None = per_rank_dir
    elif not cycles and not reports:
        rank_dir = path  # a plain directory of per-rank dumps (ours or torch's)
    else:
        rank_dir = None
    ordered = sorted(cycles.values(), key=lambda c: _stamp_key(c.stamp))
    if rank_dir is not None:
        try:
            files, notes = rank_files(rank_dir)
        except DumpError as e:
            problems.append(str(e))
            files, notes = {}, []
        for n in notes:
            logger.debug("debug_server view: %s", n)
        if files:
            mtime = max(_mtime(p) for p in files.values())
            # Ranks rewrite these every cycle and once more on their way out: place them by
            # their time among the dated cycles (usually last).
            at = sum(1 for c in ordered if c.mtime <= mtime)
            ordered.insert(at, Cycle(PER_RANK, rank_files=files, mtime=mtime))
    hang = [_hang_report(stamp, reports[stamp]) for stamp in sorted(reports, key=_stamp_key)]
    if not ordered:
        problems.append(f"{path}: no dump cycles (no fr_snapshot_<ts>.json, stacks_<ts>.txt, "
                        f"per_rank/ or <prefix><rank> dump files)")
    return Scan(ordered, hang, problems)


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


def _hang_report(stamp: str, files: Mapping[str, str]) -> HangReportInfo:
    txt = os.path.basename(files["txt"]) if "txt" in files else None
    verdict = "(no .json report)"
    if "json" in files:
        try:
            obj = json.loads(_read_bounded(files["json"]))
            verdict = str(obj.get("verdict") or "(no verdict)") if isinstance(obj, dict) else (
                "(not a hang report)")
        except (OSError, ValueError, DumpError) as e:
            verdict = f"(unreadable: {first_line(e)})"
    return HangReportInfo(stamp, txt, verdict[:500])



# ---------------------------------------------------------------------------------------------
# One cycle's data


@dataclass(slots=True)
class CycleData:
    """What one cycle says about every rank, and every file-level problem in one line each."""

    cycle: Cycle | None
    dumps: dict[int, dict[str, Any]] = field(default_factory=dict)
    fr_errors: dict[int, str] = field(default_factory=dict)
    stacks: dict[int, str] = field(default_factory=dict)
    stack_errors: dict[int, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    stacks_from: str | None = None
    """The stacks file used, when it is not the cycle's own (per-rank dumps)."""
    world_size: int = 0

    def sources(self) -> tuple[str, str]:
        c = self.cycle
        fr = (os.path.basename(c.snapshot) if c and c.snapshot
              else "per-rank dumps" if c and c.rank_files else "")
        st = os.path.basename(self.stacks_from or (c.stacks if c and c.stacks else "") or "")
        return fr, st


def _rank_key(key: str, source: str) -> int:
    if not (key.isascii() and key.isdigit()) or int(key) > MAX_RANK:
        raise DumpError(f"{source}: {key[:40]!r} is not a rank number")
    return int(key)


def _load_snapshot(path: str, data: CycleData) -> None:
    name = os.path.basename(path)
    try:
        obj = snapshot.expand(json.loads(_read_bounded(path)))  # shared member lists inline
    except (OSError, ValueError, DumpError) as e:
        data.problems.append(f"{name}: unusable ({first_line(e)})")
        return
    if not isinstance(obj, dict):
        data.problems.append(f"{name}: not a snapshot (top level is {type(obj).__name__})")
        return
    for key, value in obj.items():
        try:
            rank = _rank_key(str(key), name)
        except DumpError as e:
            data.problems.append(str(e))
            continue
        if isinstance(value, dict) and set(value) == {"error"}:
            data.fr_errors[rank] = str(value["error"]).splitlines()[0][:300] if value["error"] else (
                "no data")
            continue
        try:
            data.dumps[rank] = validate_dump(value, f"{name} rank {rank}")
        except DumpError as e:
            data.fr_errors[rank] = str(e)


def _load_rank_files(files: Mapping[int, str], data: CycleData) -> None:
    for rank, path in sorted(files.items()):
        try:
            data.dumps[rank] = load_dump(path)
        except DumpError as e:
            data.fr_errors[rank] = str(e)
        except MemoryError:
            data.fr_errors[rank] = f"{os.path.basename(path)}: too large to load"


def _load_stacks(path: str, data: CycleData) -> None:
    name = os.path.basename(path)
    try:
        text = _read_bounded(path).decode("utf-8", errors="replace")
    except (OSError, DumpError) as e:
        data.problems.append(f"{name}: unusable ({first_line(e)})")
        return
    sections = stackparse.split_stacks_file(text)
    if not sections:
        data.problems.append(f"{name}: no '=== Rank N ===' sections")
    for rank, body in sections.items():
        if rank > MAX_RANK:
            data.problems.append(f"{name}: rank {rank} is above {MAX_RANK}")
            continue
        stripped = body.strip()
        # The dumper writes a rank that did not answer as its one failure line.
        if "\n" not in stripped and _FAILED_SECTION.match(stripped) and not (
                stackparse.parse_threads(body)):
            data.stack_errors[rank] = stripped
        else:
            data.stacks[rank] = body


def load_cycle(scan: Scan, cycle: Cycle | None) -> CycleData:
    """Read one cycle's files (restricted loading only); never raises."""
    data = CycleData(cycle, problems=list(scan.problems))
    if cycle is not None:
        if cycle.snapshot:
            _load_snapshot(cycle.snapshot, data)
        elif cycle.rank_files:
            _load_rank_files(cycle.rank_files, data)
        else:
            extra = (f"; its text report is {os.path.basename(cycle.fr_text)}"
                     if cycle.fr_text else "")
            data.problems.append(f"cycle {cycle.stamp} has no {SNAPSHOT_PREFIX}_{cycle.stamp}.json"
                                 f" (Flight Recorder data not kept){extra}")
        stacks_path = cycle.stacks
        if stacks_path is None and cycle.stamp == PER_RANK:
            # Per-rank dumps come with no stacks of their own: use the last ones written.
            stacks_path = next((c.stacks for c in reversed(scan.cycles) if c.stacks), None)
            data.stacks_from = stacks_path
        if stacks_path:
            _load_stacks(stacks_path, data)
        else:
            data.problems.append(f"cycle {cycle.stamp} has no stacks file")
    ranks = set(data.dumps) | set(data.fr_errors) | set(data.stacks) | set(data.stack_errors)
    for dump in data.dumps.values():
        for cfg in (dump.get("pg_config") or {}).values():
            ranks.update(r for r in _cfg_ranks(cfg) if 0 <= r <= MAX_RANK)
    data.world_size = max(ranks) + 1 if ranks else 0
    for p in data.problems[len(scan.problems):]:
        logger.warning("debug_server view: %s", p)
    for rank, err in sorted(data.fr_errors.items()):
        logger.warning("debug_server view: rank %d: %s", rank, err)
    return data


def _cfg_ranks(cfg: Any) -> list[int]:
    try:
        return parse_ranks(cfg.get("ranks", "[]")) if isinstance(cfg, dict) else []
    except DumpError:
        return []


# ---------------------------------------------------------------------------------------------
# The collector's twin

_CURRENT: contextvars.ContextVar[CycleData] = contextvars.ContextVar("debug_server_view_cycle")


def _current() -> CycleData:
    try:
        return _CURRENT.get()
    except LookupError:  # outside a request (e.g. /metrics before any page): nothing chosen
        return CycleData(None)


class DiskRegistry:
    """The ranks of the chosen cycle; their "address" is the file their data came from."""

    @property
    def world_size(self) -> int:
        return _current().world_size

    async def lookup(self) -> list[WorkerAddr]:
        data = _current()
        fr, st = data.sources()
        return [WorkerAddr(r, fr or st or None) for r in range(data.world_size)]

    def close(self) -> None:
        pass


class DiskCollector:
    """``fanout.Collector``'s methods over the chosen cycle's files instead of live workers.

    Extra keyword arguments (new fetch options of the live collector) are accepted and
    ignored: on disk there is one recorded answer per rank.
    """

    def __init__(self) -> None:
        self.registry = DiskRegistry()
        self.states = RankStates()

    @property
    def world_size(self) -> int:
        return _current().world_size

    def data_time_ns(self) -> int:
        c = _current().cycle
        return int((c.mtime if c else time.time()) * 1e9)

    async def fetch(self, handler: str, params: Mapping[str, str] | None = None,
                    addrs: Sequence[WorkerAddr] | None = None, **_: Any) -> list[RankResult]:
        if handler == STACKS_HANDLER:
            return await self.stacks(addrs)
        if handler in (FR_HANDLER, C10D_FR_HANDLER):
            return (await self.fr(only_active=False, addrs=addrs)).results
        # Health, profiles...: nothing was recorded; 404 reads as "no health check" on the pages.
        return [RankResult(r, None, FAILED, error=f"rank {r}: {handler} not recorded "
                           "(post-mortem)", http_status=404) for r in _ranks(addrs)]

    async def fr(self, *, only_active: bool = False, whole: bool = False,
                 addrs: Sequence[WorkerAddr] | None = None, **_: Any) -> FrData:
        """The recorded rings; ``only_active``: the ops not completed, as a worker would send.

        The live collector's default window (each communicator from its frontier) exists to
        bound what crosses the network; on disk the whole ring costs nothing more, so it is
        what the default (and ``whole``) gives.
        """
        data = _current()
        src, _st = data.sources()
        results, dumps = [], {}
        for r in _ranks(addrs):
            dump = data.dumps.get(r)
            if dump is None:
                why = data.fr_errors.get(r) or f"no Flight Recorder data in {src or 'this cycle'}"
                # A snapshot records a failed rank as its own line ("rank 1: unreachable ...").
                line = why if why.startswith(f"rank {r}: ") else f"rank {r}: {why}"
                results.append(RankResult(r, src or None, FAILED, error=line))
                continue
            if only_active and not whole:  # as the worker's onlyactive: ops not completed
                dump = {**dump, "entries": [e for e in dump.get("entries") or ()
                                            if not (isinstance(e, dict)
                                                    and e.get("state") == "completed")]}
            dumps[r] = dump
            results.append(RankResult(r, src or None, OK))
        return FrData(results, dumps, scope=f"as the dumper wrote them to {src or 'this cycle'}")

    async def stacks(self, addrs: Sequence[WorkerAddr] | None = None,
                     **_: Any) -> list[RankResult]:
        data = _current()
        _fr, src = data.sources()
        out = []
        for r in _ranks(addrs):
            text = data.stacks.get(r)
            if text is not None:
                out.append(RankResult(r, src or None, OK, body=text))
            else:
                why = data.stack_errors.get(r) or f"rank {r}: no stacks in {src or 'this cycle'}"
                out.append(RankResult(r, src or None, FAILED, error=why))
        return out


def _ranks(addrs: Sequence[WorkerAddr] | None) -> list[int]:
    if addrs is not None:
        return [a.rank for a in addrs]
    return list(range(_current().world_size))


# ---------------------------------------------------------------------------------------------
# The app: the frontend's, plus the cycle choice and the banner

_BANNER = jinja2.Environment(autoescape=True).from_string("""\
<div class="banner warn" id="postmortem">
<div class="head">Post-mortem: job ended; data from {{ when }}</div>
<div class="where"><form method="get" id="cycle-form">Dump cycle:
<select name="cycle" id="cycle-picker" onchange="this.form.submit()">
{% for c in cycles %}<option value="{{ c.stamp }}"{{ " selected" if c.stamp == chosen }}>{{ c.label }}</option>
{% endfor %}</select> <noscript><button>Show</button></noscript>
<span class="note">{{ cycles|length }} cycle{{ "s" if cycles|length != 1 }} in {{ dir }}{% if sources %}; showing {{ sources }}{% endif %}</span></form></div>
{% for p in problems %}<div class="where bad">{{ p }}</div>
{% endfor %}
{% if reports %}<div class="where">Hang reports: {% for h in reports %}{% if h.txt %}<a href="/postmortem/files/{{ h.txt }}">{{ h.stamp }}</a>{% else %}{{ h.stamp }}{% endif %}: {{ h.verdict }}{{ "; " if not loop.last }}{% endfor %}</div>{% endif %}
{% if files %}<div class="full">Files of this cycle: {% for f in files %}<a href="/postmortem/files/{{ f }}">{{ f }}</a>{{ " " if not loop.last }}{% endfor %}</div>{% endif %}
</div>
""")


class DumpSource:
    """The viewed directory: scans it per request (cheap) and caches loaded cycles."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._cache: OrderedDict[tuple[Any, ...], CycleData] = OrderedDict()

    def scan(self) -> Scan:
        return scan_dir(self.path)

    def load(self, scan: Scan, cycle: Cycle | None) -> CycleData:
        key = (cycle.stamp if cycle else None,
               tuple((p, _mtime(p)) for p in (cycle.files() if cycle else [])),
               tuple(scan.problems))
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        data = load_cycle(scan, cycle)
        self._cache[key] = data
        while len(self._cache) > CACHED_CYCLES:
            self._cache.popitem(last=False)
        return data


SOURCE = web.AppKey("postmortem_source", DumpSource)


def _choose(request: web.Request, scan: Scan) -> tuple[Cycle | None, bool]:
    """The cycle asked for (``?cycle=``, else the cookie, else the newest); 404 if unknown."""
    raw = request.query.get("cycle")
    if raw is not None:
        cycle = scan.find(raw) if (raw == PER_RANK or _STAMP_RE.match(raw)) else None
        if cycle is None:
            have = ", ".join(c.stamp for c in scan.cycles[-5:]) or "none"
            raise web.HTTPNotFound(text=f"no dump cycle {raw[:40]!r} in {scan_dir_name(request)} "
                                        f"(newest: {have})\n")
        return cycle, True
    cookie = request.cookies.get(COOKIE)
    if cookie and (cycle := scan.find(cookie)) is not None:
        return cycle, False
    return (scan.cycles[-1] if scan.cycles else None), False


def scan_dir_name(request: web.Request) -> str:
    return request.app[SOURCE].path


@web.middleware
async def postmortem_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Pick the cycle, run the frontend's handler over it, and say it is a post-mortem."""
    if request.path.startswith("/postmortem/"):
        return await handler(request)
    source = request.app[SOURCE]
    loop = asyncio.get_running_loop()
    scan = await loop.run_in_executor(None, source.scan)
    cycle, explicit = _choose(request, scan)
    data = await loop.run_in_executor(None, source.load, scan, cycle)
    token = _CURRENT.set(data)
    try:
        inner = request
        if "cycle" in request.query:
            inner = request.clone(rel_url=request.rel_url.without_query_params("cycle"))
        resp = await handler(inner)
    finally:
        _CURRENT.reset(token)
    if request.path in DECORATED and isinstance(resp, web.Response) and resp.status == 200:
        _decorate(resp, source, scan, data)
    if explicit and cycle is not None:
        resp.set_cookie(COOKIE, cycle.stamp, httponly=True, samesite="Strict", path="/")
    return resp


def _info(source: DumpSource, scan: Scan, data: CycleData) -> dict[str, Any]:
    c = data.cycle
    fr, st = data.sources()
    return {
        "dir": source.path,
        "cycle": c.stamp if c else None,
        "data_from": c.when() if c else None,
        "sources": {"fr": fr or None, "stacks": st or None},
        "cycles": [{"cycle": x.stamp, "label": x.label(),
                    "files": [os.path.relpath(p, source.path) for p in x.files()]}
                   for x in scan.cycles],
        "hang_reports": [{"stamp": h.stamp, "file": h.txt, "verdict": h.verdict}
                         for h in scan.hang_reports],
        "problems": data.problems,
    }


def _decorate(resp: web.Response, source: DumpSource, scan: Scan, data: CycleData) -> None:
    info = _info(source, scan, data)
    when = info["data_from"] or "(no data)"
    ctype = resp.content_type
    body = resp.text or ""
    if ctype == "application/json":
        obj = json.loads(body)
        if isinstance(obj, dict):
            obj["postmortem"] = info
            resp.text = json.dumps(obj, default=str)
        return
    if ctype == "text/html":
        fr, st = info["sources"]["fr"], info["sources"]["stacks"]
        files = ([os.path.basename(p) for p in data.cycle.files()
                  if os.path.dirname(p) == source.path] if data.cycle else [])
        html = _BANNER.render(
            when=when, cycles=[{"stamp": x.stamp, "label": x.label()} for x in scan.cycles],
            chosen=info["cycle"], dir=source.path, problems=data.problems[:20],
            reports=scan.hang_reports[-5:], files=files,
            sources=", ".join(s for s in (fr, f"stacks from {st}" if st else None) if s))
        at = body.find("</nav>")
        at = at + len("</nav>") if at >= 0 else 0
        resp.text = body[:at] + "\n" + html + body[at:]
        return
    head = [f"POST-MORTEM: job ended; data from {when} (cycle {info['cycle']}, "
            f"{len(scan.cycles)} in {source.path}; ?cycle=<ts> picks another)"]
    head += [f"POST-MORTEM: {p}" for p in data.problems[:20]]
    resp.text = "\n".join(head) + "\n\n" + body


async def cycle_file(request: web.Request) -> web.Response:
    """One text/JSON file of the dump dir by name (hang reports, text reports); nothing else."""
    name = request.match_info["name"]
    if _CYCLE_FILE.match(name) is None:
        raise web.HTTPNotFound(text=f"{name[:80]!r} is not a dump cycle file\n")
    path = os.path.join(request.app[SOURCE].path, name)
    try:
        body = await asyncio.get_running_loop().run_in_executor(None, _read_bounded, path)
    except (OSError, DumpError) as e:
        raise web.HTTPNotFound(text=f"{name}: {first_line(e)}\n") from None
    ctype = "application/json" if name.endswith(".json") else "text/plain"
    return web.Response(body=body, content_type=ctype, charset="utf-8")


def make_view_app(path: str, *, auth_token: str | None = None) -> web.Application:
    """The frontend app over the dump directory ``path`` (no job, store or GPU needed)."""
    config = ServerConfig(port=0, auth_token=auth_token)
    collector = DiskCollector()
    app = make_frontend_app(config, collector.registry, collector=collector,
                            middlewares=[postmortem_middleware])
    app[SOURCE] = DumpSource(os.path.abspath(path))
    app.router.add_get("/postmortem/files/{name}", cycle_file)
    return app


# ---------------------------------------------------------------------------------------------
# CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m debug_server.view",
        description="Serve the debug_server UI from a dump directory after the job has ended.")
    p.add_argument("dump_dir", help="the job's dump_dir (or a directory of per-rank dumps)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="HTTP port (0: any free one)")
    p.add_argument("--host", default="127.0.0.1",
                   help="bind address (default loopback; any other needs the access token)")
    return p


async def _serve(app: web.Application, host: str, port: int, token: str | None) -> int:
    async with own_server(app) as runner:
        try:
            # One port for every address family of host (a TCPSite on "" or "::" would give
            # IPv4 and IPv6 different ephemeral ports).
            bound = await start_sites(runner, host, port)
        except OSError as e:
            print(f"error: cannot bind {host}:{port}: {e.strerror or e}", file=sys.stderr)
            return 3
        stop = asyncio.Event()
        stop_on_signals(stop)
        shown = f"[{host}]" if ":" in host else host
        link = f"http://{shown}:{bound}/" + (f"?token={token}" if token else "")
        logger.info("debug_server post-mortem viewer for %s on %s", app[SOURCE].path, link)
        print(f"ready {bound}", flush=True)
        await stop.wait()
        return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (1 unusable directory, 2 bad option, 3 port busy)."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not os.path.isdir(args.dump_dir):
        print(f"error: no such directory: {args.dump_dir}", file=sys.stderr)
        return 1
    # As the live frontend: loopback needs no secret; any other address needs the token
    # (from the environment, never argv, or a new one shown once in the log).
    token = os.environ.pop(TOKEN_ENV, None) or None
    try:
        if token is None and token_required("auto", args.host, None):
            token = new_token()
        app = make_view_app(args.dump_dir, auth_token=token)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    scan = scan_dir(os.path.abspath(args.dump_dir))
    for p in scan.problems:
        logger.warning("debug_server view: %s", p)
    logger.info("debug_server view: %d dump cycle(s), %d hang report(s) in %s",
                len(scan.cycles), len(scan.hang_reports), args.dump_dir)
    return asyncio.run(_serve(app, args.host, args.port, token))


__all__ = ["DiskCollector", "main", "make_view_app", "scan_dir"]

if __name__ == "__main__":
    sys.exit(main())
