"""Order inversions: ranks that issued two groups' collectives in opposite orders.

Each rank runs its collectives in the order it issued them, whatever the group. Op X waits for
op Y when a member of X's group has Y ahead of X (it issued Y first, or it has not issued X yet
and waits in Y). A cycle of such waits is a collective-order bug: every op of it is issued,
none can complete, and each group's ring alone looks fine (on NCCL every member "issued" every
op; on gloo each side looks missing from the other's op). This module builds that wait-for
graph over the incomplete collectives of every rank class, and each cycle becomes one
``order_inversion`` finding: ``ops`` in the order the odd ranks issued them, ``ranks`` the
ranks of the minority order(s), ``others`` the ranks of the majority order (``others_ops``);
``undecided`` when as many ranks keep each order and some rank may have skipped an op: then
``ranks`` holds both sides, ``others`` is empty, and ``sides`` says who keeps which order;
``certain`` whether every rank issued every op (else the odd ranks may have skipped the op they
have not issued: the finding's ``group``/``seq`` is that op).

Where some rank has not issued an op of the cycle (gloo: each side blocked in its first op),
it may have skipped that op rather than put it later; the cycle is an inversion only where the
ranks issued the same groups' previous ops in one order and the majority still keeps it (else
the missing-rank findings stand). Deterministic: the same dumps give the same finding (ties
between two equally large orders go to the previous step's order, then to the lowest rank's).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from debug_server.analysis.causes import sccs
from debug_server.analysis.groups import Group, RankClass
from debug_server.analysis.merge import Merge
from debug_server.analysis.ranks import ranks_phrase
from debug_server.analysis.sigcheck import user_line
from debug_server.analysis.streams import UNKNOWN_T, ClassOps, OpKey

__all__ = ["order_inversions", "ops_text"]

OpsOf = Callable[[RankClass], ClassOps]


def order_inversions(m: Merge, ops_of: OpsOf) -> None:
    """Add one ``order_inversion`` finding per cycle of collective waits across groups."""
    by_id = {g.id: g for g in m.groups.values()}
    pend: dict[int, list[OpKey]] = {}
    for c in m.class_list:
        pend[c.idx] = [k for _, k, _, _ in ops_of(c).blocked if not k[1]]
    nodes = sorted({k for ks in pend.values() for k in ks})
    if len({k[0] for k in nodes}) < 2:
        return
    index = {k: i for i, k in enumerate(nodes)}
    adj: list[set[int]] = [set() for _ in nodes]
    for c in m.class_list:
        ops, ks = ops_of(c), pend[c.idx]
        for x in nodes:
            g = by_id.get(x[0])
            if g is None or not any(r in g.rank_set for r in c.ranks):
                continue
            ahead = ks[:ks.index(x)] if x in ks else ([] if ops.issued(x) else ks)
            adj[index[x]].update(index[y] for y in ahead if y[0] != x[0])
    comp = sccs([sorted(a) for a in adj])
    cycles: dict[int, list[OpKey]] = {}
    for i, k in enumerate(nodes):
        cycles.setdefault(comp[i], []).append(k)
    for ks in cycles.values():
        if len({k[0] for k in ks}) >= 2:
            _finding(m, by_id, ops_of, ks)


def _order(c: RankClass, ops: ClassOps, cycle: Sequence[OpKey], by_id: Mapping[str, Group]
           ) -> tuple[OpKey, ...]:
    """The cycle's ops in the order this class issued them (those of its groups only): issued
    ones by issue time, then the ones it has not issued yet (they come after, in any order).
    Only a class in two or more of the cycle's groups has an order that can differ."""
    mine = [k for k in cycle if (g := by_id.get(k[0])) is not None
            and any(r in g.rank_set for r in c.ranks)]
    issued = sorted((k for k in mine if ops.time(k) != UNKNOWN_T), key=ops.time)
    return tuple(issued) + tuple(sorted(k for k in mine if k not in issued))


def _previous_order(m: Merge, ops_of: OpsOf, cycle: Sequence[OpKey]) -> tuple[OpKey, ...] | None:
    """The order the ranks issued each op's predecessor in (seq - 1 of the same group), where
    every class that holds all of them agrees; None when unknown or disputed."""
    seen: set[tuple[OpKey, ...]] = set()
    for c in m.class_list:
        ops = ops_of(c)
        prev = [(k[0], False, k[2] - 1) for k in cycle]
        ts = [ops.time(p) for p in prev]
        if any(t == UNKNOWN_T for t in ts):
            continue
        seen.add(tuple(k for _, k in sorted(zip(ts, cycle, strict=True))))
    return next(iter(seen)) if len(seen) == 1 else None


Pair = tuple[OpKey, OpKey]
Order = tuple[OpKey, ...]


def _pairs(o: Sequence[OpKey], issued: frozenset[OpKey]) -> set[Pair]:
    """What an order says: X before Y for every issued X and each op after it."""
    return {(x, y) for i, x in enumerate(o) if x in issued for y in o[i + 1:]}


def _finding(m: Merge, by_id: Mapping[str, Group], ops_of: OpsOf, cycle: list[OpKey]) -> None:
    orders: dict[Order, list[RankClass]] = {}
    issued: dict[Order, frozenset[OpKey]] = {}
    for c in m.class_list:
        ops = ops_of(c)
        o = _order(c, ops, cycle, by_id)
        if len({k[0] for k in o}) >= 2 and ops.time(o[0]) != UNKNOWN_T:
            orders.setdefault(o, []).append(c)
            issued[o] = frozenset(k for k in o if ops.time(k) != UNKNOWN_T)
    if len(orders) < 2:
        return
    pairs = {o: _pairs(o, issued[o]) for o in orders}
    certain = all(len(issued[o]) == len(o) for o in orders)
    usual = _previous_order(m, ops_of, cycle)
    usual_pairs = _pairs(usual, frozenset(usual)) if usual is not None else set()
    usual_side, undecided = _usual_side(orders, pairs, issued, usual_pairs, certain, ops_of)
    if undecided and usual is None:
        return  # no order to depart from (a group's first op): the missing-rank findings stand
    ref: set[Pair] = set().union(*(pairs[o] for o in usual_side))
    if not (certain or undecided) and (usual is None or any((y, x) in usual_pairs for x, y in ref)):
        # A rank that has not issued an op of the cycle may have skipped it rather than put it
        # later: only the order the ranks kept at the previous step tells an inversion apart.
        return
    odd = [o for o in orders if o not in usual_side]
    if not odd:
        return
    minor = min(odd, key=lambda o: (-sum(len(c.ranks) for c in orders[o]),
                                    min(r for c in orders[o] for r in c.ranks)))
    ranks = sorted(r for o in odd for c in orders[o] for r in c.ranks)
    others = sorted(r for o in usual_side for c in orders[o] for r in c.ranks)
    sides = [{"ranks": ranks}, {"ranks": others}]
    if undecided:  # as many ranks each way: both sides are named, neither is blamed
        ranks, others = sorted(ranks + others), []
    ref_order = sorted(cycle, key=lambda k: (-sum(1 for x, _ in ref if x == k), k))
    ops = _ops(m, ops_of, orders[minor], minor, by_id)
    others_ops = _ops(m, ops_of, [c for o in usual_side for c in orders[o]], ref_order, by_id)
    # The finding's own op: where the odd ranks' order first departs from the others'. When
    # they have not issued an op the others wait in, that op (they may have skipped it);
    # else the op their streams run first.
    lead = next((o for o in ops if not o["issued"]), ops[0])
    g = by_id[lead["group"]]
    m.finding(
        "order_inversion", g, lead["seq"], lead["op"], ranks,
        f"{ranks_phrase(ranks).capitalize()} issued {ops_text(ops)}; {ranks_phrase(others)} "
        f"issued {ops_text(others_ops)}",
        others=others, ops=ops, others_ops=others_ops, certain=certain,
        undecided=undecided, sides=sides,
    )


_EXACT_LIMIT = 12
"""Distinct orders up to which every set of them is tried (beyond, greedily)."""


def _usual_side(orders: Mapping[Order, list[RankClass]], pairs: Mapping[Order, set[Pair]],
                issued: Mapping[Order, frozenset[OpKey]], usual_pairs: set[Pair], certain: bool,
                ops_of: OpsOf) -> tuple[list[Order], bool]:
    """The orders most ranks keep: the set of orders that contradict none of each other with
    the most ranks (ranks in fewer of the cycle's groups agree with every order they do not
    contradict). Between equally large sets: the one whose ranks issued every op of their
    order (the other may have skipped one), then the one that keeps the previous step's order,
    then the one whose first op was issued first, then the lowest rank's. Where a rank may have
    skipped an op and two sets tie on size and on that, the first with ``True`` (undecided: no
    evidence of which side is odd)."""
    keys = list(orders)
    n = len(keys)
    clash = [[any((y, x) in pairs[b] for x, y in pairs[a]) for b in keys] for a in keys]
    size = [sum(len(c.ranks) for c in orders[k]) for k in keys]
    first = [min(ops_of(c).time(k[0]) for c in orders[k]) for k in keys]
    low = [min(r for c in orders[k] for r in c.ranks) for k in keys]
    if n <= _EXACT_LIMIT:
        sets = [[i for i in range(n) if mask >> i & 1] for mask in range(1, 1 << n)]
        sets = [s for s in sets if not any(clash[i][j] for i in s for j in s)]
    else:  # many distinct orders: greedily, the largest first
        chosen: list[int] = []
        for i in sorted(range(n), key=lambda i: -size[i]):
            if not any(clash[i][j] for j in chosen):
                chosen.append(i)
        sets = [chosen]

    def key(s: list[int]) -> tuple[int, int, int, int, int]:
        against = any((y, x) in usual_pairs for i in s for x, y in pairs[keys[i]])
        partial = any(len(issued[keys[i]]) < len(keys[i]) for i in s)
        return (-sum(size[i] for i in s), 1 if partial else 0, 1 if against else 0,
                min(first[i] for i in s), min(low[i] for i in s))

    sets.sort(key=key)
    undecided = not certain and len(sets) > 1 and key(sets[0])[:2] == key(sets[1])[:2]
    return [keys[i] for i in sets[0]], undecided


def _ops(m: Merge, ops_of: OpsOf, cs: Sequence[RankClass], order: Sequence[OpKey],
         by_id: Mapping[str, Group]) -> list[dict[str, Any]]:
    """One side's ops as the finding lists them: group, label, seq, op, whether that side
    issued it, the user's line (from the first of ``cs`` that issued it)."""
    info: dict[OpKey, tuple[int, int]] = {}
    for c in cs:
        for _, k, sig, fr in ops_of(c).blocked:
            info.setdefault(k, (sig, fr))
    out = []
    for k in order:
        sig, fr = info.get(k, (-1, -1))
        g = by_id.get(k[0])
        out.append({
            "group": k[0], "group_label": g.label if g is not None else k[0], "seq": k[2],
            "op": m.sigs[sig][1] if sig >= 0 else _op_name(m, k),
            "issued": k in info,
            "line": user_line(m.frames[fr]) if fr >= 0 and m.frames[fr] else None,
        })
    return out


def _op_name(m: Merge, k: OpKey) -> str:
    """The op's name from any collective row of that group and seq (a side that never issued
    it has no signature of its own)."""
    row = next((c for c in m.collectives if c["group"] == k[0] and c["seq"] == k[2]), None)
    return str(row["op"]) if row is not None else "collective"


def _op_label(o: Mapping[str, Any]) -> str:
    return f"{o['op']} #{o['seq']} on {o['group_label']}"


def ops_text(ops: Sequence[Mapping[str, Any]]) -> str:
    """``all_reduce #4 on metrics (train.py:52) before all_reduce #4 on grad_sync (not issued
    yet)``: one side's order, as the verdict says it."""
    parts = []
    for o in ops:
        where = f" ({o['line']})" if o.get("line") else ""
        if not o.get("issued", True):
            where = " (not issued yet)"
        parts.append(_op_label(o) + where)
    return " before ".join(parts)
