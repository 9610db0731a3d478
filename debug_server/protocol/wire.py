"""The wire protocol's two routes, shared by the worker (``rank.worker``) and the host agent
(``agent``): ``GET /handler/`` lists the handler names as JSON, ``POST
/handler/<name>?<params>`` runs one (the paths of torch's C++ ``WorkerServer``).

Unknown name: 404. ``HandlerError``: its status and one-line reason. Any other failure: a
one-line 500, the traceback to the log. Kept apart from ``rank.worker`` so that the frontend
process (the agent) serves the protocol without loading the recording side.
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web

from debug_server.errors import first_line
from debug_server.protocol.names import (  # noqa: F401 (the names the wire spells, also here)
    C10D_FR_HANDLER,
    DUMP_FILE_HANDLER,
    FR_HANDLER,
    HEALTH_HANDLER,
    INCLUDE_COLLECTIVES,
    INCLUDE_STACKTRACES,
    ONLY_ACTIVE,
    PING_HANDLER,
    SINCE,
    STACKS_HANDLER,
    WINDOW,
    WITH_STACKS,
)

logger = logging.getLogger(__name__)


STACKS_SEP = "\n\x1e"
"""Between the FR JSON and the stacks text of a ``stacks=true`` reply. JSON escapes every control
character, so the first ``\\x1e`` of a reply is always this one."""


def split_stacks(body: str) -> tuple[str, str | None]:
    """A ``stacks=true`` reply as (FR JSON text, stacks text); (body, None) without stacks."""
    fr, sep, stacks = body.partition(STACKS_SEP)
    return (fr, stacks) if sep else (body, None)


class HandlerError(Exception):
    """An error a handler reports with an HTTP status and a one-line reason."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


def handler_routes(handlers: Mapping[str, Callable[[Any, dict[str, str]], Any]],
                   target: Callable[[web.Request], Any], who: str) -> web.RouteTableDef:
    """The two routes over ``handlers``.

    ``GET /handler/`` lists the names; ``POST /handler/<name>`` calls
    ``handlers[name](target(request), query)`` (``target`` only for a known name). A handler
    returns a response, text or JSON-able data, or an awaitable of one; ``HandlerError`` gives
    its status and reason, any other exception a one-line 500 (its traceback goes to the log,
    tagged ``who``).
    """
    table = web.RouteTableDef()

    @table.get("/handler/")
    async def list_handlers(request: web.Request) -> web.Response:
        return web.json_response(sorted(handlers))

    @table.post("/handler/{name}")
    async def run_handler(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        handler = handlers.get(name)
        if handler is None:
            return web.Response(status=404, text=f"Handler {name[:80]} not found")
        params = {k: request.query.getone(k) for k in request.query}
        try:
            out = handler(target(request), params)
            if inspect.isawaitable(out):  # a long capture (torch_profile) waits off this loop
                out = await out
        except HandlerError as e:
            return web.Response(status=e.status, text=e.reason)
        except Exception as e:  # one line to the caller, the traceback to this process's log
            logger.exception("debug_server %s: handler %s failed", who, name)
            return web.Response(status=500, text=f"{name} failed: {type(e).__name__}: "
                                                 f"{first_line(e, 500, empty='')}")
        if isinstance(out, web.Response):
            return out
        if isinstance(out, str):
            return web.Response(text=out)
        return web.Response(text=json.dumps(out, default=str), content_type="application/json")

    return table


__all__ = ["C10D_FR_HANDLER", "DUMP_FILE_HANDLER", "FR_HANDLER", "HEALTH_HANDLER",
           "INCLUDE_COLLECTIVES", "INCLUDE_STACKTRACES", "ONLY_ACTIVE", "PING_HANDLER", "SINCE",
           "STACKS_HANDLER", "STACKS_SEP", "WINDOW", "WITH_STACKS", "HandlerError", "handler_routes", "split_stacks"]
