"""Rank-set wording shared by the analysis and every renderer: ``0-2, 5``, ``ranks 0-2, 5``.

Imports only ``protocol.addrs`` (the range rule the agent's ``ranks`` parameter shares), so a tool that only prints rank lists (``nccl_log``,
``preflight``, ``envinfo``) does not load the analyzer.
"""

from __future__ import annotations

from collections.abc import Iterable

from debug_server.protocol.addrs import sorted_ranges

__all__ = ["format_rank_set", "format_ranks", "parse_rank_text", "rank_ranges", "ranks_phrase"]

_SMALL_SET = 16


def rank_ranges(ranks: Iterable[int]) -> list[str]:
    """``[0, 1, 2, 5]`` -> ``["0-2", "5"]`` (``protocol.addrs.rank_ranges``)."""
    return sorted_ranges(sorted(set(ranks)))


def format_ranks(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2, 5`` (sorted, ranges collapsed)."""
    return ", ".join(rank_ranges(ranks))


def ranks_phrase(ranks: Iterable[int]) -> str:
    """``rank 3`` or ``ranks 0-2, 5``."""
    rs = sorted(set(ranks))
    return f"{'rank' if len(rs) == 1 else 'ranks'} {', '.join(sorted_ranges(rs))}"


def format_rank_set(ranks: Iterable[int]) -> str:
    """Ranks as a Python set literal (``{1}``, ``{0, 1}``); blank when empty.

    Beyond 16 ranks consecutive runs collapse (``{0-62, 64-127}``) so a 4096-rank row stays short.
    """
    rs = sorted(set(ranks))
    if not rs:
        return ""
    if len(rs) <= _SMALL_SET:
        return "{" + ", ".join(map(str, rs)) + "}"
    return "{" + ", ".join(sorted_ranges(rs)) + "}"


def parse_rank_text(raw: object, where: str = "ranks", limit: int = 1 << 20) -> list[int]:
    """``0-7,9`` or ``0-7, 9`` (:func:`format_ranks`' text) -> the ranks, ascending.

    Raises ``ValueError`` with one line for anything else: ranks out of order or overlapping,
    a rank above ``limit``, more than ``limit + 1`` ranks in all (a hostile file's range text
    cannot make a reader build a huge list).
    """
    if not isinstance(raw, str) or not raw:
        raise ValueError(f"{where}: ranks is not range text")
    out: list[int] = []
    for part in raw.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not (lo.isascii() and lo.isdigit()) or (sep and not (hi.isascii() and hi.isdigit())):
            raise ValueError(f"{where}: {part[:20]!r} is not a rank or a range a-b")
        a = int(lo)
        b = int(hi) if sep else a
        if b < a or b > limit or (out and a <= out[-1]) or len(out) + b - a >= limit + 1:
            raise ValueError(f"{where}: bad range {part[:20]!r} (out of order, overlapping or "
                             f"above rank {limit})")
        out.extend(range(a, b + 1))
    return out
