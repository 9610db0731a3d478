"""A rank's registration in the job's TCPStore, and its view of its peers.

``register_worker`` writes the keys ``protocol.addrs`` names (URL first, then the sidecar that
says which restart wrote it); ``advertise`` picks the address the others reach this rank at;
``Peers`` is a worker's view of its job's announced ranks. Reading the store from outside the
ranks is ``readers.storeview``.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, NamedTuple

from debug_server.config import HOST_ENV as HOST_ENV
from debug_server.config import JobEnv, is_loopback
from debug_server.errors import first_line
from debug_server.protocol.addrs import meta_key, url_key
from debug_server.readers import jobpids
from debug_server.readers.storeview import lookup_workers, store_client

if TYPE_CHECKING:
    import torch.distributed as dist

logger = logging.getLogger(__name__)

PEERS_REFRESH_S = 1.0


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
            if pid not in self._by_pid and time.monotonic() - self._read_at > PEERS_REFRESH_S:
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
