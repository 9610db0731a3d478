"""Ranks grouped by where their main thread is (from the stack text alone), odd ones first."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from debug_server.analysis import stackparse

__all__ = ["group_stacks", "stack_groups"]


def stack_groups(stacks: Mapping[int, str]) -> list[dict[str, Any]]:
    """Ranks grouped by where their main thread is, odd ones (smallest groups) first.

    ``stacks``: rank -> faulthandler text. Each group is ``{"ranks", "summary",
    "in_collective"}``, e.g. ``{"ranks": [5], "summary": "time.sleep at demo.py:66",
    "in_collective": False}``; the same groups as ``analyze(...)["stack_groups"]``.
    """
    return group_stacks(stacks, [])[0]


def group_stacks(
    stacks: Mapping[int, str], notes: list[str]
) -> tuple[list[dict[str, Any]], dict[int, stackparse.Position]]:
    """:func:`stack_groups` and each rank's position; an unparseable text becomes a note."""
    by_summary: dict[tuple[str, bool], list[int]] = {}
    positions: dict[int, stackparse.Position] = {}
    cache: dict[str, stackparse.Position | None] = {}
    for r, text in sorted(stacks.items()):
        if text not in cache:
            try:
                cache[text] = stackparse.summarize_text(text)
            except Exception as e:  # noqa: BLE001 - unparseable stacks must not stop the analysis
                notes.append(f"rank {r}: stack text unparseable ({type(e).__name__})")
                cache[text] = None
        pos = cache[text]
        if pos is None:
            continue
        positions[r] = pos
        by_summary.setdefault((pos.summary, pos.in_collective), []).append(r)
    groups = [
        {"ranks": rs, "summary": s, "in_collective": ic}
        for (s, ic), rs in sorted(by_summary.items(), key=lambda kv: (len(kv[1]), kv[1][0]))
    ]
    return groups, positions
