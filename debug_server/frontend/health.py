"""Every rank's health from one poll, as the frontend reads it.

A rank's ``torchcomms_health_check`` reply becomes a ``RankHealth``. One poll of a whole job is a
``HealthSet``: runs of ranks that answered alike, one record per run (``parse_health``), so the
readers that want ranks alike, not ranks (the overview's health column, the hang report's lines,
the watch's decision), work per run: 131072 ranks stalled in one op are a few thousand runs
(ages in ms), not 131072 records. A rank's own record is made only where one is read
(``/metrics``, a small job's report), once per poll.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

from debug_server.fanout.transport import RankResult

__all__ = ["NO_HEALTH_CHECK", "HealthClass", "HealthKind", "HealthSet", "RankHealth",
           "class_texts", "health_classes", "kind_text", "parse_health", "ranks_of"]

NO_HEALTH_CHECK = "no health check"
"""Why the health of a rank whose worker answers the health check with 404 is unknown."""


@dataclass(slots=True)
class RankHealth:
    """One rank's answer to one health poll, reduced to what the watch decides on."""

    rank: int
    answered: bool
    """The worker replied with a health JSON object."""
    healthy: bool | None
    """None when unknown (no answer, or a worker without a health check)."""
    stalled_op: dict[str, Any] | None = None
    """The stalled op (``group``, ``seq``, ``op``); its ``age_s`` may be another rank's
    (``parse_health`` shares it between ranks alike): this rank's is :attr:`op_age_s`."""
    info: dict[str, Any] = field(default_factory=dict)
    """The whole health reply (``in_flight``...), shared like ``stalled_op``: this rank's
    ``oldest_in_flight_s`` is :attr:`oldest_s`."""
    error: str | None = None
    op_age_s: float | None = None
    """This rank's stalled op's age (from ``stalled_op`` when not given)."""
    oldest_s: float | None = None
    """This rank's oldest op in flight's age (from ``info`` when not given)."""

    def __post_init__(self) -> None:
        if self.op_age_s is None and self.stalled_op:
            self.op_age_s = _num(self.stalled_op.get("age_s"))
        if self.oldest_s is None and self.info:
            self.oldest_s = _num(self.info.get("oldest_in_flight_s"))

    def op_now(self) -> dict[str, Any] | None:
        """The stalled op with this rank's own age."""
        op = self.stalled_op
        if op is None or op.get("age_s") == self.op_age_s:
            return op
        return {**op, "age_s": self.op_age_s}

    def text(self) -> str:
        """This rank's health in words: the overview's health column, the hang report's line."""
        return kind_text(self.kind(), self.age())

    def kind(self) -> HealthKind:
        """This rank's health in words less its age: ranks of one kind read alike but for it."""
        if self.healthy is None:
            return (f"health unknown ({self.error or 'no answer'})", "", "", "")
        if self.healthy:
            n = self.info.get("in_flight")
            if not isinstance(n, int) or n <= 0:
                return ("healthy", "", "", "")
            return (f"healthy ({n} op{'s' if n != 1 else ''} in flight", ", oldest {} s", ".0f",
                    ")")
        op = self.stalled_op
        if op:
            return (f"UNHEALTHY: {op.get('group')} seq {op.get('seq')} {op.get('op')}",
                    " in flight for {} s", ".1f", "")
        return (f"UNHEALTHY: {self.error or 'stalled'}", "", "", "")

    def age(self) -> float | None:
        """The age in this rank's words: its stalled op's, else its oldest op in flight's."""
        if self.healthy is None:
            return None
        return self.op_age_s if self.healthy is False else self.oldest_s

    def line(self) -> str:
        return f"rank {self.rank}: {self.text()}"


def _num(v: Any) -> float | None:
    if type(v) is float:  # the usual case first: once or twice a rank per poll
        return v  # type: ignore[no-any-return]
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


HealthKind = tuple[str, str, str, str]
"""A health text less its age: (words, the age's words with ``{}`` for it, the age's format,
words after the age)."""


def kind_text(kind: HealthKind, lo: float | None, hi: float | None = None) -> str:
    """The words of ``kind`` with an age, or with the range of ages ``lo``-``hi`` of ranks alike."""
    head, around, fmt, tail = kind
    if lo is None or not around:
        return head + tail
    low, high = format(lo, fmt), format(lo if hi is None else hi, fmt)
    return head + around.format(low if low == high else f"{low}-{high}") + tail


@dataclass(slots=True)
class HealthClass:
    """Ranks whose health reads alike but for its age, with the range of their ages."""

    kind: HealthKind
    ranks: list[int]
    first: RankHealth
    """The record of its first rank."""
    lo: float | None = None
    hi: float | None = None

    def text(self) -> str:
        return kind_text(self.kind, self.lo, self.hi)


class HealthSet(Sequence[RankHealth]):
    """Every rank's health from one poll, in the order the poll's records came: runs of ranks
    whose replies read alike (ages too), one record per run, the record of its first rank.

    Indexing or iterating it gives each rank's own record, made on the first such read and
    held (the run's first record is the run's). Nothing changes a record once it is made."""

    __slots__ = ("_each", "_len", "runs")

    def __init__(self, runs: list[tuple[RankHealth, list[int]]]) -> None:
        self.runs = runs
        """(record, its run's ranks: the record's own first)."""
        self._len = sum(len(ranks) for _, ranks in runs)
        self._each: list[RankHealth] | None = None

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, i: int) -> RankHealth: ...
    @overload
    def __getitem__(self, i: slice) -> list[RankHealth]: ...

    def __getitem__(self, i: int | slice) -> RankHealth | list[RankHealth]:
        return self._records()[i]

    def __iter__(self) -> Iterator[RankHealth]:
        return iter(self._records())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, HealthSet | list):
            return self._records() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"HealthSet({self._records()!r})"

    def _records(self) -> list[RankHealth]:
        if self._each is None:
            out: list[RankHealth] = []
            for rec, ranks in self.runs:
                out.append(rec)
                if len(ranks) > 1:
                    out += [_same(rec, r) for r in ranks[1:]]
            self._each = out
        return self._each

    def where(self, keep: Callable[[RankHealth], bool]) -> HealthSet:
        """The ranks whose record ``keep`` keeps: asked once per run, so it reads what the
        ranks of a run share (not ``rank``)."""
        return HealthSet([(rec, ranks) for rec, ranks in self.runs if keep(rec)])

    def ranks(self) -> list[int]:
        """Every rank, in order."""
        return [r for _, ranks in self.runs for r in ranks]


def _same(rec: RankHealth, rank: int) -> RankHealth:
    """``rec`` as rank ``rank``'s record."""
    out = RankHealth(rank, rec.answered, rec.healthy, rec.stalled_op, rec.info, rec.error,
                     rec.op_age_s, rec.oldest_s)
    if rec.op_age_s is None or rec.oldest_s is None:  # not the shared dicts' (__post_init__)
        out.op_age_s, out.oldest_s = rec.op_age_s, rec.oldest_s
    return out


def ranks_of(health: Iterable[RankHealth]) -> list[int]:
    """The ranks of ``health``, in order (a ``HealthSet``'s without a record per rank)."""
    if isinstance(health, HealthSet):
        return health.ranks()
    return [h.rank for h in health]


def runs_of(health: Iterable[RankHealth]) -> Iterable[tuple[RankHealth, list[int] | None]]:
    """(record, its run's ranks) of a ``HealthSet``; (record, None) per record of any other."""
    if isinstance(health, HealthSet):
        return health.runs
    return ((h, None) for h in health)


def health_classes(health: Iterable[RankHealth]) -> list[HealthClass]:
    """``health`` by kind, in the order kinds first come (ranks in the order they come); a
    ``HealthSet`` is read per run."""
    out: dict[HealthKind, HealthClass] = {}
    # A kind is read off the rank's shared dicts (``parse_health``): once per pair of them
    # (the first record of each pair is held, so the dicts' ids stay theirs meanwhile).
    by_dicts: dict[tuple[Any, ...], tuple[HealthClass, RankHealth]] = {}
    for h, ranks in runs_of(health):
        key = (h.healthy, h.error, id(h.info), id(h.stalled_op))
        held = by_dicts.get(key)
        if held is None:
            kind = h.kind()
            c = out.get(kind)
            if c is None:
                c = out[kind] = HealthClass(kind, [], h)
            by_dicts[key] = (c, h)
        else:
            c = held[0]
        age = h.age()
        if ranks is None:
            c.ranks.append(h.rank)
        else:
            c.ranks += ranks
        if age is not None:
            c.lo = age if c.lo is None or age < c.lo else c.lo
            c.hi = age if c.hi is None or age > c.hi else c.hi
    return list(out.values())


def class_texts(health: Iterable[RankHealth]) -> dict[int, str]:
    """Each rank's health as its class's words (one text per class; ages as their range):
    the overview's health column where ranks alike share one row (``render.CELLS_MAX``)."""
    out: dict[int, str] = {}
    for c in health_classes(health):
        out.update(dict.fromkeys(c.ranks, c.text()))
    return out


_AGES = ("stalled_op", "oldest_in_flight_s")
"""The keys of a health reply that differ between ranks stalled in one op (``parse_health``)."""


def parse_health(results: Sequence[RankResult],
                 errors: Mapping[int, str] | None = None) -> HealthSet:
    """Health replies as records; a missing or malformed reply is ``healthy=None``; a rank in
    ``errors`` is unhealthy for that reason (the watch's: its checks timed out too often).

    Records that come in a row alike (the same reply text, status and error: a host's or an
    aggregator's ranks that answered alike, ``hostreply.records``; every healthy rank of a
    job asked directly) are one run of the set, read once. Replies that differ only in their
    ages (131071 ranks stalled in one op, polled ms apart) share one ``info`` and one
    ``stalled_op`` dict, each record keeping its own ages (``op_age_s``, ``oldest_s``).
    """
    runs: list[tuple[RankHealth, list[int]]] = []
    # Each distinct text is read once; its parsed dicts are shared between records, only read.
    read: dict[str, _Read | str] = {}
    shapes: dict[Any, tuple[dict[str, Any], dict[str, Any] | None]] = {}
    prev: RankResult | None = None  # the record the last run was read from
    ranks: list[int] = []
    for r in results:
        own = errors is not None and r.rank in errors  # the watch's verdict: a run of its own
        if (not own and prev is not None and r.body == prev.body and r.status == prev.status
                and r.error == prev.error and r.http_status == prev.http_status
                and r.dump is prev.dump):
            ranks.append(r.rank)
            continue
        ranks = [r.rank]
        runs.append((_one(r, read, shapes, errors), ranks))
        prev = None if own else r
    return HealthSet(runs)


def _one(r: RankResult, read: dict[str, _Read | str],
         shapes: dict[Any, tuple[dict[str, Any], dict[str, Any] | None]],
         errors: Mapping[int, str] | None) -> RankHealth:
    if errors and r.rank in errors:
        return RankHealth(r.rank, False, False, error=errors[r.rank])
    if r.http_status == 404:  # a worker without the handler (torch's own, or the viewer's)
        return RankHealth(r.rank, False, None, error=NO_HEALTH_CHECK)
    if not r.ok:
        return RankHealth(r.rank, False, None, error=r.error or r.status)
    got = read.get(r.body) if r.body is not None else None
    if got is None:
        got = _read_health(r, shapes)
        if r.body is not None:
            read[r.body] = got
    if isinstance(got, str):
        return RankHealth(r.rank, False, None, error=got)
    healthy, op, info, age, oldest = got
    rec = RankHealth(r.rank, True, healthy, op, info, None, age, oldest)
    # Its own ages, None ones too (where __post_init__ took the shared dicts': the first
    # such rank's).
    if age is None or oldest is None:
        rec.op_age_s, rec.oldest_s = age, oldest
    return rec


_Read = tuple[bool, dict[str, Any] | None, dict[str, Any], float | None, float | None]
"""One health reply text as read (``_read_health``)."""


def _read_health(r: RankResult, shapes: dict[Any, tuple[dict[str, Any], dict[str, Any] | None]],
                 ) -> _Read | str:
    """One reply text's (healthy, stalled op, info, its op's age, its oldest op's age), the
    dicts those of the first reply of its shape (its text less its ages: 131071 ranks stalled
    in one op, polled ms apart, share one); or why it is not understood."""
    try:
        h = r.json()
    except ValueError:
        h = None
    if not isinstance(h, dict) or not isinstance(h.get("healthy"), bool):
        return "health reply is not understood"
    op = h.get("stalled_op")
    op = op if isinstance(op, dict) else None
    age = _num(op.get("age_s")) if op is not None else None
    oldest = _num(h.get("oldest_in_flight_s"))
    try:  # the reply less its ages; an unhashable value (a list...) is shared with none
        rest, op_rest = h.copy(), dict(op) if op else None  # C loops, not a generator
        for k in _AGES:
            rest.pop(k, None)
        if op_rest is not None:
            op_rest.pop("age_s", None)
        shape: Any = (tuple(rest.items()), tuple(op_rest.items()) if op_rest is not None
                      else None)
        hash(shape)
    except TypeError:
        shape = None
    first = shapes.setdefault(shape, (h, op)) if shape is not None else (h, op)
    return h["healthy"], first[1], first[0], age, oldest
