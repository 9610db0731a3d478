"""Cause before consequence, across groups: which error findings explain which.

A rank's collectives run in issue order on its stream(s) whatever the communicator, so an op a
peer never joined blocks everything that rank issued after it, on every group. Over the error
findings this module builds a graph, ``F -> F'`` meaning "F is explained by F'":

* a **stuck_everywhere** at op (G, s) is explained by the finding of any op that a member issued
  before (G, s) and has not completed (its stream is blocked behind that op), and by a mismatch
  at (G, s) itself;
* a **missing_ranks** or **unmatched_p2p** finding is explained by the finding of the op each
  missing rank is blocked in (its earliest incomplete op that some finding covers), unless that
  rank's stack shows it outside any collective (it is away on the CPU) or the ranks that issued
  the finding's op issued that op after it (the rank went past the finding's op: it skipped
  it); either way the rank's absence is the finding's own cause;
* a mismatch is explained by nothing: the calls disagree whatever else happens.

The roots are the findings of sink strongly connected components (no edge leaves them); within
one, a mismatch leads, then a missing rank or peer, then stuck_everywhere, then the op issued
first. Every other finding is a consequence and is listed after the root it leads to.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from debug_server.analysis.groups import Group, GroupKey, RankClass
from debug_server.analysis.merge import MISMATCH_KINDS, Merge
from debug_server.analysis.sigcheck import user_line
from debug_server.analysis.stackparse import Position
from debug_server.analysis.streams import UNKNOWN_T, ClassOps, OpKey

__all__ = ["Causes", "Edge", "cause_order", "sccs"]

Finding = dict[str, Any]

_WALK_LIMIT = 10_000  # ops visited per finding when explaining through ops without findings


def _preference(f: Mapping[str, Any]) -> int:
    """Which finding of a cycle leads: the disagreement, then who is absent, then the stuck op."""
    if f["kind"] in MISMATCH_KINDS:
        return 0
    if f["kind"] in ("missing_ranks", "unmatched_p2p"):
        return 1
    return 2


class Edge(NamedTuple):
    """``cause`` explains a finding through ``rank``, whose op ``op`` (``op_name``) is the one
    covered by ``cause``; rank and op are None for a mismatch at the finding's own op."""

    cause: Finding
    rank: int | None
    op: OpKey | None
    op_name: str | None


class Causes:
    """The explained-by graph over ``m``'s error findings, and what it needs of each rank."""

    def __init__(self, m: Merge, groups: Mapping[GroupKey, Group], positions: Mapping[int, Position]) -> None:
        self.m, self.groups, self.positions = m, groups, positions
        self.by_id = {g.id: g for g in groups.values()}
        self.errors = [f for f in m.findings if f["severity"] == "error"]
        self.owner: dict[OpKey, Finding] = {}
        self.inversions = [f for f in self.errors if f["kind"] == "order_inversion"]
        for f in self.errors:
            if f["seq"] is None or f["kind"] == "order_inversion":
                continue
            k = (f["group"], False, f["seq"])
            held = self.owner.get(k)
            if held is None or _preference(f) < _preference(held):
                self.owner[k] = f
        self.p2p_owner: dict[tuple[str, int, int], Finding] = {}
        for f in self.errors:
            for u in f.get("unmatched") or ():
                self.p2p_owner[(f["group"], u["rank"], u["p2p_seq"])] = f

    def _ops(self, c: RankClass) -> ClassOps:
        """A class's ops per group (for issue times) and its incomplete ops in issue order."""
        return self.m.ops(c)

    def _finding_of(self, rank: int, k: OpKey) -> Finding | None:
        """The finding about op ``k`` of ``rank`` itself, if any."""
        if k[1]:
            return self.p2p_owner.get((k[0], rank, k[2]))
        return self.owner.get(k)

    def _blockers(self, r: int, k: OpKey, t_k: int, seen: set[tuple[int, OpKey]]) -> list[Edge]:
        """What keeps op ``k`` (issued by ``r`` at ``t_k``) from completing: the findings of the
        earlier incomplete ops of the ranks that issued it, through ops without a finding of
        their own (a group is reported once, where it stops; its earlier ops wait with it)."""
        out: list[Edge] = []
        for rank in self._issuers(r, k):
            c = self.m.class_of.get(rank)
            if c is None:
                continue
            ops = self._ops(c)
            t_mine = ops.time(k) if rank != r else t_k
            if t_mine == UNKNOWN_T:
                continue
            for t, y, sig, _ in ops.blocked:
                if t >= t_mine:
                    break
                out.extend(self._covering(rank, y, t, sig, seen))
        return out

    def _covering(self, rank: int, y: OpKey, t: int, sig: int,
                  seen: set[tuple[int, OpKey]]) -> list[Edge]:
        """The findings that cover op ``y`` of ``rank``: its own, else what blocks it."""
        fy = self._finding_of(rank, y)
        if fy is not None:
            return [Edge(fy, rank, y, self.m.sigs[sig][1])]
        if (rank, y) in seen or len(seen) > _WALK_LIMIT:
            return []
        seen.add((rank, y))
        return self._blockers(rank, y, t, seen)

    def _issuers(self, r: int, k: OpKey) -> list[int]:
        """Ranks (one per class) that have op ``k`` pending: ``r`` for a P2P op."""
        if k[1]:
            return [r]
        g = self.by_id.get(k[0])
        if g is None:
            return [r]
        out = []
        for c in self.m.class_list:
            if k in self._ops(c).pending:
                rank = next((x for x in c.ranks if x in g.rank_set), None)
                if rank is not None:
                    out.append(rank)
        return out

    def op_time(self, f: Mapping[str, Any]) -> int:
        """When the finding's op was first issued (the earliest issuing rank), or a large value."""
        best = UNKNOWN_T
        if f["kind"] == "unmatched_p2p":
            for u in f.get("unmatched") or ():
                c = self.m.class_of.get(u["rank"])
                if c is not None:
                    best = min(best, self._ops(c).time((f["group"], True, u["p2p_seq"])))
            return best
        k = (f["group"], False, f["seq"])
        for c in self.m.class_list:
            best = min(best, self._ops(c).time(k))
        return best

    def edges(self, f: Finding) -> list[Edge]:
        """The findings that explain ``f`` (none for a root), each with the rank through which
        it does and that rank's op (None: the same op)."""
        out: list[Edge] = []
        seen: set[tuple[int, OpKey]] = set()
        if f["kind"] != "order_inversion" and f["seq"] is not None:
            out.extend(self._inverted(f))
        if f["kind"] == "stuck_everywhere":
            k = (f["group"], False, f["seq"])
            same = self.owner.get(k)
            if same is not None and same is not f:
                out.append(Edge(same, None, None, None))
            r0 = next((r for r in f["ranks"] if r in self.m.class_of), None)
            if r0 is not None:
                out.extend(self._blockers(r0, k, self._ops(self.m.class_of[r0]).time(k), seen))
        elif f["kind"] in ("missing_ranks", "unmatched_p2p"):
            for r in f["ranks"]:
                pos = self.positions.get(r)
                c = self.m.class_of.get(r)
                if c is None or (pos is not None and not pos.in_collective):
                    continue
                # The op it is blocked in: its oldest pending op that some finding covers;
                # unless the ranks that issued f's op issued that one after it: then the rank
                # went past f's op (skipped it), and its absence is its own doing.
                for t, x, sig, _ in self._ops(c).blocked:
                    cover = self._covering(r, x, t, sig, seen)
                    if cover:
                        if not self._went_past(f, x):
                            out.extend(cover)
                        break
        return [e for e in out if e.cause is not f]

    def _inverted(self, f: Finding) -> list[Edge]:
        """The order inversion whose cycle holds ``f``'s op: the minority's first op is held up
        by the majority ranks waiting in theirs, every other op of the cycle by the minority
        ranks waiting in their first op."""
        x = (f["group"], f["seq"])
        out = []
        for inv in self.inversions:
            odd, usual = inv["ops"], inv["others_ops"]
            if not any((o["group"], o["seq"]) == x for o in odd + usual):
                continue
            odd_ranks, usual_ranks = (side["ranks"] for side in inv["sides"])
            if (odd[0]["group"], odd[0]["seq"]) == x:
                o, ranks = usual[0], usual_ranks
            else:
                o, ranks = odd[0], odd_ranks
            g = self.by_id.get(f["group"])
            r = next((r for r in ranks if g is None or r in g.rank_set), ranks[0])
            out.append(Edge(inv, r, (o["group"], False, o["seq"]), o["op"]))
        return out

    def _went_past(self, f: Mapping[str, Any], y: OpKey) -> bool:
        """Some rank that issued ``f``'s op issued collective ``y`` after it: in program order
        ``y`` comes after ``f``'s op, so a rank blocked in ``y`` skipped ``f``'s op."""
        if y[1]:
            return False  # P2P numbers are per rank: no common order to compare
        if f["kind"] == "unmatched_p2p":
            sides = [(self.m.class_of.get(u["rank"]), (f["group"], True, u["p2p_seq"]))
                     for u in f.get("unmatched") or ()]
        else:
            k = (f["group"], False, f["seq"])
            sides = [(c, k) for c in self.m.class_list]
        for c, x in sides:
            if c is None:
                continue
            ops = self._ops(c)
            t_x, t_y = ops.time(x), ops.time(y)
            if t_x != UNKNOWN_T and t_y != UNKNOWN_T and t_y > t_x:
                return True
        return False

    def blocked_in(self, r: int, f: Mapping[str, Any]) -> tuple[str, str | None] | None:
        """Rank ``r``'s oldest incomplete op other than ``f``'s: (``barrier #3 on pg 0
        (default_pg)``, its user line or None); None when the FR shows none."""
        c = self.m.class_of.get(r)
        if c is None:
            return None
        for _, (gid, p2p, seq), sig, fr in self._ops(c).blocked:
            if gid == f["group"] and ((p2p and seq == f.get("p2p_seq")) or (not p2p and seq == f["seq"])):
                continue
            g = self.by_id.get(gid)
            label = g.label if g is not None else gid
            op = self.m.sigs[sig][1]
            what = f"{op} p2p #{seq} on {label}" if p2p else f"{op} #{seq} on {label}"
            return what, (user_line(self.m.frames[fr]) if fr >= 0 and self.m.frames[fr] else None)
        return None


def cause_order(causes: Causes) -> tuple[list[Finding], list[Finding]]:
    """(roots, every error finding root first with its consequences after it)."""
    errors = causes.errors
    n = len(errors)
    index = {id(f): i for i, f in enumerate(errors)}
    adj = [sorted({index[id(e.cause)] for e in causes.edges(f)}) for f in errors]
    comp = sccs(adj)
    n_comp = max(comp, default=-1) + 1
    leaves = [False] * n_comp
    sink = [True] * n_comp
    for i in range(n):
        leaves[comp[i]] = True
        if any(comp[j] != comp[i] for j in adj[i]):
            sink[comp[i]] = False
    times = [causes.op_time(f) for f in errors]
    # Within a cycle (ranks blocked in each other's ops), the finding that explains the most
    # others of its cycle leads: the skipped op everyone else ends up behind.
    explains = [0] * n
    for i, js in enumerate(adj):
        for j in js:
            if comp[j] == comp[i] and j != i:
                explains[j] += 1

    def key(i: int) -> tuple[int, int, int, int]:
        return (_preference(errors[i]), -explains[i], times[i], i)

    members: dict[int, list[int]] = {}
    for i in range(n):
        members.setdefault(comp[i], []).append(i)
    roots = sorted((min(members[c], key=key) for c in range(n_comp) if leaves[c] and sink[c]), key=key)
    radj: list[list[int]] = [[] for _ in range(n)]
    for i, js in enumerate(adj):
        for j in js:
            radj[j].append(i)
    seen: set[int] = set()
    ordered: list[int] = []
    for r in roots:
        # The root, then what it explains (directly or through other consequences), in order.
        seen.add(r)
        ordered.append(r)
        reach: list[int] = []
        stack = list(radj[r]) + [i for i in members[comp[r]] if i != r]
        while stack:
            i = stack.pop()
            if i in seen:
                continue
            seen.add(i)
            reach.append(i)
            stack.extend(radj[i])
        ordered.extend(sorted(reach, key=key))
    ordered.extend(sorted((i for i in range(n) if i not in seen), key=key))
    return [errors[i] for i in roots], [errors[i] for i in ordered]


def sccs(adj: list[list[int]]) -> list[int]:
    """Tarjan's strongly connected components, iteratively; the component id per node."""
    n = len(adj)
    index = [-1] * n
    low = [0] * n
    on_stack = [False] * n
    comp = [-1] * n
    stack: list[int] = []
    counter = 0
    n_comp = 0
    for start in range(n):
        if index[start] >= 0:
            continue
        work = [(start, 0)]
        while work:
            v, pi = work.pop()
            if pi == 0:
                index[v] = low[v] = counter
                counter += 1
                stack.append(v)
                on_stack[v] = True
            recurse = False
            for k in range(pi, len(adj[v])):
                w = adj[v][k]
                if index[w] < 0:
                    work.append((v, k + 1))
                    work.append((w, 0))
                    recurse = True
                    break
                if on_stack[w]:
                    low[v] = min(low[v], index[w])
            if recurse:
                continue
            if low[v] == index[v]:
                while True:
                    w = stack.pop()
                    on_stack[w] = False
                    comp[w] = n_comp
                    if w == v:
                        break
                n_comp += 1
            if work:
                u = work[-1][0]
                low[u] = min(low[u], low[v])
    return comp
