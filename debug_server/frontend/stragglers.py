"""``/stragglers``: ranks that arrive late at collectives while the job runs, and their history.

``StragglerWatch`` polls every ``POLL_INTERVAL_S`` (longer above 640 ranks: ``MAX_POLLS_PER_S``):
each rank's newest entries' times (``window_for`` ops per communicator, fewer at scale so a poll
moves at most ``ENTRY_BUDGET`` entries) and each rank's clock against ours (``fanout.recent``:
through the tree's aggregators or each host's agent where the job has them, two asks per agent;
every other rank asked directly, a reply with no entries for its clock, then its times), and
``analysis.stragglers.analyze``. It keeps the last result (the overview's "Slow:" lines and
``/metrics`` read it, at no cost to them) and, per (rank, group), since when the rank has been
named slow without a break: the hang report says "rank 2 had been arriving last for 14 min
before it stopped" from that (``before_hang``).

The page itself polls once more (fresh data for curl; where the job is big enough that the watch
rations its polls, it shows the last poll while that is younger than one interval, and says so,
in its text and in an ``Age`` header: ``for_page``), then answers as the others do: HTML to
browsers (a table per group, ranks by median lag, a lag sparkline each), the text tables to
curl, and to ``Accept: application/json`` / ``?format=json`` exactly
``{"stragglers": [...], "groups_checked": [...], "window_ops": N}``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from aiohttp import web
from tabulate import tabulate

from debug_server.analysis import stragglers
from debug_server.analysis.stragglers import Rule
from debug_server.fanout import recent
from debug_server.fanout.collector import Collector
from debug_server.fanout.live import LiveCollector
from debug_server.fanout.pagefirst import poll_forever
from debug_server.frontend import render
from debug_server.frontend.pagekit import (
    COLLECTOR,
    TEMPLATES,
    negotiate,
)
from debug_server.frontend.pagekit import off_loop as _off_loop
from debug_server.frontend.pagekit import parse_format as _format
from debug_server.frontend.pagekit import query as _query
from debug_server.frontend.pagekit import respond as _respond

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 5.0
"""Seconds between background polls. Each costs every rank one read of its ring (what one page
load's FR fetch costs it), so not every 2 s as the health poll; ``/stragglers`` polls afresh."""
MAX_POLLS_PER_S = 128
"""Ranks asked per second at most by the background poll: above 640 ranks its interval grows
with the job (32 s at 4096 ranks), so an idle frontend stays cheap; ``/stragglers`` itself
always polls afresh."""
ENTRY_BUDGET = 32_768
"""FR entries one poll asks for over all ranks (``window_for``): 128 per rank up to 256 ranks,
down to ``MIN_WINDOW`` from 2048 on (what the lag computation costs grows with it)."""
MAX_WINDOW = 128
MIN_WINDOW = 16
STREAK_GRACE_S = 30.0
"""A rank not named for longer than this (polls that failed, a quiet group) starts a new streak."""
ROWS_SHOWN = 32
"""Ranks per group on the page and in the text (the slowest); JSON names every straggler."""
SPARK_W, SPARK_H = 120, 20



def window_for(world_size: int) -> int:
    """Collectives per group a poll looks at: 128 up to 256 ranks, fewer above (16 from 2048
    ranks on: the chance of being last by luck, 1/m, is smaller there too, and a big group
    needs only ``Rule.min_ops``, 8, of them: ``analysis.stragglers.needed_ops``)."""
    return max(MIN_WINDOW, min(MAX_WINDOW, ENTRY_BUDGET // max(1, world_size)))


class StragglerWatch:
    """The straggler polls and what they remember (module docstring)."""

    def __init__(self, collector: Collector, *, interval: float = POLL_INTERVAL_S) -> None:
        self.collector = collector
        self.interval = interval
        self.rule = Rule(window_ops=window_for(collector.world_size))
        self.book = recent.ClockBook()
        """Each rank's (or agent's) clock estimates (``fanout.recent``)."""
        self.last: dict[str, Any] | None = None
        self.last_at: float | None = None
        """``time.time()`` of the last result."""
        self.streaks: dict[tuple[int, str], list[float]] = {}
        """(rank, group) -> [first, last] ``time.time()`` it was named, without a break."""
        self._lock = asyncio.Lock()
        self.failures: list[str] = []
        """One line per rank the last poll got no FR data from."""

    def poll_interval(self) -> float:
        return max(self.interval, self.collector.world_size / MAX_POLLS_PER_S)

    async def run_forever(self) -> None:
        # The agents' clocks sampled at quiet moments between polls too (``fanout.recent``).
        sampler = asyncio.ensure_future(recent.sample_clocks(self.collector, self.book)) \
            if isinstance(self.collector, LiveCollector) else None
        try:
            await poll_forever(self.poll_interval, self.poll, lambda e: logger.error(
                "debug_server: straggler poll failed", exc_info=e))
        finally:
            if sampler is not None:
                sampler.cancel()

    async def poll(self) -> dict[str, Any]:
        """One fetch and analysis; the result (``analysis.stragglers.analyze``) is kept."""
        async with self._lock:  # the page and the background poll: one at a time
            got = await self._fetch()
            self.failures = got.lines()
            result = await _off_loop(stragglers.analyze, got.dumps, got.clocks, self.rule)
            self._remember(result, time.time())
            return result

    async def for_page(self) -> tuple[dict[str, Any], float | None]:
        """The page's result and its age: a poll now; where this job size rations the polls
        (``poll_interval`` above ``interval``), the last one while it is younger than one
        interval (a poll asks every rank twice: 262144 requests at 131072 ranks), with its
        age in seconds (None: polled now)."""
        interval = self.poll_interval()
        if self.last is not None and self.last_at is not None and interval > self.interval:
            age = time.time() - self.last_at
            if 0 <= age <= interval:
                return self.last, age
        return await self.poll(), None

    def held_note(self, age: float) -> str:
        """What the page says of a result ``age`` seconds old (``for_page``)."""
        return (f"From the straggler poll of {age:.0f} s ago: at this job size the watch polls "
                f"every {self.poll_interval():.0f} s, and the page does not ask every rank "
                "again meanwhile.")

    async def _fetch(self) -> recent.Recent:
        if not isinstance(self.collector, LiveCollector):
            # The post-mortem viewer's collector: the rings as written, on the frontend's clock.
            fr = await self.collector.fr(whole=True)
            return recent.Recent(dict(fr.dumps), {}, {r.rank: (r.status, r.line())
                                                      for r in fr.results if not r.ok})
        # Through the tree where the job has one (two asks per aggregator), else each rank
        # directly: its clock from a reply with no entries, then its times (``fanout.recent``).
        return await recent.read(self.collector, self.rule.window_ops,
                                 await self.collector.registry.lookup(), self.book)

    def _remember(self, result: dict[str, Any], now: float) -> None:
        self.last, self.last_at = result, now
        for s in result["stragglers"]:
            key = (s["rank"], s["group"])
            span = self.streaks.get(key)
            if span is None or now - span[1] > max(STREAK_GRACE_S, 3 * self.poll_interval()):
                self.streaks[key] = [now, now]
            else:
                span[1] = now
        stale = now - max(STREAK_GRACE_S, 3 * self.poll_interval())
        for key in [k for k, span in self.streaks.items() if span[1] < stale]:
            del self.streaks[key]

    # -- what other pages show ----------------------------------------------------------------

    def lines(self) -> list[str]:
        """The overview's "Slow: ..." sentences from the last poll (none before the first)."""
        if self.last is None:
            return []
        return [stragglers.sentence(s, self.last) for s in self.last["stragglers"]]

    def overview_lines(self, analysis: Mapping[str, Any]) -> list[str]:
        """``lines``, and where the analysis ``analysis`` finds a hang, ``before_hang`` of its
        culprit ranks."""
        culprits = {r for f in analysis.get("findings", []) if f.get("severity", "error") == "error"
                    for r in f.get("ranks", [])}
        history = self.before_hang(culprits) if culprits else ""
        return self.lines() + ([history] if history else [])

    def before_hang(self, culprits: Iterable[int] = (), now: float | None = None) -> str:
        """The hang report's sentence: which of the hang's culprit ranks (else which ranks) had
        been slow, and for how long; "" when none was."""
        if self.last is None:
            return ""
        now = time.time() if now is None else now
        named = {(s["rank"], s["group"]): s for s in self.last["stragglers"]}
        spans = {k: v for k, v in self.streaks.items() if k in named}
        wanted = set(culprits)
        picked = {k: v for k, v in spans.items() if k[0] in wanted} or spans
        out = []
        for (rank, group), (first, _) in sorted(picked.items(), key=lambda kv: kv[1][0]):
            s = named[(rank, group)]
            verb = "starting late" if s["side"] == stragglers.DEVICE else "arriving last"
            label = _label(self.last, group)
            tail = "before it stopped" if rank in wanted else "before the hang"
            out.append(f"rank {rank} had been {verb} on {label} (median {s['median_lag_ms']:.0f}"
                       f" ms behind the first rank) for {_span(now - first)} {tail}.")
        return " ".join(out)


def _label(result: Mapping[str, Any], group: str) -> str:
    return next((g["label"] for g in result["groups"] if g["group"] == group), group)


def _span(seconds: float) -> str:
    if seconds < 90:
        return f"{max(1, round(seconds))} s"
    if seconds < 5400:
        return f"{round(seconds / 60)} min"
    return f"{seconds / 3600:.1f} h"


# ---------------------------------------------------------------------------------------------
# Renderers


def text_report(result: Mapping[str, Any]) -> str:
    """The plain-text page: the sentences, then one table per group (slowest ranks first)."""
    lines = [stragglers.sentence(s, result) for s in result["stragglers"]] or [
        "Nobody is slow: no rank arrives last far more often than chance with a lag well above "
        "the group's."]
    lines.append(f"Window: the newest {result['window_ops']} collectives per group that every "
                 "member issued.")
    for g in result["groups"]:
        rows = [[r["rank"], f"{r['median_lag_ms']:.2f}", f"{r['last_share'] * 100:.0f} %",
                 f"{r['trend_ms']:+.2f}", f"{r['clock_error_ms']:.2f}",
                 f"SLOW ({r['side']})" if r["slow"] else ""] for r in g["rows"][:ROWS_SHOWN]]
        more = len(g["rows"]) - ROWS_SHOWN
        lines += ["", f"=== {g['label']} ({g['size']} ranks, {g['ops']} collectives: "
                      f"{', '.join(g['op_names'])}) ===",
                  tabulate(rows, headers=["rank", "median lag ms", "last", "trend ms",
                                          "clock error ms", ""]),
                  *([f"... and {more} more ranks"] if more > 0 else [])]
    return "\n".join(lines) + "\n"


def _points(spark: Sequence[float], top: float) -> str:
    if not spark:
        return ""
    step = SPARK_W / max(1, len(spark) - 1)
    scale = (SPARK_H - 2) / top if top > 0 else 0.0
    return " ".join(f"{i * step:.1f},{SPARK_H - 1 - v * scale:.1f}" for i, v in enumerate(spark))


def page_model(result: Mapping[str, Any], held_note: str = "") -> dict[str, Any]:
    """What ``stragglers.html`` shows: the sentences, per group its slowest rows, and where the
    result is an earlier poll's, ``held_note`` (``StragglerWatch.held_note``)."""
    groups = []
    for g in result["groups"]:
        rows = g["rows"][:ROWS_SHOWN]
        top = max((max(r["spark"], default=0.0) for r in rows), default=0.0)
        groups.append({**g, "rows": [{**r, "points": _points(r["spark"], top),
                                      "share_pct": round(r["last_share"] * 100)} for r in rows],
                       "more": max(0, len(g["rows"]) - ROWS_SHOWN), "top_ms": round(top, 1)})
    return {"sentences": [stragglers.sentence(s, result) for s in result["stragglers"]],
            "groups": groups, "window_ops": result["window_ops"], "held_note": held_note,
            "spark_w": SPARK_W, "spark_h": SPARK_H}


# ---------------------------------------------------------------------------------------------
# The page

routes = web.RouteTableDef()


@routes.get("/stragglers")
async def stragglers_page(request: web.Request) -> web.Response:
    q = _query(request, {"format": _format, "refresh": render.parse_refresh})
    fmt = negotiate(request, q.get("format"))
    watch = watch_of(request.app)
    result, age = await watch.for_page()
    note = watch.held_note(age) if age is not None else ""
    if fmt == "json":  # exactly the contract's keys; a held poll's age in the Age header
        resp = _respond(fmt, stragglers.public(result))
    elif fmt == "text":
        text = await _off_loop(text_report, result)
        resp = _respond(fmt, f"{note}\n{text}" if note else text)
    else:
        resp = _respond(fmt, await _off_loop(
            lambda: request.app[TEMPLATES].get_template("stragglers.html").render(
                title="Stragglers", failures=watch.failures, **page_model(result, note))))
    if age is not None:  # HTTP's own word for how old a kept answer is (RFC 9111)
        resp.headers["Age"] = str(int(age))
    return resp


class _Slot:
    """The app's watch, made at its first use (the app is frozen by then; the slot is not)."""

    watch: StragglerWatch | None = None


SLOT = web.AppKey("stragglers", _Slot)


def setup(app: web.Application) -> None:
    """Add ``/stragglers`` to the frontend ``app`` (``frontend.make_frontend_app``)."""
    app[SLOT] = _Slot()
    app.add_routes(routes)


def watch_of(app: web.Application) -> StragglerWatch:
    """The app's watch over its collector: the live fan-out's, or the post-mortem viewer's
    (whose rings are read whole, as the dumper wrote them)."""
    slot = app[SLOT]
    if slot.watch is None:
        slot.watch = StragglerWatch(app[COLLECTOR])
    return slot.watch


def held(app: web.Application) -> StragglerWatch | None:
    """The app's watch where one has polled (the overview and ``/metrics`` read its result)."""
    slot = app.get(SLOT)
    return slot.watch if slot is not None and slot.watch is not None \
        and slot.watch.last is not None else None
