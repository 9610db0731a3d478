"""When an op counts as stalled, and how a stalled op is reported: one rule for every source.

An op is stalled once it has been in flight longer than its limit (seconds; None: never). The
sources are our hooks' records and the in-flight ops of c10d-backed communicators
(``hooks.health`` and the stall watchdog, ``hooks._stall_check``), and c10d's own groups
(``c10d_fr.stalled_op``, whose pending op comes from c10d's progress, see ``StallWatch``). Each
reports the op as ``{"group", "seq", "op", "age_s", ...}``, which the worker's health check
serves and the frontend shows.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

__all__ = ["InFlightOp", "age_s", "is_stalled", "oldest_stalled", "report", "report_op"]


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
