"""This rank's clock as its worker reports it, with an offset that tests inject.

Entries carry wall-clock times (``time_created_ns``...) and each FR reply its read time
(``dump_time_ns``); the frontend puts ranks of other hosts on its own clock from these
(``analysis.stragglers``). To test that without two machines whose clocks differ, a rank can be
given a deliberate offset: ``DEBUG_SERVER_CLOCK_OFFSET_NS=<int>`` in its environment (read once,
when the worker first serves FR data) shifts every time its worker reports, as if its host's
clock were that far ahead. Unset or 0 (every real job): the dump is served as it is, at no cost.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any

OFFSET_ENV = "DEBUG_SERVER_CLOCK_OFFSET_NS"
TIME_KEYS = ("time_created_ns", "time_discovered_started_ns", "time_discovered_completed_ns")


@functools.cache
def offset_ns() -> int:
    """The injected offset (0 unless ``DEBUG_SERVER_CLOCK_OFFSET_NS`` is set); read once."""
    raw = os.environ.get(OFFSET_ENV, "").strip()
    if not raw:
        return 0
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{OFFSET_ENV}={raw[:40]!r} must be an integer (nanoseconds)") from None


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
