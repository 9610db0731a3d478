"""When an op counts as stalled, and how a stalled op is reported: one rule for every source.

An op is stalled once it has been in flight longer than its limit (seconds; None: never). The
sources are our hooks' records and the in-flight ops of c10d-backed communicators
(``hooks.health`` and the stall watchdog, ``hooks._stall_check``), and c10d's own groups
(``c10d_fr.c10d_stalled_op``, whose pending op comes from c10d's progress, see :class:`StallWatch`).
Each reports the op as ``{"group", "seq", "op", "age_s", ...}``, which the worker's health
check serves and the frontend shows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple, Protocol

__all__ = ["InFlightOp", "StallWatch", "age_s", "is_stalled", "oldest_stalled",
           "int_or", "report", "report_op"]


class InFlightOp(Protocol):
    """What the rule reads of an op (``records.OpRecord`` and ``records.InFlight`` have it)."""

    comm: Any
    op: str
    seq: int
    p2p_seq: int
    is_p2p: bool
    time_created_ns: int


def age_s(created_ns: int, now_ns: int) -> float:
    """Seconds since ``created_ns``."""
    return (now_ns - created_ns) / 1e9


def is_stalled(age: float, limit: float | None) -> bool:
    """The rule: in flight longer than ``limit`` seconds (None: no limit, never stalled)."""
    return limit is not None and age > limit


def report(group: str, seq: int, op: str, age: float, **extra: Any) -> dict[str, Any]:
    """A stalled op as health reports it (``extra``: e.g. ``group_desc``, ``source``)."""
    return {"group": group, "seq": seq, "op": op, "age_s": round(age, 3), **extra}


def report_op(op: InFlightOp, age: float) -> dict[str, Any]:
    """:func:`report` of one of our ops: its communicator, and its P2P seq for P2P ops."""
    return report(op.comm.get_name(), op.p2p_seq if op.is_p2p else op.seq, op.op, age)


def oldest_stalled(ops: Iterable[tuple[InFlightOp, float | None]], now_ns: int
                   ) -> tuple[InFlightOp, float] | None:
    """Of ``(op, limit)`` pairs of ops in flight, the oldest stalled one and its age."""
    best: tuple[InFlightOp, float] | None = None
    for op, limit in ops:
        age = age_s(op.time_created_ns, now_ns)
        if is_stalled(age, limit) and (best is None or op.time_created_ns < best[0].time_created_ns):
            best = (op, age)
    return best


def int_or(v: Any, default: int) -> int:
    """``int(v)``, or ``default`` for what c10d writes as missing or text (also used by the c10d merge)."""
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


# ---------------------------------------------------------------------------------------------
# c10d's own groups: a group that makes no progress


class _Pending(NamedTuple):
    status: tuple[int, int]
    """The group's (last enqueued, last completed) when first seen pending; any change is
    progress, or a new op, and starts the watch over."""
    seen_ns: int
    """When the watch first saw this status."""
    read: bool
    """Whether the group's entries were read for this status."""
    seq: int
    """The pending op: the group's oldest unretired collective (-1: none, nothing pending)."""
    op: str
    desc: str
    created_ns: int


class StallWatch:
    """Notices c10d groups with an op in flight that make no progress.

    Every check reads only ``pg_status`` (about a millisecond, no entries): a group may have an
    op in flight while its last enqueued collective is above its last completed one. gloo's
    ``last_completed_collective`` lags and can stay one behind for good, so that alone is never
    evidence: a group whose status is unchanged at the next check has its entries read, once
    per status, and its pending op is its oldest entry not retired (c10d retires an op when it
    ends; on gloo that is the only sign). The op stalls when it is older than the timeout. A
    healthy job, whose status moves between checks, never pays for reading entries.
    """

    def __init__(self) -> None:
        self._pending: dict[str, _Pending] = {}

    def update(self, status: Mapping[str, Mapping[str, Any]], now_ns: int) -> list[str]:
        """Feed one ``pg_status``; returns the groups whose entries must be read now (their
        status did not move since the previous check), for :meth:`resolve`."""
        still: dict[str, _Pending] = {}
        unread = []
        for name, st in status.items():
            key = (int_or(st.get("last_enqueued_collective"), -1),
                   int_or(st.get("last_completed_collective"), -1))
            if key[0] <= key[1]:
                continue
            prev = self._pending.get(name)
            if prev is not None and prev.status == key:
                still[name] = prev
                if not prev.read:
                    unread.append(name)
            else:
                still[name] = _Pending(key, now_ns, False, -1, "", "", 0)
        self._pending = still
        return sorted(unread)

    def resolve(self, group: str, entries: Iterable[Mapping[str, Any]]) -> None:
        """Find ``group``'s pending op among its entries (c10d's, process_group[0] == group)."""
        p = self._pending.get(group)
        if p is None:
            return
        pending = [e for e in entries if not e.get("retired") and not e.get("is_p2p")
                   and e.get("state") != "completed"]
        if not pending:  # the status lagged: nothing is in flight
            self._pending[group] = p._replace(read=True)
            return
        e = min(pending, key=lambda e: int_or(e.get("collective_seq_id"), 0))
        pg = e.get("process_group") or ("", "")
        self._pending[group] = p._replace(
            read=True, seq=int_or(e.get("collective_seq_id"), -1),
            op=str(e.get("profiling_name", "")).partition(":")[2].split(" ")[0],
            desc=str(pg[1]) if len(pg) > 1 else "",
            created_ns=int_or(e.get("time_created_ns"), 0) or p.seen_ns)

    def stalled(self, stall_timeout: float, now_ns: int) -> list[tuple[str, float, _Pending]]:
        """``(group, age_s, pending)`` of every pending op older than ``stall_timeout``."""
        out = []
        for g, p in sorted(self._pending.items()):
            age = age_s(p.created_ns, now_ns)
            if p.seq >= 0 and is_stalled(age, stall_timeout):
                out.append((g, age, p))
        return out
