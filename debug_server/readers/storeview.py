"""Reading the job's TCPStore from outside the ranks: where the workers are.

The frontend's view (``StoreRegistry``: lookups on a daemon thread of their own, the last
addresses kept once the store went away), a fixed map (``StaticRegistry``), the client and the
lookup itself. The keys and what they hold are ``protocol.addrs``'s; a rank writes them
(``rank.discovery``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from debug_server.errors import first_line
from debug_server.protocol.addrs import (
    NOT_REGISTERED,
    PREFIX,
    WorkerAddr,
    meta_dicts,
    meta_key,
    stale_reason,
    url_key,
)
from debug_server.readers import jobpids

if TYPE_CHECKING:
    import torch.distributed as dist

logger = logging.getLogger(__name__)

T = TypeVar("T")


def store_client(master_addr: str, master_port: int, timeout: float) -> dist.Store:
    """A client of the job's TCPStore under torch's ``debug_server`` prefix.

    ``timeout`` bounds the connect and any wait; readers here never wait on a missing key.
    """
    import torch.distributed as dist

    store = dist.TCPStore(
        host_name=master_addr,
        port=master_port,
        is_master=False,
        timeout=timedelta(seconds=timeout),
    )
    return dist.PrefixStore(PREFIX, store)


def store_refuses(master_addr: str, master_port: int, timeout: float = 1.0) -> bool:
    """Whether nothing listens at the store's address now: a plain TCP connect, told at once,
    where c10d's client would retry a refused connection for its whole timeout (and log each
    try with a C++ trace). The store's server takes it for a client that left at once."""
    try:
        with socket.create_connection((master_addr, master_port), timeout=timeout):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:  # no answer in time, no route: not known to be gone
        return False


STORE_CHUNK = 4096
"""Keys per ``check``/``multi_get`` call. c10d's TCPStore answers one call of n keys in time
that grows faster than n (131072 keys: 32 s for ``multi_get``, 4 s for ``check``), chunks of
4096 in linear time (131072 keys: about 1 s): every call over many keys goes through
:func:`present` and :func:`get_many`."""


def present(store: dist.Store, keys: Sequence[str]) -> list[bool]:
    """Which of ``keys`` the store holds: one ``check`` per chunk, one per key only in a chunk
    that lacks some."""
    out: list[bool] = []
    for i in range(0, len(keys), STORE_CHUNK):
        chunk = list(keys[i:i + STORE_CHUNK])
        out += [True] * len(chunk) if store.check(chunk) else [store.check([k]) for k in chunk]
    return out


def get_many(store: dist.Store, keys: Sequence[str]) -> list[bytes]:
    """``multi_get`` of ``keys`` (all present), in chunks."""
    out: list[bytes] = []
    for i in range(0, len(keys), STORE_CHUNK):
        out += store.multi_get(list(keys[i:i + STORE_CHUNK]))
    return out


@functools.lru_cache(maxsize=4)
def _keys(world_size: int) -> tuple[list[str], list[str]]:
    """Every rank's two keys (``url_key``, ``meta_key``), made once per world size: a read
    every ``reread_s`` made 262144 texts each time at 131072 ranks. Read, never changed."""
    ranks = range(world_size)
    return [url_key(r) for r in ranks], [meta_key(r) for r in ranks]


def lookup_workers(store: dist.Store, world_size: int, restart_count: int) -> list[WorkerAddr]:
    """One ``WorkerAddr`` per rank; never waits for a key that is not there."""
    url_keys, meta_keys = _keys(world_size)
    here = present(store, url_keys)
    present_ranks = [r for r in range(world_size) if here[r]]
    if len(present_ranks) < world_size:  # the keys of the ranks registered
        url_keys = [url_keys[r] for r in present_ranks]
        meta_keys = [meta_keys[r] for r in present_ranks]
    # One round trip per chunk where every rank has its sidecar (ours do).
    with_meta = [(r, k) for r, k, m in zip(present_ranks, meta_keys, present(store, meta_keys),
                                          strict=True) if m]
    got_urls = dict(zip(present_ranks, get_many(store, url_keys), strict=True))
    got_metas = dict(zip((r for r, _ in with_meta), get_many(store, [k for _, k in with_meta]),
                         strict=True))
    metas = meta_dicts(got_metas)
    out: list[WorkerAddr] = []
    add = out.append
    for rank in range(world_size):
        url = got_urls.get(rank)
        if url is None:
            add(WorkerAddr(rank, None, NOT_REGISTERED))
            continue
        meta = metas.get(rank)
        # Parsed once: a sidecar of this restart is fine as it is (the usual case).
        stale = None if meta is not None and meta.get("restart") == restart_count and \
            type(meta["restart"]) is int else stale_reason(got_metas.get(rank), restart_count)
        if stale:
            add(WorkerAddr(rank, None, stale))
        else:
            add(WorkerAddr(rank, url.decode(errors="replace").rstrip("/"), None, meta))
    return out


def same_as_before(last: list[WorkerAddr] | None, new: list[WorkerAddr]) -> list[WorkerAddr]:
    """``new``, with each address that reads as in ``last`` the very object of ``last``, and
    ``last`` itself where all do: a read again of unchanged keys (every ``REREAD_S``) makes no
    new objects, so what is held by the list's or an address's identity (the route's split of
    the ranks by aggregator, ``agentreply``'s memos per list) stays valid, and the previous read
    is not kept alive beside the new one (at 131072 ranks, ~80 MB of addresses and sidecars
    per read)."""
    if last is None or len(last) != len(new):
        return new
    same = True
    for i, (a, b) in enumerate(zip(last, new, strict=True)):
        if a is b or a == b:
            new[i] = a
        else:
            same = False
    return last if same else new


class StoreLane:
    """Blocking store calls, one at a time and in order, on a daemon thread of their own.

    A TCPStore client is not shared between threads, so one thread makes every call. Not a
    ``ThreadPoolExecutor``: the interpreter joins its threads at exit, and a call blocked on a
    store that went away (a connect retries for its whole timeout) held the frontend's exit for
    seconds, printing c10d's traces after "exiting". A daemon thread is not waited for.
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Any, Any] | None] = \
            queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """``fn()`` on the lane; its result (or exception) in the running loop's future."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self._jobs.put((fn, loop, fut))
        return fut

    def submit(self, fn: Callable[[], object]) -> None:
        """``fn()`` on the lane, nobody waiting for it."""
        self._jobs.put((fn, None, None))

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, loop, fut = job
            try:
                out, err = fn(), None
            except Exception as e:
                out, err = None, e
            if fut is not None:
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                    loop.call_soon_threadsafe(_settle, fut, out, err)

    def close(self) -> None:
        """End the thread after the call it is in (queued calls still run first)."""
        self._jobs.put(None)


def _settle(fut: asyncio.Future[Any], out: Any, err: BaseException | None) -> None:
    if fut.done():
        return
    if err is not None:
        fut.set_exception(err)
    else:
        fut.set_result(out)


REREAD_S = 30.0
"""How long the frontend trusts its last read of every rank's keys while the store's key count
stays the same (``StoreRegistry``), at least (``reread_s``)."""
REREAD_RANKS_PER_S = 1024.0
"""Above ``REREAD_S x`` this many ranks, the read again is rationed like the watches' polls: a
read of every rank's keys costs the frontend 0.5 s of CPU at 131072 ranks, landing inside
whatever page is in flight; every 30 s that was 0.18 s of each page's CPU."""


def reread_s(world_size: int) -> float:
    """Seconds between reads again of unchanged keys: ``REREAD_S``, 128 s at 131072 ranks (a
    rank that registered again over its own keys is found that much later)."""
    return max(REREAD_S, world_size / REREAD_RANKS_PER_S)


class StoreRegistry:
    """The frontend's view of the store: async lookups on one private thread (``StoreLane``).

    The connection is made lazily and retried while the store has never answered (with a plain
    ``env://`` rendezvous rank 0 creates it late). Once it has answered, a store that goes away
    is gone for good: the launcher ended the job (torchrun closes its store after the last
    rank), or rank 0 hosted it and died. It is never asked again: a store on that port now is
    the next job's, and each try would cost c10d's connect timeout. Lookups then answer the
    last addresses at once (``store_lost_at`` says since when), so a frontend that outlives
    rank 0 during a hang still serves the pages.
    ``announce``: publish this process as its host's reader (rank 0's frontend: ``jobpids``),
    once, on the first connection.
    """

    def __init__(
        self, master_addr: str, master_port: int, world_size: int, restart_count: int,
        timeout: float = 5.0, *, announce: bool = False,
    ) -> None:
        self.world_size = world_size
        self._addr = (master_addr, master_port)
        self._restart = restart_count
        self._timeout = timeout
        self._announce = announce
        self._store: dist.Store | None = None
        self._connected = False
        """The store has answered once (a connect, a lookup)."""
        self._last: list[WorkerAddr] | None = None
        self._keys = -1
        """The store's key count at the last full read (``_lookup_sync``)."""
        self._read_at = 0.0
        self._complete = False
        """Every rank was registered at the last full read (else each lookup reads again)."""
        self.store_ok_at: float | None = None
        """``time.monotonic()`` of the last lookup the store answered."""
        self.store_lost_at: float | None = None
        """``time.time()`` when the store stopped answering (None while it answers)."""
        self.listener: Callable[[list[WorkerAddr]], None] | None = None
        """Called in the event loop with each lookup's addresses (the frontend's watch follows
        new ranks' processes at once: ``departed.ExitWatch``)."""
        self._lane = StoreLane("debug_server.store")
        # Import torch and connect now, in the background: done lazily, the first page would
        # pay seconds for it, on top of a stuck rank's fetch_timeout.
        self._lane.submit(self._connect)

    @property
    def last(self) -> list[WorkerAddr] | None:
        """The addresses of the last lookup the store answered (None before one)."""
        return self._last

    @property
    def answered(self) -> bool:
        """The store has answered once (a lookup before that waits out a connect)."""
        return self._connected

    async def refuses(self) -> bool:
        """Whether nothing listens at the store's address now (``store_refuses``)."""
        return await asyncio.get_running_loop().run_in_executor(None, store_refuses, *self._addr)

    @property
    def gone(self) -> bool:
        """The store answered once and then went away: it is not asked again."""
        return self._connected and self.store_lost_at is not None

    def _client(self) -> dist.Store:
        if self._store is None:
            store = store_client(*self._addr, timeout=self._timeout)
            if self._announce and not self._connected:  # ranks here point PR_SET_PTRACER at it
                jobpids.publish_frontend(store, self._restart)
            self._store = store
            self._connected = True
        return self._store

    def _connect(self) -> None:
        try:
            store = self._client()
            # A frontend that starts after the ranks registered (attached to a running job,
            # or restarted in one) reads them now, not on the first page: at 131072 ranks,
            # 262144 keys are ~0.3 s of CPU a page asked at 3 AM need not wait for. One that
            # starts with the job finds its first and last ranks not there yet and leaves the
            # read to the first page.
            if self.world_size and store.check([url_key(0), url_key(self.world_size - 1)]):
                self._lookup_sync()
        except Exception:  # the lookup reports it, once, when a page asks
            self._store = None

    def _unknown(self, why: str) -> list[WorkerAddr]:
        reason = f"{NOT_REGISTERED} (store {self._addr[0]}:{self._addr[1]} {why})"
        return [WorkerAddr(r, None, reason) for r in range(self.world_size)]

    def _lookup_sync(self) -> list[WorkerAddr]:
        if self.gone:
            return self._last if self._last is not None else self._unknown("is gone")
        try:
            store = self._client()
            # Every rank's two keys, read and parsed, cost a page 0.2 s at 16384 ranks and
            # more than a second at 131072: read again only when a key came (a rank, an agent,
            # the tree registered) or the last read is reread_s() old (a rank that registered
            # again over its own keys).
            keys = store.num_keys()
            now = time.monotonic()
            if self._last is not None and keys == self._keys and \
                    now - self._read_at < reread_s(self.world_size) and self._complete:
                self.store_ok_at = now
                return self._last
            out = same_as_before(self._last, lookup_workers(store, self.world_size,
                                                            self._restart))
            self._keys, self._read_at = keys, time.monotonic()  # reread_s from the read's end
            self._complete = all(a.url is not None for a in out)
        except Exception as e:
            self._store = None
            if self._connected:
                # Said by the frontend's watch where it matters (ranks still run): at the
                # job's end the store closing is the launcher's normal exit.
                self.store_lost_at = time.time()
                logger.debug("debug_server: store %s:%d is gone: %s", *self._addr, first_line(e))
                return self._last if self._last is not None else self._unknown("is gone")
            out = self._unknown(f"unavailable: {first_line(e)}")
            if self.store_lost_at is None:  # never reached: something is wrong, say it once
                self.store_lost_at = time.time()
                logger.warning("debug_server: %s", out[0].error)
            return out
        self._last = out
        self.store_ok_at = time.monotonic()
        self.store_lost_at = None
        return out

    async def lookup(self) -> list[WorkerAddr]:
        if self.gone:  # no trip to the lane: a page never waits behind a store that is gone
            return self._lookup_sync()
        out = await self._lane.call(self._lookup_sync)
        if self.listener is not None:
            self.listener(out)
        return out

    @property
    def store_address(self) -> tuple[str, int]:
        """``(MASTER_ADDR, MASTER_PORT)`` of the job's store (``/tcpstore`` reads it too)."""
        return self._addr

    @property
    def restart_count(self) -> int:
        return self._restart

    @property
    def store_timeout(self) -> float:
        return self._timeout

    def close(self) -> None:
        self._lane.close()
        self._store = None


class StaticRegistry:
    """A fixed rank -> URL map (tests, benchmarks, and a frontend pointed at known workers)."""

    def __init__(self, urls: Sequence[str | None]) -> None:
        self.world_size = len(urls)
        self._urls = list(urls)

    async def lookup(self) -> list[WorkerAddr]:
        return [
            WorkerAddr(r, u.rstrip("/")) if u else WorkerAddr(r, None, NOT_REGISTERED)
            for r, u in enumerate(self._urls)
        ]

    def close(self) -> None:
        pass
