"""This rank's clock as its worker reports it, with an offset that tests inject.

Entries carry wall-clock times (``time_created_ns``...) and each FR reply its read time
(``dump_time_ns``); the frontend puts ranks of other hosts on its own clock from these
(``analysis.stragglers``). To test that without two machines whose clocks differ, a rank can be
given a deliberate offset: ``config.Settings.clock_offset_ns`` (its variable in docs/settings.md;
read by ``start_debug_server`` and handed over with ``set_offset_ns``) shifts every time its worker
reports, as if its host's clock were that far ahead. Unset or 0 (every real job): the dump is served as it is, at no cost.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

TIME_KEYS = ("time_created_ns", "time_discovered_started_ns", "time_discovered_completed_ns")


# Set by start_debug_server from its settings; 0 (every real job) serves dumps as they are.
_offset_ns = 0


def set_offset_ns(offset: int) -> None:
    """This process's injected offset (``Settings.clock_offset_ns``), from the entry point."""
    global _offset_ns
    _offset_ns = offset


def offset_ns() -> int:
    """The injected offset (``Settings.clock_offset_ns``, 0 in every real job)."""
    return _offset_ns


def shifted(dump: Mapping[str, Any], offset: int | None = None) -> Mapping[str, Any]:
    """``dump`` with every time moved by ``offset`` (default: this process's ``offset_ns``)."""
    off = offset_ns() if offset is None else offset
    if not off:
        return dump
    out = dict(dump)
    if isinstance(out.get("dump_time_ns"), int):
        out["dump_time_ns"] += off
    entries = out.get("entries")
    if isinstance(entries, list):
        out["entries"] = [_entry(e, off) if isinstance(e, Mapping) else e for e in entries]
    return out


def _entry(e: Mapping[str, Any], off: int) -> dict[str, Any]:
    out = dict(e)
    for k in TIME_KEYS:
        if type(out.get(k)) is int and out[k] > 0:
            out[k] += off
    return out
