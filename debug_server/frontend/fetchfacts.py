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

from debug_server.fanout.reply import FrData
from debug_server.fanout.transport import OK, RankResult

__all__ = ["FetchFacts", "failure_lines"]


def failure_lines(results: Sequence[RankResult]) -> list[str]:
    """One line per rank that failed, or is gone (its kept data, aged)."""
    return [r.line() for r in results if r.status != OK]  # not ok, or GONE


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
