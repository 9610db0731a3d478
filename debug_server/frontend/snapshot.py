"""``fr_snapshot_<ts>.json``: what one dump cycle analyzed, in bytes that do not grow with rings.

The snapshot is ``{"<rank>": dump | {"error": line}}`` as the analyzer saw it, with two bounds
that keep a cycle's size independent of ring length x ranks (whole rings stay in the per-rank
pickles each rank writes itself, ``per_rank/rank_<N>``):

- **entries**: each rank's dump is the live window (entries from each communicator's frontier on,
  ``frwindow``), and at most :data:`MAX_ENTRIES_PER_RANK` of them: every entry not yet completed,
  then the newest completed ones. What a cap dropped is counted in the dump's ``fr_window``
  (``snapshot_dropped``), so a reader knows the ring held more.
- **member lists**: every member of a group carries the group's full member list
  (``pg_config.*.ranks``), so N ranks x an N-member group is O(N^2) bytes (1.9 GB at 16384 ranks).
  A list longer than :data:`INLINE_RANKS_CHARS` is written once under :data:`MEMBERS_KEY`
  (``{"m0": "[0, 1, ...]"}``) and each rank's ``ranks`` names it (``"@m0"``).

:func:`expand` undoes the second (readers call it right after ``json.loads``), so what comes back
is plain torch-schema dumps again.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from debug_server.protocol.members import MIN_CHARS, map_lists

__all__ = ["INLINE_RANKS_CHARS", "MAX_ENTRIES_PER_RANK", "MEMBERS_KEY", "cap_entries", "encode",
           "expand"]

MEMBERS_KEY = "pg_members"
"""Top-level key of the shared member lists (never a rank number, so readers can tell it apart)."""
INLINE_RANKS_CHARS = MIN_CHARS
"""Member lists up to this many characters stay inline (small groups cost less than a reference)."""
MAX_ENTRIES_PER_RANK = 512
"""Most FR entries one rank contributes to a snapshot (the live window is usually far smaller)."""
_REF = "@"
_WINDOW_KEY = "fr_window"


def _done(e: Any) -> bool:
    return isinstance(e, Mapping) and bool(
        e.get("state") == "completed" or e.get("retired") or e.get("time_discovered_completed_ns"))


def cap_entries(dump: Mapping[str, Any], cap: int = MAX_ENTRIES_PER_RANK) -> Mapping[str, Any]:
    """``dump`` with at most ``cap`` entries: all pending ones, then the newest completed ones
    (ring order kept). Unchanged (the same object) when it is within the cap."""
    entries = dump.get("entries")
    if not isinstance(entries, list) or len(entries) <= cap:
        return dump
    pending = [i for i, e in enumerate(entries) if not _done(e)]
    room = max(0, cap - len(pending))
    keep = set(pending[-cap:])
    for i in range(len(entries) - 1, -1, -1):
        if room <= 0:
            break
        if i not in keep:
            keep.add(i)
            room -= 1
    kept = [entries[i] for i in sorted(keep)]
    out = dict(dump)
    out["entries"] = kept
    prior = dump.get(_WINDOW_KEY)
    window = dict(prior) if isinstance(prior, Mapping) else {"ring_entries": len(entries)}
    window["snapshot_dropped"] = int(window.get("snapshot_dropped", 0) or 0) + len(entries) - len(kept)
    out[_WINDOW_KEY] = window
    return out


class _Members:
    """Shared member lists: one name per distinct text."""

    def __init__(self) -> None:
        self.names: dict[str, str] = {}

    def ref(self, text: str) -> str:
        name = self.names.get(text)
        if name is None:
            name = self.names[text] = f"m{len(self.names)}"
        return name


def encode(items: Sequence[tuple[int, Mapping[str, Any] | None, str | None]],
           cap: int = MAX_ENTRIES_PER_RANK) -> str:
    """The snapshot text of ``(rank, dump or None, error line or None)`` items, in that order."""
    members = _Members()
    parts = []
    for rank, dump, error in items:
        if dump is None:
            value = json.dumps({"error": error or "no data"})
        else:
            value = json.dumps(map_lists(cap_entries(dump, cap), members.ref), default=str)
        parts.append(f"{json.dumps(str(rank))}: {value}")
    if members.names:
        table = {name: text for text, name in members.names.items()}
        parts.append(f"{json.dumps(MEMBERS_KEY)}: {json.dumps(table)}")
    return "{" + ",\n".join(parts) + "}\n"


def expand(obj: Any) -> Any:
    """A loaded snapshot with shared member lists put back inline (the torch schema again).

    A reference that names no list is left as it is, for the dump check to refuse with its own
    one-line reason. Anything that is not a snapshot dict is returned unchanged.
    """
    if not isinstance(obj, dict) or MEMBERS_KEY not in obj:
        return obj
    table = obj.pop(MEMBERS_KEY)
    if not isinstance(table, dict):
        return obj
    for dump in obj.values():
        cfg = dump.get("pg_config") if isinstance(dump, dict) else None
        if not isinstance(cfg, dict):
            continue
        for c in cfg.values():
            raw = c.get("ranks") if isinstance(c, dict) else None
            if isinstance(raw, str) and raw.startswith(_REF):
                text = table.get(raw[len(_REF):])
                if isinstance(text, str):
                    c["ranks"] = text
    return obj
