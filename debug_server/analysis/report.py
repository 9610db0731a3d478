"""Plain-text renderers of an analysis result (tables via tabulate).

Renderers format, they never analyse: everything shown here is already in the result dict of
:func:`debug_server.analysis.core.analyze`. The same text goes to the CLI, to ``curl`` on the rank-0
frontend and into ``torchcomms_fr_trace_<ts>.txt``; the ``*_table`` helpers return
``(headers, rows)`` so the HTML renderer can build its own tables from the same data.

Output stays bounded at any scale: fully passing collectives beyond the newest
:data:`PASSING_ROWS_SHOWN` are elided (every failing row is kept), and NCCL calls are shown for
failing collectives first, up to :data:`NCCL_ROWS_SHOWN` rows.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from tabulate import tabulate

from debug_server.analysis.ranks import format_ranks
from debug_server.analysis.verdict import category_line

logger = logging.getLogger(__name__)

PASSING_ROWS_SHOWN = 50
NCCL_ROWS_SHOWN = 200
_SMALL_SET = 16

COLLECTIVE_HEADERS = [
    "id",
    "group_id",
    "pass_check",
    "collective_seq_id",
    "p2p_seq_id",
    "collective_name",
    "collective_state",
    "missing_ranks",
    "expected_ranks",
    "input_sizes",
    "output_sizes",
    "mismatch",
]
NCCL_HEADERS = ["id", "collective_id", "group_id", "global_rank", "collective_type", "state"]


def format_rank_set(ranks: Iterable[int]) -> str:
    """Ranks as a Python set literal (``{1}``, ``{0, 1}``); blank when empty.

    Beyond 16 ranks consecutive runs collapse (``{0-62, 64-127}``) so a 4096-rank row stays short.
    """
    rs = sorted(set(ranks))
    if not rs:
        return ""
    if len(rs) <= _SMALL_SET:
        return "{" + ", ".join(map(str, rs)) + "}"
    return "{" + format_ranks(rs) + "}"


def _selected_collectives(result: dict[str, Any]) -> tuple[list[dict[str, Any]], int]:
    rows = result.get("collectives", [])
    passing = [i for i, c in enumerate(rows) if c.get("pass_check")]
    keep_passing = set(passing[-PASSING_ROWS_SHOWN:])
    shown = [c for i, c in enumerate(rows) if not c.get("pass_check") or i in keep_passing]
    return shown, len(rows) - len(shown)


def _labels(result: dict[str, Any]) -> dict[str, str]:
    """Group id -> the name a person reads (``mesh_tp [2, 3]``); the id where there is none."""
    return {g.get("id", g["name"]): g.get("label") or g.get("id", g["name"])
            for g in result.get("groups", [])}


def collectives_table(result: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """Headers and rows of the Collectives table (elided to failing + newest passing rows).

    The group column shows each group as the user named it (the id is in the JSON)."""
    shown, _ = _selected_collectives(result)
    labels = _labels(result)
    rows = [
        [
            c["id"],
            labels.get(c["group"], c["group"]),
            c["pass_check"],
            "" if c.get("seq") is None else c["seq"],
            "" if c.get("p2p_seq") is None else c["p2p_seq"],
            c["profiling_name"],
            c["state"],
            format_rank_set(c.get("missing_ranks", ())),
            format_rank_set(c.get("expected_ranks", ())),
            c.get("input_sizes"),
            c.get("output_sizes"),
            c.get("mismatch") or "",
        ]
        for c in shown
    ]
    return list(COLLECTIVE_HEADERS), rows


def nccl_calls_table(result: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """Headers and rows of the NCCL Calls table (failing collectives' calls first, bounded)."""
    calls = result.get("nccl_calls", [])
    failing = {c["id"] for c in result.get("collectives", []) if not c.get("pass_check")}
    first = [c for c in calls if c["collective_id"] in failing]
    rest = [c for c in calls if c["collective_id"] not in failing]
    chosen = first[:NCCL_ROWS_SHOWN]
    if len(chosen) < NCCL_ROWS_SHOWN:
        chosen += rest[-(NCCL_ROWS_SHOWN - len(chosen)) :]
    chosen.sort(key=lambda c: c["id"])
    labels = _labels(result)
    rows = [
        [
            c["id"],
            c["collective_id"],
            labels.get(c["group"], c["group"]),
            c["global_rank"],
            c["collective_type"],
            c["state"],
        ]
        for c in chosen
    ]
    return list(NCCL_HEADERS), rows


def findings_lines(result: dict[str, Any]) -> list[str]:
    """One line per finding: ``[kind] group #seq op ranks {..}: detail``."""
    out = []
    for f in result.get("findings", []):
        seq = f"#{f['seq']}" if f.get("seq") is not None else ""
        if f.get("p2p_seq") is not None and f.get("seq") is None:
            seq = f"p2p #{f['p2p_seq']}"
        op = f.get("op") or ""
        group = f.get("group_label") or f.get("group") or ""
        head = " ".join(x for x in (f"[{f['kind']}]", group, seq, op) if x)
        out.append(
            f"{head} ranks {format_rank_set(f.get('ranks', ())) or '{}'}: {f.get('detail', '')}"
        )
    return out


def groups_table(result: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """Headers and rows of the Groups table."""
    rows = [
        [g.get("id", g["name"]), g.get("desc", ""), len(g["ranks"]), format_rank_set(g["ranks"]),
         "inferred" if g.get("inferred") else "", g.get("label", "")]
        for g in result.get("groups", [])
    ]  # fmt: skip
    return ["group_id", "desc", "size", "ranks", "note", "shown as"], rows


def stack_groups_lines(result: dict[str, Any]) -> list[str]:
    """One line per group of ranks with the same main-thread position, odd ones first."""
    return [
        f"ranks {format_rank_set(g['ranks'])}: {g['summary']}"
        + ("" if g.get("in_collective") else "  (not in a collective)")
        for g in result.get("stack_groups", [])
    ]


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    if not rows:
        return "(none)"
    return tabulate(rows, headers=headers, tablefmt="plain", disable_numparse=True)


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
        for u in result.get("unavailable", []):
            out.append(f"rank {u['rank']}: {u['reason']}")
        out.append("")
    sg = stack_groups_lines(result)
    if sg:
        out.append("--- Stacks ---")
        out.extend(sg)
        out.append("")
    out.append("--- Groups ---")
    out.append(_table(*groups_table(result)))
    out.append("")
    out.append("--- Collectives ---")
    headers, rows = collectives_table(result)
    _, elided = _selected_collectives(result)
    out.append(_table(headers, rows))
    if elided:
        out.append(f"... {elided} fully passing collectives elided (all in the JSON output)")
    out.append("")
    out.append("--- NCCL Calls ---")
    headers, rows = nccl_calls_table(result)
    out.append(_table(headers, rows))
    total_calls = len(result.get("nccl_calls", [])) + int(result.get("nccl_calls_elided", 0) or 0)
    if total_calls > len(rows):
        out.append(f"... {total_calls - len(rows)} calls not shown")
    notes = result.get("notes") or []
    if notes:
        out.append("")
        out.append("--- Notes ---")
        out.extend(notes[:50])
        if len(notes) > 50:
            out.append(f"... {len(notes) - 50} more notes")
    return "\n".join(out) + "\n"
