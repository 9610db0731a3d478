"""Attaching a frontend to a running job from any machine that reaches its TCPStore.

``python -m debug_server.frontend --store HOST:PORT --world-size N [--port 25999]`` serves the
same pages as rank 0's frontend (a login node, or a healthy host when rank 0's is the sick one).
Workers are found through the store exactly as rank 0's frontend finds them
(``storeview.lookup_workers``: ours, with their ``_meta`` sidecar, and torch's own C++ workers,
without one). This module settles what the command line leaves open:

- which elastic restart to trust: the newest one named by the workers' sidecars, so a store
  that still holds an earlier generation's keys shows the live ranks, not the dead ones;
- the access token: ``$TOKEN_ENV`` (``Settings.auth_token``) when set (there is no command-line option:
  ``ps`` shows the command line to every user), else the job's own key in the store
  (``auth.store_key``), read without waiting (a job without a token has none, and then pages
  need none either).

``config_from_args`` turns the command's few options into the same ``FrontendConfig`` that rank
0's frontend gets from ``start_debug_server``.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from debug_server import auth
from debug_server.config import (
    DEFAULT_PORT,
    FrontendConfig,
    ServerConfig,
    check_token_text,
)
from debug_server.protocol import addrs
from debug_server.readers import storeview

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["AttachError", "Attached", "config_from_args", "current_restart", "job_token",
           "parse_store", "parser", "resolve"]


class AttachError(ValueError):
    """A store address or token the attached frontend cannot use; the text is one line."""


def parse_store(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6addr]:PORT`` for IPv6) -> (host, port); raises :class:`AttachError`."""
    host, sep, port = text.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise AttachError(f"--store {text[:80]!r}: expected HOST:PORT (the job's "
                          "MASTER_ADDR:MASTER_PORT), e.g. node001:29500")
    return host, int(port)


def current_restart(store: dist.Store, world_size: int) -> int:
    """The newest elastic restart named by any rank's registration sidecar (0 when none has
    one, e.g. a job of torch's own C++ workers)."""
    keys = [addrs.meta_key(r) for r in range(world_size)]
    present = keys if store.check(keys) else [k for k in keys if store.check([k])]
    newest = 0
    for raw in store.multi_get(present) if present else ():
        try:
            newest = max(newest, int(json.loads(raw)["restart"]))
        except (ValueError, KeyError, TypeError):
            continue  # discovery reports an unreadable sidecar for its rank
    return newest


def job_token(store: dist.Store, restart_count: int, explicit: str | None) -> str | None:
    """The token pages and fan-out use: ``explicit`` when given, else the job's store key, else
    None (a job without a token). Raises :class:`AttachError` on a malformed token."""
    token = explicit
    if token is None:
        key = auth.store_key(restart_count)
        if store.check([key]):
            token = store.get(key).decode(errors="replace")
    if token is None:
        return None
    try:
        return check_token_text(token)
    except ValueError as e:
        raise AttachError(str(e)) from None


class Attached(NamedTuple):
    """Where the job's store is, which restart to trust, and the token (None: none needed)."""

    host: str
    port: int
    restart: int
    token: str | None


def resolve(store_text: str, world_size: int, restart: int | None, token: str | None,
            *, timeout: float = 5.0) -> Attached:
    """Connect to the job's store once and settle the restart and the token (module doc).

    Raises :class:`AttachError` with one line when the store cannot be reached in ``timeout``.
    """
    host, port = parse_store(store_text)
    try:
        store = storeview.store_client(host, port, timeout)
    except Exception as e:  # torch raises DistNetworkError/RuntimeError/TimeoutError here
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise AttachError(f"cannot reach the job's TCPStore at {host}:{port} within "
                          f"{timeout:.0f} s ({first})") from None
    if restart is None:
        restart = current_restart(store, world_size)
    return Attached(host, port, restart, job_token(store, restart, token))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m debug_server.frontend",
        description="Serve debug_server's pages for a running job, found through its TCPStore, "
                    "from any machine that reaches it. The access token is "
                    f"${auth.TOKEN_ENV} when set, else the job's own from the store.")
    p.add_argument("--store", metavar="HOST:PORT", required=True,
                   help="the job's TCPStore: its MASTER_ADDR:MASTER_PORT")
    p.add_argument("--world-size", type=_positive, required=True, help="the job's WORLD_SIZE")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help=f"port of the pages (default {DEFAULT_PORT}; 0: a free one)")
    p.add_argument("--host", default=None, help="bind address (default: all interfaces)")
    p.add_argument("--restart-count", type=int, default=None,
                   help="elastic restart whose ranks to show (default: the newest registered)")
    p.add_argument("--dump-dir", default=None, help="write periodic dumps here (default: none)")
    p.add_argument("--fetch-timeout", type=float, default=5.0,
                   help="seconds to wait for one rank (and for the store), default 5")
    return p


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} is not >= 1")
    return n


def config_from_args(argv: Sequence[str], token: str | None = None) -> FrontendConfig:
    """The attach command's ``FrontendConfig``: its options, then the store's answers.

    ``token``: ``Settings.auth_token`` as the frontend's ``main`` read it.

    Bad options exit through argparse (code 2); a store that cannot be reached or a bad value
    raises :class:`AttachError` or ``ConfigError`` (both ``ValueError``) with one line.
    """
    args = parser().parse_args(argv)
    attached = resolve(args.store, args.world_size, args.restart_count, token,
                       timeout=min(5.0, args.fetch_timeout))
    dump_dir = os.path.abspath(args.dump_dir) if args.dump_dir else None
    server = ServerConfig(port=args.port, host=args.host, dump_dir=dump_dir,
                          fetch_timeout=args.fetch_timeout, auth_token=attached.token)
    return FrontendConfig(server=server, world_size=args.world_size,
                          store=(attached.host, attached.port), restart_count=attached.restart)
