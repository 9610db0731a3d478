"""Where this process sits in the job (``JobEnv``), read from torchrun's environment, never guessed;
and the bind address that follows from it."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass

from debug_server.config.settings import ConfigError

LOOPBACK = "127.0.0.1"


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

