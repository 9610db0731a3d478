"""The frontend's hang watch: a verdict on disk seconds after a rank stalls.

``HangWatch`` polls every rank's ``torchcomms_health_check`` every ``min(dump_interval, 2 s)``
(cheap: no FR data moves; above 1024 ranks less often, ``MAX_POLLS_PER_S``). When the job goes from healthy to unhealthy (the first rank reports
a stalled op; not every poll while it stays stalled) it has every rank write its pickle, fetches
the FR data and stacks once, runs the analyzer, and writes ``hang_report_<ts>.txt`` and
``hang_report_<ts>.json`` into ``dump_dir``: who is missing from which collective, and the line
each culprit is on. That lands long before the communicator's timeout tears the job down. When
every rank is healthy again the watch re-arms, so a later stall gets its own report.

A rank whose health check times out ``unresponsive_polls`` times in a row (a process wedged in C
code holding the GIL cannot answer) counts as unhealthy too.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from debug_server.analysis import stackparse
from debug_server.analysis.verdict import category_line
from debug_server.fanout.collector import Collector
from debug_server.fanout.pagefirst import poll_forever
from debug_server.fanout.transport import TIMED_OUT, RankResult
from debug_server.frontend.dumplists import (
    MAX_ROWS,
    PER_RANK_LISTING_MAX,
    capped,
    grouped_sections,
    ranks_head,
    ranks_text,
)
from debug_server.frontend.dumps import (
    DUMP_FILE_HANDLER,
    HANG_REPORT_PREFIX,
    STAMP_FORMAT,
    DumpDir,
    analyze_fr,
    dump_file_lines,
    fr_trace_text,
)
from debug_server.frontend.fetchfacts import FetchFacts
from debug_server.frontend.health import (
    HealthClass,
    RankHealth,
    class_texts,
    health_classes,
    kind_text,
    parse_health,
    ranks_of,
)
from debug_server.frontend.lastcycle import FrPart, HealthPart, LastCycle
from debug_server.protocol import fastjson
from debug_server.protocol.names import HEALTH_HANDLER
from debug_server.readers import procstate

logger = logging.getLogger(__name__)

MAX_POLL_INTERVAL = 2.0
"""Seconds between health polls at most, however long ``dump_interval`` is."""
MAX_POLLS_PER_S = 512
"""Health requests per second at most: above 1024 ranks the poll interval grows with the job
(32 s at 16384 ranks), so an idle frontend stays near 5 % of one core at any size."""
UNRESPONSIVE_POLLS = 3
REPORT_VERSION = 1


def health_lines(health: Sequence[RankHealth], grouped: bool | None = None) -> list[str]:
    """``rank N: <health>`` per rank; above ``PER_RANK_LISTING_MAX`` ranks (or ``grouped``),
    ranks alike in one line, ``ranks 0-77776, 77778-131071: UNHEALTHY: ... in flight for
    120.0-136.5 s`` (a rank alone keeps its own line), at most ``MAX_ROWS`` lines."""
    if grouped is None:
        grouped = len(health) > PER_RANK_LISTING_MAX
    if not grouped:
        return [h.line() for h in health]
    rows = [(c.ranks, c.first.line() if len(c.ranks) == 1 else
             f"{ranks_head(c.ranks, 'rank')} ({len(c.ranks)} ranks): {c.text()}")
            for c in health_classes(health)]
    rows.sort(key=lambda row: row[0][0])
    return capped(rows)


@dataclass(slots=True)
class HangReport:
    """What one report says; ``to_json`` is the ``.json`` file, ``text`` the ``.txt`` file."""

    stamp: str
    time_unix: float
    trigger: Sequence[RankHealth]
    health: Sequence[RankHealth]
    result: dict[str, Any]
    culprits: list[dict[str, Any]]
    text: str = ""
    slow_before: str = ""
    """Who had been slow before the hang, and how long (``frontend.stragglers``); "" if none."""

    def to_json(self) -> dict[str, Any]:
        return {
            "version": REPORT_VERSION,
            "stamp": self.stamp,
            "time_unix": round(self.time_unix, 3),
            "time_iso": _iso(self.time_unix),
            "trigger": health_json(self.trigger, len(self.health) > PER_RANK_LISTING_MAX),
            "health": health_json(self.health),
            "verdict": self.result.get("verdict", ""),
            **({"slow_before": self.slow_before} if self.slow_before else {}),
            **({"category": self.result["category"], "next_step": self.result.get("next_step")}
               if self.result.get("category") else {}),
            "findings": self.result.get("findings", []),
            "culprits": self.culprits,
            "analysis": self.result,
        }


def _health_json(h: RankHealth) -> dict[str, Any]:
    return {"rank": h.rank, "healthy": h.healthy, "stalled_op": h.op_now(),
            "in_flight": h.info.get("in_flight"), "oldest_in_flight_s": h.oldest_s,
            "error": h.error}


def health_json(health: Sequence[RankHealth], grouped: bool | None = None
                ) -> list[dict[str, Any]]:
    """The report's ``health`` (and ``trigger``) entries: one per rank; above
    ``PER_RANK_LISTING_MAX`` ranks (or ``grouped``), one per class of ranks alike
    (``health_classes``) with ``ranks`` (range text), ``count``, the first rank's fields less
    its ages and ``age_s``: [lowest, highest]; a rank alone keeps its own entry. At most
    ``MAX_ROWS`` entries; a last one with ``left_out: true`` names the ranks of the rest."""
    if grouped is None:
        grouped = len(health) > PER_RANK_LISTING_MAX
    if not grouped:
        return [_health_json(h) for h in health]
    rows: list[tuple[list[int], dict[str, Any]]] = []
    for c in sorted(health_classes(health), key=lambda c: c.ranks[0]):
        first = c.first
        if len(c.ranks) == 1:
            rows.append((c.ranks, _health_json(first)))
            continue
        op = first.stalled_op
        rows.append((c.ranks, {
            "ranks": ranks_text(c.ranks), "count": len(c.ranks), "healthy": first.healthy,
            "text": c.text(),
            "stalled_op": {k: v for k, v in op.items() if k != "age_s"} if op else op,
            "in_flight": first.info.get("in_flight"), "age_s": [c.lo, c.hi],
            "error": first.error}))
    out = [e for _, e in rows[:MAX_ROWS]]
    if len(rows) > MAX_ROWS:
        rest = sorted(r for ranks, _ in rows[MAX_ROWS:] for r in ranks)
        out.append({"ranks": ranks_text(rest), "count": len(rest), "left_out": True})
    return out


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).astimezone().isoformat(timespec="milliseconds")


def _where(stack_text: str | None) -> dict[str, Any] | None:
    """The main thread's innermost user frame of one rank: file (full path), line, function."""
    if not stack_text:
        return None
    thread = stackparse.main_thread(stackparse.parse_threads(stack_text))
    if thread is None or not thread.frames:
        return None
    pos = stackparse.summarize(thread.frames)
    # The user's frame: outside the communication stack, innermost first.
    frames = [f for f in thread.frames if not stackparse.is_collective_frame(f)] or thread.frames
    top = frames[0]
    return {"file": top.filename, "line": top.line, "function": top.function,
            "summary": pos.summary, "in_collective": pos.in_collective}


def culprits_of(result: Mapping[str, Any], stacks: Mapping[int, str]) -> list[dict[str, Any]]:
    """One row per (finding, culprit rank): the collective and where that rank is now."""
    rows = []
    procs = {p["rank"]: p.get("process") for p in result.get("ranks") or ()
             if isinstance(p, Mapping) and "rank" in p}
    findings = result.get("findings", [])
    # The analysis' order: the root cause first, its consequences after it.
    order = result.get("finding_order") or range(len(findings))
    for f in (findings[i] for i in order if 0 <= i < len(findings)):
        if f.get("severity", "error") != "error":
            continue
        for rank in f.get("ranks", []):
            rows.append({"rank": rank, "kind": f.get("kind"), "group": f.get("group"),
                         "group_label": f.get("group_label") or f.get("group"),
                         "seq": f.get("seq"), "op": f.get("op"), "detail": f.get("detail", ""),
                         "where": _where(stacks.get(rank)), "process": procs.get(rank)})
    return rows


def render_text(rep: HangReport, fetch: FetchFacts, stacks: Sequence[RankResult],
                dumped: Sequence[RankResult] | None) -> str:
    """The ``.txt`` report: trigger, verdict, culprits with their stacks, then the FR tables.

    Bounded at any job size: above ``PER_RANK_LISTING_MAX`` ranks, ranks whose health reads
    alike share one line (``health_lines``), culprit lines stop at ``MAX_ROWS`` and the stacks
    of the ranks shown are sections of ranks alike (``dumplists.grouped_sections``)."""
    lines = [f"=== Hang report {rep.stamp} ===",
             f"Written: {_iso(rep.time_unix)} (unix {rep.time_unix:.3f})",
             "Trigger: " + "; ".join(health_lines(rep.trigger, len(rep.health) >
                                                  PER_RANK_LISTING_MAX)), "",
             "=== Health ===", *health_lines(rep.health), "",
             "=== Verdict ===", rep.result.get("verdict", "") or "(no verdict)",
             *([rep.slow_before] if rep.slow_before else [])]
    if rep.result.get("category"):
        lines.append(category_line(rep.result))
    lines.append("")
    lines.append("=== Culprits ===")
    if not rep.culprits:
        lines.append("(the analyzer found no culprit rank; see the stacks and tables below)")
    rows = []
    for c in rep.culprits:
        w = c["where"]
        at = (f"{w['file']}:{w['line']} in {w['function']} ({w['summary']})" if w
              else "stack unavailable")
        proc = procstate.describe(c.get("process"))
        rows.append(([c["rank"]], f"rank {c['rank']}: {c['kind']} "
                     f"{c.get('group_label') or c['group']} seq {c['seq']} {c['op']}; "
                     f"now at {at}" + (f"; process {proc}" if proc else "")))
    lines += capped(rows)
    shown = sorted({c["rank"] for c in rep.culprits} | set(ranks_of(rep.trigger)))
    if len(shown) > PER_RANK_LISTING_MAX:
        by_rank = {r.rank: r for r in stacks}
        lines += ["", grouped_sections([by_rank[r] for r in shown if r in by_rank], []).rstrip("\n")]
    else:
        texts = {r.rank: r.body for r in stacks if r.ok and r.body is not None}
        procs = {c["rank"]: c.get("process") for c in rep.culprits}
        for rank in shown:
            lines += ["", f"=== Rank {rank} stacks ==="]
            if procs.get(rank):
                lines.append(f"Process: {procstate.describe(procs[rank])}")
            lines.append((texts.get(rank) or "(unavailable)").rstrip("\n"))
    lines += ["", "=== Flight recorder ===", fr_trace_text(rep.result, fetch, dumped).rstrip("\n")]
    return "\n".join(lines) + "\n"


POLLED = "the hang watch's poll"
PAGE_READ = "an overview's read of every rank"
"""Who read the watch's last health (``HangWatch.last_by``), as the overview names it."""


class HangWatch:
    """Polls health; on the job's first unhealthy rank, writes one hang report."""

    def __init__(self, collector: Collector, dump_dir: str | None, *, interval: float,
                 keep: int = 50, per_rank: bool = True,
                 unresponsive_polls: int = UNRESPONSIVE_POLLS,
                 cycle: LastCycle | None = None) -> None:
        self.collector = collector
        self.cycle = cycle
        """Where each poll's health and each report's FR analysis go (``/metrics`` reads them)."""
        self.dir = DumpDir(dump_dir, keep) if dump_dir else None
        self.interval = min(interval, MAX_POLL_INTERVAL)
        self.per_rank = per_rank
        self.unresponsive_polls = unresponsive_polls
        self.unhealthy = False
        """True from the report until every rank is healthy again."""
        self.reports: list[str] = []
        """Paths of the ``.txt`` reports written (or, without a dump_dir, their stamps)."""
        self.last: Sequence[RankHealth] = ()
        self.last_at: float | None = None
        """``time.monotonic()`` when ``last`` came in (the overview may use it: ``health_held``)."""
        self.last_by = POLLED
        """Who read ``last``: this watch's poll, or an overview's own fetch (``hold``)."""
        self._timeouts: dict[int, int] = {}
        self.before_hang: Callable[[Iterable[int]], str] | None = None
        """Given the culprit ranks, who had been slow before the hang and for how long
        (``frontend.stragglers.StragglerWatch.before_hang``); the report adds it to its verdict."""

    def hold(self, results: Sequence[RankResult], health: Sequence[RankHealth],
             asked_at: float) -> None:
        """A page's own read of every rank's health (the overview's, where no poll is young
        enough to show), held as the last poll: the next overviews show it while it is young
        (``health_held``) instead of each asking every rank again (131072 health requests per
        reload at 131072 ranks, 2.5 s of the overview there). Only the watch's own polls write
        reports; ``/metrics`` takes the fresher health too. ``asked_at``: ``time.monotonic()``
        when the page asked; a poll that came in since is newer, and stays."""
        if self.last_at is not None and self.last_at > asked_at:
            return
        self.last, self.last_at, self.last_by = health, time.monotonic(), PAGE_READ
        if self.cycle is not None:
            self.cycle.put_health(HealthPart.of(results, health))

    def poll_interval(self) -> float:
        """Seconds between polls: ``interval``, longer where the job is too big for it."""
        return max(self.interval, self.collector.world_size / MAX_POLLS_PER_S)

    async def run_forever(self) -> None:
        await poll_forever(self.poll_interval, self.poll, self._failed)

    def _failed(self, e: Exception) -> None:
        if isinstance(e, OSError):
            logger.error("debug_server: cannot write hang report to %s: %s",
                         self.dir.path if self.dir else None, e)
        else:
            logger.error("debug_server: health poll failed", exc_info=e)

    async def poll(self) -> HangReport | None:
        """One health poll; returns the report when this poll wrote one."""
        addrs = await self.collector.registry.lookup()
        results = await self.collector.fetch(HEALTH_HANDLER, None, addrs)
        # Timeouts in a row, kept for the ranks that time out only (not a count per rank).
        timeouts, self._timeouts, errors = self._timeouts, {}, {}
        for r in results:
            if r.status != TIMED_OUT:
                continue
            n = self._timeouts[r.rank] = timeouts.get(r.rank, 0) + 1
            if n >= self.unresponsive_polls:
                errors[r.rank] = f"health check timed out {n} times in a row"
        # Off the loop: 131072 replies take a while to read, which pages would wait.
        health = await asyncio.get_running_loop().run_in_executor(None, parse_health, results,
                                                                  errors)
        self.last, self.last_at, self.last_by = health, time.monotonic(), POLLED
        if self.cycle is not None:
            self.cycle.put_health(HealthPart.of(results, health))
        bad = health.where(lambda h: h.healthy is False)
        if not bad:
            if self.unhealthy:
                logger.warning("debug_server: no rank reports a stall any more")
                self.unhealthy = False
            return None
        if self.unhealthy:
            return None
        self.unhealthy = True
        logger.error("debug_server: job unhealthy: %s; writing hang report",
                     "; ".join(health_lines(bad, len(health) > PER_RANK_LISTING_MAX)))
        return await self.write_report(bad, health, addrs)

    async def write_report(self, trigger: Sequence[RankHealth], health: Sequence[RankHealth],
                           addrs: Any = None) -> HangReport:
        c = self.collector
        now = time.time()
        # asyncio.sleep(0) returns None: the gather's slot for the dumps when none are wanted.
        dump_task = (c.fetch(DUMP_FILE_HANDLER, None, addrs) if self.per_rank and self.dir
                     else asyncio.sleep(0))
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        with self.cycle.fetching_fr() if self.cycle is not None else contextlib.nullcontext():
            (fr, stacks), dumped = await asyncio.gather(c.fr_stacks(addrs), dump_task)
            result = await loop.run_in_executor(None, analyze_fr, fr, stacks, c.world_size,
                                                c.digest_memo)
            if self.cycle is not None:  # the report's analysis is the freshest for /metrics
                self.cycle.put_fr(await loop.run_in_executor(None, FrPart.of, fr, result,
                                                             started, "hang report"))
        stack_texts = {r.rank: r.body for r in stacks if r.ok and r.body is not None}
        # The dump dir's own thread does every file operation: a slow disk never stalls pages.
        stamp = await self.dir.run(self.dir.new_stamp, now) if self.dir else report_stamp(now)
        rep = HangReport(stamp, now, trigger, health, result, culprits_of(result, stack_texts))
        if self.before_hang is not None:
            rep.slow_before = self.before_hang({c["rank"] for c in rep.culprits})
        fetch = FetchFacts.of(fr)
        rep.text = await loop.run_in_executor(None, render_text, rep, fetch, stacks, dumped)
        logger.error("debug_server: hang verdict: %s", result.get("verdict", ""))
        if self.dir is None:
            self.reports.append(stamp)
            return rep
        path = await self.dir.run(self._write_files, self.dir, rep, fetch, dumped)
        self.reports.append(path)
        logger.error("debug_server: hang report written to %s", path)
        return rep

    @staticmethod
    def _write_files(d: DumpDir, rep: HangReport, fetch: FetchFacts,
                     dumped: list[RankResult] | None) -> str:
        d.create()
        # JSON first: a reader that waits for the .txt then finds both.
        d.write(f"{HANG_REPORT_PREFIX}_{rep.stamp}.json", report_json(rep, fetch, dumped) + "\n")
        return d.write(f"{HANG_REPORT_PREFIX}_{rep.stamp}.txt", rep.text)


def report_json(rep: HangReport, fetch: FetchFacts, dumped: list[RankResult] | None) -> str:
    """The report's ``.json``: indented for a small job's reader; compact above
    ``PER_RANK_LISTING_MAX`` ranks, where the ``.txt`` is what a person reads (at 131072 ranks
    the indented text, every rank list one number a line, was 28 MB, made by ``json``'s
    pure-Python encoder in seconds, its pieces the frontend's peak memory: +170 MB)."""
    doc = {**rep.to_json(), "fr_window": fetch.window, "dump_files": dump_file_lines(dumped or [])}
    if len(rep.health) <= PER_RANK_LISTING_MAX:
        return json.dumps(doc, default=str, indent=1)
    return fastjson.dumps(doc, default=str)


def report_stamp(now: float) -> str:
    return time.strftime(STAMP_FORMAT, time.localtime(now))


__all__ = ["PAGE_READ", "POLLED", "HangReport", "HangWatch", "HealthClass", "RankHealth",
           "class_texts", "culprits_of", "report_json",
           "health_classes", "health_json", "health_lines", "kind_text", "parse_health"]
