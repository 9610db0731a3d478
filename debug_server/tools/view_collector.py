"""The post-mortem viewer's collector (``fanout.collector.Collector``): answers from files.

The frontend's handlers ask a collector for every rank's FR dump and stacks; :class:`DiskCollector`
answers from the cycle the request chose (:data:`CURRENT`, set by ``tools/view.py``'s
middleware for the length of the request) instead of asking live workers.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Mapping, Sequence
from typing import Any

from debug_server.analysis.digest import DigestMemo
from debug_server.fanout.reply import FrData
from debug_server.fanout.transport import FAILED, OK, RankResult, RankStates
from debug_server.protocol.addrs import WorkerAddr
from debug_server.protocol.names import (
    C10D_FR_HANDLER,
    FR_HANDLER,
    HEALTH_HANDLER,
    STACKS_HANDLER,
)
from debug_server.tools.view_disk import CycleData

CURRENT: contextvars.ContextVar[CycleData] = contextvars.ContextVar("debug_server_view_cycle")
"""The cycle the request being served chose (a context variable: one per request's task)."""


def _current() -> CycleData:
    try:
        return CURRENT.get()
    except LookupError:  # outside a request (e.g. /metrics before any page): nothing chosen
        return CycleData(None)


class DiskRegistry:
    """The ranks of the chosen cycle; their "address" is the file their data came from."""

    @property
    def world_size(self) -> int:
        return _current().world_size

    async def lookup(self) -> list[WorkerAddr]:
        data = _current()
        fr, st = data.sources()
        return [WorkerAddr(r, fr or st or None) for r in range(data.world_size)]

    def close(self) -> None:
        pass


class DiskCollector:
    """``fanout.collector.Collector`` over the chosen cycle's files instead of live workers.

    Extra keyword arguments (new fetch options of the live collector) are accepted and
    ignored: on disk there is one recorded answer per rank.
    """

    def __init__(self) -> None:
        self.registry = DiskRegistry()
        self.states = RankStates()
        self.digest_memo: DigestMemo | None = None
        """Each cycle read from disk is new objects: nothing to digest again."""

    @property
    def world_size(self) -> int:
        return _current().world_size

    def data_time_ns(self) -> int:
        c = _current().cycle
        return int((c.mtime if c else time.time()) * 1e9)

    async def fetch(self, handler: str, params: Mapping[str, str] | None = None,
                    addrs: Sequence[WorkerAddr] | None = None, **_: Any) -> list[RankResult]:
        if handler == STACKS_HANDLER:
            return await self.stacks(addrs)
        if handler in (FR_HANDLER, C10D_FR_HANDLER):
            return (await self.fr(only_active=False, addrs=addrs)).results
        # Health, profiles...: nothing was recorded; 404 reads as "no health check" on the pages.
        return [RankResult(r, None, FAILED, error=f"rank {r}: {handler} not recorded "
                           "(post-mortem)", http_status=404) for r in _ranks(addrs)]

    async def fr_stacks(self, addrs: Sequence[WorkerAddr] | None = None,
                        ) -> tuple[FrData, list[RankResult]]:
        """The live collector's pair for a page that shows both (``LiveCollector.fr_stacks``)."""
        return await self.fr(addrs=addrs), await self.stacks(addrs)

    async def fr_stacks_health(self, addrs: Sequence[WorkerAddr] | None = None,
                               ) -> tuple[FrData, list[RankResult], list[RankResult]]:
        """``fr_stacks`` and the health, which a cycle does not record (``fetch``)."""
        fr, stacks = await self.fr_stacks(addrs)
        return fr, stacks, await self.fetch(HEALTH_HANDLER, None, addrs)

    async def fr(self, *, only_active: bool = False, whole: bool = False,
                 addrs: Sequence[WorkerAddr] | None = None, **_: Any) -> FrData:
        """The recorded rings; ``only_active``: the ops not completed, as a worker would send.

        The live collector's default window (each communicator from its frontier) exists to
        bound what crosses the network; on disk the whole ring costs nothing more, so it is
        what the default (and ``whole``) gives.
        """
        data = _current()
        src, _st = data.sources()
        results, dumps = [], {}
        active: dict[int, list[Any]] = {}
        for r in _ranks(addrs):
            dump = data.dumps.get(r)
            if dump is None:
                why = data.fr_errors.get(r) or f"no Flight Recorder data in {src or 'this cycle'}"
                # A snapshot records a failed rank as its own line ("rank 1: unreachable ...").
                line = why if why.startswith(f"rank {r}: ") else f"rank {r}: {why}"
                results.append(RankResult(r, src or None, FAILED, error=line))
                continue
            if only_active and not whole:  # as the worker's onlyactive: ops not completed
                ents = dump.get("entries")
                kept = active.get(id(ents))  # ranks alike share entries: filtered once, shared
                if kept is None:
                    kept = active[id(ents)] = [e for e in ents or ()
                                               if not (isinstance(e, dict)
                                                       and e.get("state") == "completed")]
                dump = {**dump, "entries": kept}
            dumps[r] = dump
            results.append(RankResult(r, src or None, OK))
        return FrData(results, dumps, scope=f"as the dumper wrote them to {src or 'this cycle'}")

    async def stacks(self, addrs: Sequence[WorkerAddr] | None = None,
                     **_: Any) -> list[RankResult]:
        data = _current()
        _fr, src = data.sources()
        out = []
        for r in _ranks(addrs):
            text = data.stacks.get(r)
            if text is not None:
                out.append(RankResult(r, src or None, OK, body=text))
            else:
                why = data.stack_errors.get(r) or f"rank {r}: no stacks in {src or 'this cycle'}"
                out.append(RankResult(r, src or None, FAILED, error=why))
        return out


def _ranks(addrs: Sequence[WorkerAddr] | None) -> list[int]:
    if addrs is not None:
        return [a.rank for a in addrs]
    return list(range(_current().world_size))
