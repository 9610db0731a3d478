"""Ranks that are gone, and the frontend outliving rank 0.

The frontend is rank 0's child, but the job does not end with rank 0: the OOM killer takes rank 0
first, or rank 0 finishes its data early, while the other ranks hang on until their timeout.
Those are the moments the pages are for. So:

- **The frontend stays** (``watch``) while its parent (rank 0) lives; once the parent is gone,
  while any rank still answers, any rank's process on this host still runs, or the job's store
  answers while some rank is not known gone; and exits when none of these has held for
  ``orphan_exit_s`` (default 120 s), or at once when every rank is known gone (the job ended:
  the next job wants the port; ranks of this host are seen ending in ``/proc`` within
  ``POLL_S``). Rank 0 leaving normally does not end it either (uneven data: rank 0 done while
  the others hang), so ``start_debug_server``'s exit hook leaves it running.
- **Quiet when nothing is wrong**: a job's end is one line (``finish_line``, logged by the
  frontend as it exits). Ranks that end while others still run are said once per batch
  (``Departures.lost_line``), and only when the job has not ended within ``LOST_GRACE_S`` (a
  launcher tearing the job down after one rank failed is the job's end, not a rank lost): a
  WARNING where the end looks wrong (a signal, an exit code other than 0, unreachable), INFO
  for ranks that exited while the others go on (uneven data).
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
import contextlib
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Iterator, KeysView, Mapping, Sequence
from typing import Any

from debug_server.analysis.ranks import format_ranks
from debug_server.fanout.reply import FrData
from debug_server.fanout.transport import GONE, OK, UNREACHABLE, RankResult
from debug_server.protocol.addrs import WorkerAddr
from debug_server.readers import jobpids

logger = logging.getLogger(__name__)

POLL_S = 0.25
"""How often the frontend looks at its parent and at the processes of its host's ranks."""
LOOKUP_S = 1.0
"""How often, at most, the watch reads the store once rank 0 is gone."""
LOST_GRACE_S = 5.0
"""How long a rank may be gone while others run before it is reported (``lost_line``)."""


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


class Departures:
    """Which ranks are gone, since when and how (one line each)."""

    def __init__(self) -> None:
        self.gone: dict[int, tuple[float, str]] = {}
        self.last_answer = time.monotonic()
        """``time.monotonic()`` of the last reply from any rank."""
        self.reported: set[int] = set()
        """Ranks a ``lost_line`` has named."""

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
        # Not logged one by one: a job's end is one line (finish_line), ranks lost while the
        # others run one line per batch (lost_line); at 1000 ranks that is what a log can hold.
        logger.debug("debug_server frontend: rank %d is gone (%s)", rank, how)

    def ended(self, rank: int) -> bool:
        """Whether the rank is known to have ended (not only unreachable)."""
        return rank in self.gone and self._certainty(self.gone[rank][1]) > 0

    def seen(self, results: Sequence[RankResult]) -> None:
        """A fetch's records: a rank that answered is back; one refusing connections is gone."""
        gone = self.gone
        # Only the records that did not answer OK, and the few ranks gone, one by one: at
        # 131072 ranks a page's records are not looped over beyond this one filter.
        others = [r for r in results if r.status != OK]
        answered = len(others) < len(results)
        back = [k for k, (_, how) in gone.items() if how.startswith("unreachable")] \
            if gone and answered else []
        if back:
            ok = {r.rank for r in results if r.status == OK}
            for rank in back:
                if rank in ok:
                    del gone[rank]
                    self.reported.discard(rank)  # said again if it goes again
        for r in others:
            if r.http_status is not None:  # not GONE: that is our own record
                answered = True
                if r.rank in gone and gone[r.rank][1].startswith("unreachable"):
                    del gone[r.rank]
                    self.reported.discard(r.rank)
            elif r.status == UNREACHABLE and r.rank not in gone:
                self.mark(r.rank, f"unreachable since {_clock(time.time())}")
        if answered:
            self.last_answer = time.monotonic()

    def lost_line(self, now: float | None = None) -> tuple[int, str, list[int]] | None:
        """(log level, line, ranks) naming the ranks gone for ``LOST_GRACE_S`` and not named
        yet; call it only while some rank of the job still runs."""
        now = time.time() if now is None else now
        due = sorted(r for r, (at, _) in self.gone.items()
                     if r not in self.reported and now - at >= LOST_GRACE_S)
        if not due:
            return None
        self.reported.update(due)
        hows = {r: self.gone[r][1] for r in due}
        level = (logging.INFO if all(_kind(h) in ("exited 0", "ended") for h in hows.values())
                 else logging.WARNING)
        lost = format_ranks(due).replace(", ", ",")
        return level, (f"debug_server frontend: rank{'s' if len(due) > 1 else ''} {lost} gone "
                       f"while the others run ({_kinds(hows)})"), due

    def finish_line(self, ranks: Sequence[int]) -> str:
        """``4 ranks exited 0`` / ``ranks 0-2 ended; rank 3 killed by SIGKILL``: how the job's
        ranks ended, one phrase per way (bounded at any number of ranks)."""
        hows = {r: self.gone[r][1] if r in self.gone else "unknown" for r in ranks}
        kinds = {_kind(h) for h in hows.values()}
        if len(kinds) == 1:
            n = len(hows)
            return f"{n} rank{'s' if n != 1 else ''} {kinds.pop()}"
        return _kinds(hows)

    def line(self, rank: int, age_s: float | None = None) -> str | None:
        """``rank 0: gone (killed by SIGKILL at 23:41:07); its FR data and stacks are from 12 s
        ago`` (with ``age_s``), or None while the rank is not gone."""
        if rank not in self.gone:
            return None
        at, how = self.gone[rank]
        when = "" if how.startswith("unreachable") else f" at {_clock(at)}"
        age = "" if age_s is None else f"; its FR data and stacks are from {age_s:.0f} s ago"
        return f"rank {rank}: gone ({how}{when}){age}"


def _kind(how: str) -> str:
    """A rank's end as a phrase without times or pids: ``exited 0``, ``killed by SIGKILL``,
    ``ended`` (its process is gone, how is not known), ``unreachable``."""
    if how.startswith("exited with code "):
        return f"exited {how.removeprefix('exited with code ')}"
    if how.startswith("killed by"):
        return how
    if how.startswith("unreachable"):
        return "unreachable"
    return "ended" if "ended" in how else how


def _kinds(hows: Mapping[int, str]) -> str:
    by: dict[str, list[int]] = {}
    for rank, how in hows.items():
        by.setdefault(_kind(how), []).append(rank)
    return "; ".join(f"rank{'s' if len(rs) > 1 else ''} {format_ranks(rs).replace(', ', ',')} {k}"
                     for k, rs in sorted(by.items(), key=lambda kv: min(kv[1])))


class _FrKept(Mapping[int, tuple[dict[str, Any], str | None]]):
    """One page's FR data as ``_Kept`` holds it: rank -> (dump, body), from the page's dumps
    and the few records whose body is not empty."""

    def __init__(self, data: FrData) -> None:
        self._dumps = dict(data.dumps)  # before a gone rank's kept dump is put in
        # A rank's body once its dump is parsed is "" (fanout.reply): only others are held.
        self._bodies = {r.rank: r.body for r in data.results if r.body}

    def __getitem__(self, rank: int) -> tuple[dict[str, Any], str | None]:
        return self._dumps[rank], self._bodies.get(rank, "")

    def __iter__(self) -> Iterator[int]:
        return iter(self._dumps)

    def __len__(self) -> int:
        return len(self._dumps)

    def keys(self) -> KeysView[int]:
        return self._dumps.keys()


class _Kept:
    """Each rank's last data and when it came, at a cost per page that does not grow with the
    ranks that keep answering: the newest page's data is held as it came (one mapping, not an
    entry per rank), and only a rank missing from it has its older data moved apart."""

    def __init__(self) -> None:
        self._page: Mapping[int, Any] = {}
        self._at = 0.0
        self._older: dict[int, tuple[Any, float]] = {}

    def put(self, fresh: Mapping[int, Any], now: float) -> None:
        """``fresh``: the ranks that answered now, and their data (not changed afterwards)."""
        for r in self._page.keys() - fresh.keys():
            self._older[r] = (self._page[r], self._at)
        if self._older:
            for r in self._older.keys() & fresh.keys():
                del self._older[r]
        self._page, self._at = fresh, now

    def get(self, rank: int) -> tuple[Any, float] | None:
        """(its last data, ``time.monotonic()`` when it came), or None."""
        if rank in self._page:
            return self._page[rank], self._at
        return self._older.get(rank)


class KeepLast:
    """The collector, with the last data of every rank kept for when the rank is gone.

    Everything but ``fetch``, ``fr``, ``stacks``, ``fr_stacks`` and ``fr_stacks_health``
    passes through.
    """

    def __init__(self, inner: Any, departures: Departures) -> None:
        self._inner = inner
        self.departures = departures
        self._fr = _Kept()
        """rank -> (its dump, its record's body)."""
        self._stacks = _Kept()
        """rank -> its stacks text."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # isinstance(x, Collector) holds for the wrapped collector
        return type(self._inner)

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
        self._fr.put(_FrKept(data), now)
        if len(data.dumps) == len(data.results):
            return data  # every rank sent its dump (no loop over 131072 records for none)
        for i, r in enumerate(data.results):
            if r.rank in data.dumps:
                continue
            kept = self._fr.get(r.rank)
            line = None if kept is None else self.departures.line(r.rank, now - kept[1])
            if kept is None or line is None:
                continue
            dump, body = kept[0]
            data.dumps[r.rank] = dump
            data.results[i] = RankResult(r.rank, r.url, GONE, body or "", None, r.elapsed_s, None,
                                         note=line.split(": ", 1)[1])
        return data

    def _keep_stacks(self, results: list[RankResult]) -> list[RankResult]:
        self.departures.seen(results)
        now = time.monotonic()
        fresh = {r.rank: r.body for r in results if r.status == OK and r.body is not None}
        self._stacks.put(fresh, now)
        if len(fresh) == len(results):
            return results  # every rank answered (nothing to relabel either)
        for i, r in enumerate(results):
            if r.status == OK and r.body is not None:
                continue
            kept = self._stacks.get(r.rank)
            line = None if kept is None else self.departures.line(r.rank, now - kept[1])
            if kept is None or line is None:
                continue
            results[i] = RankResult(r.rank, r.url, GONE, f"{line}\n{kept[0]}",
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

    async def fr_stacks_health(self, addrs: Sequence[WorkerAddr] | None = None,
                               ) -> tuple[FrData, list[RankResult], list[RankResult]]:
        fr, stacks, health = await self._inner.fr_stacks_health(addrs)
        self.departures.seen(health)
        return self._keep_fr(fr), self._keep_stacks(stacks), self._relabel(health)


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


class ExitWatch:
    """Told the moment a rank of this host exits, with its exit code.

    A ``pidfd`` (Linux 5.3) of each announced rank process, in the event loop: it turns
    readable when the process exits, while its parent (the launcher) has not reaped it yet, so
    ``/proc`` still shows how it ended ("exited with code 0"). A poll every ``POLL_S`` would
    mostly come after torchrun's reap (every 0.1 s) and know only that it ended.
    """

    def __init__(self, departures: Departures, woken: asyncio.Event) -> None:
        self._departures = departures
        self._woken = woken
        self._fds: dict[int, int] = {}

    def follow(self, addrs: Sequence[WorkerAddr], host: str | None = None) -> None:
        """Watch the processes of ``addrs``' ranks on this host not watched yet."""
        if not hasattr(os, "pidfd_open"):
            return
        host = socket.gethostname() if host is None else host
        loop = asyncio.get_running_loop()
        for a in addrs:
            meta = a.meta
            if a.rank in self._fds or a.rank in self._departures.gone or meta is None or \
                    meta.get("host") != host or not isinstance(meta.get("pid"), int):
                continue
            try:
                fd = os.pidfd_open(meta["pid"])
            except OSError:  # gone already: the next poll's local_fates says how
                continue
            if jobpids.fate(meta["pid"], meta.get("start")) is not None:  # not that process
                os.close(fd)
                continue
            self._fds[a.rank] = fd
            loop.add_reader(fd, self._exited, a.rank, meta["pid"], meta.get("start"))

    def _exited(self, rank: int, pid: int, start: int | None) -> None:
        self._departures.mark(rank, jobpids.fate(pid, start) or "its process has ended")
        self._drop(rank)
        self._woken.set()

    def _drop(self, rank: int) -> None:
        fd = self._fds.pop(rank)
        asyncio.get_running_loop().remove_reader(fd)
        os.close(fd)

    def close(self) -> None:
        for rank in list(self._fds):
            self._drop(rank)


async def watch(parent_pid: int | None, registry: Any, departures: Departures,
                exit_after_s: float, shutdown: asyncio.Event) -> str:
    """Keep serving while rank 0 or the job lives; set ``shutdown`` once neither has for
    ``exit_after_s`` seconds, or once every rank is gone (see the module's docstring). Returns
    why it stopped, the phrase of the frontend's finish line."""
    woken = asyncio.Event()
    exits = ExitWatch(departures, woken)
    if hasattr(registry, "listener"):  # a rank's process followed as soon as it is known
        registry.listener = exits.follow
    try:
        return await _watch(parent_pid, registry, departures, exit_after_s, shutdown, exits,
                            woken)
    finally:
        if hasattr(registry, "listener"):
            registry.listener = None
        exits.close()


async def _watch(parent_pid: int | None, registry: Any, departures: Departures,
                 exit_after_s: float, shutdown: asyncio.Event, exits: ExitWatch,
                 woken: asyncio.Event) -> str:
    was_child = parent_pid is not None and os.getppid() == parent_pid
    parent_gone = parent_pid is None
    last_alive = time.monotonic()
    all_gone_at: float | None = None
    addrs: Sequence[WorkerAddr] = []
    looked_at = 0.0
    while True:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(woken.wait(), POLL_S)
        woken.clear()
        now = time.monotonic()
        if not parent_gone:
            assert parent_pid is not None
            # getppid() changes when the parent dies (re-parenting); it also guards against
            # pid reuse.
            parent_gone = (was_child and os.getppid() != parent_pid) or \
                not jobpids.alive(parent_pid)
            if parent_gone:
                departures.mark(0, f"the frontend's parent process {parent_pid} ended")
        store_closed = False
        if parent_gone and now - looked_at >= LOOKUP_S:
            looked_at = now
            if getattr(registry, "answered", True):
                # After the store is gone this answers the last addresses at once.
                addrs = await registry.lookup()
            else:
                # Not reached yet (a job of seconds may end before this process connects): a
                # lookup would wait behind c10d's connect; ask the port instead.
                store_closed = await registry.refuses()
        else:
            addrs = _known(registry) or addrs
        exits.follow(addrs)
        running = local_fates(addrs, departures)
        # The store alone keeps the pages up only while a rank may still be alive somewhere
        # (torchrun's agent hosts it until the last rank ends; a test's or a launcher's store
        # may outlive every rank).
        store_up = getattr(registry, "store_lost_at", 0) is None and \
            any(a.rank not in departures.gone for a in addrs)
        if not parent_gone:  # rank 0 lives: the job lives; only say which ranks it lost
            last_alive = now
            _say_lost(departures, parent_gone)
            continue
        if running or store_up or now - departures.last_answer < exit_after_s:
            last_alive = max(last_alive, now if running or store_up else departures.last_answer)
        # Every rank gone (the job ended, rank 0 last or first): nothing left to show live,
        # and the port is wanted by the next job. At once where each end is known (this
        # host's processes, rank 0); a second later where a rank only stopped answering, so
        # one that missed a fetch is not taken for gone.
        every_gone = bool(addrs) and not running and \
            all(a.rank in departures.gone for a in addrs)
        all_gone_at = (all_gone_at or now) if every_gone else None
        if every_gone and (all(departures.ended(a.rank) for a in addrs)
                           or now - all_gone_at >= 1.0):
            why = f"job finished; {departures.finish_line([a.rank for a in addrs])}"
        elif parent_gone and (store_closed or getattr(registry, "gone", False)) and \
                not _known(registry):
            # Rank 0 and the store both gone before a single lookup named a rank (a job of a
            # few seconds): the launcher ended the job, nothing is left to serve.
            why = "job finished; its store closed"
        elif now - last_alive >= exit_after_s:
            why = (f"no rank of the job has answered and its store is unreachable for "
                   f"{exit_after_s:.0f} s")
        else:
            if not every_gone:
                _say_lost(departures, parent_gone)
            continue
        shutdown.set()
        return why


def _say_lost(departures: Departures, parent_gone: bool) -> None:
    said = departures.lost_line()
    if said is not None:
        level, line, ranks = said
        logger.log(level, "%s%s", line, "; the pages stay while the job lives"
                   if 0 in ranks and parent_gone else "")


def _known(registry: Any) -> Sequence[WorkerAddr]:
    """The addresses the registry read last, without asking the store (the pages and the hang
    watch keep them fresh while rank 0 lives)."""
    last = getattr(registry, "last", None)
    return last if last is not None else []


__all__ = ["Departures", "KeepLast", "local_fates", "running_here", "watch"]
