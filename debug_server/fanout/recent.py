"""The straggler poll's read of every rank: its newest collectives' times and its clock.

``frontend.stragglers`` needs, of every rank, the times of its newest collectives per group
(``analysis.stragglers.timings``) and its clock against the reader's. :func:`read` gets both,
one mechanism at every level of the tree:

- **Ranks it asks itself** (``direct``): two asks each. First an FR reply with no entries: built
  in microseconds, so its round trip is short and bounds when the rank read its clock
  (``stragglers.estimate``; per rank the shortest of the last :data:`CLOCK_KEEP` round trips
  wins, ``ClockBook``). Then its newest ``ops`` entries per group, kept as their times as each
  reply arrives (``LiveCollector.fr_recent(keep=stragglers.compact)``).
- **Ranks behind an agent** (the collector's ``agents.AgentRoute`` plan: the tree's aggregators,
  else each host's agent): two asks per agent. ``agent_recent?clock=true``, which the agent
  answers at once with its own clock (the agent's clock against the reader's, as a rank's), then
  ``agent_recent?ops=N&ranks=...``, which runs this same :func:`read` on the agent over those
  ranks and answers their times as the ranks read them, with each rank's clock against the
  agent's (:func:`encode`). The reader composes: a rank's clock against the reader's is its clock
  against the agent plus the agent's against the reader, their errors added. Times are never
  converted on the way up; only clocks are composed.

So at 131072 ranks the frontend asks 128 aggregators twice, not 131072 ranks twice, and the
analysis gets what it got before: compact dumps and a clock per rank. An agent that fails (or
predates ``agent_recent``) is bypassed as on every page: an aggregator's ranks go through their
host agents, then directly.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import operator
import random
import sys
import time
from array import array
from collections import deque
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from debug_server.analysis import stragglers
from debug_server.analysis.digest import SNAPSHOT_TIME_KEY
from debug_server.analysis.stragglers import Clock, Run
from debug_server.fanout.agentdir import GROUP_ID_PREFIX
from debug_server.fanout.agentreply import AgentAddr
from debug_server.fanout.agents import AgentRoute
from debug_server.fanout.live import LiveCollector
from debug_server.fanout.reply import INLINE_BYTES, parse_off_loop
from debug_server.fanout.transport import RankResult
from debug_server.protocol import agentwire, fastjson, frwindow
from debug_server.protocol.addrs import NOT_REGISTERED, WorkerAddr
from debug_server.protocol.names import FR_HANDLER, INCLUDE_COLLECTIVES

_RANK = operator.attrgetter("rank")
logger = logging.getLogger(__name__)

__all__ = ["CLOCK_KEEP", "CLOCK_PARAMS", "ClockBook", "Recent", "decode", "encode", "read", "sample_clocks"]

CLOCK_KEEP = 16
"""Round trips per rank (or agent) whose clock estimates are kept; the shortest one's is used."""
CLOCK_PARAMS = {INCLUDE_COLLECTIVES: "false"}
"""The clock round's FR ask: config, status and ``dump_time_ns``, no entries."""
CLOCK_ASKS = 8
"""Agents asked for their clock at once by one read: a round trip is the bound on a clock's
error, and one that waits behind a hundred others' replies on the asker's own loop (an
aggregator asking its 128 hosts at once) reads tens of ms longer than the network's."""
CLOCK_TIMEOUT_S = 2.0
"""Most seconds an agent's clock ask may take: it is answered at once, and a round trip that
long bounds nothing useful; a wedged agent then costs its reader 2 s, not a page's timeout
(its ranks are asked another way)."""
CLOCK_SAMPLE_S = 60.0
"""Seconds between a reader's background asks of its agents' clocks (:func:`sample_clocks`),
each wait drawn from half to one and a half times it."""
MAX_ROWS = 1 << 21
"""Most ranks one ``agent_recent`` reply may carry (a reply over that is refused)."""


@dataclass(slots=True)
class Recent:
    """What one read got: per rank a compact dump (``stragglers.compact``: its ``pg_config`` and
    its times), per rank its clock against the reader's, and for each rank without data why."""

    dumps: dict[int, Mapping[str, Any]]
    clocks: dict[int, Clock]
    failed: dict[int, tuple[str, str]]
    """rank -> its record's status and line, where it gave no data."""

    def lines(self) -> list[str]:
        """One line per rank without data, in rank order (the page's failures)."""
        return [self.failed[r][1] for r in sorted(self.failed)]


class ClockBook:
    """Each rank's (or agent's) last :data:`CLOCK_KEEP` clock estimates; ``best`` of them."""

    def __init__(self) -> None:
        self._by: dict[Hashable, deque[Clock]] = {}

    def add(self, key: Hashable, result: RankResult, read_ns: Any) -> None:
        """An estimate from ``result``'s round trip, where the far side read its clock
        (``read_ns``) inside it."""
        if result.ok and result.done_ns and type(read_ns) is int and read_ns > 0:
            self._by.setdefault(key, deque(maxlen=CLOCK_KEEP)).append(
                stragglers.estimate(read_ns, result.done_ns, result.elapsed_s))

    def best(self, key: Hashable) -> Clock | None:
        got = self._by.get(key)
        return stragglers.best_clock(got) if got else None


async def read(collector: LiveCollector, ops: int, addrs: Sequence[WorkerAddr],
               book: ClockBook) -> Recent:
    """Every rank of ``addrs``: its newest ``ops`` collectives' times per group and its clock
    against this process's (module docstring); ``book`` keeps the clock estimates between
    reads (one per reader: the watch's, an agent's)."""
    route = collector.route if isinstance(collector.route, AgentRoute) else None
    plan = await route.plan(addrs) if route is not None and addrs else None
    if route is None or plan is None:
        return await _direct(collector, ops, addrs, book)
    got = Recent({}, {}, {})
    direct: list[WorkerAddr] = list(plan.direct)
    while plan.groups:
        # Every agent's clock first, then the data: a clock ask that waits behind other
        # agents' data replies on this loop reads a longer round trip, a larger error.
        clocks = await _agent_clocks(route, collector, [ag for ag, _ in plan.groups], book)
        meanwhile = asyncio.ensure_future(_direct(collector, ops, direct, book))
        parts = await asyncio.gather(*(_through(route, ag, rs, ops, clocks.get(ag.id))
                                       for ag, rs in plan.groups))
        _merge(got, await meanwhile)
        direct = []
        for (_, rs), part in zip(plan.groups, parts, strict=True):
            if part is None:  # the agent failed: all its ranks another way
                direct += rs
                continue
            _merge(got, part)
            # Ranks it did not know (its view of the store lags) are asked another way; ranks
            # it could not read are not asked again (a stuck rank would cost a second timeout).
            direct += [a for a in rs if a.rank not in part.dumps and part.failed.get(
                a.rank, (NOT_REGISTERED,))[0] == NOT_REGISTERED]
        if not direct or not any(ag.id.startswith(GROUP_ID_PREFIX) for ag, _ in plan.groups):
            break
        below = await route.plan(direct, tree=False)  # an aggregator's ranks: their hosts
        if below is None:
            break
        plan, direct = below, list(below.direct)
    _merge(got, await _direct(collector, ops, direct, book))
    return got


def _merge(into: Recent, part: Recent) -> None:
    into.dumps.update(part.dumps)
    into.clocks.update(part.clocks)
    into.failed.update(part.failed)


async def _direct(collector: LiveCollector, ops: int, addrs: Sequence[WorkerAddr],
                  book: ClockBook) -> Recent:
    """``addrs`` asked directly: the clock round, then their times (module docstring)."""
    if not addrs:
        return Recent({}, {}, {})
    heads = await collector.direct_fetch(FR_HANDLER, CLOCK_PARAMS, addrs)
    head_dumps = await parse_off_loop(heads)
    for r in heads:
        d = head_dumps.get(r.rank)
        book.add(r.rank, r, d.get(SNAPSHOT_TIME_KEY) if d is not None else None)
    # Each reply kept as the analysis' times as it arrives: 131072 ranks' windows parsed
    # whole were 3.8 GB, their times are 0.17 GB.
    fr = await collector.fr_recent(ops, addrs, keep=stragglers.compact)
    clocks: dict[int, Clock] = {}
    for r in fr.results:
        d = fr.dumps.get(r.rank)
        book.add(r.rank, r, d.get(SNAPSHOT_TIME_KEY) if d is not None else None)
        # A rank without a clock reading (torch's C++ worker) is taken as on ours.
        if (c := book.best(r.rank)) is not None:
            clocks[r.rank] = c
    return Recent(dict(fr.dumps), clocks, {r.rank: (r.status, r.line()) for r in fr.results
                                           if not r.ok})


async def _agent_clocks(route: AgentRoute, collector: LiveCollector, agents: list[AgentAddr],
                        book: ClockBook, at_once: int = CLOCK_ASKS) -> dict[str, Clock]:
    """Each of ``agents``' clock against ours (``agent_recent?clock=true``, at most
    ``at_once`` asks at a time), where it answered now."""
    asks = asyncio.Semaphore(at_once)

    async def one(ag: AgentAddr) -> Clock | None:
        async with asks:
            head = await collector.asker.one(WorkerAddr(-1, ag.url), agentwire.RECENT,
                                             {agentwire.CLOCK: "true"},
                                             min(CLOCK_TIMEOUT_S, route.agent_timeout))
        if not head.ok:  # down, or an agent older than agent_recent (404)
            return None
        try:
            now = fastjson.loads(head.body or "").get(SNAPSHOT_TIME_KEY)
        except (ValueError, AttributeError):
            return None
        book.add(("agent", ag.id), head, now)
        return book.best(("agent", ag.id))

    got = await asyncio.gather(*(one(ag) for ag in agents))
    return {ag.id: c for ag, c in zip(agents, got, strict=True) if c is not None}


async def sample_clocks(collector: LiveCollector, book: ClockBook,
                        interval: float = CLOCK_SAMPLE_S) -> None:
    """For ever: every ``interval`` s or so, the agents of the route's last plan (the tree's
    aggregators, else each host's agent, as the last page or poll through it found them: no
    store read of its own) asked for their clocks, two at a time, into ``book``. A poll's own
    clock phase runs where every level starts its own at once (an aggregator's 128 hosts as its
    frontend's ask arrives; in ``bench_tree`` 64 aggregators on one loop: round trips of
    50-400 ms); an estimate taken at a quiet moment has a short round trip, and the book keeps
    the best of its last ``CLOCK_KEEP``. A reader without a route (a host's agent over its
    ranks, on their host) has nothing to sample."""
    route = collector.route if isinstance(collector.route, AgentRoute) else None
    if route is None:
        return
    rnd = random.Random()
    while True:
        await asyncio.sleep(interval * rnd.uniform(0.5, 1.5))
        try:
            if route.planned:
                await _agent_clocks(route, collector, list(route.planned), book, 2)
        except Exception:  # noqa: BLE001 - a sample is a hint; the poll asks again anyway
            logger.debug("debug_server: clock sample failed", exc_info=True)


async def _through(route: AgentRoute, ag: AgentAddr, rs: Sequence[WorkerAddr], ops: int,
                   mine: Clock | None) -> Recent | None:
    """``rs`` through agent ``ag``, whose clock against ours is ``mine``: its ranks' times,
    their clocks composed with it; None where it did not answer (or its clock did not: its
    ranks are then asked another way)."""
    if mine is None:
        return None
    return await route.ask_agent(ag, rs, agentwire.RECENT, {agentwire.OPS: str(ops)},
                                 functools.partial(_parse, mine))  # type: ignore[no-any-return]


def _parse(mine: Clock, body: str, ag: AgentAddr, rs: Sequence[WorkerAddr]) -> Recent:
    got = decode(fastjson.loads(body), mine)
    asked = set(map(_RANK, rs))
    if not (asked.issuperset(got.dumps) and asked.issuperset(got.failed)):
        raise ValueError("a rank that was not asked")
    return got


# ---------------------------------------------------------------------------------------------
# The wire: ``agent_recent``'s reply


def encode(got: Recent) -> dict[str, Any]:
    """``got`` as ``agent_recent`` answers it: ``groups`` (name -> desc and members as
    ``[first, last]`` ranges), ``seqs`` and ``ops`` (each distinct tuple once), ``ranks`` (one
    row per rank: rank, clock offset and error in ns, and per group the indexes of its seqs and
    ops, its issue times as the first and then differences, its start times as differences from
    its issue times, null where it has none), ``failed`` (``[rank, status, line]`` per rank
    without data)."""
    groups: dict[str, dict[str, Any]] = {}
    seen: set[tuple[str, int]] = set()
    members: dict[str, set[int]] = {}
    seqs: dict[tuple[int, ...], int] = {}
    ops: dict[tuple[str, ...], int] = {}
    rows = []
    for rank, dump in sorted(got.dumps.items()):
        cfg = dump.get("pg_config")
        for name, ms in frwindow.config_members(dump).items():
            if (name, id(ms)) not in seen:  # ranks alike share one parsed list (frwindow)
                seen.add((name, id(ms)))
                members.setdefault(name, set()).update(ms)
                c = cfg.get(name) if isinstance(cfg, Mapping) else None
                if isinstance(c, Mapping) and name not in groups:
                    groups[name] = {"desc": str(c.get("desc", ""))}
        runs = dump.get(stragglers.TIMINGS)
        per = {}
        for name, run in (runs if isinstance(runs, dict) else {}).items():
            groups.setdefault(name, {"desc": run.desc})
            si = seqs.setdefault(run.seqs, len(seqs))
            oi = ops.setdefault(run.ops, len(ops))
            issued = list(run.issued)
            deltas = [*issued[:1], *(b - a for a, b in itertools.pairwise(issued))]
            started = None if run.started is None else [
                s - i if s > 0 else None for s, i in zip(run.started, issued, strict=True)]
            per[name] = [si, oi, deltas, started]
        c = got.clocks.get(rank, Clock())
        rows.append([rank, c.offset_ns, c.error_ns, per])
    for name, g in groups.items():
        g["ranks"] = _pairs(sorted(members.get(name, ())))
    return {"groups": groups, "seqs": [list(s) for s in seqs], "ops": [list(o) for o in ops],
            "ranks": rows, "failed": [[r, st, line] for r, (st, line) in got.failed.items()]}


def encode_bytes(got: Recent) -> bytes:
    return fastjson.dumps_bytes(encode(got))


def decode(obj: Any, base: Clock | None = None) -> Recent:
    """An ``agent_recent`` reply read back (:func:`encode`): compact dumps that share one
    ``pg_config`` and one tuple per distinct seqs and ops, and each rank's clock (composed with
    ``base``, the agent's clock against the reader's: offsets and errors added; ranks whose
    clocks read alike share one ``Clock``); raises ValueError (one line) on anything else."""
    if not isinstance(obj, dict) or not all(isinstance(obj.get(k), list)
                                            for k in ("seqs", "ops", "ranks", "failed")):
        raise ValueError("not an agent_recent reply")
    if not isinstance(obj.get("groups"), dict) or len(obj["ranks"]) > MAX_ROWS:
        raise ValueError("not an agent_recent reply (groups, or too many ranks)")
    cfg = {str(name): {"name": str(name), "desc": str(g.get("desc", "")),
                       "ranks": _members_text(g.get("ranks"))}
           for name, g in obj["groups"].items() if isinstance(g, dict)}
    descs = {name: c["desc"] for name, c in cfg.items()}
    seqs = [stragglers.shared(tuple(_ints(s))) for s in obj["seqs"]]
    ops = [stragglers.shared(tuple(sys.intern(str(o)) for o in _list(s))) for s in obj["ops"]]
    off0, err0 = (base.offset_ns, base.error_ns) if base is not None else (0, 0)
    shared_clocks: dict[tuple[int, int], Clock] = {}
    dumps: dict[int, Mapping[str, Any]] = {}
    clocks: dict[int, Clock] = {}
    for row in obj["ranks"]:
        if not isinstance(row, list) or len(row) != 4 or not isinstance(row[3], dict):
            raise ValueError("a rank row is not [rank, offset, error, groups]")
        rank, off, err, parts = row
        if not (type(rank) is int and type(off) is int and type(err) is int):
            raise ValueError("a rank row's rank, offset and error are not integers")
        runs = {}
        for name, part in parts.items():
            if not isinstance(part, list) or len(part) != 4:
                raise ValueError("a group's part is not [seqs, ops, times, starts]")
            si, oi, deltas, started = part
            if not (type(si) is int and 0 <= si < len(seqs) and type(oi) is int
                    and 0 <= oi < len(ops)) or len(seqs[si]) != len(ops[oi]):
                raise ValueError("a group's seqs or ops index is out of range")
            issued = _times(itertools.accumulate(_list(deltas)))
            if len(issued) != len(seqs[si]):
                raise ValueError("a group's times do not match its seqs")
            if started is not None and len(_list(started)) != len(issued):
                raise ValueError("a group's start times do not match its seqs")
            start = None if started is None else _times(
                map(operator.add, issued, started) if None not in started else
                (i + d if d is not None else 0 for i, d in zip(issued, started, strict=True)))
            runs[str(name)] = Run(descs.get(name, ""), seqs[si], ops[oi], issued, start)
        dumps[rank] = _Timed(cfg, runs)
        key = (off + off0, max(0, err) + err0)
        c = shared_clocks.get(key)
        if c is None:
            c = shared_clocks[key] = Clock(*key)
        clocks[rank] = c
    failed = {}
    for f in obj["failed"]:
        if not (isinstance(f, list) and len(f) == 3 and type(f[0]) is int):
            raise ValueError("a failed row is not [rank, status, line]")
        failed[f[0]] = (str(f[1])[:40], str(f[2])[:500])
    return Recent(dumps, clocks, failed)


class _Timed(Mapping[str, Any]):
    """One rank's compact dump as ``decode`` reads it: ``pg_config`` (the reply's, shared) and
    its runs (``stragglers.TIMINGS``). A rank of one group holds its run alone, not a dict of
    one and a dict around it: 131072 ranks' dumps took 0.1 GB as two dicts each."""

    __slots__ = ("_cfg", "_runs")

    def __init__(self, cfg: dict[str, Any], runs: dict[str, Run]) -> None:
        self._cfg = cfg
        self._runs: dict[str, Run] | tuple[str, Run] = \
            next(iter(runs.items())) if len(runs) == 1 else runs

    def __getitem__(self, key: str) -> Any:
        if key == "pg_config":
            return self._cfg
        if key == stragglers.TIMINGS:
            return dict([self._runs]) if isinstance(self._runs, tuple) else self._runs
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(("pg_config", stragglers.TIMINGS))

    def __len__(self) -> int:
        return 2


def _times(values: Iterable[Any]) -> array[int]:
    """Integers in an array (``array`` itself refuses anything else). Made from a list: an
    array filled from an iterator grows item by item, a third slower (131072 ranks' times are
    a fifth of a straggler poll's decode)."""
    try:
        return array("q", list(values))
    except (TypeError, OverflowError) as e:
        raise ValueError(f"times that are not integers ({e})") from None


def _list(v: Any) -> list[Any]:
    if not isinstance(v, list):
        raise ValueError("a list was expected")
    return v


def _ints(v: Any) -> list[int]:
    out = _list(v)
    if not all(type(i) is int for i in out):
        raise ValueError("integers were expected")
    return out


def _pairs(ranks: Sequence[int]) -> list[list[int]]:
    """Sorted ``ranks`` as ``[first, last]`` runs."""
    out: list[list[int]] = []
    for r in ranks:
        if out and r == out[-1][1] + 1:
            out[-1][1] = r
        else:
            out.append([r, r])
    return out


def _members_text(ranges: Any) -> str:
    """A group's members as the JSON list text ``pg_config`` carries: one text object per
    distinct ranges (:func:`_text_of`), so ``frwindow`` parses it once, not once per reply (a
    world group's list at 131072 ranks is 0.9 MB)."""
    pairs = []
    total = 0
    for pair in _list(ranges):
        lo, hi = _ints(pair) if len(_list(pair)) == 2 else (-1, -1)
        total += hi - lo + 1
        if lo < 0 or hi < lo or total > MAX_ROWS:
            raise ValueError("a group's members are not ranges [first, last]")
        pairs.append((lo, hi))
    return _text_of(tuple(pairs))


@functools.lru_cache(maxsize=256)
def _text_of(pairs: tuple[tuple[int, int], ...]) -> str:
    return fastjson.dumps([r for lo, hi in pairs for r in range(lo, hi + 1)])


def big(got: Recent) -> bool:
    """Whether encoding ``got`` is worth a thread (as a reply over ``INLINE_BYTES`` is)."""
    return len(got.dumps) * 256 > INLINE_BYTES


def now_reply() -> dict[str, int]:
    """``agent_recent?clock=true``'s reply: this process's clock, read now."""
    return {SNAPSHOT_TIME_KEY: time.time_ns()}
