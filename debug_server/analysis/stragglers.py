"""Slow ranks before they hang: arrival lag at collectives, from the Flight Recorder rings.

Every FR entry says when its rank issued the collective (``time_created_ns``). For each
collective that every member of a group issued within the window (the group's newest
``window_ops`` such collectives), a member's **lag** is its issue time minus the earliest
member's. Ranks whose clocks differ (other hosts) are first put on one clock with
:class:`Clock` (offset and error estimated by the frontend at each fetch, :func:`estimate`).

**The rule.** A rank is named slow on a group when (1) it arrived last at far more of the
window's collectives than chance allows: the binomial tail P(X >= k | n, 1/m) for k last
arrivals in n collectives of an m-member group is below :attr:`Rule.p_value` (1e-6), over at
least as many collectives as that could ever happen in (:func:`needed_ops`: 20 for 2 members,
10 for 4, never fewer than :attr:`Rule.min_ops`, 8); and (2) its median lag is well above
the group's: at least ``max(min_lag_ms, lag_factor x the median of the other members' median
lags, its clock error)``. Uniform traffic (every member equally likely last) meets neither condition; a rank
that is always last by a few microseconds (a constant code-path difference) meets (1) but not (2).

**Host or device.** The rule runs on issue times first (side ``"host"``: the rank's Python
reached the collective late: data, CPU). Where every member has a start time
(``time_discovered_started_ns``: c10d's timing, our CUDA start marks) it runs again on those
(side ``"device"``: issued on time, but its collectives start late on its stream: a slow GPU,
link or NIC). A rank named on the host side is not named again on the device side.

Pure: no torch, no HTTP. ``analyze`` returns the ``/stragglers`` JSON plus, under ``groups``,
the per-rank rows the pages show.
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
import statistics
import sys
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from debug_server.protocol import frwindow

__all__ = ["TIMINGS", "Clock", "Rule", "Run", "analyze", "best_clock", "binom_tail", "compact",
           "estimate", "needed_ops", "public", "sentence", "shared", "timings"]

HOST, DEVICE = "host", "device"
SPARK_POINTS = 48
"""Most points of a rank's lag sparkline (the window is averaged down to this many)."""
SPARK_ROWS = 64
"""Rows per group that get a trend and a sparkline: the slowest (and every slow one)."""
_P2P = ("send", "recv")


@dataclass(frozen=True, slots=True)
class Clock:
    """A rank's clock against the frontend's: ``rank clock = frontend clock + offset_ns``,
    known to within ``error_ns``."""

    offset_ns: int = 0
    error_ns: int = 0


def estimate(rank_time_ns: int, done_ns: int, elapsed_s: float) -> Clock:
    """One fetch's estimate: the rank read its clock (``rank_time_ns``: the dump's
    ``dump_time_ns``) somewhere inside the round trip that ended at ``done_ns`` (frontend
    clock) and took ``elapsed_s``; so its offset is that reading minus the round trip's
    midpoint, to within half the round trip."""
    rtt = max(0, int(elapsed_s * 1e9))
    return Clock(rank_time_ns - (done_ns - rtt // 2), rtt // 2 + 1)


def best_clock(estimates: Iterable[Clock]) -> Clock:
    """The estimate with the smallest error (the shortest round trip, as NTP filters). An
    offset within its own error of zero is taken as zero (the same clock: ranks on the
    frontend's host), with the error doubled: the true offset lies within ``error`` of the
    estimate, so within ``2 x error`` of zero."""
    best = min(estimates, key=lambda c: c.error_ns, default=Clock())
    if abs(best.offset_ns) <= best.error_ns:
        return Clock(0, 2 * best.error_ns)
    return best


@dataclass(frozen=True, kw_only=True, slots=True)
class Rule:
    """When a rank is named slow (module docstring)."""

    window_ops: int = 200
    """Collectives per group looked at: the newest that every member issued."""
    min_ops: int = 8
    """Fewer complete collectives than this in a group: nobody is named on it. Small groups
    need more (``needed_ops``): as many as being last every time takes to reach ``p_value``
    by chance (20 for 2 members, 10 for 4)."""
    p_value: float = 1e-6
    """Most probability that uniform traffic makes a rank last this often."""
    min_lag_ms: float = 10.0
    """A median lag below this is never slow, whatever the shares."""
    lag_factor: float = 3.0
    """The median lag must be this many times the other members' typical median lag."""


def needed_ops(rule: Rule, m: int) -> int:
    """Collectives a group of ``m`` members needs before anyone can be named on it."""
    if m < 2:
        return rule.min_ops
    return max(rule.min_ops, math.ceil(math.log(rule.p_value) / math.log(1.0 / m) - 1e-9))


def binom_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p)."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    q = 1.0 - p
    return min(1.0, sum(math.comb(n, i) * p**i * q ** (n - i) for i in range(k, n + 1)))


# ---------------------------------------------------------------------------------------------
# The window: per group, every member's times of its newest complete collectives


@dataclass(frozen=True, slots=True)
class Run:
    """One rank's collectives on one group as the analysis reads them (``timings``), oldest
    first: per collective its seq, op and issue time, and its start time (0: none)."""

    desc: str
    """The group's desc in its first entry (where its ``pg_config`` has none)."""
    seqs: tuple[int, ...]
    """Shared between ranks alike (``shared``), as is ``ops``."""
    ops: tuple[str, ...]
    issued: array[int]
    started: array[int] | None
    """None where no entry has a start time."""


_SHARED: dict[tuple[Any, ...], tuple[Any, ...]] = {}
_SHARED_MAX = 4096


def shared(t: tuple[Any, ...]) -> tuple[Any, ...]:
    """One tuple object for equal tuples: 131072 ranks' windows of one group are one tuple of
    seqs and one of ops, not 131072 of each."""
    got = _SHARED.get(t)
    if got is None:
        if len(_SHARED) >= _SHARED_MAX:
            _SHARED.clear()
        got = _SHARED[t] = t
    return got


def timings(dump: Mapping[str, Any]) -> dict[str, Run]:
    """What the analysis reads of a dump's entries, per group: its issued collectives (not
    P2P) with their times, in two arrays: under 0.5 KB a rank for a window of 16, where the
    entries as parsed take about 29 KB. The straggler poll keeps this of each reply as it
    arrives (``compact``): 131072 ranks' replies held 168 MB, not 3.8 GB
    (``benchmarks/bench_stragglers_scale.py``)."""
    acc: dict[str, tuple[str, list[int], list[str], array[int], array[int]]] = {}
    name: Any = None
    cur: tuple[str, list[int], list[str], array[int], array[int]] | None = None
    entries = dump.get("entries")
    for e in entries if isinstance(entries, list) else ():
        if type(e) is not dict:  # a malformed entry is skipped, as a timeless one is
            continue
        seq, issued = e.get("collective_seq_id"), e.get("time_created_ns")
        if type(seq) is not int or type(issued) is not int or issued <= 0:
            continue
        pg, p2p = e.get("process_group"), e.get("is_p2p")
        if p2p or not isinstance(pg, (list, tuple)) or not pg:
            continue
        op = _op(e.get("profiling_name"))
        if p2p is None and op.partition(" ")[0] in _P2P:
            continue  # a schema without is_p2p: P2P by its name
        if cur is None or pg[0] != name:
            name = pg[0]
            cur = acc.get(str(name))
            if cur is None:
                cur = acc[str(name)] = (str(pg[1]) if len(pg) > 1 else "", [], [], array("q"),
                                        array("q"))
        started = e.get("time_discovered_started_ns")
        cur[1].append(seq)
        cur[2].append(sys.intern(op))
        cur[3].append(issued)
        cur[4].append(started if type(started) is int and started > 0 else 0)
    return {n: Run(desc, shared(tuple(seqs)), shared(tuple(ops)), issued,
                   started if any(started) else None)
            for n, (desc, seqs, ops, issued, started) in acc.items()}


def compact(dump: Mapping[str, Any]) -> dict[str, Any]:
    """``dump`` less its entries, with their ``timings`` (under ``TIMINGS``): all that
    ``analyze`` reads of it."""
    out = {k: v for k, v in dump.items() if k != "entries"}
    out[TIMINGS] = timings(dump)
    return out


TIMINGS = "straggler_timings"
"""Where a ``compact`` dump keeps its ``timings`` (``analyze`` reads them instead of entries)."""


@dataclass(slots=True)
class _Group:
    name: str
    desc: str
    members: list[int]
    runs: dict[int, Run]
    """rank -> its collectives on this group."""
    ops: dict[int, str]


def _op(name: Any) -> str:
    name = str(name or "")
    return name.partition(":")[2] if ":" in name else name


def _config(dumps: Mapping[int, Mapping[str, Any]]) -> dict[str, tuple[str, set[int]]]:
    """Each group's desc and members over every rank's ``pg_config``."""
    config: dict[str, tuple[str, set[int]]] = {}
    seen: set[tuple[str, int]] = set()
    read: set[int] = set()  # ids of the pg_configs read: ranks of one reply share theirs
    for dump in dumps.values():
        cfg = dump.get("pg_config")
        if id(cfg) in read:
            continue
        read.add(id(cfg))  # cfg lives in its dump while this runs: its id is its own
        descs = {str(c.get("name", k)): str(c.get("desc", ""))
                 for k, c in (cfg.items() if isinstance(cfg, Mapping) else ())
                 if isinstance(c, Mapping)}
        for name, members in frwindow.config_members(dump).items():
            # Every member sends the same list, parsed once into one frozenset
            # (frwindow's cache): merged once, not once per rank (4096 x 4096 at scale).
            if (name, id(members)) not in seen:
                seen.add((name, id(members)))
                config.setdefault(name, (descs.get(name, ""), set()))[1].update(members)
    return config


def _groups(dumps: Mapping[int, Mapping[str, Any]]) -> dict[str, _Group]:
    out: dict[str, _Group] = {}
    config = _config(dumps)
    merged: set[tuple[str, int, int]] = set()  # (group, id(seqs), id(ops)) whose ops are in
    for rank, dump in dumps.items():
        runs = dump.get(TIMINGS)
        for name, run in (runs if isinstance(runs, dict) else timings(dump)).items():
            g = out.get(name)
            if g is None:
                desc, members = config.get(name, (run.desc, set()))
                g = out[name] = _Group(name, desc, sorted(members), {}, {})
            g.runs[rank] = run
            key = (name, id(run.seqs), id(run.ops))  # runs alike share both (_shared)
            if key not in merged:
                merged.add(key)
                for seq, op in zip(run.seqs, run.ops, strict=True):
                    g.ops.setdefault(seq, op)
    for g in out.values():
        if not g.members:  # no pg_config: the ranks seen in its entries
            g.members = sorted(g.runs)
    return out


def _complete(g: _Group, window: int) -> list[int]:
    """The newest ``window`` seqs every member issued (a rank missing data hides the group)."""
    if any(r not in g.runs for r in g.members):
        return []
    distinct = {id(g.runs[r].seqs): g.runs[r].seqs for r in g.members}
    common = set.intersection(*(set(s) for s in distinct.values())) if distinct else set()
    common &= set(g.ops)
    return sorted(common)[-window:]


# ---------------------------------------------------------------------------------------------
# Per rank: lags, last share, trend, the rule


@dataclass(slots=True)
class _Lags:
    columns: dict[int, array[int]]
    """rank -> its times at each collective of the window, oldest first (on the reader's
    clock)."""
    firsts: list[int]
    """The first member's time at each collective."""
    medians: dict[int, float]
    """rank -> its median lag in ms."""
    last: dict[int, int]
    n: int

    def lags(self, rank: int) -> list[float]:
        """``rank``'s lag in ms at each collective of the window, oldest first (made where a
        row shows them: every member's at once were 25 MB at 131072 members)."""
        return [(t - f) / 1e6 for t, f in zip(self.columns[rank], self.firsts, strict=True)]


def _lags(g: _Group, seqs: Sequence[int], started: bool,
          offsets: Mapping[int, int]) -> _Lags | None:
    """Each member's lag at each of ``seqs``: by issue time, or (``started``) by start time;
    None where a member lacks one of them. Times are put on the reader's clock (``offsets``)."""
    if not seqs:
        return None
    members = g.members
    # id(a run's seqs) -> where ``seqs`` lie in it: a slice where they lie in a row (a window
    # every member issued whole: the usual case), else their positions; None: one is missing.
    where: dict[int, slice | list[int] | None] = {}
    columns: list[array[int]] = []  # arrays: 131072 members' 16 times as int objects were 83 MB
    for r in members:
        run = g.runs.get(r)
        times = None if run is None else run.started if started else run.issued
        if run is None or times is None:
            return None
        if id(run.seqs) not in where:
            where[id(run.seqs)] = _positions(run.seqs, seqs)
        pos = where[id(run.seqs)]
        if pos is None:
            return None
        if isinstance(pos, slice):  # the run itself where the window is all of it
            col = times if pos.start == 0 and pos.stop == len(times) else times[pos]
        else:
            col = array("q", [times[i] for i in pos])
        if started and min(col) <= 0:  # an entry without a start time
            return None
        off = offsets.get(r, 0)
        columns.append(array("q", map(operator.sub, col, itertools.repeat(off))) if off else col)
    last = dict.fromkeys(members, 0)
    firsts = []
    for i in range(len(seqs)):  # one collective at a time: no tuple of every member's times each
        at_seq = list(map(operator.itemgetter(i), columns))
        firsts.append(min(at_seq))
        last[members[at_seq.index(max(at_seq))]] += 1
    # Each member's median lag from its lags made and dropped one member at a time.
    medians = {r: _median_ms(sorted(map(operator.sub, col, firsts)))
               for r, col in zip(members, columns, strict=True)}
    return _Lags(dict(zip(members, columns, strict=True)), firsts, medians, last, len(seqs))


def _median_ms(ordered: Sequence[int]) -> float:
    """``statistics.median`` of ``ordered`` (sorted ns) in ms, the very float it gives of the
    lags in ms (each divided, then the middle two averaged): the order of the ns is theirs."""
    n = len(ordered)
    if n % 2:
        return ordered[n // 2] / 1e6
    return (ordered[n // 2 - 1] / 1e6 + ordered[n // 2] / 1e6) / 2


def _positions(run_seqs: Sequence[int], seqs: Sequence[int]) -> slice | list[int] | None:
    """Where each of ``seqs`` lies in a run's (a seq again: its last entry): a slice where they
    lie in a row, else a list; None where one is missing."""
    at = {s: i for i, s in enumerate(run_seqs)}
    if not all(s in at for s in seqs):
        return None
    pos = [at[s] for s in seqs]
    if pos == list(range(pos[0], pos[0] + len(pos))):
        return slice(pos[0], pos[0] + len(pos))
    return pos


def _trend(lags: Sequence[float]) -> float:
    """Median lag of the newer half of the window minus the older half's (ms)."""
    if len(lags) < 4:
        return 0.0
    half = len(lags) // 2
    return statistics.median(lags[half:]) - statistics.median(lags[:half])


def _spark(lags: Sequence[float]) -> list[float]:
    if len(lags) <= SPARK_POINTS:
        return [round(x, 3) for x in lags]
    step = len(lags) / SPARK_POINTS
    out = []
    for i in range(SPARK_POINTS):
        part = lags[int(i * step):int((i + 1) * step)]
        out.append(round(sum(part) / len(part), 3))
    return out


def _p_last(k: int, n: int, m: int) -> float:
    # At or below chance (1/m) it cannot be significant: no tail sum (most of 4096 ranks).
    return binom_tail(k, n, 1.0 / m) if k * m > n else 1.0


class _Row(NamedTuple):
    """One member's figures on one side (``_rows``), before the pages' rounding."""

    rank: int
    median: float
    last: int
    p: float
    err: float
    bar: float
    slow: bool
    side: str


def _rows(g: _Group, lg: _Lags, clocks: Mapping[int, Clock], rule: Rule,
          side: str) -> list[_Row]:
    m = len(g.members)
    needed = needed_ops(rule, m)
    medians = lg.medians
    errors = {r: clocks[r].error_ns / 1e6 if r in clocks else 0.0 for r in g.members}
    typical_err = statistics.median(errors.values())
    ordered = sorted(medians.values())
    rows = []
    for r in g.members:
        base = _median_without(ordered, medians[r])
        err = errors[r] + typical_err
        p = _p_last(lg.last[r], lg.n, m)
        bar = max(rule.min_lag_ms, rule.lag_factor * base, err)
        slow = lg.n >= needed and p <= rule.p_value and medians[r] >= bar
        rows.append(_Row(r, medians[r], lg.last[r], p, err, bar, slow, side))
    return rows


def _row(row: _Row, n: int, lags: Sequence[float] | None) -> dict[str, Any]:
    """A member's row as the pages read it. With its ``lags`` (the slowest ``SPARK_ROWS`` and
    every slow one): every figure, its trend and its sparkline. Without (the others): what
    ``/metrics`` reads of every member, its lag, share and side; at 131072 members the full
    rows were 90 MB of the poll's result, held until the next poll."""
    head = {"rank": row.rank, "median_lag_ms": round(row.median, 3),
            "last_share": round(row.last / n, 4), "last": row.last}
    if lags is None:
        return {**head, "slow": row.slow, "side": row.side}
    return {**head, "p_value": row.p, "clock_error_ms": round(row.err, 3),
            "within_clock_error": row.median < row.err, "threshold_ms": round(row.bar, 3),
            "slow": row.slow, "side": row.side, "trend_ms": round(_trend(lags), 3),
            "spark": _spark(lags)}


def _median_without(ordered: Sequence[float], v: float) -> float:
    """The median of ``ordered`` (sorted) less one instance of ``v``: the other members'
    typical lag, in O(log m) per rank."""
    i, n = bisect.bisect_left(ordered, v), len(ordered) - 1
    if n <= 0:
        return 0.0

    def at(k: int) -> float:
        return ordered[k] if k < i else ordered[k + 1]

    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


def _group_result(g: _Group, clocks: Mapping[int, Clock], rule: Rule) -> dict[str, Any] | None:
    seqs = _complete(g, rule.window_ops)
    offsets = {r: c.offset_ns for r, c in clocks.items() if c.offset_ns}
    host = _lags(g, seqs, False, offsets) if len(g.members) >= 2 else None
    if host is None:
        return None
    rows = _rows(g, host, clocks, rule, HOST)
    device = _lags(g, seqs, True, offsets)
    if device is not None:
        named = {row.rank for row in rows if row.slow}
        for i, dev in enumerate(_rows(g, device, clocks, rule, DEVICE)):
            if dev.slow and dev.rank not in named:
                rows[i] = dev
    rows.sort(key=lambda row: (-row.median, row.rank))
    # Every figure, the trend and the sparkline for the rows a page shows (the slowest, and
    # every slow one); the others as /metrics reads them.
    out = [_row(row, host.n, (device if row.side == DEVICE and device else host).lags(row.rank)
                if i < SPARK_ROWS or row.slow else None) for i, row in enumerate(rows)]
    counts: dict[str, int] = {}
    for s in seqs:
        counts[g.ops[s]] = counts.get(g.ops[s], 0) + 1
    return {"group": g.name, "desc": g.desc, "label": _label(g), "size": len(g.members),
            "ops": host.n, "op_names": sorted(counts, key=lambda o: -counts[o]), "rows": out}


def _label(g: _Group) -> str:
    # c10d names its groups "0", "1"...: people know them by their desc ("default_pg").
    return g.desc if g.name.isdigit() and g.desc else g.name


def analyze(dumps: Mapping[int, Mapping[str, Any]], clocks: Mapping[int, Clock] | None = None,
            rule: Rule = Rule()) -> dict[str, Any]:
    """The straggler result over per-rank FR dumps (module docstring).

    ``clocks``: each rank's clock against the reader's (:func:`estimate`, :func:`best_clock`);
    ranks without one are taken as on the reader's clock. Returns ``stragglers`` (one row per
    slow rank and group: ``rank, group, label, median_lag_ms, last_share, side``; ``label`` names
    the group as the pages do, e.g. ``default_pg`` for c10d's group ``0``), ``groups_checked``
    (groups with enough complete collectives in the window: ``needed_ops``), ``window_ops``, and
    ``groups`` (per group a row per member, slowest first, for the pages and ``/metrics``: the
    slowest ``SPARK_ROWS`` and every slow one with every figure, the others with ``rank``,
    ``median_lag_ms``, ``last_share``, ``last``, ``slow`` and ``side``: ``_row``).
    """
    clocks = clocks or {}
    groups = []
    for g in sorted(_groups(dumps).values(), key=lambda g: g.name):
        res = _group_result(g, clocks, rule)
        if res is not None:
            groups.append(res)
    checked = [g for g in groups if g["ops"] >= needed_ops(rule, g["size"])]
    stragglers = [{"rank": row["rank"], "group": g["group"], "label": g["label"],
                   "median_lag_ms": round(row["median_lag_ms"], 1),
                   "last_share": round(row["last_share"], 2), "side": row["side"]}
                  for g in checked for row in g["rows"] if row["slow"]]
    stragglers.sort(key=lambda s: (-s["median_lag_ms"], s["rank"], s["group"]))
    return {"stragglers": stragglers, "groups_checked": [g["group"] for g in checked],
            "window_ops": rule.window_ops, "groups": groups}


def public(result: Mapping[str, Any]) -> dict[str, Any]:
    """The ``/stragglers`` JSON: exactly ``stragglers``, ``groups_checked``, ``window_ops``."""
    return {k: result[k] for k in ("stragglers", "groups_checked", "window_ops")}


def sentence(s: Mapping[str, Any], result: Mapping[str, Any]) -> str:
    """One straggler in words: "Slow: rank 2 arrives last at 96 % of all_reduce on main_comm,
    median 41 ms after the first rank (host side)"."""
    g = next((g for g in result.get("groups", []) if g["group"] == s["group"]), None)
    label = g["label"] if g else s["group"]
    names = g["op_names"] if g else []
    ops = "/".join(names[:3]) + ("..." if len(names) > 3 else "") if names else "collectives"
    share = f"{s['last_share'] * 100:.0f} %"
    if s["side"] == DEVICE:
        return (f"Slow: rank {s['rank']} starts last at {share} of {ops} on {label}, median "
                f"{s['median_lag_ms']:.0f} ms after the first rank (device side: issued on "
                "time, started late)")
    return (f"Slow: rank {s['rank']} arrives last at {share} of {ops} on {label}, median "
            f"{s['median_lag_ms']:.0f} ms after the first rank (host side)")
