"""A lean HTTP/1.1 client for the fan-out's hot path: ``POST`` with no body, the reply read whole.

Why not aiohttp's client there: a page of a 4096-rank job sends 8192 to 12288 requests (FR,
stacks, health), and aiohttp's client spends about 90 us of CPU on each (URL objects, request
and response objects, a task per timeout): most of the frontend's CPU for the page. This client
writes one prebuilt request and parses the status line and the three headers it needs by hand:
4096 requests took 0.15 s of CPU instead of 0.37-0.47 s, and ``benchmarks/bench_frontend.py
--per-rank --memo --ranks 4096`` went from 2.08 to 1.12 s for ``/fr_trace`` (2-core box).

It reads what workers answer (aiohttp's servers: our workers and agents; torch's C++ worker):
HTTP/1.0 and 1.1 replies with ``Content-Length``, a chunked body, or a body up to the close.
Connections are kept alive, at most ``per_host`` idle ones per worker (a file descriptor each);
a kept connection that the worker closed meanwhile is replaced once, transparently. Plain
``http://`` URLs only (:meth:`LeanClient.handles`); the fan-out sends anything else through
aiohttp. Failures are the exceptions the fan-out already maps to its states: ``OSError`` /
``ConnectionError`` (unreachable), :class:`ProtocolError` (failed), :class:`BodyTooLarge`
(failed); a timeout is the caller's (it cancels :meth:`LeanClient.post`, and the connection is
dropped, never reused with a reply still on its way).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Mapping
from urllib.parse import urlsplit

__all__ = ["BodyTooLarge", "LeanClient", "ProtocolError"]

MAX_HEAD_BYTES = 64 * 1024
"""A reply whose status line and headers exceed this is refused (ours are under 300 bytes)."""
RESOLVE_TTL_S = 10.0
"""How long a host name's addresses are reused (aiohttp's DNS cache keeps them as long)."""

_LENGTH, _CHUNKED, _TO_CLOSE = 0, 1, 2
_NEED_SIZE, _TRAILERS = -1, -2


class ProtocolError(Exception):
    """The reply is not HTTP/1.x this client reads; the text is one line."""


class BodyTooLarge(Exception):
    """The reply's body exceeds the client's bound; the text is one line."""


class _Stale(ConnectionResetError):
    """The connection closed before any byte of the reply (a kept one the worker had closed)."""


class _Conn(asyncio.Protocol):
    """One keep-alive connection; one request at a time (``request``)."""

    def __init__(self, max_body: int, open_set: set[_Conn]) -> None:
        self.max_body = max_body
        self.open_set = open_set
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[tuple[int, bytes, bool]] | None = None
        self.closed = False
        self.got_bytes = False
        self._start_reply()

    def _start_reply(self) -> None:
        self.status = 0
        self.mode = _LENGTH
        self.length = 0
        self.keep = True
        self.chunk_left = _NEED_SIZE
        self.body = bytearray()

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.open_set.add(self)

    def data_received(self, data: bytes) -> None:
        if self.waiter is None or self.waiter.done():
            self.close()  # bytes nobody asked for: this connection's framing is lost
            return
        self.got_bytes = True
        self.buf += data
        try:
            self._feed()
        except (ProtocolError, BodyTooLarge) as e:
            self._fail(e)

    def eof_received(self) -> bool:
        return False  # close our side too; connection_lost settles a pending reply

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.open_set.discard(self)
        w = self.waiter
        if w is None or w.done():
            return
        if self.status and self.mode == _TO_CLOSE:
            w.set_result((self.status, bytes(self.buf), False))
        elif not self.got_bytes:
            w.set_exception(_Stale("server closed the connection before replying"))
        else:
            w.set_exception(ConnectionResetError("server disconnected in the middle of a reply"))

    # -- one request ----------------------------------------------------------------------------

    def request(self, head: bytes) -> asyncio.Future[tuple[int, bytes, bool]]:
        """Send ``head``; the future is (status, body, whether the connection may be reused)."""
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.got_bytes = False
        self._start_reply()
        self.transport.write(head)
        return self.waiter

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _fail(self, e: Exception) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(e)
        self.close()

    def _finish(self, body: bytes) -> None:
        assert self.waiter is not None
        # Bytes after the reply mean the framing is not what we think: never reuse then.
        self.waiter.set_result((self.status, body, self.keep and not self.closed and not self.buf))

    def _feed(self) -> None:
        while self.status == 0:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > MAX_HEAD_BYTES:
                    raise ProtocolError(f"reply head exceeds {MAX_HEAD_BYTES} bytes")
                return
            head = bytes(self.buf[:end])
            del self.buf[:end + 4]
            self._head(head)
            if 100 <= self.status < 200:  # an interim reply: the real one follows
                self._start_reply()
            elif self.status in (204, 304):
                self._finish(b"")
                return
        if self.mode == _LENGTH:
            if len(self.buf) >= self.length:
                body = bytes(self.buf[:self.length])
                del self.buf[:self.length]
                self._finish(body)
        elif self.mode == _CHUNKED:
            if self._chunks():
                self._finish(bytes(self.body))
        elif len(self.buf) > self.max_body:
            raise BodyTooLarge(f"reply exceeds {self.max_body} bytes")

    def _head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        first = lines[0].split(b" ", 2)
        if len(first) < 2 or not first[0].startswith(b"HTTP/1."):
            raise ProtocolError(f"not an HTTP/1.x reply: {lines[0][:60]!r}")
        try:
            self.status = int(first[1])
        except ValueError:
            raise ProtocolError(f"bad status line: {lines[0][:60]!r}") from None
        keep = first[0] == b"HTTP/1.1"
        length = None
        chunked = False
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                continue
            name = name.strip().lower()
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    raise ProtocolError(f"bad Content-Length {value[:30]!r}") from None
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"connection":
                v = value.lower()
                keep = b"close" not in v and (keep or b"keep-alive" in v)
        self.keep = keep
        if chunked:
            self.mode = _CHUNKED
        elif length is not None:
            if length > self.max_body:
                raise BodyTooLarge(f"reply of {length} bytes exceeds {self.max_body}")
            if length < 0:
                raise ProtocolError(f"bad Content-Length {length}")
            self.mode, self.length = _LENGTH, length
        else:
            self.mode, self.keep = _TO_CLOSE, False

    def _chunks(self) -> bool:
        """Move whole chunks from ``buf`` to ``body``; True once the last chunk and trailers
        are in."""
        buf = self.buf
        while True:
            if self.chunk_left == _NEED_SIZE or self.chunk_left == _TRAILERS:
                end = buf.find(b"\r\n")
                if end < 0:
                    if len(buf) > MAX_HEAD_BYTES:
                        raise ProtocolError("chunk size line too long")
                    return False
                line = bytes(buf[:end])
                del buf[:end + 2]
                if self.chunk_left == _TRAILERS:
                    if not line:
                        return True
                    continue
                try:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise ProtocolError(f"bad chunk size {line[:30]!r}") from None
                self.chunk_left = size if size > 0 else _TRAILERS
                continue
            if len(buf) < self.chunk_left + 2:
                return False
            self.body += buf[:self.chunk_left]
            del buf[:self.chunk_left + 2]
            self.chunk_left = _NEED_SIZE
            if len(self.body) > self.max_body:
                raise BodyTooLarge(f"reply exceeds {self.max_body} bytes")


class LeanClient:
    """Keep-alive ``POST`` requests with no body to plain-HTTP workers (module doc).

    ``headers`` go with every request (the job's token); ``per_host``: idle connections kept per
    worker; ``max_body``: the largest reply accepted. One event loop; :meth:`close` when done.
    """

    def __init__(self, headers: Mapping[str, str] | None = None, *, per_host: int = 1,
                 max_body: int = 256 * 1024 * 1024) -> None:
        for k, v in (headers or {}).items():
            if any(c in s for s in (k, v) for c in "\r\n") or ":" in k:
                raise ValueError(f"header {k[:40]!r} cannot be sent as is")
        self._extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self.per_host = max(1, per_host)
        self.max_body = max_body
        self._idle: dict[str, list[_Conn]] = {}
        self._open: set[_Conn] = set()
        self._addrs: dict[str, tuple[float, list[tuple[str, int]]]] = {}
        self._closed = False

    @staticmethod
    def handles(url: str) -> bool:
        """Whether :meth:`post` takes ``url`` (plain http, ASCII)."""
        return url.startswith("http://") and url.isascii()

    async def post(self, url: str, timeout: float | None = None) -> tuple[int, bytes]:
        """(status, body) of ``POST url``; raises as the module doc says, and
        ``asyncio.TimeoutError`` where no whole reply came within ``timeout`` seconds.

        ``timeout`` is one timer on the reply's future (and ``asyncio.timeout`` only around a
        new connection): a fan-out sends thousands of requests, and a timeout context per
        request cost more than the rest of this client's work for it (issue 31)."""
        netloc, _, path = url[len("http://"):].partition("/")
        head = (f"POST /{path} HTTP/1.1\r\nHost: {netloc}\r\nContent-Length: 0\r\n"
                f"{self._extra}\r\n").encode("ascii")
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        conn = self._take(netloc)
        reused = conn is not None
        try:
            if conn is None:
                conn = await self._connect_within(netloc, deadline)
            try:
                status, body, keep = await _reply(conn.request(head), deadline)
            except _Stale:
                if not reused:
                    raise
                # the kept one had been closed: once more
                conn = await self._connect_within(netloc, deadline)
                status, body, keep = await _reply(conn.request(head), deadline)
        except BaseException:
            if conn is not None:
                conn.close()  # cancelled (timed out) or broken: a late reply must not be read
            raise
        idle = self._idle.setdefault(netloc, [])
        if keep and not self._closed and len(idle) < self.per_host:
            conn.waiter = None
            idle.append(conn)
        else:
            conn.close()
        return status, body

    async def _connect_within(self, netloc: str, deadline: float | None) -> _Conn:
        if deadline is None:
            return await self._connect(netloc)
        left = deadline - asyncio.get_running_loop().time()
        return await asyncio.wait_for(self._connect(netloc), max(0.0, left))

    def close(self) -> None:
        """Close every connection (idle or in use)."""
        self._closed = True
        self._idle.clear()
        for c in list(self._open):
            c.close()

    def _take(self, netloc: str) -> _Conn | None:
        idle = self._idle.get(netloc)
        while idle:
            c = idle.pop()
            # is_closing: the worker's close arrived and connection_lost is not run yet
            if not c.closed and c.transport is not None and not c.transport.is_closing():
                return c
        return None

    async def _connect(self, netloc: str) -> _Conn:
        loop = asyncio.get_running_loop()
        last: OSError | None = None
        for host, port in await self._resolve(netloc):
            try:  # numeric hosts: asyncio connects without a resolver thread
                _, conn = await loop.create_connection(
                    lambda: _Conn(self.max_body, self._open), host, port)
                return conn
            except OSError as e:
                last = e
        raise last or OSError(f"cannot connect to {netloc}")

    async def _resolve(self, netloc: str) -> list[tuple[str, int]]:
        """``netloc``'s numeric addresses; a name is resolved once per :data:`RESOLVE_TTL_S`."""
        now = time.monotonic()
        hit = self._addrs.get(netloc)
        if hit is not None and hit[0] > now:
            return hit[1]
        parts = urlsplit(f"//{netloc}")
        try:
            host, port = parts.hostname, parts.port or 80
        except ValueError as e:
            raise ProtocolError(f"bad address {netloc[:60]!r}: {e}") from None
        if not host:
            raise ProtocolError(f"bad address {netloc[:60]!r}")
        if _numeric(host):
            addrs = [(host, port)]
        else:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port,
                                                                 type=socket.SOCK_STREAM)
            addrs = [(str(a[4][0]), port) for a in infos]
        self._addrs[netloc] = (now + RESOLVE_TTL_S, addrs)
        return addrs


async def _reply(fut: asyncio.Future[tuple[int, bytes, bool]],
                 deadline: float | None) -> tuple[int, bytes, bool]:
    if deadline is None:
        return await fut
    timer = asyncio.get_running_loop().call_at(deadline, _expire, fut)
    try:
        return await fut
    finally:
        timer.cancel()


def _expire(fut: asyncio.Future[tuple[int, bytes, bool]]) -> None:
    if not fut.done():
        fut.set_exception(asyncio.TimeoutError())


def _numeric(host: str) -> bool:
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
        except OSError:
            continue
        return True
    return False
