"""Where the agent's host's ranks are: read from the job's store (only these ranks' keys), or
fixed URLs (``--worker-urls``: tests, benchmarks)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from debug_server.errors import first_line
from debug_server.protocol import addrs
from debug_server.protocol.addrs import AGENT_META_KEY as META_KEY
from debug_server.protocol.addrs import NOT_REGISTERED, WorkerAddr
from debug_server.readers import storeview

if TYPE_CHECKING:
    import torch.distributed as dist


T = TypeVar("T")


class HostRegistry:
    """This host's ranks' workers, read from the job's store (only these ranks' keys)."""

    def __init__(self, master_addr: str, master_port: int, world_size: int, restart: int,
                 ranks: Sequence[int], my_id: str | None, timeout: float) -> None:
        self.world_size = world_size
        self.ranks = list(ranks)
        self._addr = (master_addr, master_port)
        self._restart = restart
        self._id = my_id
        self._timeout = timeout
        self._store: dist.Store | None = None
        self._gone: str | None = None
        """Why the store, once reached, is no longer asked (it went away with the job)."""
        self._last: tuple[tuple[int, int], float, list[WorkerAddr]] | None = None
        """((the store's key count, how many ranks), when, the addresses) of the last read
        that found every rank registered (``_lookup_sync``)."""
        # One thread: a TCPStore client is not to be shared between threads (fr and stacks
        # of one page arrive together); a daemon one, never joined at exit (storeview.StoreLane).
        self._lane = storeview.StoreLane("debug_server.agent")

    @property
    def answered(self) -> bool:
        """The store has answered once (a lookup before that may wait out a connect)."""
        return self._store is not None or self._gone is not None

    def refuses(self) -> bool:
        """Whether nothing listens at the store's address now (``storeview.store_refuses``)."""
        return storeview.store_refuses(*self._addr)

    def store(self) -> dist.Store:
        if self._store is None:
            self._store = storeview.store_client(*self._addr, timeout=self._timeout)
        return self._store

    def _lookup_sync(self) -> list[WorkerAddr]:
        if self._gone is not None:  # never reconnect: that port may hold the next job's store
            return [WorkerAddr(r, None, self._gone) for r in self.ranks]
        reached = self._store is not None
        try:
            store = self.store()
            # Read again only when a key came or the last read is REREAD_S old (an
            # aggregator's thousand ranks' keys on every request cost it most of its page).
            count = store.num_keys()
            last = self._last
            if last is not None and last[0] == (count, len(self.ranks)) and \
                    time.monotonic() - last[1] < storeview.REREAD_S:
                return last[2]
            present = [r for r, here in zip(self.ranks, storeview.present(
                store, [addrs.url_key(r) for r in self.ranks]), strict=True) if here]
            # One round trip per chunk where every rank has its sidecar (ours do).
            with_meta = [r for r, here in zip(present, storeview.present(
                store, [addrs.meta_key(r) for r in present]), strict=True) if here]
            urls = dict(zip(present, storeview.get_many(store, [addrs.url_key(r) for r in present]),
                            strict=True))
            metas = dict(zip(with_meta, storeview.get_many(
                store, [addrs.meta_key(r) for r in with_meta]), strict=True))
        except Exception as e:  # the store is gone: every rank unknown, one reason
            self._store = None
            reason = f"{NOT_REGISTERED} (agent: store unavailable: {first_line(e, 200)})"
            if reached:
                self._gone = reason
            return [WorkerAddr(r, None, reason) for r in self.ranks]
        out = []
        for r in self.ranks:
            if r not in urls:
                out.append(WorkerAddr(r, None, NOT_REGISTERED))
                continue
            meta = addrs.meta_dict(metas.get(r))
            if r in metas and (meta is None or meta.get("restart") != self._restart):
                out.append(WorkerAddr(r, None, f"{NOT_REGISTERED} (stale or unreadable sidecar)"))
            elif self._id is not None and meta is not None and \
                    meta.get(META_KEY) not in (None, self._id):
                continue  # another host's agent serves it
            else:
                out.append(WorkerAddr(r, urls[r].decode(errors="replace").rstrip("/"), meta=meta))
        complete = all(a.url is not None for a in out) and len(out) == len(self.ranks)
        self._last = ((count, len(self.ranks)), time.monotonic(), out) if complete else None
        return out

    async def lookup(self) -> list[WorkerAddr]:
        return await self._lane.call(self._lookup_sync)

    async def on_lane(self, fn: Callable[[], T]) -> T:
        """``fn()`` on this registry's store lane (its daemon thread, its client)."""
        return await self._lane.call(fn)

    def close(self) -> None:
        self._lane.close()


class StaticHostRegistry:
    """Fixed URLs for ranks ``first..`` (benchmarks, and tests without a store)."""

    def __init__(self, urls: Sequence[str], first: int, world_size: int) -> None:
        self.world_size = world_size
        self.ranks = list(range(first, first + len(urls)))
        self._urls = [u.rstrip("/") for u in urls]

    async def lookup(self) -> list[WorkerAddr]:
        return [WorkerAddr(r, u) for r, u in zip(self.ranks, self._urls, strict=True)]

    def close(self) -> None:
        pass


__all__ = ["HostRegistry", "StaticHostRegistry"]
