"""Ranks that are gone, and the frontend outliving rank 0.

The frontend is rank 0's child, but the job does not end with rank 0: the OOM killer takes rank 0
first, or rank 0 finishes its data early, while the other ranks hang on until their timeout.
Those are the moments the pages are for. So:

- **The frontend stays** (``watch``) while its parent (rank 0) lives; once the parent is gone,
  while any rank still answers, any rank's process on this host still runs, or the job's store
  answers while some rank is not known gone; and exits when none of these has held for
  ``orphan_exit_s`` (default 120 s), or at once when every rank is known gone (the job ended:
  the next job wants the port). Rank 0 leaving normally does not end it either (uneven data:
  rank 0 done while the others hang), so ``start_debug_server``'s exit hook leaves it running.
- **A rank that disappeared is shown as gone** (``Departures``), with how where this host can
  tell: rank 0 is the frontend's parent; a rank on this host ended as ``/proc`` says (its exit
  code or signal while its parent has not reaped it yet); any other rank "unreachable since
  <time>" (its worker refuses connections).
- **Its last data stays** (``KeepLast``, wrapped around the collector the pages, the dumper and
  the hang watch share): the FR dump and stacks of the last fetch that reached it, marked with
  their age. The verdict keeps using them: a rank that completed its part before it died is not
  "missing" from anything.

When the store was hosted by rank 0 (``MASTER_ADDR:PORT`` on rank 0, as ``srun`` jobs do), the
registry keeps serving the addresses it last read (``discovery.StoreRegistry``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from debug_server.fanout.reply import FrData
from debug_server.fanout.transport import GONE, OK, UNREACHABLE, RankResult
from debug_server.rank import jobpids
from debug_server.rank.discovery import WorkerAddr

logger = logging.getLogger(__name__)

POLL_S = 1.0
"""How often the frontend looks at its parent, and (once it is gone) at the job."""


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


class Departures:
    """Which ranks are gone, since when and how (one line each)."""

    def __init__(self) -> None:
        self.gone: dict[int, tuple[float, str]] = {}
        self.last_answer = time.monotonic()
        """``time.monotonic()`` of the last reply from any rank."""

    @staticmethod
    def _certainty(how: str) -> int:
        if how.startswith(("killed by", "exited with")):
            return 2
        return 0 if how.startswith("unreachable") else 1

    def mark(self, rank: int, how: str, since: float | None = None) -> None:
        """``how``: a known end ("killed by SIGKILL") wins over "its process has ended", which
        wins over a guess ("unreachable since ...")."""
        old = self.gone.get(rank)
        if old is not None and self._certainty(how) <= self._certainty(old[1]):
            return
        at = old[0] if old is not None else time.time() if since is None else since
        self.gone[rank] = (at, how)
        # An unreachable rank is already logged by the fan-out (RankStates): once is enough.
        logger.log(logging.INFO if self._certainty(how) == 0 else logging.WARNING,
                   "debug_server frontend: rank %d is gone (%s)", rank, how)

    def ended(self, rank: int) -> bool:
        """Whether the rank is known to have ended (not only unreachable)."""
        return rank in self.gone and self._certainty(self.gone[rank][1]) > 0

    def seen(self, results: Sequence[RankResult]) -> None:
        """A fetch's records: a rank that answered is back; one refusing connections is gone."""
        answered = False
        for r in results:
            if r.status == OK or r.http_status is not None:  # not GONE: that is our own record
                answered = True
                if r.rank in self.gone and self.gone[r.rank][1].startswith("unreachable"):
                    del self.gone[r.rank]
            elif r.status == UNREACHABLE and r.rank not in self.gone:
                self.mark(r.rank, f"unreachable since {_clock(time.time())}")
        if answered:
            self.last_answer = time.monotonic()

    def line(self, rank: int, age_s: float | None = None) -> str | None:
        """``rank 0: gone (killed by SIGKILL at 23:41:07); its FR data and stacks are from 12 s
        ago`` (with ``age_s``), or None while the rank is not gone."""
        if rank not in self.gone:
            return None
        at, how = self.gone[rank]
        when = "" if how.startswith("unreachable") else f" at {_clock(at)}"
        age = "" if age_s is None else f"; its FR data and stacks are from {age_s:.0f} s ago"
        return f"rank {rank}: gone ({how}{when}){age}"


class KeepLast:
    """The collector, with the last data of every rank kept for when the rank is gone.

    Everything but ``fetch``, ``fr``, ``stacks`` and ``fr_stacks`` passes through.
    """

    def __init__(self, inner: Any, departures: Departures) -> None:
        self._inner = inner
        self.departures = departures
        self._fr: dict[int, tuple[dict[str, Any], str | None, float]] = {}
        self._stacks: dict[int, tuple[str, float]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # isinstance(x, Collector) holds for the wrapped collector
        return type(self._inner)

    def _age(self, rank: int, kept: Mapping[int, tuple[Any, ...]]) -> float | None:
        return time.monotonic() - kept[rank][-1] if rank in kept else None

    def _relabel(self, results: list[RankResult]) -> list[RankResult]:
        # A failed record of a rank known to have ended says how; one that only refuses
        # connections keeps its own line ("unreachable after 0.0 s (...)").
        for r in results:
            if r.status != OK and self.departures.ended(r.rank):
                r.error = (self.departures.line(r.rank) or "").split(": ", 1)[1]
        return results

    async def fetch(self, handler: str, params: Mapping[str, str] | None = None,
                    addrs: Sequence[WorkerAddr] | None = None,
                    each: Callable[[RankResult], Awaitable[None]] | None = None,
                    ) -> list[RankResult]:
        results = await self._inner.fetch(handler, params, addrs, each)
        self.departures.seen(results)
        return self._relabel(results)

    def _keep_fr(self, data: FrData) -> FrData:
        self.departures.seen(data.results)
        now = time.monotonic()
        bodies = {r.rank: r.body for r in data.results}
        for rank, dump in data.dumps.items():
            self._fr[rank] = (dump, bodies.get(rank), now)
        for i, r in enumerate(data.results):
            if r.rank in data.dumps or r.rank not in self._fr:
                continue
            line = self.departures.line(r.rank, self._age(r.rank, self._fr))
            if line is None:
                continue
            dump, body, _ = self._fr[r.rank]
            data.dumps[r.rank] = dump
            data.results[i] = RankResult(r.rank, r.url, GONE, body or "", None, r.elapsed_s, None,
                                         note=line.split(": ", 1)[1])
        return data

    def _keep_stacks(self, results: list[RankResult]) -> list[RankResult]:
        self.departures.seen(results)
        now = time.monotonic()
        for i, r in enumerate(results):
            if r.status == OK and r.body is not None:
                self._stacks[r.rank] = (r.body, now)
                continue
            line = self.departures.line(r.rank, self._age(r.rank, self._stacks))
            if line is None or r.rank not in self._stacks:
                continue
            results[i] = RankResult(r.rank, r.url, GONE, f"{line}\n{self._stacks[r.rank][0]}",
                                    None, r.elapsed_s, None, note=line.split(": ", 1)[1])
        return self._relabel(results)

    async def fr(self, **kw: Any) -> FrData:
        return self._keep_fr(await self._inner.fr(**kw))

    async def stacks(self, addrs: Sequence[WorkerAddr] | None = None, **kw: Any) -> list[RankResult]:
        return self._keep_stacks(await self._inner.stacks(addrs, **kw))

    async def fr_stacks(self, addrs: Sequence[WorkerAddr] | None = None,
                        ) -> tuple[FrData, list[RankResult]]:
        fr, stacks = await self._inner.fr_stacks(addrs)
        return self._keep_fr(fr), self._keep_stacks(stacks)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def running_here(addrs: Sequence[WorkerAddr], host: str | None = None) -> bool:
    """Whether a rank announced on this host still runs (``jobpids.running_here``)."""
    return jobpids.running_here(addrs, host)


def local_fates(addrs: Sequence[WorkerAddr], departures: Departures,
                host: str | None = None) -> bool:
    """Mark the ranks of this host whose process ended; True if one of them still runs."""
    running = False
    for rank, how in jobpids.local_fates(addrs, host):
        if how is None:
            running = True
        else:
            departures.mark(rank, how)
    return running


async def watch(parent_pid: int | None, registry: Any, departures: Departures,
                exit_after_s: float, shutdown: asyncio.Event) -> None:
    """Keep serving while rank 0 or the job lives; set ``shutdown`` once neither has for
    ``exit_after_s`` seconds (see the module's docstring)."""
    was_child = parent_pid is not None and os.getppid() == parent_pid
    parent_gone = parent_pid is None
    last_alive = time.monotonic()
    all_gone_polls = 0
    while True:
        await asyncio.sleep(POLL_S)
        if not parent_gone:
            assert parent_pid is not None
            # getppid() changes when the parent dies (re-parenting); it also guards against
            # pid reuse.
            if not ((was_child and os.getppid() != parent_pid) or not _alive(parent_pid)):
                continue
            parent_gone = True
            departures.mark(0, f"the frontend's parent process {parent_pid} ended")
            logger.warning("debug_server frontend: parent process %d (rank 0) is gone; serving "
                           "while the job lives (exit after %.0f s without a sign of it)",
                           parent_pid, exit_after_s)
        addrs = await registry.lookup()
        running = local_fates(addrs, departures)
        # The store alone keeps the pages up only while a rank may still be alive somewhere
        # (torchrun's agent hosts it until the last rank ends; a test's or a launcher's store
        # may outlive every rank).
        store_up = getattr(registry, "store_lost_at", 0) is None and \
            any(a.rank not in departures.gone for a in addrs)
        now = time.monotonic()
        if running or store_up or now - departures.last_answer < exit_after_s:
            last_alive = max(last_alive, now if running or store_up else departures.last_answer)
        # Every rank known gone (the job ended, rank 0 last or first): nothing left to show
        # live, and the port is wanted by the next job; two polls in a row, so a rank that
        # only missed one fetch is not taken for gone.
        every_gone = bool(addrs) and all(a.rank in departures.gone for a in addrs)
        all_gone_polls = all_gone_polls + 1 if every_gone and not running else 0
        if now - last_alive >= exit_after_s or all_gone_polls >= 2:
            logger.warning("debug_server frontend: %s; exiting", "every rank of the job is gone"
                           if all_gone_polls >= 2 else f"no rank of the job has answered and its "
                           f"store is unreachable for {exit_after_s:.0f} s")
            shutdown.set()
            return


__all__ = ["Departures", "KeepLast", "local_fates", "running_here", "watch"]
