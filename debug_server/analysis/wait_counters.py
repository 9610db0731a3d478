"""PyTorch's wait counters of every rank as one table: a row per counter and field, a column
per rank, the values that stand out marked. Pure functions over the ranks' replies.

A wait counter (``torch.monitor._WaitCounter``; TCPStore get/set/wait, process-group init...)
reports ``active_count`` (waits in progress now), ``total_calls``, ``total_time_us`` and
``max_time_us``. A rank whose waits are far longer or far more numerous than the others' (or
the one rank still waiting, ``active_count``) is marked, by :func:`debug_server.analysis.outliers.outliers`
with a floor per field so that microseconds of noise are never marked.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from debug_server.analysis.outliers import outliers

FIELDS = ("active_count", "total_calls", "total_time_us", "max_time_us")
FLOORS = {"active_count": 1.0, "total_calls": 2.0, "total_time_us": 10_000.0,
          "max_time_us": 10_000.0}
"""How far from the median a value must be to be marked (counts; microseconds)."""
MAX_COUNTERS = 500
MAX_NAME = 200
"""Counter and field names are cut to this many characters."""
NAME_PREFIX = "pytorch.wait_counter."

Counters = dict[str, dict[str, float]]


def parse_counters(body: str) -> Counters:
    """One rank's ``wait_counter_values`` reply; ``ValueError`` (one line) when malformed.

    Fields that are not numbers are left out; a counter that is not an object is refused.
    """
    try:
        data = json.loads(body)
    except RecursionError:
        raise ValueError("reply is nested too deeply") from None
    if not isinstance(data, dict):
        raise ValueError("reply is not a JSON object of counters")
    out: Counters = {}
    for name, fields in data.items():
        if not isinstance(fields, dict):
            raise ValueError(f"counter {str(name)[:60]!r} is not an object")
        out[str(name)[:MAX_NAME]] = {str(f)[:MAX_NAME]: float(v) for f, v in fields.items()
                          if isinstance(v, int | float) and not isinstance(v, bool)
                          and v == v and abs(v) != float("inf")}
    return out


def short_name(name: str) -> str:
    return name[len(NAME_PREFIX):] if name.startswith(NAME_PREFIX) else name


def table(per_rank: Mapping[int, Mapping[str, Mapping[str, float]]]) -> dict[str, Any]:
    """Rows ``{"counter", "field", "values": {rank: value | None}, "marks": {rank: "high" |
    "low"}}`` for every counter any rank has (rows that are 0 on every rank left out), and the
    marked cells as a list."""
    ranks = sorted(per_rank)
    names = sorted({n for counters in per_rank.values() for n in counters})
    truncated = max(0, len(names) - MAX_COUNTERS)
    rows: list[dict[str, Any]] = []
    marked: list[dict[str, Any]] = []
    for name in names[:MAX_COUNTERS]:
        fields = [f for f in FIELDS if any(f in per_rank[r].get(name, {}) for r in ranks)]
        fields += sorted({f for r in ranks for f in per_rank[r].get(name, {})} - set(FIELDS))
        for field in fields:
            values = {r: per_rank[r].get(name, {}).get(field) for r in ranks}
            present = {r: v for r, v in values.items() if v is not None}
            if not any(present.values()):
                continue
            marks = {}
            for o in outliers(present, floor=FLOORS.get(field, 1.0)):
                marks[o.rank] = o.direction
                marked.append({"counter": name, "field": field, "rank": o.rank, "value": o.value,
                               "median": o.median, "direction": o.direction})
            rows.append({"counter": name, "field": field, "values": values, "marks": marks})
    return {"ranks": ranks, "rows": rows, "marked": marked, "truncated_counters": truncated}
