"""The dump files' listings at scale (issue 41): ranks alike in one row, by their ranges.

``frontend.dumps`` renders each cycle's files; above :data:`PER_RANK_LISTING_MAX` ranks its
listings (stacks sections, Dump File lines, failure lines) come from here: one row per kind of
answer with the ranks that gave it, a rank alone in today's per-rank form, and a bound on rows
(:data:`MAX_ROWS`) and on the stacks file (:data:`MAX_STACKS_FILE_CHARS`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from debug_server.analysis.ranks import format_ranks
from debug_server.fanout.transport import GONE, RankResult
from debug_server.protocol.agentwire import StackClasses
from debug_server.readers import procstate

__all__ = ["MAX_ROWS", "MAX_STACKS_FILE_CHARS", "PER_RANK_LISTING_MAX", "capped", "failure_rows", "ranks_text",
           "group_lines", "grouped_sections", "ranks_head", "strip_rank"]

PER_RANK_LISTING_MAX = 32
"""Up to this many ranks, a listing of the dump files (stacks sections, Dump File lines, failure
lines) has one row per rank, as it always had; above, ranks alike share one row (ranges)."""
MAX_ROWS = 200
"""Most rows of a grouped listing; the rest are counted in one last row."""
MAX_STACKS_FILE_CHARS = 512 * 1024
"""``stacks_<ts>.txt`` keeps within this (sections past it are counted and their ranks named)."""
_RANKS_TEXT_CHARS = 2000


def ranks_text(ranks: Sequence[int]) -> str:
    """Range text of ``ranks``, cut to a bound (a scattered set is named by its first runs)."""
    text = format_ranks(ranks)
    if len(text) <= _RANKS_TEXT_CHARS:
        return text
    cut = text.rfind(", ", 0, _RANKS_TEXT_CHARS)
    return f"{text[:cut]}, ... ({len(ranks)} ranks in all)"


def ranks_head(ranks: Sequence[int], word: str = "Rank") -> str:
    """``Rank 5`` or ``Ranks 0-77776, 77778-131071``."""
    return f"{word} {ranks[0]}" if len(ranks) == 1 else f"{word}s {ranks_text(ranks)}"


def strip_rank(rank: int, line: str) -> tuple[bool, str]:
    """A failure line without its ``rank N: `` head (True; a record's ``line()`` of an error
    that names its rank has it twice), or the line as it is."""
    head = f"rank {rank}: "
    if not line.startswith(head):
        return False, line
    while line.startswith(head):
        line = line[len(head):]
    return True, line


def group_lines(items: Iterable[tuple[int, Any]]) -> list[tuple[list[int], Any]]:
    """``(rank, key)`` pairs -> ``(ranks, key)`` per distinct key, in the order keys first came."""
    groups: dict[Any, list[int]] = {}
    for rank, key in items:
        got = groups.get(key)
        if got is None:
            groups[key] = [rank]
        else:
            got.append(rank)
    return [(ranks, key) for key, ranks in groups.items()]


def capped(rows: list[tuple[list[int], str]], indent: str = "") -> list[str]:
    """The rows' lines, at most ``MAX_ROWS``; the rest counted in one last line."""
    lines = [indent + line for _, line in rows[:MAX_ROWS]]
    if len(rows) > MAX_ROWS:
        rest = sorted(r for ranks, _ in rows[MAX_ROWS:] for r in ranks)
        lines.append(f"{indent}... {len(rows) - MAX_ROWS} more rows left out (ranks "
                     f"{ranks_text(rest)})")
    return lines


def failure_rows(lines: Sequence[str]) -> list[str]:
    """Failure lines (``rank N: why``) of many ranks: one per distinct ``why`` with its ranks
    (``ranks 100-199: unreachable after 2.0 s``), at most ``MAX_ROWS``."""
    keyed = []
    for line in lines:
        head = line.partition(": ")[0]
        num = head[5:] if head.startswith("rank ") else ""
        keyed.append((int(num), strip_rank(int(num), line)) if num.isdigit() else (-1, (False, line)))
    rows = []
    for ranks, (has_rank, why) in group_lines(k for k in keyed if k[0] >= 0):
        rows.append((ranks, f"{ranks_head(ranks, 'rank')}: {why}" if has_rank else why))
    loose = [line for r, (_, line) in keyed if r < 0]
    return capped(rows) + loose[:MAX_ROWS]


def _stack_key(r: RankResult, class_of: StackClasses) -> tuple[Any, ...]:
    """What puts ranks in one section of ``stacks_<ts>.txt``: the same text but for thread ids
    (each process has its own), the same process state; or the same failure."""
    if not r.ok:
        return ("failed", *strip_rank(r.rank, r.line()))
    norm = class_of(r.body or "")
    state = r.process.get("state") if isinstance(r.process, Mapping) else None
    return ("ok", norm, r.note if r.status == GONE else None, state, r.process is not None)


def grouped_sections(results: Sequence[RankResult], parts: list[str]) -> str:
    """``parts`` (the stack groups' preamble), then one section per class of ranks alike
    (``frontend.dumps.stacks_file``), within ``MAX_STACKS_FILE_CHARS``."""
    by_rank = {r.rank: r for r in results}
    class_of = StackClasses()
    classes = group_lines((r.rank, _stack_key(r, class_of)) for r in results)
    classes.sort(key=lambda c: min(c[0]))
    size = sum(len(p) + 1 for p in parts)
    left: list[int] = []
    n_left = 0
    for ranks, key in classes:
        first = by_rank[ranks[0]]
        if len(ranks) == 1:
            section = [f"=== Rank {first.rank} ==="]
            if first.process is not None:
                section.append(f"Process: {procstate.describe(first.process)}")
            section.append((first.body or "").rstrip("\n") if first.ok else first.line())
        else:
            section = [f"=== Ranks {ranks_text(ranks)} ({len(ranks)} ranks) ==="]
            if key[0] == "failed":
                section.append(f"{ranks_head(ranks, 'rank')}: {key[2]}" if key[1] else key[2])
            else:
                if first.process is not None:
                    section.append(f"Process: {key[3] or 'read'} (each rank's pid and times: "
                                   f"the live /stacks page)")
                if first.status == GONE:
                    section.append(f"(kept from an earlier answer: {first.note})")
                section.append((first.body or "").rstrip("\n"))
        section.append("")
        chars = sum(len(p) + 1 for p in section)
        if size + chars > MAX_STACKS_FILE_CHARS - 4 * _RANKS_TEXT_CHARS:
            left.extend(ranks)
            n_left += 1
            continue
        parts += section
        size += chars
    if n_left:
        parts.append(f"... {n_left} more section{'s' if n_left != 1 else ''} left out (this file "
                     f"keeps within {MAX_STACKS_FILE_CHARS // 1024} KB): ranks "
                     f"{ranks_text(sorted(left))}")
        parts.append("")
    return "\n".join(parts)
