"""Access control: a shared secret that workers and the frontend require on multi-host jobs.

A job on one host binds loopback only and needs no secret. A job whose servers listen beyond
loopback requires a token on every request: rank 0 creates it (``secrets.token_urlsafe(32)``)
unless the user passed one, puts it in the job's TCPStore (``debug_server/auth_token_r<restart>``),
and every other rank reads it from there (bounded wait) before it registers its worker, so the
frontend never meets a worker that does not know the token yet.

Presenting the token: the header ``X-Debug-Server-Token`` (curl, the frontend's fan-out), or in
a browser once as ``/?token=...`` (the link rank 0 logs at start), which answers with a redirect
that drops the token from the address bar and sets an HttpOnly, SameSite=Strict cookie.
Missing token: 401; wrong token: 403; both with one line. Comparison is constant-time.
"""

from __future__ import annotations

import hmac
import logging
import secrets
from datetime import timedelta
from typing import TYPE_CHECKING

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from debug_server.config import TOKEN_ENV as TOKEN_ENV  # where attach and view read it
from debug_server.config import ConfigError, is_loopback

if TYPE_CHECKING:
    import torch.distributed as dist

logger = logging.getLogger(__name__)

TOKEN_HEADER = "X-Debug-Server-Token"
TOKEN_COOKIE = "debug_server_token"
TOKEN_QUERY = "token"
AUTH_MODES = ("auto", "token", "none")
TOKEN_WAIT_S = 300.0
"""How long a rank other than 0 waits for rank 0 to put the token in the store."""


def new_token() -> str:
    return secrets.token_urlsafe(32)


def token_required(mode: str, bind_host: str | None, explicit_token: str | None) -> bool:
    """Whether servers must require a token.

    ``auto``: yes when they listen beyond loopback (``bind_host`` None, ``0.0.0.0``, a real
    address) or a token was given; ``token``: always; ``none``: never.
    """
    if mode not in AUTH_MODES:
        raise ConfigError(f"auth={mode!r} must be one of {', '.join(AUTH_MODES)}")
    if mode == "none":
        if explicit_token is not None:
            raise ConfigError("auth='none' and an auth_token contradict each other; drop one")
        return False
    if mode == "token" or explicit_token is not None:
        return True
    return bind_host is None or not is_loopback(bind_host)


def store_key(restart_count: int) -> str:
    # Per restart: an elastic restart's ranks must not pick up the previous generation's token
    # before the new rank 0 has written its own.
    return f"auth_token_r{restart_count}"


def publish_token(store: dist.Store, restart_count: int, token: str) -> None:
    store.set(store_key(restart_count), token)


def read_token(store: dist.Store, restart_count: int, timeout: float = TOKEN_WAIT_S) -> str:
    """Rank 0's token from the store; raises ``TimeoutError`` after ``timeout`` seconds."""
    key = store_key(restart_count)
    try:
        store.wait([key], timedelta(seconds=timeout))
    except Exception as e:  # torch raises DistStoreError (a RuntimeError) on timeout
        raise TimeoutError(f"no access token from rank 0 in the store within {timeout:.0f} s "
                           f"({type(e).__name__})") from None
    return store.get(key).decode()


class TokenGate:
    """The token a server accepts. While it is unknown (a rank still waiting for rank 0's),
    every request is refused with 503."""

    def __init__(self, token: str | None = None) -> None:
        self._token = token.encode() if token is not None else None

    def set(self, token: str) -> None:
        self._token = token.encode()

    @property
    def known(self) -> bool:
        return self._token is not None

    @property
    def token(self) -> str | None:
        return self._token.decode() if self._token is not None else None

    def matches(self, presented: str) -> bool:
        if self._token is None:
            return False
        # compare_digest on bytes: constant time, and no TypeError on non-ASCII input.
        return hmac.compare_digest(self._token, presented.encode("utf-8", "replace"))


_MISSING = ("debug_server: access token required: send header X-Debug-Server-Token, or open the "
            "/?token=... link that rank 0 logged at start\n")
_WRONG = "debug_server: wrong access token\n"
_UNKNOWN = "debug_server: access token not known yet (waiting for rank 0 through the store)\n"


def auth_middleware(gate: TokenGate, *, browser: bool) -> Middleware:
    """Require the token on every request. ``browser``: also accept the cookie, and a
    ``?token=`` query that is swapped for the cookie by a redirect (the frontend's pages)."""

    @web.middleware
    async def require_token(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not gate.known:
            return web.Response(status=503, text=_UNKNOWN)
        header = request.headers.get(TOKEN_HEADER)
        if header is not None:
            if not gate.matches(header):
                return web.Response(status=403, text=_WRONG)
            return await handler(request)
        if browser:
            query = request.query.get(TOKEN_QUERY)
            if query is not None:
                if not gate.matches(query):
                    return web.Response(status=403, text=_WRONG)
                rest = request.rel_url.without_query_params(TOKEN_QUERY)
                resp = web.Response(status=303, headers={"Location": str(rest)},
                                    text="debug_server: token accepted\n")
                resp.set_cookie(TOKEN_COOKIE, query, httponly=True, samesite="Strict", path="/")
                return resp
            cookie = request.cookies.get(TOKEN_COOKIE)
            if cookie is not None:
                if not gate.matches(cookie):
                    return web.Response(status=403, text=_WRONG)
                return await handler(request)
        return web.Response(status=401, text=_MISSING)

    return require_token
