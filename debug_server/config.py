"""Configuration of the debug server: what the job's environment says, and what the user chose.

Two frozen records: ``JobEnv`` (read from torchrun's environment, never guessed) and
``ServerConfig`` (the keyword arguments of ``start_debug_server``, passed to the frontend
process on its command line).
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

ALL_DUMPS: frozenset[str] = frozenset({"fr_trace", "stacks", "per_rank", "snapshot"})
"""Dump kinds the periodic dumper can write (``enabled_dumps`` is a subset)."""

DEFAULT_PORT = 25999
DEFAULT_KEEP_BYTES = 2 << 30
"""Default bound on a dump dir's cycle files (2 GiB): 50 cycles of a 16384-rank job fit."""
LOOPBACK = "127.0.0.1"


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
            from debug_server.auth import check_token_text  # auth imports this module

            check_token_text(self.auth_token)
