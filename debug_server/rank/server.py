"""``start_debug_server`` / ``stop_debug_server``: the worker on every rank, the frontend on rank 0.

The frontend is its own process (``spawn_frontend``): ``python -m debug_server.frontend`` with no
arguments, its whole ``config.FrontendConfig`` in an inherited unnamed file.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from debug_server.auth import (
    TOKEN_ENV,
    TokenGate,
    new_token,
    publish_token,
    read_token,
    token_required,
)
from debug_server.config import (
    ALL_DUMPS,
    DEFAULT_KEEP_BYTES,
    DEFAULT_PORT,
    FRONTEND_CONFIG_FD_ENV,
    FrontendConfig,
    JobEnv,
    ServerConfig,
    Settings,
    default_bind_host,
    write_inherited,
)
from debug_server.errors import first_line
from debug_server.protocol import addrs
from debug_server.rank import agent_launch as host_agent
from debug_server.rank import clock, ptracer, sigstack
from debug_server.rank.discovery import HOST_ENV, Advertised, Peers, advertise, register_worker
from debug_server.rank.worker import HooksProvider, WorkerThread, start_worker_thread
from debug_server.readers import pyspy
from debug_server.readers.sigstack import META_KEY as SIGSTACK_META_KEY
from debug_server.readers.storeview import store_client
from debug_server.recording import c10d_fr

logger = logging.getLogger(__name__)

EXIT_QUIESCE_S = 1.0
"""At most this long, at interpreter exit, for the worker's in-flight request to end."""
_LOCK = threading.Lock()
_CURRENT: DebugServer | None = None

FRONTEND_START_TIMEOUT = 60.0
STORE_CONNECT_TIMEOUT = 300.0
REGISTER_WAIT = 2.0
DEFAULT_STALL_TIMEOUT = 60.0
"""Seconds in flight before an op counts as stalled: well under the usual communicator timeout
(NCCL's default is 10 minutes), so the evidence is on disk long before the job is torn down."""


class _Registration:
    """Writes this rank's worker URL into the job's store from a daemon thread.

    Under torchrun the store is up before the trainer starts and this finishes at once; with a
    plain ``env://`` rendezvous rank 0 creates the store later, in ``init_process_group``, so
    blocking ``start_debug_server`` on it would deadlock a job that starts the server first.
    """

    def __init__(self, job: JobEnv, url: str, *, gate: TokenGate | None = None,
                 publish: str | None = None, extra: dict[str, object] | None = None,
                 keeper: ptracer.PtracerKeeper | None = None) -> None:
        self.job = job
        self.keeper = keeper
        self.url = url
        self.gate = gate
        self.publish = publish
        self.extra = extra
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="debug_server.register", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            store = store_client(self.job.master_addr, self.job.master_port, STORE_CONNECT_TIMEOUT)
            if self.publish is not None:  # rank 0: hand the token to the other ranks
                publish_token(store, self.job.restart_count, self.publish)
            elif self.gate is not None and not self.gate.known:
                # Learn rank 0's token before registering, so the frontend never meets this
                # worker while it still refuses everything.
                self.gate.set(read_token(store, self.job.restart_count))
            register_worker(store, self.job, self.url, self.extra)
            self.done.set()
            if self.keeper is not None:  # from now on: PR_SET_PTRACER on this host's reader
                self.keeper.run(store)
        except Exception as e:  # logged here: nobody may be waiting any more
            self.error = e
            logger.error("debug_server: rank %d could not register its worker %s in the store "
                         "%s:%d: %s", self.job.rank, self.url, self.job.master_addr,
                         self.job.master_port, first_line(e))
        finally:
            self.done.set()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the registration thread (the keeper) to end."""
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)


class DebugServer:
    """What ``start_debug_server`` started in this process; ``stop()`` ends it (idempotent)."""

    def __init__(self, job: JobEnv, config: ServerConfig, worker: WorkerThread, worker_url: str,
                 frontend: subprocess.Popen[bytes] | None, frontend_port: int | None,
                 registration: _Registration) -> None:
        self.job = job
        self.registration = registration
        self.config = config
        self.worker = worker
        self.worker_url = worker_url
        self.frontend = frontend
        self.frontend_port = frontend_port
        self.sigstack: sigstack.SigStack | None = None
        self.gate: TokenGate | None = None
        self.fr_env_set: dict[str, str] = {}
        """c10d Flight Recorder variables this server set (``c10d_fr.turn_on_env``)."""
        self.advertised: Advertised | None = None
        """The address this rank's servers advertise (``discovery.advertise``)."""
        self.agent: subprocess.Popen[bytes] | None = None
        """This host's agent process, on its local rank 0 (``frontend.agent``)."""
        self._stopped = False

    @property
    def auth_token(self) -> str | None:
        """The token requests must carry (None without access control, or while a rank other
        than 0 still waits for it)."""
        return self.gate.token if self.gate is not None else None

    @property
    def browser_url(self) -> str | None:
        """The frontend link to open in a browser (with ``?token=`` when a token is required)."""
        if self.frontend_url is None:
            return None
        return f"{self.frontend_url}/" + (f"?token={self.auth_token}" if self.auth_token else "")

    def wait_registered(self, timeout: float | None = None) -> bool:
        """True once this rank's worker is in the store (False on timeout or failure)."""
        return self.registration.done.wait(timeout) and self.registration.error is None

    @property
    def worker_port(self) -> int:
        return self.worker.port

    @property
    def frontend_url(self) -> str | None:
        """``http://<host>:<port>`` of the rank-0 frontend; None on other ranks.

        The host is the advertised one, so on a multi-host job the link works from elsewhere.
        """
        if self.frontend_port is None:
            return None
        host = self.advertised.host if self.advertised else (self.config.host or "127.0.0.1")
        return f"http://{_url_host(host)}:{self.frontend_port}"

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the frontend process (rank 0) and this rank's worker. Safe to call twice."""
        global _CURRENT
        if self._stopped:
            return
        self._stopped = True
        atexit.unregister(self._quiesce_at_exit)
        if self.frontend is not None:
            _end_process(self.frontend, timeout)
        if self.agent is not None:
            _end_process(self.agent, timeout)
        if self.registration.keeper is not None:
            self.registration.keeper.stop.set()
        self.worker.stop(timeout)
        if self.sigstack is not None:
            self.sigstack.close()
        for k, v in self.fr_env_set.items():
            if os.environ.get(k) == v:
                del os.environ[k]
        with _LOCK:
            if _CURRENT is self:
                _CURRENT = None
                _set_recording_defaults(None, None)
                pyspy.use_setting(None)
                clock.set_offset_ns(0)

    def _quiesce_at_exit(self) -> None:
        # At interpreter exit, before finalization: a daemon thread caught inside a C++ call
        # (a store read, c10d's FR dump for a page) when the interpreter finalizes is ended by
        # pthread_exit through C++ frames, and the process aborts ("terminate called without
        # an active exception", SIGABRT). The frontend outlives rank 0 and keeps asking, so
        # finish the worker's in-flight request and stop the keeper first; bounded, so the
        # trainer's exit waits at most a second. The frontend is left running on purpose.
        if self._stopped:
            return
        if self.registration.keeper is not None:
            self.registration.keeper.stop.set()
        self.worker.stop(EXIT_QUIESCE_S)
        self.registration.join(EXIT_QUIESCE_S / 2)


def start_debug_server(
    port: int = DEFAULT_PORT,
    worker_port: int = 0,
    dump_dir: str | None = None,
    dump_interval: float = 60.0,
    enabled_dumps: Collection[str] | None = None,
    fetch_timeout: float = 5.0,
    host: str | None = None,
    *,
    keep_dumps: int = 50,
    keep_bytes: int = DEFAULT_KEEP_BYTES,
    max_concurrency: int = 64,
    stall_timeout: float | None = DEFAULT_STALL_TIMEOUT,
    auth: str = "auto",
    auth_token: str | None = None,
    signal_stacks: bool | None = None,
) -> DebugServer:
    """Start the hang debugger on this rank; call it on every rank after torchrun set the env.

    Every rank starts a worker (an HTTP server in a daemon thread that serves this process's
    stacks and Flight Recorder record) and registers it in the job's TCPStore
    (``MASTER_ADDR:MASTER_PORT``). Rank 0 also starts the frontend in its own process, which
    serves ``/``, ``/fr_trace`` and ``/stacks`` for the whole job and runs the periodic dumper.

    Args:
        port: The frontend's port on rank 0 (default 25999). If it is taken, this raises
            ``OSError`` naming the port (and the worker is stopped again).
        worker_port: This rank's worker port; 0 (default) lets the OS pick a free one.
        dump_dir: Where the frontend writes periodic dumps; None (default) disables them. When
            set and ``TORCHCOMM_FR_DUMP_TEMP_FILE`` is not, every rank's pickle goes to
            ``<dump_dir>/per_rank/rank_<N>``, next to the reports.
        dump_interval: Seconds between dump cycles (default 60; above 512 ranks per second
            of it, ``world_size / 512``); the first runs about a second after start.
            (``/metrics``: the last cycle's analysis, else the frontend's own every 15 s.)
        enabled_dumps: Which dumps a cycle writes, a subset of ``{"fr_trace", "stacks",
            "per_rank", "snapshot"}``; None (default) means all.
        fetch_timeout: Seconds the frontend waits for one rank before reporting it as timed
            out (default 5); pages and dumps never wait longer than this on a stuck rank.
        host: Address to bind the worker and frontend to. None (default) binds 127.0.0.1 for
            a single-host job (``MASTER_ADDR`` is loopback and ``LOCAL_WORLD_SIZE ==
            WORLD_SIZE``) and all interfaces otherwise (IPv4 and, where the host has it,
            IPv6, on one port). The address registered for the other hosts, and used in
            ``handle.browser_url``, is ``$DEBUG_SERVER_HOST`` if set, else an explicit
            ``host``, else the local address of the interface that reaches ``MASTER_ADDR``
            (never a loopback address while another one exists).
        keep_dumps: Dump cycles kept in ``dump_dir`` (default 50); older files are deleted.
        keep_bytes: Most bytes the dump cycles in ``dump_dir`` may hold (default 2 GiB); the
            oldest cycles are deleted first, the newest is always kept.
        max_concurrency: Most worker requests the frontend has in flight at once (default 64).
        stall_timeout: Seconds an op may stay in flight before it counts as stalled (default
            60), for every ``FlightRecorderHook`` created with ``stall_timeout=None``. A stalled
            op makes this rank unhealthy, writes its pickle and ``stalled_stacks_r<rank>.txt``,
            and the frontend writes ``hang_report_<ts>.txt/.json`` into ``dump_dir``. Keep it
            under the communicator's timeout and above the longest legitimate wait. None: off.
        auth: Access control of the workers and the frontend. ``"auto"`` (default): require
            a token when they listen beyond loopback (a multi-host job, or an explicit
            non-loopback ``host``) or when ``auth_token`` is given; a single-host job binds
            127.0.0.1 and needs none. ``"token"``: always require one. ``"none"``: never (a
            trusted network; lets torch's own frontend read these workers, which cannot send
            a token).
        auth_token: The token to require (printable ASCII, >= 16 characters), the same on
            every rank. None (default): when one is required, rank 0 creates one with
            ``secrets.token_urlsafe(32)`` and the other ranks read it from the job's store
            (bounded wait) before registering. Requests carry it in the header
            ``X-Debug-Server-Token``; a browser opens ``handle.browser_url`` (``/?token=...``,
            logged by rank 0) once and then holds an HttpOnly cookie. Missing: 401, wrong: 403.
        signal_stacks: Opt in to stacks by signal (``sigstack``) for a rank that py-spy cannot
            read and whose worker does not answer; the signal interrupts a ``sleep``/``poll``
            (EINTR), so it is off by default. None: ``$DEBUG_SERVER_SIGNAL_STACKS=1`` turns it on.

    Returns:
        A ``DebugServer`` handle; ``handle.stop()`` (or ``stop_debug_server()``) ends it.

    Raises:
        RuntimeError: if a debug server is already running in this process.
        debug_server.config.ConfigError: on a missing torchrun variable or a bad argument.
        OSError: if a port cannot be bound (the message names it).
    """
    job = JobEnv.from_env()
    settings = Settings.from_env()  # every variable of ours, read once (docs/settings.md)
    bind_host = host if host is not None else default_bind_host(job)
    required = token_required(auth, bind_host, auth_token)
    if required and auth_token is None and job.rank == 0:
        auth_token = new_token()
    config = ServerConfig(
        port=port, worker_port=worker_port, dump_dir=dump_dir, dump_interval=dump_interval,
        enabled_dumps=ALL_DUMPS if enabled_dumps is None else frozenset(enabled_dumps),
        fetch_timeout=fetch_timeout, keep_dumps=keep_dumps, keep_bytes=keep_bytes,
        max_concurrency=max_concurrency,
        stall_timeout=stall_timeout, auth_token=auth_token,
        host=bind_host,
    )
    handle, advertised, pg_existed = _start_locked(job, config, required, settings, signal_stacks)
    atexit.register(handle._quiesce_at_exit)
    # No exit hook ends the frontend (rank 0 may finish first while the others hang, when the
    # pages are needed), and none touches the store: the frontend sees each rank of its host
    # end (a pidfd), the store close, and exits in one line once every rank is gone, or after
    # orphan_exit_s without a sign of the job (frontend/departed.py), or on stop().
    _log_started(handle, advertised, pg_existed, settings)
    return handle


def _start_locked(job: JobEnv, config: ServerConfig, required: bool, settings: Settings,
                  signal_stacks: bool | None) -> tuple[DebugServer, Advertised, bool]:
    """Start this process's parts once (under the lock) and make the handle current."""
    global _CURRENT
    with _LOCK:
        if _CURRENT is not None:
            raise RuntimeError("debug server already running in this process; "
                               "call stop_debug_server() first")
        # c10d's own Flight Recorder holds what DDP, FSDP and plain torch.distributed issue. It
        # sizes its ring once, when the first process group is created, from these variables:
        # before that, turn it on (2000 entries) unless the user chose; after, only a log line
        # (below) can help. stop() takes ours back, like the dump path.
        pg_existed = c10d_fr.group_exists()
        fr_env_set = {} if pg_existed else c10d_fr.turn_on_env(settings)
        # Start timing on NCCL groups, so a GPU that never started its collective is told
        # apart from one inside it (analysis: gpu_busy); the user's own setting stands.
        fr_env_set.update(c10d_fr.turn_on_timing(settings))
        if signal_stacks is not None:  # the argument wins over the variable
            settings = dataclasses.replace(settings, signal_stacks=signal_stacks)
        handle, advertised = _start_parts(job, config, required, settings)
        handle.fr_env_set = fr_env_set
        # This host's agent (debug_server.agent), on its local rank 0 of a multi-host job; never
        # waited for.
        handle.agent = host_agent.start_for_rank(config, job, advertised.host, required,
                                                 settings)
        _CURRENT = handle
        _set_recording_defaults(config.stall_timeout, _pickle_prefix(settings, config.dump_dir))
    return handle, advertised, pg_existed


def _pickle_prefix(settings: Settings, dump_dir: str | None) -> str | None:
    """Each rank's pickle next to the reports, where PyTorch's fr_trace reads them with
    ``-p rank_``; the user's own ``TORCHCOMM_FR_DUMP_TEMP_FILE`` wins. A value handed to the
    hooks, not the environment: nothing outlives stop() or leaks into children."""
    if settings.dump_prefix or dump_dir is None:
        return settings.dump_prefix
    return os.path.join(os.path.abspath(dump_dir), "per_rank", "rank_")


def _start_parts(job: JobEnv, config: ServerConfig, required: bool,
                 settings: Settings) -> tuple[DebugServer, Advertised]:
    """The frontend (rank 0), the worker, the stack readers and the registration; on any
    failure, what was started is ended again before the error propagates."""
    # Start the frontend first: it needs seconds to import; the worker starts meanwhile.
    pending = _spawn_frontend(config, job, settings.orphan_exit_s) if job.rank == 0 else None
    worker: WorkerThread | None = None
    gate = TokenGate(config.auth_token) if required else None
    # py-spy, run by the frontend or this host's agent (neither is an ancestor), reads this
    # process from outside when its worker cannot answer; under Yama ptrace_scope=1 the rank
    # must name that reader. Until the reader is known (the store may not be up yet), any
    # process of this user may; then only the reader (ptracer.PtracerKeeper).
    agent_meta = host_agent.rank_meta(job, settings)
    keeper = ptracer.PtracerKeeper(job, agent_meta.get(addrs.AGENT_META_KEY), settings.ptracer)
    keeper.apply(None)
    # Stacks by signal: only where the rank opted in (a signal interrupts sleeps and polls).
    sig = sigstack.install(settings.signal_stacks)
    # What this process's worker reads of the settings, handed over as values.
    pyspy.use_setting(settings.pyspy)
    clock.set_offset_ns(settings.clock_offset_ns)
    try:
        # The stall timeout reaches health through the hooks' process default (set by the
        # caller), so a hook's own stall_timeout is not overridden by the worker.
        provider = HooksProvider(job.rank)
        # pyspy_dump?pid= reads only a rank this job announced on this host (jobpids).
        provider.peers = Peers(job).announced
        worker = start_worker_thread(provider, config.host, config.worker_port, gate=gate)
        # Frontend and worker bind the same host, so this one address serves both links.
        advertised = advertise(config.host, job.master_addr, job.master_port, settings.host)
        worker_url = f"http://{_url_host(advertised.host)}:{worker.port}"
        registration = _Registration(
            job, worker_url, gate=gate,
            publish=config.auth_token if required and job.rank == 0 else None,
            extra={**({SIGSTACK_META_KEY: sig.meta()} if sig is not None else {}),
                   **agent_meta} or None, keeper=keeper)
        registration.done.wait(REGISTER_WAIT)
        frontend_port = (wait_frontend_ready(pending, config.port) if pending is not None
                         else None)
    except BaseException:
        if pending is not None:
            _end_process(pending[0], 2.0)
        if worker is not None:
            worker.stop()
        if sig is not None:
            sig.close()
        raise
    handle = DebugServer(job, config, worker, worker_url,
                         pending[0] if pending else None, frontend_port, registration)
    handle.sigstack = sig
    handle.gate = gate
    handle.advertised = advertised
    return handle, advertised


def _log_started(handle: DebugServer, advertised: Advertised, pg_existed: bool,
                 settings: Settings) -> None:
    job = handle.job
    # A user's job log gains nothing from us on every rank: this line is for debugging
    # (rank 0's at info), unless no other host can reach this rank (a loopback address on a
    # multi-host job), which is said where it shows without any logging setup.
    level = (logging.WARNING if not (advertised.reachable or job.single_host)
             else logging.INFO if job.rank == 0 else logging.DEBUG)
    logger.log(level, "debug_server: rank %d worker at %s (%s)%s", job.rank, handle.worker_url,
               advertised.how + ("" if advertised.reachable else
                                 f"; other hosts cannot reach it: set {HOST_ENV}"),
               f"; frontend at {handle.frontend_url}" if handle.frontend_url else "")
    off = c10d_fr.off_reason(settings) if pg_existed else None
    if off is not None:
        # One line per job, not per rank: every rank has the same environment.
        logger.log(logging.WARNING if job.rank == 0 else logging.DEBUG,
                   "debug_server: c10d's Flight Recorder is off (%s), so ops issued directly "
                   "through torch.distributed (DDP, FSDP) are not recorded; set "
                   "TORCH_FR_BUFFER_SIZE=2000 before init_process_group, or call "
                   "start_debug_server before it", off)
    if handle.frontend_url:
        # The one line a job's log gets from us, on rank 0: where the pages are. Warning level
        # so it shows without any logging setup (with a token it is the one way in).
        logger.warning("debug_server: %s %s", "access token required; open" if handle.auth_token
                       else "pages at", handle.browser_url)


def stop_debug_server() -> None:
    """Stop this process's debug server, if any. Safe on every rank and safe to call twice."""
    with _LOCK:
        handle = _CURRENT
    if handle is not None:
        handle.stop()


def _set_recording_defaults(stall_timeout: float | None, dump_prefix: str | None) -> None:
    # Imported here so that importing the server side does not load the recording side.
    from debug_server.recording import hooks

    hooks.set_default_stall_timeout(stall_timeout)
    hooks.set_dump_prefix(dump_prefix)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _spawn_frontend(config: ServerConfig, job: JobEnv,
                    orphan_exit_s: float) -> tuple[subprocess.Popen[bytes], int]:
    # Absolute: the trainer may change its working directory after the frontend started.
    dump_dir = os.path.abspath(config.dump_dir) if config.dump_dir is not None else None
    return spawn_frontend(FrontendConfig(
        server=dataclasses.replace(config, dump_dir=dump_dir), world_size=job.world_size,
        store=(job.master_addr, job.master_port), restart_count=job.restart_count,
        parent_pid=os.getpid(), orphan_exit_s=orphan_exit_s))


def spawn_frontend(config: FrontendConfig, *, env: Mapping[str, str] | None = None,
                   **popen: Any) -> tuple[subprocess.Popen[bytes], int]:
    """Start ``python -m debug_server.frontend`` with ``config`` whole; returns (process, the
    read end of its ready pipe) for ``wait_frontend_ready``.

    The config travels as JSON in an inherited unnamed file (``config.write_inherited``); the
    command line carries nothing, so ``ps`` shows no option and no token. ``popen``: extra
    ``subprocess.Popen`` arguments (output files, ``start_new_session``).
    """
    read_fd, write_fd = os.pipe()
    config_fd = -1
    try:
        config_fd = write_inherited(dataclasses.replace(config, ready_fd=write_fd))
        child_env = dict(os.environ if env is None else env)
        # The token is in the config; a copy in the environment would reach the frontend's own
        # children (py-spy).
        child_env.pop(TOKEN_ENV, None)
        child_env[FRONTEND_CONFIG_FD_ENV] = str(config_fd)
        # c10d logs each failed store call with a C++ stack trace of some 20 frames, into the
        # job's log. The frontend's only C++ is its store client, whose failures it says in one
        # line of its own; the store closing at the job's end is no failure at all.
        child_env["TORCH_CPP_LOG_LEVEL"] = "FATAL"
        # The child must import this very package even when the trainer found it via sys.path
        # tweaks rather than an install.
        pkg_root = str(Path(__file__).resolve().parents[2])
        child_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (pkg_root, child_env.get("PYTHONPATH")) if p)
        proc = subprocess.Popen([sys.executable, "-m", "debug_server.frontend"], env=child_env,
                                stdin=subprocess.DEVNULL, pass_fds=(write_fd, config_fd),
                                close_fds=True, **popen)
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
        if config_fd >= 0:
            os.close(config_fd)
    return proc, read_fd


def wait_frontend_ready(pending: tuple[subprocess.Popen[bytes], int], port: int,
                        timeout: float = FRONTEND_START_TIMEOUT) -> int:
    """The port a ``spawn_frontend`` process bound, or an ``OSError``/``RuntimeError``/
    ``TimeoutError`` naming ``port`` (the one asked for); waits at most ``timeout`` s."""
    proc, read_fd = pending
    deadline = time.monotonic() + timeout
    buf = b""
    try:
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"debug_server frontend did not report ready on port "
                                   f"{port} within {timeout:.0f} s")
            ready, _, _ = select.select([read_fd], [], [], min(left, 0.5))
            if not ready:
                continue
            chunk = os.read(read_fd, 4096)
            if not chunk:  # the child exited (or closed the pipe) without a word
                code = proc.wait(timeout=5)
                raise RuntimeError(f"debug_server frontend (port {port}) exited with "
                                   f"code {code} before it was ready; see its log above")
            buf += chunk
    finally:
        os.close(read_fd)
    line = buf.split(b"\n", 1)[0].decode(errors="replace").strip()
    if line.startswith("ready "):
        return int(line.split()[1])
    reason = line.removeprefix("error: ")
    code = errno.EADDRINUSE if "in use" in reason else errno.EACCES
    raise OSError(code, f"debug_server frontend: {reason}; pass another port= to "
                  f"start_debug_server or stop what holds port {port}")


def _end_process(proc: subprocess.Popen[bytes], timeout: float) -> None:
    if proc.poll() is None:
        with contextlib.suppress(OSError):
            proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                proc.kill()
            proc.wait(timeout)
