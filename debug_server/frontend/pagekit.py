"""What every page of the frontend shares: the app's keys, the templates, and reading a
request and answering it in the format asked for (HTML, text or JSON).

``app`` (the core pages) and ``pages_extra`` (``/profile``, ``/tcpstore``, ``/wait_counters``)
both build on this module; neither imports the other's helpers.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.resources
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jinja2
from aiohttp import web

from debug_server.config import ServerConfig
from debug_server.fanout.collector import Collector
from debug_server.protocol import fastjson
from debug_server.protocol.addrs import Registry

FORMATS = ("html", "text", "json")
PAGE_ROWS = 1000
"""Rows per page of the ``?full=1`` HTML view."""
MAX_PAGE = 100_000

CONFIG = web.AppKey("config", ServerConfig)
REGISTRY = web.AppKey("registry", Registry)
COLLECTOR = web.AppKey("collector", Collector)
TEMPLATES = web.AppKey("templates", jinja2.Environment)


# ---------------------------------------------------------------------------------------------
# Templates


def _template_sources() -> dict[str, str]:
    """The templates' text: from the source tree this package was imported from, where it is
    one (a checkout: a worktree's own templates, not those of another tree that an editable
    install points at), else from the installed package."""
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").is_file() and (checkout / "templates" / "base.html").is_file():
        return {p.name: p.read_text("utf-8") for p in (checkout / "templates").glob("*.html")}
    with contextlib.suppress(ModuleNotFoundError, FileNotFoundError, NotADirectoryError):
        root = importlib.resources.files("debug_server.templates")
        found = {p.name: p.read_text("utf-8") for p in root.iterdir() if p.name.endswith(".html")}
        if found:
            return found
    src = Path(__file__).resolve().parents[2] / "templates"
    return {p.name: p.read_text("utf-8") for p in src.glob("*.html")}


def load_templates() -> jinja2.Environment:
    sources = _template_sources()
    if "base.html" not in sources:
        raise FileNotFoundError("debug_server templates not found (no base.html in the package "
                                "or in <repo>/templates)")
    return jinja2.Environment(loader=jinja2.DictLoader(sources), autoescape=True,
                              undefined=jinja2.StrictUndefined)


# ---------------------------------------------------------------------------------------------
# Request parsing


class BadRequest(web.HTTPBadRequest):
    def __init__(self, reason: str) -> None:
        super().__init__(text=reason + "\n")


def query(request: web.Request, allowed: Mapping[str, Callable[[str], Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in request.query:
        parse = allowed.get(key)
        if parse is None:
            raise BadRequest(f"unknown parameter {key!r} (allowed: {', '.join(sorted(allowed))})")
        raw = request.query.getone(key)
        try:
            out[key] = parse(raw)
        except ValueError as e:
            raise BadRequest(f"bad parameter {key}={raw[:40]!r}: {e}") from None
    return out


def parse_format(raw: str) -> str:
    if raw not in FORMATS:
        raise ValueError("must be html, text or json")
    return raw


def bool01(raw: str) -> bool:
    try:
        return {"0": False, "1": True, "false": False, "true": True}[raw.lower()]
    except KeyError:
        raise ValueError("must be 0/1 or true/false") from None


def page_number(raw: str) -> int:
    n = int(raw)
    if not 1 <= n <= MAX_PAGE:
        raise ValueError(f"must be 1..{MAX_PAGE}")
    return n


def negotiate(request: web.Request, fmt: str | None) -> str:
    """``?format=`` wins; else the Accept header: browsers get html, tools json, curl text."""
    if fmt:
        return fmt
    ranges = []
    for i, part in enumerate(request.headers.get("Accept", "*/*").split(",")):
        media, *opts = (s.strip() for s in part.split(";"))
        q = 1.0
        for opt in opts:
            if opt.startswith("q="):
                with contextlib.suppress(ValueError):
                    q = float(opt[2:])
        ranges.append((-q, i, media.lower()))
    for _, _, media in sorted(ranges):
        if media in ("text/html", "application/xhtml+xml"):
            return "html"
        if media == "application/json":
            return "json"
        if media in ("text/plain", "text/*", "*/*"):
            return "text"
    return "text"


def respond(fmt: str, body: str | Any) -> web.Response:
    if fmt == "json":
        return web.Response(body=fastjson.dumps_bytes(body, default=str),
                            content_type="application/json", charset="utf-8")
    if fmt == "html":
        return web.Response(text=body, content_type="text/html")
    return web.Response(text=body, content_type="text/plain")


async def off_loop(fn: Callable[..., Any], *args: Any) -> Any:
    # Analysis and rendering are CPU work: off the loop, so other pages and the dumper go on.
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
