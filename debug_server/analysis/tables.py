"""The report's tables and finding lines, made once from an analysis result.

The text report (``report``: tabulate) and the live page (``frontend/render.py``: escaped HTML)
show the same tables: these functions choose their rows and columns, both renderers only draw
them. A :class:`TableModel`'s cells are what the text shows; beside them it says what the HTML
adds: which rows fail (``marks``) and which cell is a set of ranks the page links to their
stacks (``rank_column``, ``rank_sets``).

Bounded at any scale: fully passing collectives beyond the newest :data:`PASSING_ROWS_SHOWN`
are elided (every failing row is kept), and NCCL calls are shown for failing collectives first,
up to :data:`NCCL_ROWS_SHOWN` rows. A caller that pages through every row hands its page of
rows in (``chosen``) and gets them all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from debug_server.analysis.ranks import format_rank_set

__all__ = ["COLLECTIVE_HEADERS", "GROUP_HEADERS", "NCCL_HEADERS", "NCCL_ROWS_SHOWN",
           "PASSING_ROWS_SHOWN", "TableModel", "collectives_table", "findings_lines",
           "groups_table", "nccl_calls_table", "selected_collectives", "selected_calls"]

PASSING_ROWS_SHOWN = 50
NCCL_ROWS_SHOWN = 200

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
GROUP_HEADERS = ["group_id", "desc", "size", "ranks", "note", "shown as"]

Item = Mapping[str, Any]


@dataclass(slots=True)
class TableModel:
    """One table: its columns and rows, and what a page marks on them."""

    headers: list[str]
    rows: list[list[Any]]
    """Cells as the text report prints them."""
    marks: list[str]
    """Per row: ``"mismatch"`` (the calls disagree), ``"fail"`` (a failing collective or one of
    its calls) or ``""``."""
    total: int = 0
    """Items of this kind in the result (``len(result[key])``): more than the rows where elided."""
    rank_column: int | None = None
    """The column whose cells are sets of ranks (missing ranks), where there is one."""
    rank_sets: list[list[int]] = field(default_factory=list)
    """Per row, that column's ranks (empty: a blank cell)."""


def selected_collectives(result: Item) -> list[Item]:
    """Every failing collective and the newest :data:`PASSING_ROWS_SHOWN` passing ones."""
    rows = result.get("collectives", [])
    passing = [i for i, c in enumerate(rows) if c.get("pass_check")]
    keep_passing = set(passing[-PASSING_ROWS_SHOWN:])
    return [c for i, c in enumerate(rows) if not c.get("pass_check") or i in keep_passing]


def selected_calls(result: Item) -> list[Item]:
    """The calls of failing collectives first, then the newest, :data:`NCCL_ROWS_SHOWN` in all,
    in id order."""
    calls = result.get("nccl_calls", [])
    failing = _failing(result)
    first = [c for c in calls if c["collective_id"] in failing]
    rest = [c for c in calls if c["collective_id"] not in failing]
    chosen = first[:NCCL_ROWS_SHOWN]
    if len(chosen) < NCCL_ROWS_SHOWN:
        chosen += rest[-(NCCL_ROWS_SHOWN - len(chosen)) :]
    chosen.sort(key=lambda c: c["id"])
    return chosen


def _failing(result: Item) -> set[int]:
    return {c["id"] for c in result.get("collectives", []) if not c.get("pass_check")}


def _labels(result: Item) -> dict[str, str]:
    """Group id -> the name a person reads (``mesh_tp [2, 3]``); the id where there is none."""
    return {g.get("id", g["name"]): g.get("label") or g.get("id", g["name"])
            for g in result.get("groups", [])}


def _mark(c: Item) -> str:
    if c.get("mismatch"):
        return "mismatch"
    return "" if c.get("pass_check", True) else "fail"


def collectives_table(result: Item, chosen: Sequence[Item] | None = None) -> TableModel:
    """The Collectives table: ``chosen`` rows (default: :func:`selected_collectives`).

    The group column shows each group as the user named it (the id is in the JSON)."""
    shown = selected_collectives(result) if chosen is None else chosen
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
    return TableModel(list(COLLECTIVE_HEADERS), rows, [_mark(c) for c in shown],
                      len(result.get("collectives", [])),
                      COLLECTIVE_HEADERS.index("missing_ranks"),
                      [list(c.get("missing_ranks") or ()) for c in shown])


def nccl_calls_table(result: Item, chosen: Sequence[Item] | None = None) -> TableModel:
    """The NCCL Calls table: ``chosen`` calls (default: :func:`selected_calls`)."""
    shown = selected_calls(result) if chosen is None else chosen
    labels = _labels(result)
    failing = _failing(result)
    rows = [
        [
            c["id"],
            c["collective_id"],
            labels.get(c["group"], c["group"]),
            c.get("global_ranks", c["global_rank"]),  # a class's row at scale (core._nccl_calls)
            c["collective_type"],
            c["state"],
        ]
        for c in shown
    ]
    return TableModel(list(NCCL_HEADERS), rows,
                      ["fail" if c["collective_id"] in failing else "" for c in shown],
                      len(result.get("nccl_calls", [])))


def groups_table(result: Item) -> TableModel:
    """The Groups table."""
    groups = result.get("groups", [])
    rows = [
        [g.get("id", g["name"]), g.get("desc", ""), len(g["ranks"]), format_rank_set(g["ranks"]),
         "inferred" if g.get("inferred") else "", g.get("label", "")]
        for g in groups
    ]  # fmt: skip
    return TableModel(list(GROUP_HEADERS), rows, [""] * len(rows), len(groups))


def findings_lines(result: Item) -> list[str]:
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
