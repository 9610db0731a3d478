"""Which ranks stand out from the rest: one rule for every per-rank number a page compares.

The rule is the preflight's straggler rule (``preflight.flag_stragglers``: above ``factor`` x the
median and at least an absolute floor above it, so noise is never a straggler), applied in both
directions: a rank far below the others stands out as much as one far above (a rank computing
while the others sit in communication has the lowest communication share of all). Pure functions.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import NamedTuple

MIN_RANKS = 3
"""Fewer values than this flag nothing: with two ranks neither is the odd one out."""


class Outlier(NamedTuple):
    rank: int
    value: float
    median: float
    direction: str
    """``"high"`` or ``"low"``."""


def outliers(values: Mapping[int, float], *, floor: float, factor: float = 1.5,
             min_ranks: int = MIN_RANKS) -> list[Outlier]:
    """Ranks whose value is above ``factor`` x the median (or below median / ``factor``) and
    at least ``floor`` away from it, in rank order."""
    if len(values) < min_ranks:
        return []
    med = statistics.median(values.values())
    out = []
    for rank in sorted(values):
        v = values[rank]
        if v > factor * med and v - med >= floor:
            out.append(Outlier(rank, v, med, "high"))
        elif v * factor < med and med - v >= floor:
            out.append(Outlier(rank, v, med, "low"))
    return out
