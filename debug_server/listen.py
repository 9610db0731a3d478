"""Listening sockets with one port for every address family.

``web.TCPSite(runner, None, 0)`` lets asyncio bind one socket per address family, and each
socket gets its own ephemeral port. A worker that registers one of those ports can then be
unreachable over the other family: on two hosts the registered port was the IPv6 one, and
every IPv4 connection to it was refused (issue 19). Here the first address is bound (with
port 0 the OS picks the port), and every other address of the host is bound on that same port.
IPv6 sockets are ``IPV6_V6ONLY`` so that IPv4 traffic goes to the IPv4 socket, as asyncio does
it. A host without IPv6 gets only the IPv4 socket. Both the worker and the frontend use this.

``own_server`` and ``stop_on_signals`` are the lifetime of a server that is its process's own
(the frontend process, the post-mortem viewer), never one inside a trainer.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from typing import NoReturn

from aiohttp import web

logger = logging.getLogger(__name__)

_FAMILY_UNAVAILABLE = frozenset({errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL, errno.EPROTONOSUPPORT})
"""What binding gives where a family or an address does not exist here (an IPv4-only host)."""
PICK_ATTEMPTS = 8
"""Tries for port 0: the port the OS picked for IPv4 may already be taken for IPv6."""

SockAddr = tuple[str, int] | tuple[str, int, int, int]


def bind_addresses(host: str | None) -> list[tuple[socket.AddressFamily, SockAddr]]:
    """The addresses that serving ``host`` means: IPv4 first, then IPv6, without repeats.

    None or ``""`` means every interface of both families (``0.0.0.0`` and ``::``). A name
    such as ``localhost`` can stand for one address of each family.
    """
    if host in (None, ""):
        return [(socket.AF_INET, ("0.0.0.0", 0)), (socket.AF_INET6, ("::", 0, 0, 0))]
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    out: list[tuple[socket.AddressFamily, SockAddr]] = []
    seen: set[tuple[socket.AddressFamily, str]] = set()
    for family, _, _, _, sockaddr in sorted(infos, key=lambda i: i[0] != socket.AF_INET):
        if family not in (socket.AF_INET, socket.AF_INET6) or (family, sockaddr[0]) in seen:
            continue
        seen.add((family, sockaddr[0]))
        out.append((family, sockaddr))
    return out


def _bind(family: socket.AddressFamily, sockaddr: SockAddr, port: int) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # As asyncio does on Unix: a restarted server can take its port back at once, while
        # connections of the previous one are still in TIME_WAIT.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((sockaddr[0], port, *sockaddr[2:]))
    except BaseException:
        sock.close()
        raise
    return sock


def bind_one_port(host: str | None, port: int) -> list[socket.socket]:
    """Bound (not yet listening) sockets for every address of ``host``, all on one port.

    ``port`` 0 lets the OS pick it for the first address. An address whose family this host
    lacks is skipped; any other error (the port is taken) raises ``OSError``, with no socket
    left open.
    """
    addrs = bind_addresses(host)
    if not addrs:
        raise OSError(errno.EADDRNOTAVAIL, f"{host!r} has no IPv4 or IPv6 address to bind")
    for attempt in range(PICK_ATTEMPTS if port == 0 else 1):
        socks: list[socket.socket] = []
        chosen = port
        try:
            first_error: OSError | None = None
            for family, sockaddr in addrs:
                try:
                    sock = _bind(family, sockaddr, chosen)
                except OSError as e:
                    if e.errno not in _FAMILY_UNAVAILABLE:
                        raise
                    logger.debug("debug_server: not serving %s (%s)", sockaddr[0], e.strerror or e)
                    first_error = first_error or e
                    continue
                socks.append(sock)
                chosen = sock.getsockname()[1]
            if not socks:
                assert first_error is not None
                raise first_error
            return socks
        except OSError as e:
            for s in socks:
                s.close()
            # The OS picked a port for the first family that another family already uses:
            # pick again. An explicit port that is taken is the caller's to report.
            if not (port == 0 and socks and e.errno == errno.EADDRINUSE
                    and attempt < PICK_ATTEMPTS - 1):
                raise
    raise AssertionError("unreachable")  # the loop returns or raises


async def start_sites(runner: web.AppRunner, host: str | None, port: int) -> int:
    """Serve ``runner`` on every address of ``host`` on one port; returns that port."""
    socks = bind_one_port(host, port)
    started = 0
    try:
        for sock in socks:
            await web.SockSite(runner, sock).start()
            started += 1
    finally:
        for sock in socks[started:]:  # only when a site failed to start
            sock.close()
    return int(socks[0].getsockname()[1])


@contextlib.asynccontextmanager
async def own_server(app: web.Application) -> AsyncIterator[web.AppRunner]:
    """``app``'s runner, set up on entry and cleaned up on exit: no aiohttp signal handlers
    (``stop_on_signals`` sets an event instead) and at most 2 s for open requests at the end."""
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=2.0, access_log=None)
    await runner.setup()
    try:
        yield runner
    finally:
        await runner.cleanup()


def stop_on_signals(stop: asyncio.Event) -> None:
    """SIGTERM and SIGINT set ``stop``. Only in a process that is the server's own: a trainer's
    signals are the trainer's."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)


def exit_now(code: int) -> NoReturn:
    """End a process of our own (the frontend, an agent) without finalizing the interpreter.

    Its work is done and its output flushed; what is left are daemon threads that may sit in
    a C++ call (a store client's connect to a store that went away retries for its whole
    timeout). Finalizing with one there ends it by ``pthread_exit`` through C++ frames and the
    process aborts; waiting for it holds the port and the job's log for seconds.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
