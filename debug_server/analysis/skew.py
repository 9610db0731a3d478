"""Ranks are never read at one instant: the rules that keep read skew from looking like a hang.

The frontend reads the ranks' rings one after another, so a collective issued just before one
rank's read may not be on another rank yet. A dump that says when it was taken
(``dump_time_ns``) lets such an op be "in flight" rather than missing or stuck, and lets a wrapped
ring read after the others keep the ops it pushed out since. A class's times are its first
rank's; ranks merged into one class did the same ops, so their issue and snapshot times differ by
the skew these rules tolerate anyway.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Mapping, Sequence

from debug_server.analysis.digest import Cell
from debug_server.analysis.groups import RankClass
from debug_server.analysis.merge import Merge

__all__ = ["IN_FLIGHT_GRACE_NS", "ClassEntries", "evicted_after_read", "issue_time",
           "just_issued", "read_before_issued"]

IN_FLIGHT_GRACE_NS = 1_000_000_000
"""A collective issued less than this before a rank's snapshot (``dump_time_ns``) is in flight:
ranks that do not hold it yet are not called missing, and nobody is called stuck in it. Why: the
frontend reads the ranks' rings one after another (an HTTP fan-out, sometimes a second round),
never at one instant, so on a job issuing collectives back to back the rank read first has not
yet issued the newest ones. 1 s is far above that skew at small scale and the clock offset of
NTP-synced hosts, and short against a hang: a page read a second into it names it, and the hang
report waits ``stall_timeout`` anyway. Dumps without ``dump_time_ns`` (PyTorch's own, older
pickles) get no grace."""

ClassEntries = tuple[RankClass, tuple[Cell, ...], tuple[int, ...]]
"""One class's entries in one group, and their issue times."""

_SEQ = operator.itemgetter(0)


def issue_time(entry: ClassEntries, seq: int) -> int:
    """When the class's first rank issued ``seq`` (its wall clock, ns); 0 when unknown."""
    _, ents, times = entry
    j = bisect.bisect_left(ents, seq, key=_SEQ)
    return times[j] if j < len(times) and ents[j][0] == seq else 0


def read_before_issued(
    m: Merge, cls: list[ClassEntries], items: Sequence[Cell], seq: int, missing: list[int]
) -> list[int]:
    """The ``missing`` ranks whose dump is no evidence that they skipped ``seq``: it was
    taken less than the grace after the first issuer issued it (compares wall clocks of
    different hosts, which NTP keeps far closer than the grace). Not "every issuer was read
    just after issuing": an issuer frozen then, whose last dump is that moment, would hide
    a rank missing for good. A rank whose dump has no time gets no grace."""
    times = [t for ci in {it[0] for it in items} if (t := issue_time(cls[ci], seq))]
    if not times:
        return []
    first = min(times)
    return [r for r in missing
            if (snap := m.digest_of[r].snap_ns) and snap - first < IN_FLIGHT_GRACE_NS]


def just_issued(cls: list[ClassEntries], items: Sequence[Cell], seq: int) -> bool:
    """The newest read of an issuer of ``seq`` came less than the grace after its last
    member issued it: an op that nobody has completed yet is in flight, not stuck. (Not
    "some issuer was read just after issuing": a rank frozen right after issuing, whose
    last dump is that moment, would keep the op young forever.)"""
    newest_read = last_issue = 0
    for ci in {it[0] for it in items}:
        snap, t = cls[ci][0].d.snap_ns, issue_time(cls[ci], seq)
        if not (snap and t):
            return False
        newest_read, last_issue = max(newest_read, snap), max(last_issue, t)
    return newest_read - last_issue < IN_FLIGHT_GRACE_NS


def ahead_of_holders(cover: Mapping[int, tuple[int, int]], ci: int, items: Sequence[Cell],
                     seq: int, lo: int) -> bool:
    """Class ``ci``'s ring (oldest seq ``lo`` > ``seq``) holds as many of this group's
    collectives as every holder of ``seq`` and ends at least ``lo - seq`` beyond them: it
    issued that many more, and each pushed one old entry out. A ring that is merely ahead (a
    rank one op further on, or read a moment later) has not lost history the others kept; no
    clocks are needed to see it. A shorter window (a smaller ring, or one shared with other
    groups) is not excused."""
    held = [cover[it[0]] for it in items]
    hi = cover[ci][1]
    return (hi - lo >= max(h - lo_h for lo_h, h in held)
            and hi - max(h for _, h in held) >= lo - seq)


def evicted_after_read(
    m: Merge, cls: list[ClassEntries], ci: int, items: Sequence[Cell], seq: int, lo: int
) -> bool:
    """Class ``ci``'s ring (oldest seq ``lo`` > ``seq`` here) was read after every holder of
    ``seq`` and has recorded at least ``lo - seq`` ops since the latest of those reads: each
    pushed one old entry out, so at the holders' instant it may still have held ``seq``.
    That is the read skew at the old end of a wrapped ring, not history lost."""
    snap_r = cls[ci][0].d.snap_ns
    held = [cls[j][0].d.snap_ns for j in {it[0] for it in items}]
    if not snap_r or not all(held):
        return False
    latest = max(held)
    if snap_r <= latest:
        return False
    key = (cls[ci][0].idx, latest)
    newer = m.newer_memo.get(key)
    if newer is None:
        # Per-group times run in seq order, which is issue order; P2P entries are not
        # counted, which can only make this say "lost" more often.
        newer = sum(len(t) - bisect.bisect_right(t, latest) for _, t in cls[ci][0].d.times)
        m.newer_memo[key] = newer
    return lo - seq <= newer
