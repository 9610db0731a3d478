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
``?cycle=<ts>`` picks one (a cookie keeps the choice while you follow links); by default the
first cycle written at or after the newest hang report (the job as it was seen hung: later
cycles may show it after a timeout ended the hang), else the newest with FR data and stacks (a
cycle cut short by a frontend killed mid-cycle is passed over), else the newest. A cycle
without a usable FR snapshot (or with ranks missing from it) takes those ranks' FR data from
the per-rank dumps (``per_rank/``, ours or PyTorch's) and says so. Nothing here talks to a job, a TCPStore or a GPU. Files are read the analyzer's way
(JSON, or pickles of plain containers only), so a hostile file is refused, never run; a file
that cannot be used is one line on the page and in the log.

The pages are the frontend's own handlers and templates: :class:`DiskCollector`
(``tools/view_collector.py``) has the methods of ``fanout.collector.Collector`` and answers them from the
chosen cycle's files, which ``tools/view_disk.py`` finds and reads. This module is the app (the
cycle choice, the banner, the files route) and the command.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import jinja2
from aiohttp import web
from aiohttp.typedefs import Handler

from debug_server.auth import new_token, token_required
from debug_server.config import ConfigError, ServerConfig, take_secrets
from debug_server.dumpio import DumpError
from debug_server.errors import first_line
from debug_server.frontend.app import make_frontend_app
from debug_server.listen import own_server, start_sites, stop_on_signals
from debug_server.tools.view_collector import CURRENT, DiskCollector
from debug_server.tools.view_disk import (
    CYCLE_FILE_RE,
    PER_RANK,
    STAMP_RE,
    Cycle,
    CycleData,
    Scan,
    file_mtime,
    load_cycle,
    read_bounded,
    scan_dir,
)

logger = logging.getLogger(__name__)

DEFAULT_PORT = 25999
CACHED_CYCLES = 4
COOKIE = "debug_server_cycle"
DECORATED = frozenset({"/", "/fr_trace", "/torchcomms_fr_trace", "/stacks"})
"""Pages that get the post-mortem banner (HTML), first line (text) or key (JSON)."""


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
{% if hang_note %}<div class="where">{{ hang_note }}</div>
{% endif %}
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
               tuple((p, file_mtime(p)) for p in (cycle.files() if cycle else [])),
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
    """The cycle asked for (``?cycle=``, else the cookie, else ``Scan.best_cycle``: the one
    of the newest hang report, else the newest with FR data and stacks); 404 if unknown."""
    raw = request.query.get("cycle")
    if raw is not None:
        cycle = scan.find(raw) if (raw == PER_RANK or STAMP_RE.match(raw)) else None
        if cycle is None:
            have = ", ".join(c.stamp for c in scan.cycles[-5:]) or "none"
            raise web.HTTPNotFound(text=f"no dump cycle {raw[:40]!r} in {scan_dir_name(request)} "
                                        f"(newest: {have})\n")
        return cycle, True
    cookie = request.cookies.get(COOKIE)
    if cookie and (cycle := scan.find(cookie)) is not None:
        return cycle, False
    return scan.best_cycle(), False


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
    token = CURRENT.set(data)
    try:
        inner = request
        if "cycle" in request.query:
            inner = request.clone(rel_url=request.rel_url.without_query_params("cycle"))
        resp = await handler(inner)
    finally:
        CURRENT.reset(token)
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
        "hang_note": _hang_note(scan, c),
    }


def _hang_note(scan: Scan, cycle: Cycle | None) -> str | None:
    """Why this cycle, when it is the hang report's and newer ones exist."""
    hung = scan.hang_cycle()
    # By stamp: a cached cycle's data holds the Cycle of the scan that loaded it.
    if cycle is None or hung is None or cycle.stamp != hung.stamp or cycle.stamp == scan.cycles[-1].stamp:
        return None
    return (f"Showing the first dump cycle after the hang report of {scan.hang_reports[-1].stamp}: "
            f"the job as it was seen hung. Newer cycles (pick one above) show it afterwards.")


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
            reports=scan.hang_reports[-5:], files=files, hang_note=info["hang_note"],
            sources=", ".join(s for s in (fr, f"stacks from {st}" if st else None) if s))
        at = body.find("</nav>")
        at = at + len("</nav>") if at >= 0 else 0
        resp.text = body[:at] + "\n" + html + body[at:]
        return
    head = [f"POST-MORTEM: job ended; data from {when} (cycle {info['cycle']}, "
            f"{len(scan.cycles)} in {source.path}; ?cycle=<ts> picks another)"]
    head += [f"POST-MORTEM: {info['hang_note']}"] if info["hang_note"] else []
    head += [f"POST-MORTEM: {p}" for p in data.problems[:20]]
    resp.text = "\n".join(head) + "\n\n" + body


async def cycle_file(request: web.Request) -> web.Response:
    """One text/JSON file of the dump dir by name (hang reports, text reports); nothing else."""
    name = request.match_info["name"]
    if CYCLE_FILE_RE.match(name) is None:
        raise web.HTTPNotFound(text=f"{name[:80]!r} is not a dump cycle file\n")
    path = os.path.join(request.app[SOURCE].path, name)
    try:
        body = await asyncio.get_running_loop().run_in_executor(None, read_bounded, path)
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
    token = take_secrets().auth_token
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
