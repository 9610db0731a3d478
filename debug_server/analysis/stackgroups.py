"""Ranks grouped by where their main thread is (from the stack text alone), odd ones first."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from debug_server.analysis import stackparse
from debug_server.protocol.agentwire import StackClasses

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
    # Ranks by text first, less thread ids (each process prints its own: 131072 texts, a few
    # classes): each class parsed once, each rank's position put in by class, not one lookup
    # chain per rank. Ranks alike share one text object on the way up: made a class once.
    by_text: dict[str, list[int]] = {}
    class_of = StackClasses()
    for r, text in stacks.items():
        key = class_of(text)
        rs = by_text.get(key)
        if rs is None:
            by_text[key] = [r]
        else:
            rs.append(r)
    by_summary: dict[tuple[str, bool], list[int]] = {}
    positions: dict[int, stackparse.Position] = {}
    for text, rs in sorted(by_text.items(), key=lambda kv: min(kv[1])):
        try:
            pos = stackparse.summarize_text(text)
        except Exception as e:  # noqa: BLE001 - unparseable stacks must not stop the analysis
            notes.append(f"rank {min(rs)}: stack text unparseable ({type(e).__name__})")
            continue
        if pos is None:
            continue
        positions.update(dict.fromkeys(rs, pos))
        by_summary.setdefault((pos.summary, pos.in_collective), []).extend(rs)
    for rs in by_summary.values():
        rs.sort()
    groups = [
        {"ranks": rs, "summary": s, "in_collective": ic}
        for (s, ic), rs in sorted(by_summary.items(), key=lambda kv: (len(kv[1]), kv[1][0]))
    ]
    return groups, positions
