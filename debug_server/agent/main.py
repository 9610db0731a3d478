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
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from debug_server import auth
from debug_server.agent import tree
from debug_server.agent.app import make_agent_app
from debug_server.agent.registry import HostRegistry, StaticHostRegistry
from debug_server.config import take_secrets
from debug_server.errors import first_line
from debug_server.fanout.transport import settle_gc
from debug_server.listen import start_sites
from debug_server.protocol.addrs import WorkerAddr, agent_key, format_ranks, parse_ranks
from debug_server.rank.agent_launch import AGENT_ID_ENV, host_id
from debug_server.readers import jobpids, pyspy, storeview

if TYPE_CHECKING:
    import torch.distributed as dist

logger = logging.getLogger(__name__)

PARENT_POLL_S = 0.25
"""How often the agent looks at its parent (and, once it is gone, at its host's ranks): it
ends within a poll of the host's last rank, before the launcher's return is 2 s old."""
LOOKUP_S = 10.0
"""How often the agent reads its host's ranks from the store while its parent lives."""
REGISTER_TIMEOUT_S = 300.0
CONNECT_TRY_S = 5.0
"""One try at connecting to the store; tried again (while the parent lives) until
``REGISTER_TIMEOUT_S``."""


def _register(store: dist.Store, my_id: str, url: str, ranks: Sequence[int],
              restart: int, tree_hosts: int = 0) -> int:
    """Register this agent; its place in the tree (``tree.join``; -1: no tree)."""
    store.set(agent_key(my_id), json.dumps({"url": url, "ranks": format_ranks(ranks),
                                            "restart": restart, "pid": os.getpid(),
                                            "host": socket.gethostname(),
                                            # ranks here name this pid their tracer (jobpids)
                                            "start": jobpids.start_time(os.getpid())}))
    return tree.join(store, my_id, restart, tree_hosts)


async def _registered(args: argparse.Namespace, store: dist.Store, url: str,
                      ranks: Sequence[int], done: asyncio.Event) -> int | None:
    """``_register`` on a daemon thread of its own; None where the job ended meanwhile: its
    store went away (rank 0 killed on a loaded box, before its agent was up), or ``done`` was
    set (the parent and the host's ranks gone while a store call hangs: that thread is not
    waited for, ``listen.exit_now``)."""
    lane = storeview.StoreLane("debug_server.agent.register")
    reg = lane.call(lambda: _register(store, args.host_id, url, ranks, args.restart_count,
                                      args.tree_hosts))
    lane.close()
    ended = asyncio.ensure_future(done.wait())
    try:
        await asyncio.wait({reg, ended}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        ended.cancel()
    if not reg.done():
        reg.cancel()
        return None
    try:
        return reg.result()
    except Exception as e:  # noqa: BLE001 - the store gone meanwhile: the job ended
        if storeview.store_refuses(args.master_addr, args.master_port):
            logger.debug("debug_server agent %s: the store went away while it registered "
                         "(%s): the job ended", args.host_id, first_line(e))
            return None
        raise


async def _serve(args: argparse.Namespace, registry: Any, token: str | None,
                 store: dist.Store | None) -> int:
    app = make_agent_app(registry, args.host_id, fetch_timeout=args.fetch_timeout,
                         max_concurrency=args.max_concurrency, token=token)
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=2.0, access_log=None)
    await runner.setup()
    done = asyncio.Event()
    group: tuple[web.AppRunner, asyncio.Task[None]] | None = None
    watch: asyncio.Task[None] | None = None
    try:
        port = await start_sites(runner, args.host, args.port)
        host = args.advertise or "127.0.0.1"
        url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        # Watched from the start: a job that ends while this agent registers ends it too.
        if args.parent_pid:
            watch = asyncio.create_task(_watch_parent(args.parent_pid, done, registry))
        if store is not None:
            place = await _registered(args, store, url, registry.ranks, done)
            if place is None:
                return 0
            lead = tree.leads(place, args.tree_hosts)
            if lead is not None:
                group = await _serve_group(args, lead, place, token)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, done.set)
        if args.ready_fd is not None:
            with contextlib.suppress(OSError):
                os.write(args.ready_fd, f"ready {port}\n".encode())
                os.close(args.ready_fd)
        # One per host: a job's log gets nothing from the agents (the frontend's two lines
        # say where the pages are; the store says where each agent is).
        logger.debug("debug_server agent %s at %s for ranks %s", args.host_id, url,
                     format_ranks(registry.ranks))
        await done.wait()
        return 0
    finally:
        if watch is not None:
            watch.cancel()
        if group is not None:
            group[1].cancel()
            await group[0].cleanup()
        await runner.cleanup()


async def _serve_group(args: argparse.Namespace, group: int, first: int,
                       token: str | None) -> tuple[web.AppRunner, asyncio.Task[None]]:
    """This agent leads group ``group`` of the tree (``tree``): the agent app over the group's
    ranks, through their host agents, on a port of its own, registered once its ranks are
    known and again whenever they grow."""
    from debug_server.fanout.agents import AgentDirectory, agent_route

    registry = tree.GroupRegistry(args.master_addr, args.master_port, args.world_size,
                                  args.restart_count, first, args.tree_hosts,
                                  timeout=min(5.0, args.fetch_timeout))
    directory = AgentDirectory(args.master_addr, args.master_port, args.restart_count,
                               timeout=min(5.0, args.fetch_timeout), tree=False)
    app = make_agent_app(registry, tree.group_id(group), fetch_timeout=args.fetch_timeout,
                         max_concurrency=args.max_concurrency, token=token,
                         route=agent_route(directory, classes=True))
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=2.0, access_log=None)
    await runner.setup()
    port = await start_sites(runner, args.host, 0)
    host = args.advertise or "127.0.0.1"
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"

    async def keep_registered() -> None:
        said = ""
        while True:
            with contextlib.suppress(Exception):  # the store may be gone with rank 0
                await registry.lookup()
                record = registry.record(url)
                if registry.ranks and record != said:
                    # On the registry's own lane (a daemon thread with its own client): a
                    # call stuck on a store that went away never holds this process's exit.
                    await registry.on_lane(lambda r=record: tree.register(
                        registry.store(), args.restart_count, group, r))
                    said = record
                if len(registry.hosts) >= args.tree_hosts and said:
                    return
            await asyncio.sleep(tree.REFRESH_S)

    return runner, asyncio.create_task(keep_registered())


async def _watch_parent(pid: int, done: asyncio.Event, registry: Any = None) -> None:
    """A stuck trainer keeps its agent (that is the point); so does a dead local rank 0 while
    other ranks of this host still run (rank 0 finished early, or was killed, while they hang:
    the frontend still asks through this agent); once none runs, the agent exits."""
    was_child = os.getppid() == pid
    known: list[WorkerAddr] = []
    looked_at: float | None = None
    while True:
        await asyncio.sleep(PARENT_POLL_S)
        parent_here = jobpids.alive(pid) and not (was_child and os.getppid() != pid)
        # The host's ranks: every 10 s while the parent lives, every second once it is gone.
        now = time.monotonic()
        if registry is not None and (looked_at is None or now - looked_at >= (
                LOOKUP_S if parent_here else 1.0)):
            looked_at = now
            # Not reached yet and gone (a job of seconds ended before this agent connected): a
            # lookup would wait out c10d's connect; nothing of the job is known here.
            if not parent_here and not getattr(registry, "answered", True) and not known and \
                    await asyncio.get_running_loop().run_in_executor(None, registry.refuses):
                done.set()
                return
            with contextlib.suppress(Exception):  # the store may be gone with rank 0
                fresh = await registry.lookup()
                known = fresh if any(a.meta for a in fresh) else known
        if parent_here:
            continue
        if jobpids.running_here(known):
            continue
        # The job's end on this host: nothing wrong, nothing for the job's log.
        logger.debug("debug_server agent: parent process %d is gone and no rank of this "
                     "host runs; exiting", pid)
        done.set()
        return


def _connect(args: argparse.Namespace) -> dist.Store | None:
    """The job's store once it is up (a plain ``env://`` rendezvous creates it late); None
    when the agent's parent ended and the store is gone before it was reached (a job of seconds:
    the agent came up after it)."""
    import torch.distributed  # noqa: F401 - seconds to import: not between the probe and the connect

    deadline = time.monotonic() + REGISTER_TIMEOUT_S
    while True:
        # Asked with a plain connect first: c10d's client retries a refused connection for its
        # whole timeout, also after the job it was started for is over.
        if not storeview.store_refuses(args.master_addr, args.master_port):
            try:
                return storeview.store_client(args.master_addr, args.master_port, min(
                    CONNECT_TRY_S, max(1.0, deadline - time.monotonic())))
            except Exception:  # gone since the probe, or slow: asked again below
                if time.monotonic() > deadline:
                    raise
        if args.parent_pid and not jobpids.alive(args.parent_pid):
            return None
        if time.monotonic() > deadline:
            raise TimeoutError(f"nothing listens there after {REGISTER_TIMEOUT_S:.0f} s")
        time.sleep(0.5)


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
    # The agent's settings, read once here and handed down (py-spy's place to its readers).
    settings = take_secrets()
    pyspy.use_setting(settings.pyspy)
    args.host_id = args.host_id or host_id(settings)
    args.tree_hosts = settings.tree_hosts
    try:
        ranks = parse_ranks(args.ranks)
    except ValueError as e:
        print(f"error: --ranks: {e}", file=sys.stderr)
        return 2
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
            store = _connect(args)
            if store is None:  # the job ended before this agent was up: nothing to serve
                return 0
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
