"""Each rank's stream: the ops it issued across groups, in issue order, and where its device is.

A rank runs its collectives in the order it issued them, whatever the group (one stream per
rank on NCCL with stream-ordered waits; a blocked CPU on gloo). Record ids and
``time_created_ns`` are per process, so within one rank they order every group's ops. Per rank
class (ranks with identical digests) this module gives the ops not yet completed, oldest first
(:class:`ClassOps`), the last op it completed, and the result's ``streams``: per class, its
recent ops as lanes (issued / started / completed) and the op its device is executing, the
picture that shows an order inversion or a busy GPU at a glance.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from typing import Any

from debug_server.analysis.digest import DONE, STATES
from debug_server.analysis.groups import Group, GroupKey, RankClass

__all__ = ["LANE_OPS", "UNKNOWN_T", "ClassOps", "OpKey", "class_ops", "stream_lanes"]

OpKey = tuple[str, bool, int]
"""(group id, is P2P, seq): a collective's ``collective_seq_id`` or a P2P op's ``p2p_seq_id``."""

UNKNOWN_T = 1 << 62
"""The issue time of an op without ``time_created_ns``: after every timed one."""

LANE_OPS = 8
"""Ops per rank class in the result's ``streams`` (the newest completed ones and every pending
one up to this many)."""


class ClassOps:
    """One class's ops: seqs and issue times per group, pending P2P times, incomplete ops."""

    __slots__ = ("colls", "p2p", "blocked", "pending", "done", "states")

    def __init__(self) -> None:
        self.colls: dict[str, tuple[list[int], Sequence[int]]] = {}
        self.p2p: dict[OpKey, int] = {}
        self.blocked: list[tuple[int, OpKey, int, int]] = []
        """(issue time, op, signature id, frames id) of every op not completed, oldest first."""
        self.pending: set[OpKey] = set()
        self.done: list[tuple[int, OpKey, int, int]] = []
        """The newest completed collectives (at most :data:`LANE_OPS` a group), oldest first."""
        self.states: dict[OpKey, int] = {}
        """The state code of each incomplete op (``digest.STATES``)."""

    def time(self, k: OpKey) -> int:
        """When this class issued op ``k``; :data:`UNKNOWN_T` when it did not or nobody knows."""
        if k[1]:
            return self.p2p.get(k, 0) or UNKNOWN_T
        held = self.colls.get(k[0])
        if held is None:
            return UNKNOWN_T
        seqs, ts = held
        j = bisect.bisect_left(seqs, k[2])
        if j < len(seqs) and seqs[j] == k[2] and j < len(ts):
            return ts[j] or UNKNOWN_T
        return UNKNOWN_T

    def issued(self, k: OpKey) -> bool:
        """This class issued collective ``k`` (it is in its ring) or a later one of its group."""
        held = self.colls.get(k[0])
        return held is not None and bool(held[0]) and held[0][-1] >= k[2]


def class_ops(c: RankClass, groups: Mapping[GroupKey, Group]) -> ClassOps:
    """A class's ops per group (for issue times) and its incomplete ops in issue order."""
    held = ClassOps()
    for (name, desc, cells), (_, ts) in zip(c.d.colls, c.d.times, strict=False):
        g = groups.get(c.gkeys.get((name, desc), ("", ())))
        if g is None:
            continue
        held.colls[g.id] = ([cell[0] for cell in cells], ts)
        # The ops after the last completed one (scanned from the newest end: few).
        j = len(cells) - 1
        while j >= 0 and cells[j][2] != DONE:
            t = ts[j] if j < len(ts) else 0
            _, sidx, st, fidx = cells[j]
            k = (g.id, False, cells[j][0])
            held.blocked.append((t or UNKNOWN_T, k, c.sig_g[sidx], c.fr_g[fidx] if fidx >= 0 else -1))
            held.states[k] = st
            j -= 1
        for i in range(max(0, j - LANE_OPS + 1), j + 1):
            _, sidx, _, fidx = cells[i]
            t = ts[i] if i < len(ts) else 0
            held.done.append((t or UNKNOWN_T, (g.id, False, cells[i][0]), c.sig_g[sidx],
                              c.fr_g[fidx] if fidx >= 0 else -1))
    ptimes = {(n, dsc): ts for n, dsc, ts in c.d.p2p_times}
    for name, desc, _done, pending in c.d.p2p:
        g = groups.get(c.gkeys.get((name, desc), ("", ())))
        if g is None:
            continue
        ts = ptimes.get((name, desc), ())
        for j, p in enumerate(pending):
            t = ts[j] if j < len(ts) else 0
            k = (g.id, True, p[0])
            held.p2p[k] = t
            held.states[k] = p[2]
            held.blocked.append((t or UNKNOWN_T, k, c.sig_g[p[1]], c.fr_g[p[3]] if p[3] >= 0 else -1))
    held.blocked.sort()
    held.done.sort()
    held.pending = {x[1] for x in held.blocked}
    return held


def stream_lanes(classes: Sequence[RankClass], groups: Mapping[GroupKey, Group],
                 ops_of: Any, sigs: Sequence[tuple[Any, ...]]) -> list[dict[str, Any]]:
    """The result's ``streams``: per rank class, its newest ops in issue order across groups.

    ``{"ranks": [...], "ops": [{"group", "label", "seq", "p2p_seq", "op", "state"}, ...],
    "executing": index of the op its device runs (the oldest started, not completed) or None,
    "queued": how many incomplete ops wait behind it}``. Identical ranks share one entry, so a
    4096-rank job with one odd rank has two.
    """
    by_id = {g.id: g for g in groups.values()}
    out = []
    for c in classes:
        ops: ClassOps = ops_of(c)
        states = ops.states
        pend = ops.blocked[:LANE_OPS]
        done = ops.done[-max(2, LANE_OPS - len(pend)):]
        lane = []
        for t, k, sig, _ in sorted(done + pend, key=lambda x: x[0]):
            g = by_id.get(k[0])
            lane.append({
                "group": k[0], "label": g.label if g is not None else k[0],
                "seq": None if k[1] else k[2], "p2p_seq": k[2] if k[1] else None,
                "op": sigs[sig][1], "state": STATES[states.get(k, DONE)],
                "time_ns": t if t != UNKNOWN_T else None,
            })
        executing = next((i for i, o in enumerate(lane) if o["state"] == "started"), None)
        queued = sum(1 for o in lane if o["state"] != "completed") - (executing is not None)
        out.append({"ranks": list(c.ranks), "ops": lane, "executing": executing,
                    "queued": max(0, queued)})
    return out
