"""The agent process (``python -m debug_server.agent``): its arguments, its registration in the
job's store, serving the app (``app``), and staying while its host's ranks run."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from debug_server import auth
from debug_server.agent.app import make_agent_app
from debug_server.agent.registry import HostRegistry, StaticHostRegistry
from debug_server.config import take_secrets
from debug_server.errors import first_line
from debug_server.fanout.transport import settle_gc
from debug_server.listen import start_sites
from debug_server.rank import discovery, jobpids
from debug_server.rank.agent_launch import (
    AGENT_ID_ENV,
    agent_key,
    format_ranks,
    host_id,
    parse_ranks,
)
from debug_server.rank.discovery import WorkerAddr

if TYPE_CHECKING:
    import torch.distributed as dist

logger = logging.getLogger(__name__)

PARENT_POLL_S = 1.0
REGISTER_TIMEOUT_S = 300.0


def _register(store: dist.Store, my_id: str, url: str, ranks: Sequence[int],
              restart: int) -> None:
    store.set(agent_key(my_id), json.dumps({"url": url, "ranks": format_ranks(ranks),
                                            "restart": restart, "pid": os.getpid(),
                                            "host": socket.gethostname(),
                                            # ranks here name this pid their tracer (jobpids)
                                            "start": jobpids.start_time(os.getpid())}))


async def _serve(args: argparse.Namespace, registry: Any, token: str | None,
                 store: dist.Store | None) -> int:
    app = make_agent_app(registry, args.host_id, fetch_timeout=args.fetch_timeout,
                         max_concurrency=args.max_concurrency, token=token)
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=2.0, access_log=None)
    await runner.setup()
    done = asyncio.Event()
    try:
        port = await start_sites(runner, args.host, args.port)
        host = args.advertise or "127.0.0.1"
        url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        if store is not None:
            await asyncio.get_running_loop().run_in_executor(
                None, _register, store, args.host_id, url, registry.ranks, args.restart_count)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, done.set)
        if args.ready_fd is not None:
            with contextlib.suppress(OSError):
                os.write(args.ready_fd, f"ready {port}\n".encode())
                os.close(args.ready_fd)
        logger.info("debug_server agent %s at %s for ranks %s", args.host_id, url,
                    format_ranks(registry.ranks))
        watch = (asyncio.create_task(_watch_parent(args.parent_pid, done, registry))
                 if args.parent_pid else None)
        await done.wait()
        if watch is not None:
            watch.cancel()
        return 0
    finally:
        await runner.cleanup()


async def _watch_parent(pid: int, done: asyncio.Event, registry: Any = None) -> None:
    """A stuck trainer keeps its agent (that is the point); so does a dead local rank 0 while
    other ranks of this host still run (rank 0 finished early, or was killed, while they hang:
    the frontend still asks through this agent); once none runs, the agent exits."""
    was_child = os.getppid() == pid
    known: list[WorkerAddr] = []
    polls = 0
    while True:
        await asyncio.sleep(PARENT_POLL_S)
        alive = True
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            alive = False
        except PermissionError:
            pass
        parent_here = alive and not (was_child and os.getppid() != pid)
        if registry is not None and (polls % 10 == 0 or not parent_here):
            with contextlib.suppress(Exception):  # the store may be gone with rank 0
                fresh = await registry.lookup()
                known = fresh if any(a.meta for a in fresh) else known
        polls += 1
        if parent_here:
            continue
        if jobpids.running_here(known):
            continue
        # The job's end on this host: nothing wrong, nothing for the job's log.
        logger.debug("debug_server agent: parent process %d is gone and no rank of this "
                     "host runs; exiting", pid)
        done.set()
        return


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m debug_server.agent",
                                description="One host's debug_server agent.")
    p.add_argument("--host-id", default=None, help=f"default ${AGENT_ID_ENV} or the host name")
    p.add_argument("--ranks", required=True, help="this host's ranks, e.g. 0-7")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--master-addr")
    p.add_argument("--master-port", type=int)
    p.add_argument("--restart-count", type=int, default=0)
    p.add_argument("--worker-urls", help="comma-separated URLs of --ranks' workers instead of "
                                         "the store (@FILE: read them from FILE)")
    p.add_argument("--host", default=None, help="bind address (default: all interfaces)")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--advertise", help="address registered for the frontend")
    p.add_argument("--fetch-timeout", type=float, default=5.0)
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--parent-pid", type=int)
    p.add_argument("--ready-fd", type=int)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the agent process."""
    args = _parser().parse_args(argv)
    settle_gc()  # this process is the agent's own
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args.host_id = args.host_id or host_id()
    try:
        ranks = parse_ranks(args.ranks)
    except ValueError as e:
        print(f"error: --ranks: {e}", file=sys.stderr)
        return 2
    settings = take_secrets()
    token, from_store = settings.auth_token, settings.agent_token_from_store
    store = None
    registry: Any
    if args.worker_urls:
        urls = args.worker_urls
        if urls.startswith("@"):
            urls = Path(urls[1:]).read_text().strip()
        url_list = urls.split(",")
        if len(url_list) != len(ranks) or ranks != list(range(ranks[0], ranks[0] + len(ranks))):
            print("error: --worker-urls needs one URL per rank of a contiguous --ranks",
                  file=sys.stderr)
            return 2
        registry = StaticHostRegistry(url_list, ranks[0], args.world_size)
    else:
        if not args.master_addr or not args.master_port:
            print("error: give --master-addr/--master-port or --worker-urls", file=sys.stderr)
            return 2
        registry = HostRegistry(args.master_addr, args.master_port, args.world_size,
                                args.restart_count, ranks, args.host_id,
                                timeout=min(5.0, args.fetch_timeout))
        try:
            store = discovery.store_client(args.master_addr, args.master_port, REGISTER_TIMEOUT_S)
            if token is None and from_store:
                # Like the other ranks: rank 0 puts the job's token in the store.
                token = auth.read_token(store, args.restart_count)
        except Exception as e:
            logger.error("debug_server agent %s: cannot reach the store %s:%s: %s", args.host_id,
                         args.master_addr, args.master_port, first_line(e, 200))
            return 2
    return asyncio.run(_serve(args, registry, token, store))


if __name__ == "__main__":
    sys.exit(main())
