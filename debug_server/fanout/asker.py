"""The one asker of every rank: one HTTP client, one bound on requests in flight, one timeout,
and what it learnt of each rank on the way.

:class:`Asker` is owned by the live collector (``live.LiveCollector``) and handed to what asks
the ranks for it: the FR rounds (``rounds.FrRounds``), the agent route (``agents.AgentRoute``)
and the outside reads (``outside.OutsideReads``). None of them knows the collector.

What it keeps on the way: each rank's reachability (``transport.RankStates``), the handlers a
worker answered 404 to (``absent``), and the ranks that went **quiet**: a rank that timed out
is not waited on again on every page. Until it answers again its worker is asked for
:data:`QUIET_ASK_S` only (the page uses its last outside read: ``outside``), while a background
ask with the whole timeout (at most every :data:`REREAD_S`) notices it answering again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from debug_server.fanout.absent import KnownAbsent
from debug_server.fanout.leanhttp import LeanClient
from debug_server.fanout.pagefirst import PageFirstSemaphore
from debug_server.fanout.reply import Each
from debug_server.fanout.transport import OK, TIMED_OUT, RankResult, RankStates, fan_out, fetch_one
from debug_server.protocol.addrs import WorkerAddr
from debug_server.protocol.names import PING_HANDLER

QUIET_ASK_S = 0.2
"""How long a quiet rank's worker is waited for on a page's path."""
REREAD_S = 2.0
"""A quiet rank's kept outside read older than this is read again in the background (and its
worker asked again with the whole timeout at most this often)."""


@dataclass(slots=True)
class Quiet:
    """A rank whose worker timed out, until it answers again."""

    url: str | None
    since: float
    """Wall clock when its worker first timed out."""
    kept: RankResult | None = None
    """Its last outside read (``outside.OutsideReads``)."""
    read_at: float = 0.0
    """``time.monotonic()`` of the kept read."""
    task: asyncio.Task[None] | None = field(default=None, repr=False)
    """The background outside read in flight."""
    probe: asyncio.Task[None] | None = field(default=None, repr=False)
    """The background ask of its worker with the whole timeout, in flight."""
    probed_at: float = 0.0


def _current_task() -> asyncio.Task[Any] | None:
    try:
        return asyncio.current_task()
    except RuntimeError:  # no running loop (close() from a plain thread)
        return None


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


class Asker:
    """Asks the ranks (module doc)."""

    def __init__(self, session: aiohttp.ClientSession, *, timeout: float,
                 max_concurrency: int = 64, http: LeanClient | None = None) -> None:
        self.session = session
        self.http = http
        """The lean client for the fan-outs (``leanhttp``), else ``session``; its owner closes it."""
        self.timeout = timeout
        # Shared by pages and the background polls; a page's requests get freed slots first.
        self.semaphore = PageFirstSemaphore(max_concurrency)
        self.states = RankStates()
        self.absent = KnownAbsent()
        """Handlers a worker answered 404 to, asked again only after a while (``absent``)."""
        self.quiet: dict[int, Quiet] = {}

    async def fetch(self, handler: str, params: Mapping[str, str] | None,
                    addrs: Sequence[WorkerAddr], each: Each | None = None,
                    ) -> list[RankResult]:
        """One handler on every rank of ``addrs``, one record per rank in rank order."""
        ask, held = self.absent.split(handler, addrs)  # a 404 stands for a while (absent)
        # A rank that timed out lately is asked briefly: the page uses its last outside read
        # (outside.OutsideReads), so one stopped rank does not cost every page a timeout.
        ask, quiet = self._split(ask)
        results, briefly = await asyncio.gather(*(
            fan_out(self.session, rs, handler, params, timeout=limit, semaphore=self.semaphore,
                    http=self.http, each=each)
            for rs, limit in ((ask, self.timeout), (quiet, min(self.timeout, QUIET_ASK_S)))))
        results += briefly
        self._note(results, quiet)
        self.absent.note(handler, results)
        if held or quiet:
            results = sorted(results + held, key=lambda r: r.rank)
        self.states.update(results)
        return results

    async def one(self, addr: WorkerAddr, handler: str, params: Mapping[str, str] | None,
                  timeout: float) -> RankResult:
        """One request in one of the slots (a rank asked alone, or an agent)."""
        async with self.semaphore:
            return await fetch_one(self.session, addr, handler, params, timeout, self.http)

    # -- quiet ranks -------------------------------------------------------------------------

    def _split(self, addrs: Sequence[WorkerAddr]) -> tuple[list[WorkerAddr], list[WorkerAddr]]:
        """``addrs`` as (asked with the whole timeout, quiet: asked for ``QUIET_ASK_S``)."""
        normal, quiet = [], []
        for a in addrs:
            q = self.quiet.get(a.rank)
            (quiet if q is not None and q.url == a.url else normal).append(a)
        return normal, quiet

    def _note(self, results: Sequence[RankResult], quiet: Sequence[WorkerAddr]) -> None:
        """A fetch's records: a rank that answered is no longer quiet; one that timed out is.
        A quiet rank's record says since when it does not answer."""
        asked_briefly = {a.rank for a in quiet}
        for r in results:
            q = self.quiet.get(r.rank)
            if r.status == OK or r.http_status is not None:
                if q is not None:
                    self.forget(r.rank)
            elif r.status == TIMED_OUT:
                if q is None or q.url != r.url:
                    self.forget(r.rank)
                    q = self.quiet[r.rank] = Quiet(r.url, time.time())
                if r.rank in asked_briefly:
                    r.error = (f"not answering since {_clock(q.since)} (timed out; asked for "
                               f"{QUIET_ASK_S:.1f} s while quiet)")
                    self._probe_later(r, q)

    def _probe_later(self, r: RankResult, q: Quiet) -> None:
        """Ask a quiet rank's worker with the whole timeout in the background (a slow worker
        that answers within it is no longer quiet), at most every ``REREAD_S``."""
        now = time.monotonic()
        if (q.probe is not None and not q.probe.done()) or now - q.probed_at < REREAD_S:
            return
        q.probed_at = now
        q.probe = asyncio.ensure_future(self._probe(WorkerAddr(r.rank, r.url)))

    async def _probe(self, addr: WorkerAddr) -> None:
        got = await fetch_one(self.session, addr, PING_HANDLER, None, self.timeout, self.http)
        q = self.quiet.get(addr.rank)
        if q is not None and q.url == addr.url and (got.status == OK
                                                    or got.http_status is not None):
            self.forget(addr.rank)  # it answers again: the next page asks it as any other

    def forget(self, rank: int) -> None:
        """``rank`` no longer quiet; its background tasks cancelled."""
        q = self.quiet.pop(rank, None)
        for task in (q.task, q.probe) if q is not None else ():
            if task is not None and task is not _current_task():  # not the one forgetting it
                task.cancel()

    def close(self) -> None:
        for rank in list(self.quiet):
            self.forget(rank)


__all__ = ["QUIET_ASK_S", "REREAD_S", "Asker", "Quiet"]
