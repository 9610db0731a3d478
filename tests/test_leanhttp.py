"""The fan-out's lean HTTP client against real servers on 127.0.0.1: aiohttp apps (our workers),
and raw asyncio servers for the framings aiohttp never sends (a body up to the close, a worker
that drops a kept connection, a reply that is not HTTP)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from fakes import closed_port_url

from debug_server.auth import TOKEN_HEADER, TokenGate
from debug_server.fanout.leanhttp import BodyTooLarge, LeanClient, ProtocolError
from debug_server.fanout.transport import fan_out, fetch_one
from debug_server.protocol.addrs import WorkerAddr
from debug_server.rank.worker import StaticProvider, make_worker_app
from debug_server.tools import synthetic

RawHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


@pytest.fixture
async def client() -> AsyncIterator[LeanClient]:
    c = LeanClient(per_host=2)
    yield c
    c.close()
    await asyncio.sleep(0)  # let the transports finish closing inside this loop


@pytest.fixture
async def raw_server() -> AsyncIterator[Callable[[RawHandler], Awaitable[tuple[str, list[int]]]]]:
    """``make(handler)`` -> (URL, connections so far): ``handler(reader, writer, n)`` serves
    connection number ``n`` (from 1)."""
    servers: list[asyncio.Server] = []

    async def make(handler: RawHandler) -> tuple[str, list[int]]:
        count = [0]

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            count[0] += 1
            try:
                await handler(reader, writer, count[0])
            finally:
                writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        servers.append(server)
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", count

    yield make
    for s in servers:
        s.close()
        await s.wait_closed()


async def _request_head(reader: asyncio.StreamReader) -> bytes:
    return await reader.readuntil(b"\r\n\r\n")


async def _app_url(aiohttp_server: Any, handler: Callable[[web.Request], Awaitable[Any]]) -> str:
    app = web.Application()
    app.router.add_post("/handler/{name}", handler)
    server = await aiohttp_server(app)
    return str(server.make_url("")).rstrip("/")


async def test_successive_requests_to_one_worker_share_one_connection(
        aiohttp_server: Any, client: LeanClient) -> None:
    peers = []

    async def echo(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        return web.Response(text=f"{request.match_info['name']}:{request.query.get('n')}")

    url = await _app_url(aiohttp_server, echo)
    bodies = [await client.post(f"{url}/handler/ping?n={i}") for i in range(3)]
    assert bodies == [(200, b"ping:0"), (200, b"ping:1"), (200, b"ping:2")]
    assert len(set(peers)) == 1


async def test_a_chunked_reply_is_read_whole(aiohttp_server: Any, client: LeanClient) -> None:
    async def chunked(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for part in (b"rank 3 ", b"is in ", b"all_reduce #4"):
            await resp.write(part)
        await resp.write_eof()
        return resp

    url = await _app_url(aiohttp_server, chunked)
    assert await client.post(f"{url}/handler/x") == (200, b"rank 3 is in all_reduce #4")
    assert await client.post(f"{url}/handler/x") == (200, b"rank 3 is in all_reduce #4")


def _answers(raw: bytes) -> RawHandler:
    """A raw server's handler: reads one request's head, writes ``raw``, closes."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await _request_head(reader)
        writer.write(raw)
        await writer.drain()

    return handler


async def test_a_reply_without_length_ends_at_the_close(raw_server: Any, client: LeanClient) -> None:
    url, count = await raw_server(
        _answers(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nseq 4 on main_comm"))
    assert await client.post(f"{url}/handler/ping") == (200, b"seq 4 on main_comm")
    assert await client.post(f"{url}/handler/ping") == (200, b"seq 4 on main_comm")
    assert count[0] == 2  # never reused: the close was the body's end


async def test_a_kept_connection_the_worker_dropped_is_replaced_once(
        raw_server: Any, client: LeanClient) -> None:
    async def drops_second(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                           n: int) -> None:
        await _request_head(reader)
        writer.write(f"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nconn {n}".encode())
        await writer.drain()
        await _request_head(reader)  # a second request on this connection: dropped unanswered

    url, count = await raw_server(drops_second)
    assert await client.post(f"{url}/handler/ping") == (200, b"conn 1")
    assert await client.post(f"{url}/handler/ping") == (200, b"conn 2")
    assert count[0] == 2


async def test_a_fresh_connection_closed_unanswered_is_an_error_not_a_retry(
        raw_server: Any, client: LeanClient) -> None:
    async def drops(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await _request_head(reader)

    url, count = await raw_server(drops)
    with pytest.raises(ConnectionError):
        await client.post(f"{url}/handler/ping")
    assert count[0] == 1


async def test_a_reply_over_the_bound_is_refused(aiohttp_server: Any) -> None:
    async def big(request: web.Request) -> web.Response:
        return web.Response(body=b"x" * 100)

    url = await _app_url(aiohttp_server, big)
    c = LeanClient(max_body=99)
    try:
        with pytest.raises(BodyTooLarge, match="reply of 100 bytes exceeds 99"):
            await c.post(f"{url}/handler/x")
    finally:
        c.close()


async def test_a_reply_that_is_not_http_is_refused(raw_server: Any, client: LeanClient) -> None:
    url, _ = await raw_server(_answers(b"SSH-2.0-OpenSSH_9.6\r\n\r\n"))
    with pytest.raises(ProtocolError, match="not an HTTP/1.x reply: b'SSH-2.0-OpenSSH_9.6'"):
        await client.post(f"{url}/handler/ping")


async def test_a_timed_out_reply_never_answers_the_next_request(
        aiohttp_server: Any, client: LeanClient) -> None:
    calls = [0]
    timed_out, late_sent = asyncio.Event(), asyncio.Event()

    async def first_slow(request: web.Request) -> web.StreamResponse:
        calls[0] += 1
        if calls[0] == 1:
            await timed_out.wait()  # answer only once the client gave up on this request
            resp = web.StreamResponse()
            resp.content_length = len(b"late reply to request 1")
            try:
                await resp.prepare(request)
                await resp.write(b"late reply to request 1")
                await resp.write_eof()
            except ConnectionError:  # the client closed that connection: nothing to answer on
                pass
            finally:
                late_sent.set()
            return resp
        return web.Response(text=f"reply to request {calls[0]}")

    url = await _app_url(aiohttp_server, first_slow)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(client.post(f"{url}/handler/x"), 0.1)
    timed_out.set()
    await asyncio.wait_for(late_sent.wait(), 30)  # the late reply went out (or found no line)
    assert await client.post(f"{url}/handler/x") == (200, b"reply to request 2")


async def test_fan_out_sends_the_token_through_the_lean_client(aiohttp_server: Any) -> None:
    dump = synthetic.hang_job(2, n_entries=3, missing_rank=1)[0]
    server = await aiohttp_server(make_worker_app(StaticProvider(dump), gate=TokenGate("s3cret")))
    url = str(server.make_url("")).rstrip("/")
    with_token, without = LeanClient({TOKEN_HEADER: "s3cret"}), LeanClient()
    try:
        (ok,) = await fan_out(None, [WorkerAddr(0, url)], "ping", timeout=2,  # type: ignore[arg-type]
                              http=with_token)
        (refused,) = await fan_out(None, [WorkerAddr(1, url)], "ping", timeout=2,  # type: ignore[arg-type]
                                   http=without)
    finally:
        with_token.close()
        without.close()
    assert (ok.status, ok.body) == ("ok", "pong")
    assert (refused.status, refused.http_status) == ("failed", 401)


async def test_fetch_through_the_lean_client_marks_a_closed_port_unreachable(
        client: LeanClient) -> None:
    r = await fetch_one(None, WorkerAddr(5, closed_port_url()), "ping", None, 2.0,  # type: ignore[arg-type]
                        client)
    assert r.status == "unreachable"
    assert r.line().startswith("rank 5: unreachable after ") and "\n" not in r.line()


async def test_fetch_through_the_lean_client_marks_a_slow_worker_timed_out(
        aiohttp_server: Any, client: LeanClient) -> None:
    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.Response(text="late")

    url = await _app_url(aiohttp_server, slow)
    r = await fetch_one(None, WorkerAddr(1, url), "ping", None, 0.2, client)  # type: ignore[arg-type]
    assert r.line() == "rank 1: timed out after 0.2 s"


def test_a_header_with_a_line_break_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot be sent as is"):
        LeanClient({TOKEN_HEADER: "abc\r\nX-Evil: 1"})
