"""Rank-set wording shared by the analysis and every renderer: ``0-2, 5``, ``ranks 0-2, 5``.

Imports only ``protocol.addrs`` (the range rule the agent's ``ranks`` parameter shares), so a tool that only prints rank lists (``nccl_log``,
``preflight``, ``envinfo``) does not load the analyzer.
"""

from __future__ import annotations

from collections.abc import Iterable

from debug_server.protocol.addrs import rank_ranges

__all__ = ["format_rank_set", "format_ranks", "ranks_phrase"]

_SMALL_SET = 16


def format_ranks(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2, 5`` (sorted, ranges collapsed)."""
    return ", ".join(rank_ranges(ranks))


def ranks_phrase(ranks: Iterable[int]) -> str:
    """``rank 3`` or ``ranks 0-2, 5``."""
    rs = sorted(set(ranks))
    return f"{'rank' if len(rs) == 1 else 'ranks'} {format_ranks(rs)}"


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
