"""What the frontend's last background cycles saw, kept for ``/metrics`` (which asks no rank).

A Prometheus scrape every 15 s must not cost a fan-out over a 131072-rank job each time. So
``/metrics`` is built from what the frontend's periodic work produced last, kept here in one
small holder the frontend owns (``LastCycle``, app key ``app.LAST_CYCLE``):

- the **FR part** (``FrPart``): the last FR fetch's analysis (its error findings), each rank's
  ``pg_status`` seqs, who answered, when, and what the fetch and analysis took. Put by the dumper
  after each cycle's fetch (``dumps.Dumper``), by the hang watch's report (``hangreport``), and
  where neither has put one for an interval, by the frontend's own cycle
  (``metrics.CycleFill``);
- the **health part** (``HealthPart``): the hang watch's last health poll (every
  ``min(dump_interval, 2 s)``, longer above 1024 ranks: ``hangreport.MAX_POLLS_PER_S``).

Each part is replaced whole (never changed in place), so a reader holding one sees one cycle.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from debug_server.fanout.reply import FrData
from debug_server.fanout.transport import RankResult
from debug_server.frontend.health import HealthSet, RankHealth

__all__ = ["SEQ_KEYS", "FrPart", "HealthPart", "LastCycle"]

SEQ_KEYS = ("last_enqueued_collective", "last_started_collective", "last_completed_collective")
"""The ``pg_status`` counters an FR part keeps per (rank, group)."""


@dataclass(frozen=True, slots=True)
class FrPart:
    """What ``/metrics`` keeps of one FR fetch and its analysis."""

    findings: tuple[Mapping[str, Any], ...]
    """The analysis result's error findings (severity ``error``), in its order."""
    ranks: tuple[int, ...]
    """Every rank the fetch asked."""
    answered: frozenset[int]
    """Ranks whose worker answered the fetch (any HTTP status)."""
    seqs: Mapping[str, tuple[tuple[str, int, tuple[int, ...]], ...]]
    """``SEQ_KEYS`` key -> ``(group, seq, ranks)``: the ranks whose ``pg_status`` reads that
    seq for that group (ranks in order; rows by group, then seq)."""
    at: float
    """``time.monotonic()`` when the analysis was done."""
    took_s: float
    """The fetch and analysis, in seconds."""
    by: str
    """Who fetched: ``dumper``, ``hang report`` or ``metrics cycle``."""

    @classmethod
    def of(cls, fr: FrData, result: Mapping[str, Any], started: float, by: str) -> FrPart:
        """The part of one fetch and its analysis ``result``; ``started``: ``time.monotonic()``
        when the fetch began. Ranks whose dumps share their ``pg_status`` by identity (the
        fan-out's copies of ranks alike) are read once: a pass over every rank is a lookup."""
        kinds: dict[int, tuple[Any, list[int]]] = {}  # id(pg_status) -> (it, its ranks)
        for rank, dump in fr.dumps.items():
            status = dump.get("pg_status") if isinstance(dump, Mapping) else None
            held = kinds.get(id(status))
            if held is None:
                kinds[id(status)] = (status, [rank])  # alive in its dump: its id is its own
            else:
                held[1].append(rank)
        rows: dict[str, dict[tuple[str, int], list[int]]] = {k: {} for k in SEQ_KEYS}
        for status, ranks in kinds.values():
            if not isinstance(status, Mapping):
                continue
            for group, st in status.items():
                if not isinstance(st, Mapping):
                    continue
                for key in SEQ_KEYS:
                    v = st.get(key)
                    if isinstance(v, int) and not isinstance(v, bool):
                        rows[key].setdefault((str(group), v), []).extend(ranks)
        findings = tuple(f for f in result.get("findings", [])
                         if f.get("severity", "error") == "error")
        now = time.monotonic()
        return cls(findings, tuple(r.rank for r in fr.results),
                   frozenset(r.rank for r in fr.results if r.http_status is not None),
                   {k: tuple((g, seq, tuple(sorted(ranks)))
                             for (g, seq), ranks in sorted(v.items())) for k, v in rows.items()},
                   now, now - started, by)


@dataclass(frozen=True, slots=True)
class HealthPart:
    """The hang watch's last health poll, as ``/metrics`` reads it."""

    health: Sequence[RankHealth]
    """Not changed once held (a ``health.HealthSet`` as ``parse_health`` made it)."""
    replied: frozenset[int]
    """Ranks whose worker answered the poll with any HTTP status (one without a health check
    answers 404: its worker is up, its health unknown)."""
    at: float
    """``time.monotonic()`` when the poll's replies came in."""

    @classmethod
    def of(cls, results: Sequence[RankResult], health: Sequence[RankHealth]) -> HealthPart:
        return cls(health if isinstance(health, HealthSet) else tuple(health), frozenset(r.rank for r in results if r.http_status is not None),
                   time.monotonic())


class LastCycle:
    """The frontend's one holder of its last FR part and health part (module docstring)."""

    def __init__(self) -> None:
        self._fr: FrPart | None = None
        self._later: tuple[FrData, Mapping[str, Any], float, str, float] | None = None
        """A page's fetch and analysis, made into the FR part only when read (``fr``): a page
        at 131072 ranks does not pay the pass over every rank's status that a scrape may never
        ask for."""
        self.fr_at: float | None = None
        """``time.monotonic()`` of the FR part's analysis (None before one)."""
        self.health: HealthPart | None = None
        self.fetching = 0
        """FR fetches for the FR part in flight now (the frontend's cycle waits for them)."""
        self.memo: tuple[Any, Any] | None = None
        """``/metrics``' text of the current parts (``metrics.CycleText``), keyed by what it
        was built from (the parts are replaced, never changed, so identity is the key)."""

    @property
    def fr(self) -> FrPart | None:
        """The FR part of the newest FR fetch (a page's made now, on first read)."""
        if self._later is not None:
            fr, result, started, by, at = self._later
            self._later = None
            self._fr = dataclasses.replace(FrPart.of(fr, result, started, by), at=at,
                                           took_s=at - started)
        return self._fr

    def put_fr(self, part: FrPart) -> None:
        if self.fr_at is None or part.at >= self.fr_at:  # a slow fetch never replaces a newer one
            self._fr, self._later, self.fr_at = part, None, part.at

    def put_page(self, fr: FrData, result: Mapping[str, Any], started: float) -> None:
        """A page's FR fetch (the job's window) and its analysis: the newest cycle too."""
        at = time.monotonic()
        if self.fr_at is None or at >= self.fr_at:
            self._later, self.fr_at = (fr, result, started, "page", at), at

    def fr_age_s(self, now: float | None = None) -> float | None:
        """Seconds since the FR part's analysis; None without one (nothing made for it)."""
        if self.fr_at is None:
            return None
        return max(0.0, (time.monotonic() if now is None else now) - self.fr_at)

    def put_health(self, part: HealthPart) -> None:
        self.health = part

    @contextlib.contextmanager
    def fetching_fr(self) -> Iterator[None]:
        """Around a fetch whose analysis will be put here."""
        self.fetching += 1
        try:
            yield
        finally:
            self.fetching -= 1

    @staticmethod
    def age_s(part: FrPart | HealthPart | None, now: float | None = None) -> float | None:
        """Seconds since ``part`` came in; None without one."""
        if part is None:
            return None
        return max(0.0, (time.monotonic() if now is None else now) - part.at)
