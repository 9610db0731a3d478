"""How far each communicator got, and which ranks are behind on it.

Per rank and communicator: the last collective seq issued and completed, from ``pg_status``
(true even when only active entries were sent) and the entries themselves (completed by the
digest's rules, so PyTorch's gloo dumps count retired ops). A rank is behind on a communicator
when it issued less than the furthest member, or when a finding names it missing there. The
overview shows exactly these rows; no renderer recomputes them from dumps.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from debug_server.analysis.digest import DONE
from debug_server.analysis.groups import Group, RankClass
from debug_server.analysis.merge import Merge

__all__ = ["communicators"]


def communicators(
    m: Merge, shown: Iterable[Group]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(``communicators`` rows, ``behind`` rows) of the result.

    A row: ``name``, ``desc``, ``size``, ``last_issued`` (the furthest member's), and
    ``last_completed_max``/``_min`` over members that completed any (-1: none known), and
    ``behind_ranks``. A ``behind`` row: ``rank`` and the ``groups`` it is behind on.
    """
    progress = _per_group(m)
    groups = {g.name: g for g in shown}
    missing_in: dict[str, set[int]] = {}
    for f in m.findings:
        if f["kind"] == "missing_ranks":
            missing_in.setdefault(f["group"], set()).update(f["ranks"])
    rows = []
    behind: dict[int, list[str]] = {}
    for name in sorted(set(progress) | set(groups)):
        per = progress.get(name, [])
        top = max((i for _, (i, _) in per if i >= 0), default=-1)
        done = [d for _, (_, d) in per if d >= 0]
        late_set = set(missing_in.get(name, set()))
        for ranks, (i, _) in per:
            if 0 <= i < top:
                late_set.update(ranks)
        late = sorted(late_set)
        for r in late:
            behind.setdefault(r, []).append(name)
        g = groups.get(name)
        rows.append({
            "name": name, "desc": g.desc if g else "",
            "size": len(g.ranks) if g and g.ranks else sum(len(rs) for rs, _ in per),
            "last_issued": top, "last_completed_max": max(done, default=-1),
            "last_completed_min": min(done, default=-1), "behind_ranks": late,
        })  # fmt: skip
    return rows, [{"rank": r, "groups": sorted(gs)} for r, gs in sorted(behind.items())]


def _per_group(m: Merge) -> dict[str, list[tuple[list[int], tuple[int, int]]]]:
    """communicator name -> [(ranks, (last issued seq, last completed seq))], -1 when unknown:
    one item per set of ranks with the same class and ``pg_progress`` (``Merge``), so the cost
    is per class, not per rank."""
    from_entries = {c.idx: _class_progress(c) for c in m.class_list}
    out: dict[str, list[tuple[list[int], tuple[int, int]]]] = {}
    for pg_progress, c, ranks in m.progress_groups.values():
        per = {name: (i, d) for name, i, d in pg_progress}
        for name, (i, d) in from_entries[c.idx].items():
            pi, pd = per.get(name, (-1, -1))
            per[name] = (max(pi, i), max(pd, d))
        for name, seqs in per.items():
            out.setdefault(name, []).append((ranks, seqs))
    return out


def _class_progress(c: RankClass) -> dict[str, tuple[int, int]]:
    """Per group name: the class's newest collective seq and newest completed one."""
    out: dict[str, tuple[int, int]] = {}
    for name, _desc, ents in c.d.colls:
        issued = ents[-1][0]
        done = max((seq for seq, _, st, _ in ents if st == DONE), default=-1)
        pi, pd = out.get(name, (-1, -1))
        out[name] = (max(pi, issued), max(pd, done))
    return out
