"""What the user chose (``ServerConfig``, the keyword arguments of ``start_debug_server``) and one
frontend process's whole configuration (``FrontendConfig``: a ``ServerConfig`` plus where the
job's workers are), with their JSON forms."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from debug_server.config.settings import ConfigError
from debug_server.errors import first_line

ALL_DUMPS: frozenset[str] = frozenset({"fr_trace", "stacks", "per_rank", "snapshot"})
"""Dump kinds the periodic dumper can write (``enabled_dumps`` is a subset)."""

DEFAULT_PORT = 25999
DEFAULT_KEEP_BYTES = 2 << 30
"""Default bound on a dump dir's cycle files (2 GiB): 50 cycles of a 16384-rank job fit."""


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
    """Seconds between dump cycles (the first comes shortly after start); above 512 ranks per
    second of it, one second per 512 ranks, the first cycle too (256 s at 131072 ranks)."""
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
    (``Settings.orphan_exit_s`` in rank 0)."""
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


