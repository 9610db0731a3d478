"""The Flight Recorder page's lanes: each rank class's recent ops, one row per group.

A view-model of the analysis result's ``streams`` (``analysis/streams.py``): per class of
identical ranks, the ops it issued last, in issue order across groups, each in its group's row
at its issue position and coloured by state (completed, started: its device runs it, scheduled:
enqueued behind). Two ranks that issued the same ops in other orders show the same chips in
other columns; a GPU that has not started its op shows it scheduled where its peers' started.
Renders what the analysis decided; computes nothing of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from debug_server.analysis.ranks import format_ranks

__all__ = ["LANES_SHOWN", "lanes_view"]

LANES_SHOWN = 16
"""Rank classes drawn (the odd ones first); the rest are counted in a note."""


def lanes_view(result: Mapping[str, Any]) -> dict[str, Any]:
    """``{"classes": [{"ranks", "rows": [{"label", "cells": [chip or None]}], "executing"}],
    "more": n}`` for the template; ``classes`` is empty when no rank has a pending op."""
    streams = result.get("streams") or []
    if not any(s.get("queued") or s.get("executing") is not None for s in streams):
        return {"classes": [], "more": 0}
    odd = _odd_ranks(result)
    ordered = sorted(streams, key=lambda s: (not odd & set(s["ranks"]), len(s["ranks"]),
                                             s["ranks"][:1]))
    classes = []
    for s in ordered[:LANES_SHOWN]:
        labels: list[str] = []
        for o in s["ops"]:
            if o["label"] not in labels:
                labels.append(o["label"])
        rows = []
        for label in labels:
            cells: list[dict[str, str] | None] = []
            for o in s["ops"]:
                if o["label"] != label:
                    cells.append(None)
                    continue
                num = f"#{o['seq']}" if o["seq"] is not None else f"p2p #{o['p2p_seq']}"
                cells.append({"text": f"{o['op']} {num}", "state": o["state"]})
            rows.append({"label": label, "cells": cells})
        ex = s.get("executing")
        running = s["ops"][ex] if ex is not None else None
        classes.append({
            "ranks": format_ranks(s["ranks"]), "n": len(s["ranks"]), "odd": bool(odd & set(s["ranks"])),
            "rows": rows, "width": len(s["ops"]),
            "executing": f"{running['op']} #{running['seq']} on {running['label']}" if running else None,
            "queued": s.get("queued", 0),
        })
    return {"classes": classes, "more": max(0, len(streams) - LANES_SHOWN)}


def _odd_ranks(result: Mapping[str, Any]) -> set[int]:
    """The ranks the headline findings name (an inversion's odd ranks, a busy GPU's rank)."""
    out: set[int] = set()
    findings = result.get("findings") or []
    for i in result.get("headline_findings") or []:
        f = findings[i]
        out.update(f.get("not_started") or f.get("ranks") or [])
    return out
