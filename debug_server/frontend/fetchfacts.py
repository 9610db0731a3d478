"""What a page shows of the FR fetch itself, beside the analysis result.

The renderers (``render``, the templates, the text pages and files) format the analysis result;
of the fetch they need only a few facts: how many ranks were asked and answered, the failures,
the window or scope of the data. :class:`FetchFacts` holds those, built where the fetch happens
(``app``, ``dumps``, ``hangreport``) with :meth:`FetchFacts.of`, so no renderer reads the
fetch's records or dumps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from debug_server.fanout.reply import FrData
from debug_server.fanout.transport import OK, RankResult
from debug_server.protocol.addrs import format_ranks

__all__ = ["RANK_ROWS_FULL_LIMIT", "FetchFacts", "failure_lines", "rank_rows", "stack_rows"]

RANK_ROWS_FULL_LIMIT = 16384
"""Up to this many records, the JSON pages' ``ranks`` list one row per rank; above it, one row
per kind of record (``rank_rows``)."""


def failure_lines(results: Sequence[RankResult]) -> list[str]:
    """One line per rank that failed, or is gone (its kept data, aged)."""
    return [r.line() for r in results if r.status != OK]  # not ok, or GONE


def rank_rows(results: Sequence[RankResult], stacks: Sequence[RankResult] = (),
              limit: int = RANK_ROWS_FULL_LIMIT) -> list[dict[str, Any]]:
    """Each rank's record as the JSON pages list it: ``summary()`` and ``line()``; with
    ``stacks``, its process as read on its host (``process``). What all but a rank's number and
    URL say is made once per kind of record (ranks that answered alike through an agent share
    status, error, time and note): 131072 rows of records alike in 0.09-0.12 s, not
    0.21-0.25 s, on the page's loop.

    Above ``limit`` records, ranks whose records agree but for their URL and reply time are
    one row (as an agent's rows and ``nccl_calls`` above its limit): the same keys, ``rank`` the
    lowest, ``global_ranks`` their range text (``"0-77776,77778-131071"``), ``url`` null (each
    rank's own is on ``/rank/<n>``), ``elapsed_s`` the longest, ``line`` naming the ranks; a
    rank read from outside (``process``) keeps its own row. 131072 rows were 31 MB of JSON."""
    procs = {r.rank: r.process for r in stacks if r.process is not None}
    if len(results) > limit:
        return _class_rows(results, procs)
    kinds: dict[tuple[Any, ...], tuple[dict[str, Any], str]] = {}
    out = []
    for r in results:
        key = (r.status, r.error, r.elapsed_s, r.http_status, r.note, id(r.process))
        kind = kinds.get(key)
        if kind is None:
            head = f"rank {r.rank}: "
            rest = {k: v for k, v in r.summary().items() if k not in ("rank", "url")}
            kind = kinds[key] = (rest, r.line()[len(head):])
        row = {"rank": r.rank, "url": r.url, **kind[0], "line": f"rank {r.rank}: {kind[1]}"}
        if r.rank in procs:
            row["process"] = procs[r.rank]
        out.append(row)
    return out


def stack_rows(results: Sequence[RankResult],
               limit: int = RANK_ROWS_FULL_LIMIT) -> list[dict[str, Any]]:
    """``/stacks?format=json``'s rows: each record's ``summary()`` and its text (``stacks``,
    null for a rank without); above ``limit`` records, one row per kind of record and text, as
    ``rank_rows`` (the tree's aggregators send the ranks waiting at one line as one text:
    131072 rows were ~260 MB of JSON, each with the same 1.8 KB)."""
    if len(results) <= limit:
        return [r.summary() | {"stacks": r.body if r.ok else None} for r in results]
    return _class_rows(results, {}, texts=True)


def _own_row(r: RankResult, procs: dict[int, Any], texts: bool) -> dict[str, Any]:
    if texts:
        return r.summary() | {"stacks": r.body if r.ok else None}
    row = r.summary() | {"line": r.line()}
    if r.rank in procs:
        row["process"] = procs[r.rank]
    return row


def _class_rows(results: Sequence[RankResult], procs: dict[int, Any],
                texts: bool = False) -> list[dict[str, Any]]:
    """``rank_rows`` above its limit: one row per kind of record (its doc); ``texts``: per
    kind of record and text, each row with its ``stacks`` instead of a ``line``
    (``stack_rows``)."""
    kinds: dict[tuple[Any, ...], tuple[RankResult, list[int]]] = {}
    own: list[tuple[int, dict[str, Any]]] = []
    for r in results:
        if r.process is not None or r.rank in procs:
            own.append((r.rank, _own_row(r, procs, texts)))
            continue
        key = (r.status, r.error, r.http_status, r.note, r.body if texts and r.ok else None)
        held = kinds.get(key)
        if held is None:
            kinds[key] = (r, [r.rank])
        else:
            if r.elapsed_s > held[0].elapsed_s:
                kinds[key] = held = (r, held[1])
            held[1].append(r.rank)
    rows = own
    for r, ranks in kinds.values():
        if len(ranks) == 1:
            rows.append((r.rank, _own_row(r, procs, texts)))
            continue
        text = format_ranks(ranks)
        # summary()'s keys after these two; its rank and URL are the representative's
        row: dict[str, Any] = {"rank": 0, "global_ranks": text, **r.summary()}
        row["rank"], row["url"] = min(ranks), None
        if texts:
            row["stacks"] = r.body if r.ok else None
        else:
            row["line"] = f"ranks {text}: {r.line().partition(': ')[2]}"
        rows.append((row["rank"], row))
    rows.sort(key=lambda kr: kr[0])
    return [row for _, row in rows]


@dataclass(frozen=True, slots=True)
class FetchFacts:
    """One FR fetch as the pages show it (module doc)."""

    asked: int
    """Ranks asked: one record each."""
    answered: int
    """Ranks whose dump the analysis read (a gone rank's kept one included)."""
    failures: tuple[str, ...]
    """One line per rank that failed or is gone (``failure_lines``)."""
    window: dict[str, int] | None
    """Per group, the first seq fetched (``frwindow``); None for whole rings or active only."""
    scope: str | None
    """What the data is, where it is not a live fetch (the post-mortem viewer's)."""

    @classmethod
    def of(cls, fr: FrData) -> FetchFacts:
        return cls(len(fr.results), len(fr.dumps), tuple(failure_lines(fr.results)),
                   fr.window, fr.scope)
