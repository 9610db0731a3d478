"""The per-rank worker: a small aiohttp app in a daemon thread of each rank.

Wire protocol (the paths of torch's C++ ``WorkerServer``, so either frontend reads either
worker): ``GET /handler/`` lists handler names as JSON; ``POST /handler/<name>?<params>`` runs
one. Unknown name: 404. Bad parameter: 400. Failure: 500. Error bodies are one line, never a
traceback. Everything is JSON or text; nothing from the network is unpickled.

The FR handlers take torch's ``onlyactive`` and ``includecollectives``, and two of ours for the
live window (``frwindow``): ``since={"<group>": <seq>}`` keeps each named group from that seq on,
``window=<slack>`` cuts at this rank's own frontier less ``slack``. The window is cut inside the
recorders (``frwindow.cutter``, ``recording.lazy``): only the entries it keeps are built.
``torchcomms_fr_trace_json?stacks=true`` also sends this rank's thread stacks, after the FR JSON
(``wire.WITH_STACKS``): a page that shows both asks each rank once.

What the worker serves comes from a ``Provider``; ``HooksProvider`` reads this process's
Flight Recorder hooks, ``StaticProvider`` serves fixed data (tests, benchmarks).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from aiohttp import web

from debug_server.auth import TokenGate, auth_middleware
from debug_server.listen import start_sites
from debug_server.protocol import frwindow, members
from debug_server.protocol.names import (
    C10D_FR_HANDLER,
    DUMP_FILE_HANDLER,
    FR_HANDLER,
    HEALTH_HANDLER,
    INCLUDE_COLLECTIVES,
    INCLUDE_STACKTRACES,
    NATIVE,
    NONBLOCKING,
    ONLY_ACTIVE,
    PID,
    PING_HANDLER,
    SINCE,
    STACKS_HANDLER,
    SUBPROCESSES,
    WINDOW,
    WITH_STACKS,
)
from debug_server.protocol.wire import STACKS_SEP, HandlerError, handler_routes
from debug_server.rank import clock, rank_capture
from debug_server.readers import jobpids, procstate, pyspy
from debug_server.recording.lazy import Cut, LazyDump
from debug_server.stacks import capture_stacks

logger = logging.getLogger(__name__)

_BOOL = {"true": True, "false": False}


class Provider(Protocol):
    """What a worker serves. Methods run on the worker's thread and may raise."""

    def fr_snapshot(self, *, only_active: bool, include_collectives: bool,
                    cut: Cut | None = None) -> Mapping[str, Any]:
        """The merged Flight Recorder dump of this process (torch FR schema); with ``cut``
        (the live window, ``frwindow.cutter``) only the entries it keeps."""
        ...

    def c10d_fr_json(self, *, only_active: bool, include_collectives: bool) -> str:
        """torch c10d's built-in FR as JSON text; raise ``HandlerError(404, ...)`` if absent."""
        ...

    def stacks(self) -> str:
        """faulthandler text of every thread."""
        ...

    def dump_file(self) -> str:
        """Write this rank's pickle now and return its path."""
        ...

    def health(self) -> Mapping[str, Any]:
        """``{"healthy": bool, "stalled_op": ... | None, ...}``."""
        ...


def c10d_fr_json(*, only_active: bool, include_collectives: bool) -> str:
    """torch's built-in c10d Flight Recorder as JSON, where this torch build has it."""
    try:
        from torch._C import _distributed_c10d as c10d
    except ImportError:
        raise HandlerError(404, "this torch has no torch.distributed (c10d) build") from None
    fn = getattr(c10d, "_dump_fr_trace_json", None) or getattr(c10d, "_dump_nccl_trace_json", None)
    if fn is None:
        raise HandlerError(404, "this torch has no built-in c10d flight recorder JSON dump")
    raw = fn(include_collectives, only_active)
    return raw.decode() if isinstance(raw, bytes) else str(raw)


class HooksProvider:
    """Serves the FlightRecorderHook(s) of this process; finds them with no wiring by the user.

    ``stall_timeout``: an op in flight longer than this makes the health check unhealthy, on
    top of whatever the hooks' own ``stall_timeout`` says.
    """

    def __init__(self, rank: int, stall_timeout: float | None = None) -> None:
        self.rank = rank
        self.stall_timeout = stall_timeout
        self._c10d_watch: Any = None  # stall.StallWatch, made at the first health check
        self.peers: Callable[[int], Mapping[str, Any] | None] | None = None
        """pid -> the sidecar of the rank of this job that announced it here (``discovery.Peers``)."""

    def fr_snapshot(self, *, only_active: bool, include_collectives: bool,
                    cut: Cut | None = None) -> Mapping[str, Any]:
        # Imported here so the server side loads without the recording side (and vice versa).
        from debug_server.recording import hooks

        # The hooks' entries and c10d's own (DDP, FSDP, plain torch.distributed) in one dump,
        # the window cut inside: only the entries it keeps are built, on this thread that
        # holds the GIL away from training.
        # clock.shifted: a test's injected clock offset (Settings.clock_offset_ns), else as is.
        return clock.shifted(hooks.snapshot(only_active=only_active,
                                            include_collectives=include_collectives, cut=cut))

    def c10d_fr_json(self, *, only_active: bool, include_collectives: bool) -> str:
        return c10d_fr_json(only_active=only_active, include_collectives=include_collectives)

    def stacks(self) -> str:
        return capture_stacks()

    def dump_file(self) -> str:
        from debug_server.recording import hooks

        return hooks.dump_file(self.rank)

    def health(self) -> Mapping[str, Any]:
        from debug_server.recording import c10d_fr, hooks, stall

        # One stall rule (recording.stall) for the hooks' ops, with this worker's limit on top.
        health = dict(hooks.health(self.stall_timeout))
        limit = self.stall_timeout if self.stall_timeout is not None else hooks.default_stall_timeout()
        if limit is not None:
            # c10d's groups (DDP, FSDP...) by their progress; fed on every poll, so it counts
            # how long a group has been pending even while a hook already reports a stall.
            if self._c10d_watch is None:
                self._c10d_watch = stall.StallWatch()
            stalled = c10d_fr.c10d_stalled_op(self._c10d_watch, limit, hooks.owned_groups())
            if stalled is not None and health.get("healthy", True):
                health.update(healthy=False, stalled_op=stalled)
        return health


class StaticProvider:
    """Fixed data behind a real worker: fake ranks in tests and benchmarks."""

    def __init__(
        self,
        dump: Mapping[str, Any],
        *,
        stacks: str = "",
        health: Mapping[str, Any] | None = None,
        dump_path: str | None = None,
    ) -> None:
        self.dump = dump
        self.stacks_text = stacks
        self.health_info = health if health is not None else {"healthy": True, "stalled_op": None}
        self.dump_path = dump_path
        self.dump_calls = 0
        self.peers: Callable[[int], Mapping[str, Any] | None] | None = None

    def fr_snapshot(self, *, only_active: bool, include_collectives: bool,
                    cut: Cut | None = None) -> Mapping[str, Any]:
        entries = self.dump.get("entries", []) if include_collectives else []
        if only_active:
            entries = [e for e in entries if e.get("state") != "completed"]
        return cut_dump({**self.dump, "entries": entries}, cut)

    def c10d_fr_json(self, *, only_active: bool, include_collectives: bool) -> str:
        raise HandlerError(404, "no c10d flight recorder in this fake rank")

    def stacks(self) -> str:
        return self.stacks_text

    def dump_file(self) -> str:
        if self.dump_path is None:
            raise HandlerError(500, "no dump path configured")
        from debug_server.dumpio import write_dump_atomic

        self.dump_calls += 1
        return write_dump_atomic(self.dump_path, dict(self.dump))

    def health(self) -> Mapping[str, Any]:
        return self.health_info


# ---------------------------------------------------------------------------------------------
# The app

PROVIDER = web.AppKey("provider", Provider)

Handler = Callable[[Provider, Mapping[str, str]], Any]


def _flag(params: Mapping[str, str], name: str, default: bool) -> bool:
    raw = params.get(name)
    if raw is None:
        return default
    try:
        return _BOOL[raw.lower()]
    except KeyError:
        raise HandlerError(400, f"parameter {name}={raw!r} must be true or false") from None


def _only(params: Mapping[str, str], allowed: frozenset[str]) -> None:
    extra = sorted(set(params) - allowed)
    if extra:
        names = ", ".join(sorted(allowed)) or "none"
        raise HandlerError(400, f"unknown parameter {extra[0]!r} (allowed: {names})")


_FR_PARAMS = frozenset({ONLY_ACTIVE, INCLUDE_COLLECTIVES, SINCE, WINDOW, members.PARAM,
                        INCLUDE_STACKTRACES})
_MAX_SLACK = 1_000_000
_NO_PARAMS: frozenset[str] = frozenset()


def _ping(p: Provider, q: Mapping[str, str]) -> str:
    _only(q, _NO_PARAMS)
    return "pong"


def _dump_traceback(p: Provider, q: Mapping[str, str]) -> str:
    _only(q, _NO_PARAMS)
    return p.stacks()


def _fr_args(q: Mapping[str, str]) -> dict[str, bool]:
    _only(q, _FR_PARAMS)
    return {
        "only_active": _flag(q, ONLY_ACTIVE, False),
        "include_collectives": _flag(q, INCLUDE_COLLECTIVES, True),
    }


def _cut_arg(q: Mapping[str, str]) -> Cut | None:
    """The live window (``frwindow``): ``since={"<group>": <seq>}`` keeps each named group from
    that seq on; ``window=<slack>`` cuts at this rank's own frontier less ``slack``."""
    raw, slack = q.get(SINCE), q.get(WINDOW)
    if raw is not None:
        try:
            return frwindow.cutter(since=frwindow.parse_since(raw))
        except ValueError as e:
            raise HandlerError(400, f"parameter since: {e}") from None
    if slack is not None:
        if not slack.isdigit() or int(slack) > _MAX_SLACK:
            raise HandlerError(400, f"parameter window={slack[:40]!r} must be an integer "
                                    f"0..{_MAX_SLACK}")
        return frwindow.cutter(slack=int(slack))
    return None


def cut_dump(dump: Mapping[str, Any], cut: Cut | None) -> dict[str, Any]:
    """A built dump cut as a recorder cuts its own (``recording.lazy``): the same entries."""
    if cut is None or not isinstance(dump.get("entries"), list):
        return dict(dump)
    return LazyDump.of(dump).finish(cut)


def _known_members(q: Mapping[str, str]) -> frozenset[str]:
    """``pgknown``: member lists the asking frontend holds (``members``), sent as references."""
    raw = q.get(members.PARAM)
    if raw is None:
        return frozenset()
    try:
        return members.parse_known(raw)
    except ValueError as e:
        raise HandlerError(400, f"parameter {members.PARAM}: {e}") from None


def _torchcomms_fr_trace_json(p: Provider, q: Mapping[str, str]) -> Mapping[str, Any] | str:
    """The FR dump; with ``stacks=true`` (``wire.WITH_STACKS``) this rank's thread stacks
    follow it, taken right after it (``wire.split_stacks`` parts them)."""
    with_stacks = _flag(q, WITH_STACKS, False)
    q = {k: v for k, v in q.items() if k != WITH_STACKS}
    args, cut, known = _fr_args(q), _cut_arg(q), _known_members(q)
    dump = members.share(p.fr_snapshot(**args, cut=cut), known)
    if not _flag(q, INCLUDE_STACKTRACES, True):  # torch's name: entries without their frames
        dump = without_frames(dump)
    if not with_stacks:
        return dump
    return json.dumps(dump, default=str) + STACKS_SEP + p.stacks()


def without_frames(dump: Mapping[str, Any]) -> Mapping[str, Any]:
    """``dump`` with every entry's ``frames`` empty (what the straggler poll asks for: a tenth
    of the bytes; ``frontend.stragglers``)."""
    entries = dump.get("entries")
    if not isinstance(entries, list):
        return dump
    return {**dump, "entries": [{**e, "frames": []} if isinstance(e, dict) else e
                                for e in entries]}


def _fr_trace_json(p: Provider, q: Mapping[str, str]) -> web.Response | Mapping[str, Any]:
    args, cut = _fr_args(q), _cut_arg(q)
    text = p.c10d_fr_json(**args)
    if cut is not None:
        dump = json.loads(text)
        if isinstance(dump, dict):
            return cut_dump(dump, cut)
    return web.Response(text=text, content_type="application/json")


def _torchcomms_fr_dump_file(p: Provider, q: Mapping[str, str]) -> Mapping[str, Any]:
    _only(q, _NO_PARAMS)
    try:
        path = p.dump_file()
    except OSError as e:
        raise HandlerError(500, f"writing the dump failed: {e}") from None
    # The host tells a frontend on another host that the path is not on its disk (a dump
    # dir that is not shared between hosts).
    return {"path": path, "host": socket.gethostname()}


def _torchcomms_health_check(p: Provider, q: Mapping[str, str]) -> Mapping[str, Any]:
    _only(q, _NO_PARAMS)
    return p.health()


_PYSPY_PARAMS = frozenset({NATIVE, NONBLOCKING, SUBPROCESSES, PID})
_BOOL01 = {"1": True, "0": False, "true": True, "false": False}


def _target(p: Provider, q: Mapping[str, str]) -> tuple[int, Mapping[str, Any] | None]:
    """``pid=`` (this process by default) and what the rank that claims it announced."""
    pid = os.getpid()
    if PID in q:
        try:
            pid = int(q[PID])
        except ValueError:
            raise HandlerError(400, f"parameter pid={q['pid'][:20]!r} must be an integer") from None
    peers = getattr(p, "peers", None)
    return pid, (jobpids.identity() if pid == os.getpid()
                 else peers(pid) if peers is not None else None)


_PROCESSES = procstate.ProcReader()
"""This worker's reads of its host's ranks (``since`` is this reader's memory)."""


def _process_state(p: Provider, q: Mapping[str, str]) -> Mapping[str, Any]:
    """A rank of this job on this host (``pid=``; this process by default) read from ``/proc``
    (``procstate``): the way a stuck rank on a host without the frontend or an agent gets
    its state read."""
    _only(q, frozenset({PID}))
    rec = _PROCESSES.read([_target(p, q)])[0]
    if rec.get("state") is None:
        raise HandlerError(403, str(rec.get("error")))
    return rec


def _pyspy_dump(p: Provider, q: Mapping[str, str]) -> str:
    """py-spy of this process (torch's ``pyspy_dump``), or with ``pid=`` of another rank of this
    job on this host (one it announced: ``jobpids``): the way a stuck rank on a host without
    the frontend gets read."""
    _only(q, _PYSPY_PARAMS)
    flags = {}
    for name in (NATIVE, NONBLOCKING, SUBPROCESSES):
        raw = q.get(name, "0").lower()
        if raw not in _BOOL01:
            raise HandlerError(400, f"parameter {name}={raw[:20]!r} must be 0/1 or true/false")
        flags[name] = _BOOL01[raw]
    # nonblocking is accepted for torch's frontend (it always sends it): every read here is
    # non-blocking unless native frames are asked for, which py-spy can only unwind paused.
    pid, announced = _target(p, q)
    try:
        pyspy.check_target(pid, announced)
        return pyspy.read(pid, native=flags[NATIVE], subprocesses=flags[SUBPROCESSES])
    except pyspy.PySpyError as e:
        code = 403 if e.kind == pyspy.REFUSED else 404 if e.kind == pyspy.GONE else 500
        raise HandlerError(code, e.reason) from None


HANDLERS: dict[str, Handler] = {
    PING_HANDLER: _ping,
    STACKS_HANDLER: _dump_traceback,
    FR_HANDLER: _torchcomms_fr_trace_json,
    C10D_FR_HANDLER: _fr_trace_json,
    DUMP_FILE_HANDLER: _torchcomms_fr_dump_file,
    HEALTH_HANDLER: _torchcomms_health_check,
    pyspy.HANDLER: _pyspy_dump,
    procstate.HANDLER: _process_state,
    **rank_capture.HANDLERS,  # torch_profile, wait_counter_values
}

# Handlers run on this worker's own thread: a slow snapshot delays only this worker's replies.
routes = handler_routes(HANDLERS, lambda request: request.app[PROVIDER], "worker")


def make_worker_app(provider: Provider, gate: TokenGate | None = None) -> web.Application:
    """The worker app serving ``provider`` under torch's ``/handler/<name>`` paths.

    With ``gate``, every request must carry the job's token (header ``X-Debug-Server-Token``).
    """
    guard = [auth_middleware(gate, browser=False)] if gate is not None else []
    app = web.Application(middlewares=guard)
    app[PROVIDER] = provider
    app.add_routes(routes)
    return app


# ---------------------------------------------------------------------------------------------
# Running it in a daemon thread of the trainer


class WorkerThread:
    """A worker app served from a daemon thread with its own event loop.

    Daemon, no signal handlers: the trainer exits as if the worker were not there. ``port`` is
    the bound port (the one asked for, or the one the OS picked for 0).
    """

    def __init__(self, app: web.Application, host: str | None, port: int) -> None:
        self._app = app
        self._host = host
        self._want_port = port
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="debug_server.rank.worker", daemon=True)

    def start(self, timeout: float = 30.0) -> WorkerThread:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"debug_server worker did not start within {timeout} s")
        if self._error is not None:
            raise self._error
        return self

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as e:  # reported to start(); never propagates into the trainer
            if not self._ready.is_set():
                self._error = e
                self._ready.set()
            else:
                logger.exception("debug_server worker thread ended with an error")

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        runner = web.AppRunner(self._app, handle_signals=False, shutdown_timeout=2.0,
                               access_log=None)
        await runner.setup()
        try:
            # One port for every address family: the registered port must answer over IPv4
            # and IPv6 alike (TCPSite with host None gives each family its own port).
            try:
                self.port = await start_sites(runner, self._host, self._want_port)
            except OSError as e:
                raise OSError(
                    e.errno, f"debug_server worker cannot bind {self._host or '*'}:{self._want_port}: "
                    f"{e.strerror or e}") from None
            self._ready.set()
            await self._stop.wait()
        finally:
            await runner.cleanup()

    def stop(self, timeout: float = 5.0) -> None:
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:  # loop already closed
                pass
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)


def start_worker_thread(
    provider: Provider, host: str | None = "127.0.0.1", port: int = 0,
    gate: TokenGate | None = None,
) -> WorkerThread:
    """Serve ``provider`` from a daemon thread; returns once the port is bound (or raises)."""
    return WorkerThread(make_worker_app(provider, gate), host, port).start()

