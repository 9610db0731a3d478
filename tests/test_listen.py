"""One port for every address family: the worker and the frontend bind with ``listen``."""

from __future__ import annotations

import errno
import socket
from typing import Any

import pytest
from aiohttp import web
from httpget import post

from debug_server import listen
from debug_server.rank.worker import StaticProvider, start_worker_thread


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


needs_ipv6 = pytest.mark.skipif(not _ipv6_loopback(), reason="this host has no IPv6 loopback")


def _ping(host: str, port: int) -> int:
    url = f"http://{host}:{port}/handler/ping"
    return post(url, timeout=5)[0]


def test_all_interfaces_means_ipv4_first_then_ipv6() -> None:
    assert listen.bind_addresses(None) == [
        (socket.AF_INET, ("0.0.0.0", 0)), (socket.AF_INET6, ("::", 0, 0, 0))]


@needs_ipv6
def test_worker_on_all_interfaces_answers_ipv4_and_ipv6_on_its_one_port() -> None:
    worker = start_worker_thread(StaticProvider({}), host=None, port=0)
    try:
        assert _ping("127.0.0.1", worker.port) == 200
        assert _ping("[::1]", worker.port) == 200
    finally:
        worker.stop()


@needs_ipv6
async def test_runner_addresses_share_one_port_for_both_families() -> None:
    runner = web.AppRunner(web.Application(), handle_signals=False)
    await runner.setup()
    try:
        port = await listen.start_sites(runner, None, 0)
        assert sorted((len(a), a[1]) for a in runner.addresses) == [(2, port), (4, port)]
    finally:
        await runner.cleanup()


@needs_ipv6
def test_explicit_port_taken_for_ipv6_raises_and_leaves_no_socket_open() -> None:
    with socket.socket(socket.AF_INET6) as v6:
        v6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        v6.bind(("::", 0))
        port = v6.getsockname()[1]
        with pytest.raises(OSError) as e:
            listen.bind_one_port(None, port)
        assert e.value.errno == errno.EADDRINUSE
        with socket.socket() as v4:  # the IPv4 socket of the failed attempt was closed
            v4.bind(("0.0.0.0", port))


def test_port_0_taken_for_ipv6_is_picked_again(monkeypatch: Any) -> None:
    # The race is the OS's to decide (the IPv4 port it picks may be held by an IPv6-only
    # socket elsewhere); here the first IPv6 bind is told so, as the OS would.
    real_bind, calls = listen._bind, []

    def bind(family: socket.AddressFamily, sockaddr: listen.SockAddr, port: int) -> socket.socket:
        calls.append((family, port))
        if family == socket.AF_INET6 and len(calls) == 2:
            raise OSError(errno.EADDRINUSE, "Address already in use")
        return real_bind(family, sockaddr, port)

    monkeypatch.setattr(listen, "_bind", bind)
    socks = listen.bind_one_port(None, 0)
    try:
        assert [f for f, _ in calls] == [socket.AF_INET, socket.AF_INET6, socket.AF_INET,
                                         socket.AF_INET6]
        assert calls[0][1] == 0 and calls[2][1] == 0  # the OS picks a new port for IPv4
        assert len({s.getsockname()[1] for s in socks}) == 1
    finally:
        for s in socks:
            s.close()


def test_host_without_ipv6_serves_ipv4_alone(monkeypatch: Any) -> None:
    real_bind = listen._bind

    def bind(family: socket.AddressFamily, sockaddr: listen.SockAddr, port: int) -> socket.socket:
        if family == socket.AF_INET6:  # what a kernel without IPv6 answers
            raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
        return real_bind(family, sockaddr, port)

    monkeypatch.setattr(listen, "_bind", bind)
    socks = listen.bind_one_port(None, 0)
    try:
        assert [s.family for s in socks] == [socket.AF_INET]
    finally:
        for s in socks:
            s.close()


def test_explicit_loopback_binds_that_address_only() -> None:
    (sock,) = listen.bind_one_port("127.0.0.1", 0)
    with sock:
        assert sock.getsockname()[0] == "127.0.0.1"
