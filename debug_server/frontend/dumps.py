"""The periodic dumper: every interval, a dated record of the job's state in ``dump_dir``.

One cycle writes, each only if enabled:

- ``torchcomms_fr_trace_<ts>.txt``: the analyzer's text report and a "Dump File" section with
  each rank's pickle result (``fr_trace``);
- ``stacks_<ts>.txt``: ``=== Rank N ===`` sections of faulthandler text (``stacks``);
- every rank's pickle under ``$TORCHCOMM_FR_DUMP_TEMP_FILE<rank>`` (``per_rank``);
- ``fr_snapshot_<ts>.json``: ``{rank: dump | {"error": line}}``, so a post-mortem can re-run the
  analyzer on exactly what was seen (``snapshot``).

At scale (issue 41: 131072 ranks) no file has a row per rank: above ``PER_RANK_LISTING_MAX``
ranks, ranks alike share one stacks section (``=== Ranks 0-77776, 77778-131071 (131071 ranks)
===``), one Dump File line and one failure line (ranges), and the snapshot writes one dump per
class of ranks (``snapshot``); a rank unlike the others keeps its own section, line or dump.

``<ts>`` is ``%Y%m%d_%H%M%S`` with ``_1``, ``_2``... when two cycles fall in one second. Files are
written to a temp name and renamed; only the newest ``keep`` cycles are kept. A dump directory
that cannot be written is logged once (and once more when it recovers), never per cycle.

No file work runs on the event loop: after the fan-out, a cycle's snapshot, reports, writes and
pruning run on the dump directory's own thread (``FileThread``), in order, so a slow or hung
filesystem (NFS) delays the dumps, never a page. The analysis runs before them on the loop's
executor and goes to the frontend's ``lastcycle.LastCycle`` (``/metrics`` reads it), so a hung
disk does not hold ``/metrics`` back either.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import queue
import re
import socket
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, TypeVar

from debug_server.analysis import core as analysis
from debug_server.analysis import report
from debug_server.analysis.digest import DigestMemo
from debug_server.analysis.ranks import format_rank_set
from debug_server.analysis.stackgroups import stack_groups
from debug_server.config import ALL_DUMPS
from debug_server.dumpio import write_atomic
from debug_server.fanout.collector import Collector
from debug_server.fanout.reply import FrData
from debug_server.fanout.transport import GONE, OK, RankResult
from debug_server.frontend import snapshot
from debug_server.frontend.dumplists import (
    MAX_ROWS,
    PER_RANK_LISTING_MAX,
    capped,
    failure_rows,
    group_lines,
    grouped_sections,
    ranks_head,
    ranks_text,
    strip_rank,
)
from debug_server.frontend.fetchfacts import FetchFacts
from debug_server.frontend.lastcycle import FrPart, LastCycle
from debug_server.protocol.names import DUMP_FILE_HANDLER
from debug_server.readers import procstate

logger = logging.getLogger(__name__)
T = TypeVar("T")

STAMP_FORMAT = "%Y%m%d_%H%M%S"
FR_TRACE_PREFIX = "torchcomms_fr_trace"
STACKS_PREFIX = "stacks"
SNAPSHOT_PREFIX = "fr_snapshot"
HANG_REPORT_PREFIX = "hang_report"
"""``hang_report_<ts>.txt/.json``: written by ``hangreport.HangWatch``, never pruned."""

_CYCLE_FILE = re.compile(
    rf"^(?:{FR_TRACE_PREFIX}|{STACKS_PREFIX}|{SNAPSHOT_PREFIX})_(\d{{8}}_\d{{6}})(?:_(\d+))?\.(?:txt|json)$"
)


# ---------------------------------------------------------------------------------------------
# Renderers shared with the frontend's text pages


def status_block(fetch: FetchFacts) -> str:
    """``PARTIAL DATA: 6/8 ranks answered`` and one line per failed rank (above
    ``PER_RANK_LISTING_MAX`` failures, per kind of failure with its ranks); empty when all did."""
    if not fetch.failures:
        return ""
    lines = [f"PARTIAL DATA: {fetch.asked - len(fetch.failures)}/{fetch.asked} ranks answered"]
    rows = (fetch.failures if len(fetch.failures) <= PER_RANK_LISTING_MAX
            else failure_rows(fetch.failures))
    lines += [f"  {line}" for line in rows]
    return "\n".join(lines)


def stacks_text(results: Sequence[RankResult], groups: Sequence[Mapping[str, Any]] = ()) -> str:
    """``=== Rank N ===`` sections: each rank's faulthandler text, or its one failure line.

    ``groups`` (``stackgroups.stack_groups``) become a preamble: one line per set of ranks whose
    main threads stand at the same place, odd ones first, so 63 identical ranks read as one line.
    """
    parts = _preamble(groups)
    for r in results:
        parts.append(f"=== Rank {r.rank} ===")
        if r.process is not None:
            parts.append(f"Process: {procstate.describe(r.process)}")
        parts.append((r.body or "").rstrip("\n") if r.ok else r.line())
        parts.append("")
    return "\n".join(parts)


def _preamble(groups: Sequence[Mapping[str, Any]]) -> list[str]:
    parts = []
    if groups:
        parts.append("--- Stack groups (main thread; odd ones first) ---")
        for g in groups[:MAX_ROWS]:
            n = len(g["ranks"])
            where = g["summary"] + ("" if g.get("in_collective") else "  (not in a collective)")
            parts.append(f"{n} rank{'s' if n != 1 else ''} ({ranks_text(g['ranks'])}): {where}")
        if len(groups) > MAX_ROWS:
            parts.append(f"... {len(groups) - MAX_ROWS} more groups")
        parts.append("")
    return parts


def stacks_report(results: Sequence[RankResult]) -> str:
    """The /stacks text: the stack groups, then every rank's section."""
    texts = {r.rank: r.body for r in results if r.ok and r.body}
    return stacks_text(results, stack_groups(texts))


def stacks_file(results: Sequence[RankResult], *, grouped: bool | None = None) -> str:
    """``stacks_<ts>.txt``: the stack groups, then a section per rank, as ``stacks_report``, up to
    ``PER_RANK_LISTING_MAX`` ranks (or with ``grouped=False``).

    Above (or with ``grouped=True``), ranks whose texts read the same (but for thread ids) are
    one section headed by their ranges, ``=== Ranks 0-77776, 77778-131071 (131071 ranks) ===``,
    showing the lowest rank's text; ranks that failed alike, one section of one line
    (``ranks 100-199: unreachable after 2.0 s``); a rank alone keeps ``=== Rank N ===`` and its
    own process line. The file keeps within ``MAX_STACKS_FILE_CHARS``: sections past it are
    counted in a last line that names their ranks. ``analysis.stackparse.split_stacks_file``
    reads both forms back, one text per rank.
    """
    if grouped is None:
        grouped = len(results) > PER_RANK_LISTING_MAX
    texts = {r.rank: r.body for r in results if r.ok and r.body}
    groups = stack_groups(texts)
    if not grouped:
        return stacks_text(results, groups)
    return grouped_sections(results, _preamble(groups))


def dump_file_lines(results: Sequence[RankResult], *, grouped: bool | None = None) -> list[str]:
    """``Rank N: OK - ... written to <path>`` or ``Rank N: <why not>``.

    A pickle this process cannot see was written on another host (a dump dir that is not
    shared): its line names that host, and a last line says how to analyze without it. Above
    ``PER_RANK_LISTING_MAX`` ranks (or with ``grouped=True``), ranks alike share one line:
    ``Ranks 0-99, 200-131071: OK - FR pickle written to <dir>/rank_<N>`` (at most ``MAX_ROWS``).
    """
    if grouped is None:
        grouped = len(results) > PER_RANK_LISTING_MAX
    lines = []
    elsewhere: list[int] = []
    here_dirs: list[str] = []
    keyed: list[tuple[int, tuple[str, ...]]] = []
    hosts: dict[tuple[str, ...], list[str]] = {}
    me = socket.gethostname()
    for r in results:
        if r.ok:
            try:
                reply = r.json()
                path, host = reply.get("path"), reply.get("host")
            except (ValueError, AttributeError):
                path = host = None
            shown = path or "(path not reported)"
            line = f"Rank {r.rank}: OK - FR pickle written to {shown}"
            away = False
            if isinstance(path, str) and path:
                if os.path.exists(path):
                    if not here_dirs:
                        here_dirs.append(os.path.dirname(path))
                else:
                    away = True
                    elsewhere.append(r.rank)
                    line += f" on host {host or '(not reported)'}, not on this host ({me})"
            if not grouped:
                lines.append(line)
                continue
            if isinstance(path, str) and path.endswith(str(r.rank)):
                shown = path[: len(path) - len(str(r.rank))] + "<N>"
            key = ("ok", shown, "away" if away else "")
            if away:
                seen = hosts.setdefault(key, [])
                if len(seen) < 4 and str(host) not in seen:
                    seen.append(str(host))
            keyed.append((r.rank, key))
        else:
            why = r.error or r.status
            if not grouped:
                lines.append(f"Rank {r.rank}: {why}")
                continue
            keyed.append((r.rank, ("failed", *map(str, strip_rank(r.rank, why)))))
    if grouped:
        rows = []
        for ranks, key in group_lines(keyed):
            if len(ranks) == 1:  # today's line for a rank alone
                r = ranks[0]
                if key[0] == "ok":
                    line = f"Rank {r}: OK - FR pickle written to {key[1].replace('<N>', str(r))}"
                    if key[2]:
                        line += (f" on host {hosts[key][0] if hosts[key] else '(not reported)'}, "
                                 f"not on this host ({me})")
                else:
                    line = f"Rank {r}: {f'rank {r}: ' if key[1] == 'True' else ''}{key[2]}"
            elif key[0] == "ok":
                line = f"{ranks_head(ranks)}: OK - FR pickle written to {key[1]}"
                if key[2]:
                    seen = hosts.get(key, [])
                    line += (f" on other hosts ({', '.join(seen[:3])}{', ...' if len(seen) > 3 else ''}),"
                             f" not on this host ({me})")
            else:
                line = f"{ranks_head(ranks)}: {key[2]}"
            rows.append((ranks, line))
        lines = capped(rows)
    if elsewhere:
        where = here_dirs[0] if here_dirs else "<dir>"
        lines.append(
            f"Rank{'s' if len(elsewhere) > 1 else ''} {format_rank_set(elsewhere)} wrote "
            f"{'their pickles' if len(elsewhere) > 1 else 'its pickle'} on other hosts: copy them "
            f"next to the others, or analyze the ones here: python -m debug_server.fr_trace {where} "
            f"-p rank_ --allow-incomplete-ranks")
    return lines


def fr_trace_text(result: Mapping[str, Any], fetch: FetchFacts,
                  dump_results: Sequence[RankResult] | None = None) -> str:
    """The fr_trace page as text (and, with ``dump_results``, the dump file)."""
    parts = []
    block = status_block(fetch)
    if block:
        parts += [block, ""]
    parts.append(report.fr_trace_text(dict(result)).rstrip("\n"))
    if dump_results is not None:
        parts += ["", "--- Dump File ---", *dump_file_lines(dump_results)]
    return "\n".join(parts) + "\n"


def snapshot_json(fr: FrData) -> str:
    """``{"<rank>": dump | {"error": line}}``: what the analysis saw, in bounded bytes.

    Each rank's dump as analyzed (cut to the job's window on a live fetch), at most
    ``snapshot.MAX_ENTRIES_PER_RANK`` entries, long group member lists written once, and ranks
    whose dumps are alike (shared parts, or the same text) written once with the list of the
    others and their own ``dump_time_ns`` (``same_as``), ranks that failed alike as one row
    (``rank_errors``): ``snapshot``'s doc has the format; a cycle's size grows with neither ring
    length nor the number of ranks alike. Readers call ``snapshot.expand``. Whole rings stay in
    the per-rank pickles.
    """
    return snapshot.encode([(r.rank, fr.dumps.get(r.rank) if r.body is not None else None,
                             r.line()) for r in fr.results])


def analyze_fr(fr: FrData, stacks: Sequence[RankResult] | None, world_size: int,
               memo: DigestMemo | None = None) -> dict[str, Any]:
    """The analyzer over one fan-out's records (what pages and dumps both show); ``memo``: the
    collector's own digests of its last analysis (``Collector.digest_memo``)."""
    # r.status, not r.ok: a property call per rank is a tenth of this line at 131072 ranks
    stack_texts = {r.rank: r.body for r in stacks or ()
                   if (r.status == OK or r.status == GONE) and r.body is not None}
    # Each rank's process as read on its host (fanout.outside): a silent rank's state is
    # evidence (analysis.silent), and the result's ranks[].process shows it.
    processes = {r.rank: r.process for r in stacks or () if r.process is not None}
    return analysis.analyze(fr.dumps, world_size=world_size, stacks=stack_texts or None,
                            unavailable=fr.unavailable(), digest_memo=memo,
                            processes=processes or None)


# ---------------------------------------------------------------------------------------------
# Files


class FileThread:
    """One thread that runs file work in the order it was submitted, for the event loop.

    A daemon thread rather than an executor's: a write stuck in the kernel (a hung NFS server)
    must not hold up the frontend's exit, and ``ThreadPoolExecutor`` joins its threads at exit.
    The thread starts on the first call and ends after ``idle_s`` without work.
    """

    def __init__(self, name: str, idle_s: float = 5.0) -> None:
        self.name = name
        self.idle_s = idle_s
        self._queue: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...],
                                             concurrent.futures.Future[Any]]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the thread, after everything submitted before it."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:  # the same lock as the idle exit: no item is left without a thread
            self._queue.put((fn, args, fut))
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=self.name, daemon=True)
                self._thread.start()
        return await asyncio.wrap_future(fut)

    def _work(self) -> None:
        while True:
            try:
                fn, args, fut = self._queue.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            if not fut.set_running_or_notify_cancel():  # its awaiter was cancelled
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # handed to the awaiter, which logs it
                fut.set_exception(e)


class DumpDir:
    """Names, writes and prunes the dated files of one dump directory.

    The methods do blocking file work; from the event loop, call them through ``run``.
    """

    def __init__(self, path: str, keep: int = 50, keep_bytes: int | None = None) -> None:
        self.path = path
        self.keep = keep
        self.keep_bytes = keep_bytes
        self._last: tuple[str, int] | None = None
        self._thread = FileThread("debug_server.dumps")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on this directory's file thread, in order with earlier calls."""
        return await self._thread.run(fn, *args)

    def new_stamp(self, now: float | None = None) -> str:
        """``%Y%m%d_%H%M%S``, suffixed ``_1``, ``_2``... when that second is already used."""
        base = time.strftime(STAMP_FORMAT, time.localtime(time.time() if now is None else now))
        n = self._last[1] + 1 if self._last and self._last[0] == base else 0
        while self._taken(base, n):  # a stamp from an earlier process in the same second
            n += 1
        self._last = (base, n)
        return base if n == 0 else f"{base}_{n}"

    def _taken(self, base: str, n: int) -> bool:
        stamp = base if n == 0 else f"{base}_{n}"
        return any(
            os.path.exists(os.path.join(self.path, f"{p}_{stamp}.{ext}"))
            for p, ext in ((FR_TRACE_PREFIX, "txt"), (STACKS_PREFIX, "txt"), (SNAPSHOT_PREFIX, "json"),
                           (HANG_REPORT_PREFIX, "txt"), (HANG_REPORT_PREFIX, "json"))
        )

    def create(self) -> None:
        os.makedirs(self.path, exist_ok=True)

    def write(self, name: str, data: str | bytes) -> str:
        path = os.path.join(self.path, name)
        write_atomic(path, data)
        return path

    def prune(self) -> list[str]:
        """Delete the files of all but the newest ``keep`` cycles, then the oldest cycles until
        the rest hold at most ``keep_bytes`` (the newest cycle always stays); returns what was
        deleted. Hang reports are not cycle files and are never deleted."""
        cycles: dict[tuple[str, int], list[str]] = {}
        for name in os.listdir(self.path):
            m = _CYCLE_FILE.match(name)
            if m:
                cycles.setdefault((m.group(1), int(m.group(2) or 0)), []).append(name)
        order = sorted(cycles)
        drop = order[: -self.keep]
        if self.keep_bytes is not None:
            kept = order[len(drop):]
            sizes = [sum(self._size(n) for n in cycles[k]) for k in kept]
            total = sum(sizes)
            for key, size in zip(kept[:-1], sizes[:-1], strict=True):
                if total <= self.keep_bytes:
                    break
                drop.append(key)
                total -= size
        removed = []
        for key in drop:
            for name in cycles[key]:
                try:
                    os.unlink(os.path.join(self.path, name))
                    removed.append(name)
                except FileNotFoundError:
                    pass
        return removed

    def _size(self, name: str) -> int:
        try:
            return os.path.getsize(os.path.join(self.path, name))
        except OSError:  # pruned meanwhile by another writer of this dir
            return 0


# ---------------------------------------------------------------------------------------------
# The dumper


DUMP_RANKS_PER_S = 512
"""Ranks per second of interval at most (as the hang watch's ``MAX_POLLS_PER_S``): above
``interval x`` this many ranks, the dump cycles come less often (``Dumper.interval_s``)."""


class Dumper:
    """Runs dump cycles; owned by the frontend app as a background task."""

    def __init__(self, collector: Collector, dump_dir: str, *, interval: float,
                 enabled: Collection[str] = ALL_DUMPS, keep: int = 50,
                 first_delay: float = 1.0, keep_bytes: int | None = None,
                 cycle: LastCycle | None = None) -> None:
        self.collector = collector
        self.cycle = cycle
        """Where each cycle's FR analysis goes (``/metrics`` reads it); None: nowhere."""
        self.dir = DumpDir(dump_dir, keep, keep_bytes)
        self.interval = interval
        self.enabled = frozenset(enabled)
        self.first_delay = min(first_delay, interval)
        self.cycles = 0
        self._failing = False

    def interval_s(self) -> float:
        """Seconds between cycles: ``interval``, longer where the job is too big for it
        (``DUMP_RANKS_PER_S``: 256 s at 131072 ranks, where ``interval``'s default of 60 s
        made every minute a whole-job fan-out of FR, stacks and dump files)."""
        return max(self.interval, self.collector.world_size / DUMP_RANKS_PER_S)

    async def run_forever(self) -> None:
        """First cycle soon after start (short demos get dumps), then every ``interval_s()``;
        where that is rationed (a job of more than ``interval x DUMP_RANKS_PER_S`` ranks) the
        first cycle waits one of them too: a new frontend's first pages then do not share the
        box with a whole-job cycle (at 131072 ranks it took the first page from 8 s to 15 s)."""
        interval = self.interval_s()
        delay = self.first_delay if interval <= self.interval else interval
        while True:
            await asyncio.sleep(delay)
            started = time.monotonic()
            await self.run_cycle()
            delay = max(0.0, self.interval_s() - (time.monotonic() - started))

    async def run_cycle(self) -> list[str]:
        """One cycle; returns the paths written. Never raises (but for cancellation)."""
        try:
            written = await self._cycle()
        except OSError as e:
            if not self._failing:
                logger.error("debug_server: cannot write dumps to %s: %s (will keep trying; "
                             "pages are unaffected)", self.dir.path, e)
            self._failing = True
            return []
        except Exception:
            logger.exception("debug_server: dump cycle failed")
            return []
        if self._failing:
            logger.warning("debug_server: writing dumps to %s works again", self.dir.path)
        self._failing = False
        self.cycles += 1
        return written

    @property
    def fetches_fr(self) -> bool:
        """Whether a cycle fetches FR (and so puts an FR part in ``cycle``)."""
        return bool(self.enabled & {"fr_trace", "snapshot"})

    async def _cycle(self) -> list[str]:
        c = self.collector
        # First, and off the loop like every file operation: an unusable dir costs no fan-out.
        await self.dir.run(self.dir.create)
        started = time.monotonic()
        addrs = await c.registry.lookup()
        # asyncio.sleep(0) returns None: the gather's slot for what this cycle does not want.
        want_fr = self.fetches_fr
        want_stacks = bool(self.enabled & {"stacks", "fr_trace"})

        async def fr_and_stacks() -> tuple[FrData | None, list[RankResult] | None]:
            if want_fr and want_stacks:  # one request per rank for both (fr_stacks)
                return await c.fr_stacks(addrs)
            return (await c.fr(addrs=addrs) if want_fr else None,
                    await c.stacks(addrs) if want_stacks else None)

        dump_task = (c.fetch(DUMP_FILE_HANDLER, None, addrs) if "per_rank" in self.enabled
                     else asyncio.sleep(0))
        result = None
        with (self.cycle.fetching_fr() if self.cycle is not None and want_fr
              else contextlib.nullcontext()):
            (fr, stacks), dumped = await asyncio.gather(fr_and_stacks(), dump_task)
            if fr is not None:
                # On the loop's executor, not the dir's thread: /metrics never waits on a disk.
                result, part = await asyncio.get_running_loop().run_in_executor(
                    None, self._analyze, fr, stacks, started)
                if self.cycle is not None:
                    self.cycle.put_fr(part)
        return await self.dir.run(self._write_cycle, fr, stacks, dumped, result)

    def _analyze(self, fr: FrData, stacks: list[RankResult] | None,
                 started: float) -> tuple[dict[str, Any], FrPart]:
        result = analyze_fr(fr, stacks, self.collector.world_size, self.collector.digest_memo)
        return result, FrPart.of(fr, result, started, "dumper")

    def _write_cycle(self, fr: FrData | None, stacks: list[RankResult] | None,
                     dumped: list[RankResult] | None,
                     result: Mapping[str, Any] | None = None) -> list[str]:
        # On the dump dir's thread: each file is built, then written, in this order.
        stamp = self.dir.new_stamp()
        written: list[str] = []
        if fr is not None and "snapshot" in self.enabled:
            written.append(self.dir.write(f"{SNAPSHOT_PREFIX}_{stamp}.json", snapshot_json(fr)))
        if fr is not None and "fr_trace" in self.enabled:
            if result is None:
                result = analyze_fr(fr, stacks, self.collector.world_size,
                                    self.collector.digest_memo)
            written.append(self.dir.write(f"{FR_TRACE_PREFIX}_{stamp}.txt",
                                          fr_trace_text(result, FetchFacts.of(fr), dumped)))
        if stacks is not None and "stacks" in self.enabled:
            written.append(self.dir.write(f"{STACKS_PREFIX}_{stamp}.txt", stacks_file(stacks)))
        self.dir.prune()
        return written
