"""Handlers a worker does not have: its 404 stands for asking it again, for a while.

A rank served by torch's own C++ worker answers 404 to every handler of ours: the hang watch's
health poll, the straggler watch's clock reads, the overview's health column. At 4096 ranks the
health poll alone is 4096 such requests every 8 s, and each costs the frontend and the worker
what a real answer costs (issue 31: a page's own 8192 requests shared the box with them). Such
an answer cannot change while the same server listens on that address, so :class:`KnownAbsent`
answers it from memory for :data:`ABSENT_TTL_S`, then asks once more (a worker of ours restarted
on the same address shows within that long; ``Collector`` forgets an address at once where it
learns that it is ours again). The record given is the worker's own last 404 (status, error
line), with no time spent.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from debug_server.fanout.transport import RankResult
    from debug_server.protocol.addrs import WorkerAddr

__all__ = ["ABSENT_TTL_S", "KnownAbsent"]

ABSENT_TTL_S = 30.0
"""How long a worker's 404 to a handler stands for asking it that handler again."""


class KnownAbsent:
    """Per (worker address, handler): the last 404 and until when it stands (module doc)."""

    def __init__(self, ttl_s: float | None = None) -> None:
        self.ttl_s = ABSENT_TTL_S if ttl_s is None else ttl_s
        # handler -> worker address -> (until when, its 404's record)
        self._held: dict[str, dict[str, tuple[float, RankResult]]] = {}

    def split(self, handler: str, addrs: Sequence[WorkerAddr],
              ) -> tuple[Sequence[WorkerAddr], list[RankResult]]:
        """The addresses to ask, and the records of those whose 404 still stands."""
        held_for = self._held.get(handler)
        if not held_for:
            return addrs, []
        now = time.monotonic()
        ask: list[WorkerAddr] = []
        held: list[RankResult] = []
        for a in addrs:
            hit = held_for.get(a.url or "")
            if hit is None or hit[0] <= now:
                ask.append(a)
            else:
                held.append(replace(hit[1], rank=a.rank, elapsed_s=0.0, done_ns=time.time_ns()))
        return ask, held

    def note(self, handler: str, results: Sequence[RankResult]) -> None:
        """Remember each 404 of ``results``; any other answer ends the one held."""
        until = time.monotonic() + self.ttl_s
        held_for = self._held.get(handler)
        for r in results:
            if r.url is None:
                continue
            if r.http_status == 404:
                if held_for is None:
                    held_for = self._held[handler] = {}
                held_for[r.url] = (until, r)
            elif held_for and r.url in held_for:
                del held_for[r.url]

    def forget(self, url: str) -> None:
        """Every 404 held for ``url`` (its worker turned out to be another)."""
        for held_for in self._held.values():
            held_for.pop(url, None)
