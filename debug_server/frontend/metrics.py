"""``/metrics``: the job's hang state for Prometheus, as of the frontend's last cycle.

**A scrape asks no rank.** At 131072 ranks a fan-out per scrape (every 15 s) would cost a page
each time, so the families are built from what the frontend's periodic work saw last, kept in
its ``lastcycle.LastCycle``: the last FR fetch's analysis (put by the dumper, a hang report, or
the frontend's own cycle, ``CycleFill``, whichever came last) and the hang watch's last health
poll. ``CycleFill`` keeps the FR part at most ``METRICS_INTERVAL_S`` old (``dump_interval``
where shorter and no dumper fetches FR; longer above 7680 ranks: ``FR_RANKS_PER_S``): an FR fetch
the dumper or a hang report made counts, so a dumper that fetches FR at least that often leaves
it nothing to do, and without a dumper (no ``dump_dir``, ``enabled_dumps`` without ``fr_trace``
and ``snapshot``, an unwritable dump dir) it is the frontend's one FR fetch for ``/metrics``.
Every value is as of its part's cycle, and the families say how old:
``debug_server_last_cycle_age_seconds{part}``. Before the first cycle a scrape still answers,
with what is known (``world_size``, ``cycle_ready 0``, the hang reports, empty families).

The post-mortem viewer (a collector of files, no ranks) has no cycles: its ``/metrics`` reads
the chosen dump cycle's files on request (``read_now``).

A cycle's families (``cycle_families``) are written by ``promtext`` as classes: ranks that share
a value and labels are one label text, their lines joined in C (at 131072 ranks, 1.4 million
samples, ``prometheus_client`` took 9 s of CPU for them); they are rendered once and reused until
a part changes, and gzipped once per cycle for scrapes that take gzip (``CycleText``). The
scrape's own moment (``NowCollector``: world size, readiness, ages, reports) is a custom
collector in a private ``CollectorRegistry`` (never the process-global one, so nothing leaks
between apps or tests). Exposition is the Prometheus text format 0.0.4.

Metrics (labels in braces; ``rank`` is the global rank, ``group`` the communicator):

- ``debug_server_world_size``: ranks in the job.
- ``debug_server_cycle_ready``: 1 once both an FR analysis and a health poll came in, else 0
  (the families below them are absent until then).
- ``debug_server_last_cycle_age_seconds{part}``: seconds since that part came in: ``fr`` (the
  FR fetch and analysis), ``health`` (the hang watch's poll), ``stragglers`` (the straggler
  poll); absent before its first.
- ``debug_server_up{rank}``: 1 when the rank's worker answered the last health poll (before
  one, the last FR fetch), else 0.
- ``debug_server_healthy{rank}``: 1 healthy, 0 a stalled op (only ranks that answered health).
- ``debug_server_in_flight_ops{rank}``: ops issued and not completed.
- ``debug_server_oldest_in_flight_seconds{rank}``: age of the oldest in-flight op (0: none),
  when the poll read it.
- ``debug_server_stalled_op_seq{rank,group,op}``: seq of the op this rank reports stalled.
- ``debug_server_last_enqueued_seq{rank,group}``, ``debug_server_last_started_seq{rank,group}``,
  ``debug_server_last_completed_seq{rank,group}``: from each rank's ``pg_status``.
- ``debug_server_missing_ranks{group,seq,rank}``: 1 for each rank missing from a collective
  that others issued; ``debug_server_missing_ranks_count{group,seq}``: how many.
- ``debug_server_stuck_seq{group,op}``: the lowest sequence number of ``group`` with an error
  finding (missing ranks, mismatch, stuck everywhere): where the job stopped.
- ``debug_server_findings{kind}``: the analyzer's error findings by kind.
- ``debug_server_hang_reports_total``: hang reports written by this frontend (now).
- ``debug_server_scrape_duration_seconds``: how long the last FR cycle's fan-out and analysis
  took (the name is older than the cycles; a scrape itself fetches nothing).
- ``debug_server_rank_arrival_lag_seconds{rank,group}``: the rank's median arrival lag at the
  group's collectives over the straggler window (``frontend.stragglers``' last poll; absent
  before it), and ``debug_server_rank_last_share{rank,group}``: the share of them it was last at.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector as PromCollector

from debug_server.fanout.collector import Collector
from debug_server.frontend import promtext
from debug_server.frontend.dumps import analyze_fr
from debug_server.frontend.hangreport import parse_health
from debug_server.frontend.health import runs_of
from debug_server.frontend.lastcycle import FrPart, HealthPart, LastCycle
from debug_server.frontend.promtext import Family
from debug_server.protocol.names import HEALTH_HANDLER

logger = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "debug_server"
METRICS_INTERVAL_S = 15.0
"""The FR part's most age before the frontend fetches one itself (a usual scrape interval)."""
FR_RANKS_PER_S = 512
"""Ranks per second the frontend's own FR cycle asks at most: above 7680 ranks its interval
grows with the job (256 s at 131072 ranks), as the hang watch's health polls do."""
FIRST_CYCLE_S = 0.25
"""Seconds after start of the frontend's own first FR cycle where no dumper fetches FR (where
one does, its first cycle, 1 s after start, brings the first part)."""
FIRST_CYCLE_RANKS = 1024
"""Above this many ranks the frontend's own first FR cycle waits ``METRICS_INTERVAL_S``: the
first pages (which feed the holder too: ``LastCycle.put_page``) do not share the box with a
whole-job fetch of its own in the frontend's first seconds."""
RECHECK_S = 1.0
"""How soon the frontend's cycle looks again while another FR fetch for the holder runs."""

_WHAT = {"fr": "FR fetch and analysis", "health": "health poll", "stragglers": "straggler poll"}


def _as_of(part: str) -> str:
    """The HELP texts' last sentence: which cycle a value is from, where its age is."""
    return (f" As of the frontend's last {_WHAT[part]} (a scrape asks no rank); its age: "
            f"debug_server_last_cycle_age_seconds, part {part}.")


@dataclass(frozen=True, slots=True)
class Cycle:
    """The parts one scrape renders (``LastCycle``'s at that moment) and the straggler poll's."""

    fr: FrPart | None
    health: HealthPart | None
    slow: dict[str, Any] | None = None
    """The straggler watch's last result (``analysis.stragglers.analyze``), None before it polled."""

    def key(self) -> tuple[Any, ...]:
        return (self.fr, self.health, self.slow)


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=labels)


def cycle_families(c: Cycle) -> list[Family]:
    """The families of one ``Cycle``, in their order: the health poll's, the FR part's (empty
    families before the first FR part), the straggler poll's. Ranks that read alike are one
    value each (a run of the health poll, the ranks at one seq: ``promtext``)."""
    return [*_health_families(c.fr, c.health), *_fr_families(c.fr),
            *_straggler_families(c.slow)]


def _health_families(fr: FrPart | None, hp: HealthPart | None) -> list[Family]:
    h_as_of = _as_of("health")
    up = Family("up", "1 when the rank's worker answered the hang watch's last health poll "
                "(before one, the last FR fetch), else 0." + h_as_of, ["rank"])
    healthy = Family("healthy", "1 healthy, 0 an op in flight longer than the stall timeout "
                     "(ranks that answered health only)." + h_as_of, ["rank"])
    in_flight = Family("in_flight_ops", "Ops issued and not completed." + h_as_of, ["rank"])
    oldest = Family("oldest_in_flight_seconds", "Age of the rank's oldest in-flight op "
                    "(0: none) when the poll read it." + h_as_of, ["rank"])
    stalled = Family("stalled_op_seq", "Sequence number of the op the rank reports "
                     "stalled." + h_as_of, ["rank", "group", "op"])
    if hp is None and fr is not None:  # no poll yet: who answered the last FR fetch
        up.add_values((1 if r in fr.answered else 0, (r,)) for r in fr.ranks)
    replied = hp.replied if hp is not None else frozenset()
    ups: list[tuple[float, Sequence[int]]] = []
    healths: list[tuple[float, Sequence[int]]] = []
    counts: list[tuple[float, Sequence[int]]] = []
    ages: list[tuple[float, Sequence[int]]] = []
    ops: dict[tuple[str, str], list[tuple[float, Sequence[int]]]] = {}
    for h, run in runs_of(hp.health) if hp is not None else ():
        ranks = run if run is not None else (h.rank,)
        if replied.issuperset(ranks):
            ups.append((1, ranks))
        else:
            ups += [(1 if r in replied else 0, (r,)) for r in ranks]
        if h.healthy is not None:
            healths.append((1 if h.healthy else 0, ranks))
        if h.answered:  # a run's ranks share their info and ages (health.HealthSet)
            counts.append((_num(h.info.get("in_flight")), ranks))
            ages.append((_num(h.oldest_s), ranks))
        op = h.stalled_op
        if op and isinstance(op.get("seq"), int):
            ops.setdefault((str(op.get("group")), str(op.get("op"))), []).append(
                (op["seq"], ranks))
    for fam, pairs in ((up, ups), (healthy, healths), (in_flight, counts), (oldest, ages)):
        fam.add_values(pairs)
    for (group, name), pairs in ops.items():
        stalled.add_values(pairs, {"group": group, "op": name})
    return [up, healthy, in_flight, oldest, stalled]


def _fr_families(fr: FrPart | None) -> list[Family]:
    as_of = _as_of("fr")
    seq_docs = {
        "last_enqueued_collective": ("last_enqueued_seq", "Last collective seq issued."),
        "last_started_collective": ("last_started_seq", "Last collective seq started."),
        "last_completed_collective": ("last_completed_seq", "Last collective seq completed."),
    }
    out = []
    for key, (name, doc) in seq_docs.items():
        fam = Family(name, doc + as_of, ["rank", "group"])
        for group, seq, ranks in fr.seqs.get(key, ()) if fr is not None else ():
            fam.add_ranks(ranks, seq, {"group": group})
        out.append(fam)
    missing = Family("missing_ranks", "1 for each rank missing from a collective that other "
                     "ranks issued." + as_of, ["group", "seq", "rank"])
    missing_n = Family("missing_ranks_count", "Ranks missing from the collective." + as_of,
                       ["group", "seq"])
    stuck = Family("stuck_seq", "Lowest collective seq of the communicator with an error "
                   "finding: where the job stopped." + as_of, ["group", "op"])
    by_kind: dict[str, int] = {}
    lowest: dict[str, tuple[int, str]] = {}
    for f in fr.findings if fr is not None else ():
        kind, group, at = str(f.get("kind")), str(f.get("group")), f.get("seq")
        by_kind[kind] = by_kind.get(kind, 0) + 1
        if kind == "missing_ranks":
            ranks = f.get("ranks", [])
            if all(type(r) is int for r in ranks):
                missing.add_ranks(ranks, 1, {"group": group, "seq": str(at)})
            else:
                for r in ranks:
                    missing.add([group, str(at), str(r)], 1)
            missing_n.add([group, str(at)], len(ranks))
        if isinstance(at, int) and (group not in lowest or at < lowest[group][0]):
            lowest[group] = (at, str(f.get("op")))
    for name, (seq, op) in sorted(lowest.items()):
        stuck.add([name, op], seq)
    kinds = Family("findings", "The analyzer's error findings by kind." + as_of, ["kind"])
    for kind, n in sorted(by_kind.items()):
        kinds.add([kind], n)
    out += [missing, missing_n, stuck, kinds]
    if fr is not None:
        took = Family("scrape_duration_seconds", "Fan-out and analysis time of the last FR "
                      "cycle (a scrape itself fetches nothing)." + as_of, [])
        took.add([], round(fr.took_s, 6))
        out.append(took)
    return out


class NowCollector(PromCollector):
    """The families of this scrape's moment: world size, readiness, ages, hang reports."""

    def __init__(self, world_size: int, c: Cycle, hang_reports: int,
                 slow_age_s: float | None) -> None:
        self.world_size, self.c = world_size, c
        self.hang_reports, self.slow_age_s = hang_reports, slow_age_s

    def collect(self) -> Iterator[Metric]:
        world = _gauge("world_size", "Ranks in the job.", [])
        world.add_metric([], self.world_size)
        yield world
        ready = _gauge("cycle_ready", "1 once the frontend's cycles brought both an FR analysis "
                       "and a health poll (the families that come from them are absent before), "
                       "else 0. /metrics asks no rank: its values are as of those cycles.", [])
        ready.add_metric([], 1 if self.c.fr is not None and self.c.health is not None else 0)
        yield ready
        age = _gauge("last_cycle_age_seconds", "Seconds since the part of the frontend's last "
                     "cycle that the other families come from: fr (the FR fetch and its "
                     "analysis), health (the hang watch's poll), stragglers (the straggler "
                     "poll); absent before its first.", ["part"])
        now = time.monotonic()
        for part, s in (("fr", LastCycle.age_s(self.c.fr, now)),
                        ("health", LastCycle.age_s(self.c.health, now)),
                        ("stragglers", self.slow_age_s)):
            if s is not None:
                age.add_metric([part], round(s, 3))
        yield age
        reports = CounterMetricFamily(f"{PREFIX}_hang_reports", "Hang reports this frontend "
                                      "wrote.", labels=[])
        reports.add_metric([], self.hang_reports)
        yield reports


def _straggler_families(result: dict[str, Any] | None) -> list[Family]:
    as_of = _as_of("stragglers")
    lag = Family("rank_arrival_lag_seconds", "Median time the rank issued the group's "
                 "collectives after its first member did, over the straggler window." + as_of,
                 ["rank", "group"])
    share = Family("rank_last_share", "Share of the group's collectives in the straggler "
                   "window the rank arrived last at." + as_of, ["rank", "group"])
    for g in (result or {}).get("groups", []):
        group = {"group": str(g["group"])}
        lag.add_values(((row["median_lag_ms"] / 1e3, (row["rank"],)) for row in g["rows"]),
                       group)
        share.add_values(((row["last_share"], (row["rank"],)) for row in g["rows"]), group)
    return [lag, share]


def _num(v: Any) -> float:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else 0.0


def _text(collector: PromCollector) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return generate_latest(registry)


GZIP_LEVEL = 1
"""zlib's level for a gzip-accepting scrape (Prometheus always asks so): at 131072 ranks the
cycle's 81 MB of text became 8 MB in 0.21 s, once per cycle (level 6: 7.4 MB in 0.58 s)."""


class CycleText:
    """One cycle's families as text (its UTF-8 parts, never joined: 81 MB at 131072 ranks), and
    their gzip, made on the first scrape that takes it: one compression per cycle; each scrape
    then adds its own moment's lines (``NowCollector``) to a copy of the compressor, and the
    body is one gzip member as any client reads it."""

    __slots__ = ("_gz", "parts")

    def __init__(self, parts: list[bytes]) -> None:
        self.parts = parts
        self._gz: tuple[bytes, Any] | None = None

    def gzipped(self, tail: bytes) -> bytes:
        if self._gz is None:  # two scrapes at once may both make it: the same bytes
            c = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 31)  # 31: a gzip header
            self._gz = (b"".join([c.compress(p) for p in self.parts]), c)
        head, c = self._gz
        c = c.copy()
        return head + c.compress(tail) + c.flush()


def render(world_size: int, c: Cycle, hang_reports: int = 0, slow_age_s: float | None = None,
           memo: LastCycle | None = None, gzip: bool = False) -> list[bytes]:
    """The text exposition, in parts to send one after the other: the cycle's families (from
    ``memo.memo`` where they were rendered for the same parts), then this moment's. Families
    are whole in each, so the two join. With ``gzip``, one part: the body gzipped
    (``CycleText``)."""
    key = c.key()
    held = memo.memo if memo is not None else None
    if held is not None and len(held[0]) == len(key) and all(
            a is b for a, b in zip(held[0], key, strict=True)):
        text = held[1]
    else:
        text = CycleText(promtext.parts(cycle_families(c)))
        if memo is not None:
            memo.memo = (key, text)
    now = _text(NowCollector(world_size, c, hang_reports, slow_age_s))
    return [text.gzipped(now)] if gzip else [*text.parts, now]


def takes_gzip(accept_encoding: str) -> bool:
    """Whether an ``Accept-Encoding`` header takes gzip (``gzip`` or ``*``, not at q=0)."""
    for item in accept_encoding.split(","):
        name, _, params = item.strip().partition(";")
        if name.strip().lower() not in ("gzip", "*"):
            continue
        q = params.strip()
        try:
            return not q.startswith("q=") or float(q[2:]) > 0
        except ValueError:
            return False
    return False


async def metrics_response(request: web.Request, cycle: LastCycle, world_size: int,
                           hang_reports: int = 0, slow: dict[str, Any] | None = None,
                           slow_age_s: float | None = None) -> web.StreamResponse:
    """The ``/metrics`` reply from ``cycle`` (no rank is asked), rendered off the event loop;
    ``slow``: the straggler watch's last result, ``slow_age_s`` its age. Gzipped where the
    request takes it (``takes_gzip``); else the parts are sent one after the other, each as
    the socket takes it (a joined 81 MB body, and the transport's copy of what the socket had
    not taken yet, cost the frontend 0.25 GB at 131072 ranks)."""
    gz = takes_gzip(request.headers.get("Accept-Encoding", ""))
    c = Cycle(cycle.fr, cycle.health, slow)
    chunks = await asyncio.get_running_loop().run_in_executor(
        None, render, world_size, c, hang_reports, slow_age_s, cycle, gz)
    headers = {"Content-Type": CONTENT_TYPE, "Vary": "Accept-Encoding",
               **({"Content-Encoding": "gzip"} if gz else {})}
    if len(chunks) == 1 or request.method == "HEAD":  # a Response sends a HEAD no body
        return web.Response(body=chunks[0] if len(chunks) == 1 else b"".join(chunks),
                            headers=headers)
    resp = web.StreamResponse(headers=headers)
    resp.content_length = sum(map(len, chunks))
    await resp.prepare(request)
    for chunk in chunks:
        await resp.write(chunk)  # waits while the socket's buffer is full
    await resp.write_eof()
    return resp


async def read_now(collector: Collector) -> LastCycle:
    """A cycle read now from a collector that asks no rank (the post-mortem viewer's files):
    its health and FR window, and the analysis of them."""
    started = time.monotonic()
    addrs = await collector.registry.lookup()
    health_res, fr = await asyncio.gather(collector.fetch(HEALTH_HANDLER, None, addrs),
                                          collector.fr(addrs=addrs))
    cycle = LastCycle()
    cycle.put_health(HealthPart.of(health_res, parse_health(health_res)))
    result = await asyncio.get_running_loop().run_in_executor(
        None, analyze_fr, fr, None, collector.world_size, collector.digest_memo)
    cycle.put_fr(FrPart.of(fr, result, started, "viewer"))
    return cycle


class CycleFill:
    """The frontend's own FR cycle for ``/metrics``: an FR fetch and its analysis whenever the
    holder's FR part is ``interval_s()`` old and no other fetch for it is under way.

    The dumper's and the hang reports' fetches count, so a dumper that fetches FR at least
    every ``METRICS_INTERVAL_S`` leaves it nothing to do; without one (no ``dump_dir``, or
    ``enabled_dumps`` without ``fr_trace`` and ``snapshot``, or a dump dir that cannot be
    written) it is what keeps ``/metrics``' FR part fresh.
    """

    def __init__(self, collector: Collector, cycle: LastCycle, *, interval: float,
                 dumper_feeds: bool = False) -> None:
        self.collector = collector
        self.cycle = cycle
        # With a dumper that fetches FR, its cycles keep the part young when they come at
        # least every METRICS_INTERVAL_S: this one then only fills the gaps of a slower one.
        self.interval = METRICS_INTERVAL_S if dumper_feeds else min(interval, METRICS_INTERVAL_S)
        self.first_delay = None if dumper_feeds else (
            FIRST_CYCLE_S if collector.world_size <= FIRST_CYCLE_RANKS else METRICS_INTERVAL_S)
        """None: the dumper's first cycle (1 s after start) brings the first FR part."""
        self.cycles = 0

    def interval_s(self) -> float:
        """The FR part's most age: ``interval``, longer where the job is too big for it."""
        return max(self.interval, self.collector.world_size / FR_RANKS_PER_S)

    def due_in(self, now: float | None = None) -> float:
        """Seconds until this cycle should fetch (0 or less: now)."""
        if self.cycle.fetching:
            return RECHECK_S
        age = self.cycle.fr_age_s(now)
        return 0.0 if age is None else self.interval_s() - age

    async def run_forever(self) -> None:
        delay = self.interval_s() if self.first_delay is None else self.first_delay
        while True:
            await asyncio.sleep(delay)
            delay = self.due_in()
            if delay > 0:
                continue
            try:
                await self.run_once()
            except Exception:  # one bad cycle must not end them
                logger.exception("debug_server: metrics cycle failed")
            delay = self.interval_s()

    async def run_once(self) -> FrPart:
        """One FR fetch (the job's window, as the pages') and its analysis, put in the holder."""
        c = self.collector
        started = time.monotonic()
        with self.cycle.fetching_fr():
            addrs = await c.registry.lookup()
            fr = await c.fr(addrs=addrs)
            part = await asyncio.get_running_loop().run_in_executor(
                None, _analyzed, fr, c.world_size, c.digest_memo, started)
        self.cycle.put_fr(part)
        self.cycles += 1
        return part


def _analyzed(fr: Any, world_size: int, memo: Any, started: float) -> FrPart:
    return FrPart.of(fr, analyze_fr(fr, None, world_size, memo), started, "metrics cycle")
