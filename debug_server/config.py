"""Configuration of the debug server: what the job's environment says, and what the user chose.

Three frozen records:

- ``JobEnv``: where this process sits in the job, read from torchrun's environment, never guessed;
- ``ServerConfig``: what the user chose (the keyword arguments of ``start_debug_server``);
- ``FrontendConfig``: one frontend process's whole configuration, a ``ServerConfig`` plus where
  the job's workers are. ``start_debug_server`` hands it to the frontend process whole, as JSON
  in an inherited unnamed file (``write_inherited`` / ``read_inherited``): nothing on the command
  line (``ps`` shows it to every user, and the config holds the access token) and no copy of the
  options in an argument parser.

This module imports nothing else of the package (``auth`` builds on it, not the reverse).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from debug_server.errors import first_line

ALL_DUMPS: frozenset[str] = frozenset({"fr_trace", "stacks", "per_rank", "snapshot"})
"""Dump kinds the periodic dumper can write (``enabled_dumps`` is a subset)."""

DEFAULT_PORT = 25999
DEFAULT_KEEP_BYTES = 2 << 30
"""Default bound on a dump dir's cycle files (2 GiB): 50 cycles of a 16384-rank job fit."""
LOOPBACK = "127.0.0.1"
FRONTEND_CONFIG_FD_ENV = "DEBUG_SERVER_FRONTEND_CONFIG_FD"
"""Names the inherited descriptor that holds a spawned frontend's ``FrontendConfig`` (JSON)."""


class ConfigError(ValueError):
    """A bad setting; the message names the variable or argument and the bad value."""


def _env_int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ConfigError(
                f"environment variable {name} is not set; start the job with torchrun "
                f"(or set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) before start_debug_server()"
            )
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class JobEnv:
    """Where this process sits in the job, as torchrun's environment tells it."""

    rank: int
    """Global rank (``RANK``)."""
    world_size: int
    """Number of ranks (``WORLD_SIZE``)."""
    local_world_size: int
    """Ranks on this host (``LOCAL_WORLD_SIZE``; defaults to ``WORLD_SIZE``)."""
    master_addr: str
    """Host of the job's TCPStore (``MASTER_ADDR``)."""
    master_port: int
    """Port of the job's TCPStore (``MASTER_PORT``)."""
    restart_count: int = 0
    """Elastic restart generation (``TORCHELASTIC_RESTART_COUNT``); older registrations are stale."""
    run_id: str = ""
    """Elastic run id (``TORCHELASTIC_RUN_ID``), recorded with each registration."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> JobEnv:
        """Read torchrun's variables; a missing or malformed one raises ``ConfigError`` naming it."""
        env = os.environ if env is None else env
        world_size = _env_int(env, "WORLD_SIZE")
        rank = _env_int(env, "RANK")
        if not 0 <= rank < world_size:
            raise ConfigError(f"RANK={rank} is outside 0..WORLD_SIZE-1 (WORLD_SIZE={world_size})")
        master_addr = env.get("MASTER_ADDR", "")
        if not master_addr:
            raise ConfigError("environment variable MASTER_ADDR is not set")
        return cls(
            rank=rank,
            world_size=world_size,
            local_world_size=_env_int(env, "LOCAL_WORLD_SIZE", world_size),
            master_addr=master_addr,
            master_port=_env_int(env, "MASTER_PORT"),
            restart_count=_env_int(env, "TORCHELASTIC_RESTART_COUNT", 0),
            run_id=env.get("TORCHELASTIC_RUN_ID", ""),
        )

    @property
    def single_host(self) -> bool:
        """True when every rank runs on this host and the store is on loopback."""
        return is_loopback(self.master_addr) and self.local_world_size == self.world_size


def is_loopback(host: str) -> bool:
    """``localhost``, ``127.x.x.x``, ``::1`` and friends."""
    if host.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def default_bind_host(job: JobEnv) -> str | None:
    """Loopback for a single-host job (no open port beyond this machine), else all interfaces.

    ``None`` means all interfaces (IPv4 and IPv6) to aiohttp.
    """
    return LOOPBACK if job.single_host else None


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerConfig:
    """What the user chose in ``start_debug_server``; shared by the worker and the frontend."""

    port: int = DEFAULT_PORT
    """Frontend (rank 0) HTTP port."""
    worker_port: int = 0
    """Per-rank worker port; 0 picks a free one."""
    host: str | None = None
    """Bind address; None binds loopback for single-host jobs and all interfaces otherwise."""
    dump_dir: str | None = None
    """Directory of periodic dumps; None disables the dumper."""
    dump_interval: float = 60.0
    """Seconds between dump cycles (the first comes shortly after start)."""
    enabled_dumps: frozenset[str] = ALL_DUMPS
    """Which dumps each cycle writes: fr_trace, stacks, per_rank, snapshot."""
    fetch_timeout: float = 5.0
    """Seconds the frontend waits for one rank before reporting it timed out."""
    max_concurrency: int = 64
    """Most worker requests the frontend has in flight at once."""
    keep_dumps: int = 50
    """Dump cycles kept in ``dump_dir``; older ones are deleted."""
    keep_bytes: int = DEFAULT_KEEP_BYTES
    """Most bytes the dump cycles in ``dump_dir`` may hold; the oldest go first (newest kept)."""
    stall_timeout: float | None = None
    """Seconds an op may stay in flight before a rank's health check says unhealthy."""
    auth_token: str | None = field(default=None, repr=False)
    """The token every worker and frontend request must carry; None: no access control."""

    def __post_init__(self) -> None:
        unknown = set(self.enabled_dumps) - ALL_DUMPS
        if unknown:
            raise ConfigError(
                f"enabled_dumps has unknown kinds {sorted(unknown)}; choose from {sorted(ALL_DUMPS)}"
            )
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port={self.port} is not a TCP port")
        if not 0 <= self.worker_port <= 65535:
            raise ConfigError(f"worker_port={self.worker_port} is not a TCP port")
        if not self.dump_interval > 0:
            raise ConfigError(f"dump_interval={self.dump_interval} must be > 0 seconds")
        if not self.fetch_timeout > 0:
            raise ConfigError(f"fetch_timeout={self.fetch_timeout} must be > 0 seconds")
        if self.stall_timeout is not None and not self.stall_timeout > 0:
            raise ConfigError(f"stall_timeout={self.stall_timeout} must be > 0 seconds or None")
        if self.max_concurrency < 1:
            raise ConfigError(f"max_concurrency={self.max_concurrency} must be >= 1")
        if self.keep_dumps < 1:
            raise ConfigError(f"keep_dumps={self.keep_dumps} must be >= 1")
        if self.keep_bytes < 1:
            raise ConfigError(f"keep_bytes={self.keep_bytes} must be >= 1")
        if self.auth_token is not None:
            check_token_text(self.auth_token)

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-ready (the token included: keep the result off argv and logs)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["enabled_dumps"] = sorted(self.enabled_dumps)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ServerConfig:
        """The inverse of ``to_dict``; an unknown or malformed field raises ``ConfigError``."""
        return _build(cls, data, {"enabled_dumps": frozenset})


def check_token_text(token: str) -> str:
    """A token must be printable ASCII without spaces (it travels in a header and a cookie)."""
    if not token or not token.isascii() or not token.isprintable() or any(c in token for c in " ;,\""):
        raise ConfigError("auth_token must be non-empty printable ASCII without spaces, "
                          "';', ',' or quotes")
    if len(token) < 16:
        raise ConfigError(f"auth_token is {len(token)} characters; use at least 16 "
                          "(e.g. secrets.token_urlsafe(32))")
    return token


@dataclass(frozen=True, kw_only=True, slots=True)
class FrontendConfig:
    """One frontend process's whole configuration: the user's choices and where the workers are.

    Workers are found either through the job's TCPStore (``store``; how rank 0's frontend and an
    attached one find them) or at fixed URLs (``worker_urls``; tests and benchmarks).
    """

    server: ServerConfig
    """What the user chose (ports, dump dir, timeouts, token)."""
    world_size: int
    """Number of ranks the pages cover."""
    store: tuple[str, int] | None = None
    """``(host, port)`` of the job's TCPStore (its ``MASTER_ADDR:MASTER_PORT``)."""
    restart_count: int = 0
    """Elastic restart whose registrations in the store are trusted."""
    worker_urls: tuple[str | None, ...] | None = None
    """Each rank's worker URL (None: not registered), instead of the store."""
    parent_pid: int | None = None
    """The trainer's rank 0; once it is gone, serve while the job lives (``orphan_exit_s``)."""
    orphan_exit_s: float = 120.0
    """Once ``parent_pid`` is gone: exit after this many seconds in which no rank answered, no
    rank's process ran on this host and the store was unreachable
    (``$DEBUG_SERVER_ORPHAN_EXIT_S`` in rank 0's environment)."""
    ready_fd: int | None = None
    """Inherited pipe on which the process writes ``ready <port>`` or ``error: <why>``."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"world_size={self.world_size} must be >= 1")
        if (self.store is None) == (self.worker_urls is None):
            raise ConfigError("a frontend needs exactly one of store=(host, port) and worker_urls")
        if not self.orphan_exit_s > 0:
            raise ConfigError(f"orphan_exit_s={self.orphan_exit_s} must be > 0")
        if self.worker_urls is not None and len(self.worker_urls) != self.world_size:
            raise ConfigError(f"{len(self.worker_urls)} worker_urls for world_size="
                              f"{self.world_size}; give one per rank (None: not registered)")

    def to_json(self) -> str:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["server"] = self.server.to_dict()
        return json.dumps(out)

    @classmethod
    def from_json(cls, text: str | bytes) -> FrontendConfig:
        """The inverse of ``to_json``; anything malformed raises ``ConfigError`` in one line."""
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"frontend config is not JSON: {e}") from None
        if not isinstance(data, dict) or not isinstance(data.get("server"), dict):
            raise ConfigError("frontend config must be a JSON object with a 'server' object")
        return _build(cls, data, {"server": ServerConfig.from_dict, "store": _pair,
                                  "worker_urls": tuple})


ORPHAN_EXIT_ENV = "DEBUG_SERVER_ORPHAN_EXIT_S"


def orphan_exit_from_env(env: Mapping[str, str] | None = None) -> float:
    """``FrontendConfig.orphan_exit_s`` as rank 0's environment sets it (default 120)."""
    raw = (os.environ if env is None else env).get(ORPHAN_EXIT_ENV, "").strip()
    if not raw:
        return 120.0
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(f"environment variable {ORPHAN_EXIT_ENV}={raw[:40]!r} must be a "
                          "number of seconds > 0")
    return value


def _pair(value: Sequence[Any] | None) -> tuple[str, int] | None:
    if value is None:
        return None
    host, port = value
    return str(host), int(port)


def _build(cls: Any, data: Mapping[str, Any], convert: Mapping[str, Any]) -> Any:
    # One generic path from a dict to a record: a field added to a record needs no other edit.
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{cls.__name__} has no field {', '.join(map(repr, unknown))}")
    kwargs = dict(data)
    try:
        for name, fn in convert.items():
            if kwargs.get(name) is not None:
                kwargs[name] = fn(kwargs[name])
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"bad {cls.__name__}: {first_line(e, 10_000)}") from None


def write_inherited(config: FrontendConfig) -> int:
    """A new descriptor of an unnamed file holding ``config`` as JSON, positioned at its start.

    The spawner passes it to the child (``pass_fds``) and names it in
    ``$DEBUG_SERVER_FRONTEND_CONFIG_FD``, then closes its own copy. Unnamed (``memfd`` where the
    OS has it, else an unlinked temp file): no other user can open it, and unlike one environment
    string (128 KiB at most) it holds the worker URLs of any job size.
    """
    data = config.to_json().encode()
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("debug_server_frontend_config")
    else:
        with tempfile.TemporaryFile() as f:
            fd = os.dup(f.fileno())
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_inherited(env: Mapping[str, str] | None = None) -> FrontendConfig | None:
    """The ``FrontendConfig`` a spawner left in ``$DEBUG_SERVER_FRONTEND_CONFIG_FD`` (None when
    the variable is unset); the descriptor is read whole and closed. Raises ``ConfigError``."""
    env = os.environ if env is None else env
    raw = env.get(FRONTEND_CONFIG_FD_ENV)
    if not raw:
        return None
    try:
        with os.fdopen(int(raw), "rb") as f:
            text = f.read()
    except (ValueError, OSError) as e:
        raise ConfigError(f"{FRONTEND_CONFIG_FD_ENV}={raw!r}: cannot read the frontend config "
                          f"({e})") from None
    return FrontendConfig.from_json(text)
