"""The plain-text renderer of an analysis result (tables via tabulate).

Renderers format, they never analyse: everything shown here is already in the result dict of
:func:`debug_server.analysis.core.analyze`. The same text goes to the CLI, to ``curl`` on the rank-0
frontend and into ``torchcomms_fr_trace_<ts>.txt``. Its tables and finding lines are
``tables``' models, which the HTML page draws too; output stays bounded as they are.
"""

from __future__ import annotations

import logging
from typing import Any

from tabulate import tabulate

from debug_server.analysis.ranks import format_rank_set, format_ranks
from debug_server.analysis.tables import (
    TableModel,
    collectives_table,
    findings_lines,
    groups_table,
    nccl_calls_table,
)
from debug_server.analysis.verdict import category_line

logger = logging.getLogger(__name__)


def stack_groups_lines(result: dict[str, Any]) -> list[str]:
    """One line per group of ranks with the same main-thread position, odd ones first."""
    return [
        f"ranks {format_rank_set(g['ranks'])}: {g['summary']}"
        + ("" if g.get("in_collective") else "  (not in a collective)")
        for g in result.get("stack_groups", [])
    ]


def _table(t: TableModel) -> str:
    if not t.rows:
        return "(none)"
    return tabulate(t.rows, headers=t.headers, tablefmt="plain", disable_numparse=True)


_LIST_EACH = 32
"""Up to this many ranks without data are listed one a line; above, one line per reason."""


def _without_data_lines(unavailable: list[dict[str, Any]]) -> list[str]:
    """``rank 3: <reason>`` each; above ``_LIST_EACH`` ranks, ranks with the same reason (but
    for their own rank number in it) share a line: ``ranks 100-199: unreachable after 2.0 s``."""
    if len(unavailable) <= _LIST_EACH:
        return [f"rank {u['rank']}: {u['reason']}" for u in unavailable]
    groups: dict[str, list[int]] = {}
    for u in unavailable:
        rank, reason = u["rank"], str(u["reason"])
        head = f"rank {rank}: "
        while reason.startswith(head):
            reason = reason[len(head):]
        groups.setdefault(reason, []).append(rank)
    lines = [f"{'rank' if len(rs) == 1 else 'ranks'} {format_ranks(rs)}: {reason}"
             for reason, rs in list(groups.items())[:200]]
    if len(groups) > 200:
        lines.append(f"... {len(groups) - 200} more reasons (all in the JSON output)")
    return lines


def fr_trace_text(result: dict[str, Any]) -> str:
    """The whole plain-text report: verdict, findings, groups, collectives, NCCL calls."""
    out: list[str] = ["=== Verdict ===", result.get("verdict", "")]
    if result.get("category"):
        out.append(category_line(result))
    out.append("")
    out.append("--- Findings ---")
    out.extend(findings_lines(result) or ["none"])
    out.append("")
    if result.get("ranks_without_data"):
        out.append("--- Ranks without data ---")
        out.extend(_without_data_lines(result.get("unavailable", [])))
        out.append("")
    sg = stack_groups_lines(result)
    if sg:
        out.append("--- Stacks ---")
        out.extend(sg)
        out.append("")
    out.append("--- Groups ---")
    out.append(_table(groups_table(result)))
    out.append("")
    out.append("--- Collectives ---")
    coll = collectives_table(result)
    elided = coll.total - len(coll.rows)
    out.append(_table(coll))
    if elided:
        out.append(f"... {elided} fully passing collectives elided (all in the JSON output)")
    out.append("")
    out.append("--- NCCL Calls ---")
    calls = nccl_calls_table(result)
    out.append(_table(calls))
    total_calls = calls.total + int(result.get("nccl_calls_elided", 0) or 0)
    if total_calls > len(calls.rows):
        out.append(f"... {total_calls - len(calls.rows)} calls not shown")
    notes = result.get("notes") or []
    if notes:
        out.append("")
        out.append("--- Notes ---")
        out.extend(notes[:50])
        if len(notes) > 50:
            out.append(f"... {len(notes) - 50} more notes")
    return "\n".join(out) + "\n"
