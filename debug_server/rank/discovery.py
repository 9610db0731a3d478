"""Finding the per-rank workers through the job's TCPStore.

Each worker writes ``debug_server/rank{R}`` = ``http://<host>:<port>`` (the key torch's own
debug server uses, through the same ``PrefixStore``), then a sidecar ``debug_server/rank{R}_meta``
= JSON ``{"restart", "run_id", "pid", "host", "start", "uid", ...}``. Readers never block on a missing key: they ``check``
first, so a rank that never registered is reported at once as "not registered". A key whose
sidecar names another elastic restart is stale and not trusted; a key without a sidecar (torch's
C++ worker) is trusted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from debug_server.config import HOST_ENV as HOST_ENV
from debug_server.config import JobEnv, is_loopback
from debug_server.errors import first_line
from debug_server.rank import jobpids

if TYPE_CHECKING:
    import torch.distributed as dist

logger = logging.getLogger(__name__)

T = TypeVar("T")

PREFIX = "debug_server"
NOT_REGISTERED = "not registered"


def url_key(rank: int) -> str:
    return f"rank{rank}"


def meta_key(rank: int) -> str:
    return f"rank{rank}_meta"


@dataclass(slots=True, frozen=True)
class WorkerAddr:
    """Where rank ``rank``'s worker listens, or why it is not known (``url`` None)."""

    rank: int
    url: str | None
    error: str | None = None
    meta: dict[str, Any] | None = None
    """The registration sidecar (pid, host, signal-stacks info); None for torch's own worker."""


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


# HOST_ENV (config.Settings.host): the address (or name) this rank's servers advertise to the
# others; wins over any guess.
WILDCARD_HOSTS = (None, "", "0.0.0.0", "::")


class Advertised(NamedTuple):
    """The address other hosts use to reach this process's servers, and how it was chosen."""

    host: str
    how: str
    reachable: bool = True
    """False when only this host can use it (a loopback address)."""


def route_source(dest: str, port: int) -> str | None:
    """The local address this host sends from to reach ``dest``, or None if it has no route.

    A UDP ``connect`` only asks the kernel for a route: no packet leaves the host.
    """
    try:
        infos = socket.getaddrinfo(dest, port, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return None
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(sockaddr)
                return str(s.getsockname()[0])
        except OSError:
            continue
    return None


def hostname_addresses() -> list[str]:
    """What ``gethostname()`` resolves to here, IPv4 first (empty when it does not resolve)."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    addrs = [str(i[4][0]) for i in sorted(infos, key=lambda i: i[0] != socket.AF_INET)]
    return list(dict.fromkeys(addrs))


def interface_addresses() -> list[str]:
    """IPv4 addresses of this host's interfaces, in interface order (Linux; else empty)."""
    try:
        import fcntl
        import struct

        names = [name for _, name in socket.if_nameindex()]
    except (ImportError, OSError):
        return []
    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            try:  # SIOCGIFADDR: the interface's IPv4 address
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            out.append(socket.inet_ntoa(raw[20:24]))
    return out


def advertise(bind_host: str | None, master_addr: str | None = None, master_port: int = 0,
              override: str | None = None) -> Advertised:
    """The address other hosts use to reach a server bound to ``bind_host``.

    In order: a loopback bind address (nothing else reaches it); ``override``
    (``Settings.host``, as the entry point read it); an
    explicit bind address (``host=``); the local address of the interface that reaches
    ``MASTER_ADDR`` (the one the job's own rendezvous uses); the host name's own non-loopback
    address; the first non-loopback interface address. A loopback address is the last resort
    only: a host name that resolves to ``127.0.1.1`` (the Debian default), or a
    ``MASTER_ADDR`` that is this host's own name, must not make the frontend on another host
    call itself.
    """
    if bind_host is not None and bind_host not in WILDCARD_HOSTS and is_loopback(bind_host):
        # Nothing else can reach a loopback bind, whatever the environment says (a cluster-wide
        # HOST_ENV must not break a single-host job).
        return Advertised(bind_host, "the bind address (loopback: this host only)",
                          reachable=False)
    if override:
        return Advertised(override, f"${HOST_ENV}")
    if bind_host is not None and bind_host not in WILDCARD_HOSTS:
        return Advertised(bind_host, "the bind address (host=)")
    if master_addr:
        src = route_source(master_addr, master_port or 9)
        if src is not None and not is_loopback(src):
            return Advertised(src, f"the interface toward MASTER_ADDR {master_addr}")
    name = socket.gethostname()
    for addr in hostname_addresses():
        if not is_loopback(addr):
            return Advertised(addr, f"the address of host name {name}")
    for addr in interface_addresses():
        if not is_loopback(addr):
            return Advertised(addr, "the first non-loopback interface address")
    return Advertised("127.0.0.1", "no non-loopback address found", reachable=False)


def advertised_host(bind_host: str | None, master_addr: str | None = None,
                    master_port: int = 0) -> str:
    """The address other hosts use to reach a server bound to ``bind_host`` (see ``advertise``)."""
    return advertise(bind_host, master_addr, master_port).host


def register_worker(store: dist.Store, job: JobEnv, url: str,
                    extra: dict[str, Any] | None = None) -> None:
    """Publish this rank's worker URL, then the sidecar that says which restart wrote it.

    URL first: a reader that sees the new URL with the old sidecar distrusts it for a moment,
    which is safer than trusting an old URL next to a new sidecar. The sidecar also carries the
    rank's announcement (``jobpids.identity``: pid, host, start time, uid), so a reader on the
    same host may read it with py-spy or by signal (``sigstack``).
    """
    # pid, host, start time and uid: the announcement that lets readers on this host read this
    # process, and no other (jobpids.check).
    meta = {"restart": job.restart_count, "run_id": job.run_id, **jobpids.identity(),
            **(extra or {})}
    store.set(url_key(job.rank), url)
    store.set(meta_key(job.rank), json.dumps(meta))


def _stale_reason(meta_raw: bytes | None, restart_count: int) -> str | None:
    if meta_raw is None:
        return None  # no sidecar: torch's own worker, trusted
    try:
        meta: Any = json.loads(meta_raw)
        restart = int(meta["restart"])
    except (ValueError, KeyError, TypeError):
        return f"{NOT_REGISTERED} (unreadable registration metadata)"
    if restart != restart_count:
        return f"{NOT_REGISTERED} (stale key from restart {restart}, job is at restart {restart_count})"
    return None


def lookup_workers(store: dist.Store, world_size: int, restart_count: int) -> list[WorkerAddr]:
    """One ``WorkerAddr`` per rank; never waits for a key that is not there."""
    ranks = range(world_size)
    if store.check([url_key(r) for r in ranks]):
        present = list(ranks)
    else:
        present = [r for r in ranks if store.check([url_key(r)])]
    # One round trip where every rank has its sidecar (ours do), one per rank otherwise
    # (16384 round trips took 1.1 s of every page).
    with_meta = present if present and store.check([meta_key(r) for r in present]) else [
        r for r in present if store.check([meta_key(r)])]
    got_urls = _multi_get(store, present, url_key)
    got_metas = _multi_get(store, with_meta, meta_key)
    out: list[WorkerAddr] = []
    for rank in range(world_size):
        if rank not in got_urls:
            out.append(WorkerAddr(rank, None, NOT_REGISTERED))
            continue
        raw = got_metas.get(rank)
        meta = meta_dict(raw)
        # Parsed once: a sidecar of this restart is fine as it is (the usual case).
        stale = None if meta is not None and type(meta.get("restart")) is int and \
            meta["restart"] == restart_count else _stale_reason(raw, restart_count)
        if stale:
            out.append(WorkerAddr(rank, None, stale))
        else:
            out.append(WorkerAddr(rank, got_urls[rank].decode(errors="replace").rstrip("/"),
                                  meta=meta))
    return out


def meta_dict(raw: bytes | None) -> dict[str, Any] | None:
    """A rank's meta value as read from the store; None when absent or not a JSON object."""
    try:
        meta = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    return meta if isinstance(meta, dict) else None


def _multi_get(store: dist.Store, ranks: list[int], key: Callable[[int], str]) -> dict[int, bytes]:
    if not ranks:
        return {}
    return dict(zip(ranks, store.multi_get([key(r) for r in ranks]), strict=True))


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
            self._client()
        except Exception:  # the lookup reports it, once, when a page asks
            self._store = None

    def _unknown(self, why: str) -> list[WorkerAddr]:
        reason = f"{NOT_REGISTERED} (store {self._addr[0]}:{self._addr[1]} {why})"
        return [WorkerAddr(r, None, reason) for r in range(self.world_size)]

    def _lookup_sync(self) -> list[WorkerAddr]:
        if self.gone:
            return self._last if self._last is not None else self._unknown("is gone")
        try:
            out = lookup_workers(self._client(), self.world_size, self._restart)
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


class Peers:
    """A worker's view of its job's announced ranks (for ``pyspy_dump?pid=``), read from the
    store on demand; the last view is kept when the store goes away (rank 0 hosted it)."""

    def __init__(self, job: JobEnv, timeout: float = 2.0) -> None:
        self._job = job
        self._timeout = timeout
        self._store: dist.Store | None = None
        self._by_pid: dict[int, dict[str, Any]] = {}
        self._read_at = 0.0
        self._lock = threading.Lock()

    def announced(self, pid: int) -> dict[str, Any] | None:
        """The sidecar of the rank that announced ``pid`` on this host, or None."""
        with self._lock:
            if pid not in self._by_pid and time.monotonic() - self._read_at > jobpids.PEERS_REFRESH_S:
                self._refresh()
            return self._by_pid.get(pid)

    def _refresh(self) -> None:
        self._read_at = time.monotonic()
        try:
            if self._store is None:
                self._store = store_client(self._job.master_addr,
                                                     self._job.master_port, self._timeout)
            addrs = lookup_workers(self._store, self._job.world_size,
                                             self._job.restart_count)
        except Exception as e:  # the store is gone: keep what was read before
            self._store = None
            logger.info("debug_server: announced ranks not re-read: %s", first_line(e))
            return
        host = socket.gethostname()
        self._by_pid = {a.meta["pid"]: a.meta for a in addrs
                        if a.meta is not None and isinstance(a.meta.get("pid"), int)
                        and a.meta.get("host") == host}
