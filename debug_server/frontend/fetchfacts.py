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

__all__ = ["FetchFacts", "failure_lines", "rank_rows"]


def failure_lines(results: Sequence[RankResult]) -> list[str]:
    """One line per rank that failed, or is gone (its kept data, aged)."""
    return [r.line() for r in results if r.status != OK]  # not ok, or GONE


def rank_rows(results: Sequence[RankResult],
              stacks: Sequence[RankResult] = ()) -> list[dict[str, Any]]:
    """Each rank's record as the JSON pages list it: ``summary()`` and ``line()``; with
    ``stacks``, its process as read on its host (``process``). What all but a rank's number and
    URL say is made once per kind of record (ranks that answered alike through an agent share
    status, error, time and note): 131072 rows of records alike in 0.09-0.12 s, not
    0.21-0.25 s, on the page's loop."""
    procs = {r.rank: r.process for r in stacks if r.process is not None}
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
