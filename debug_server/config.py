"""Configuration of the debug server: what the job's environment says, and what the user chose.

Four frozen records:

- ``Settings``: every environment variable the package reads (``DEBUG_SERVER_*`` and the torch
  variables it reads or sets), declared once below with its type, default and one line of doc,
  read once by ``Settings.from_env`` and passed down as values; ``python -m debug_server.config
  --markdown`` prints the table of ``docs/settings.md`` from these declarations;
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

import argparse
import dataclasses
import ipaddress
import json
import os
import sys
import tempfile
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from debug_server.errors import first_line

ALL_DUMPS: frozenset[str] = frozenset({"fr_trace", "stacks", "per_rank", "snapshot"})
"""Dump kinds the periodic dumper can write (``enabled_dumps`` is a subset)."""

DEFAULT_PORT = 25999
DEFAULT_KEEP_BYTES = 2 << 30
"""Default bound on a dump dir's cycle files (2 GiB): 50 cycles of a 16384-rank job fit."""
LOOPBACK = "127.0.0.1"

# -- the environment's names: the only place they are spelled ----------------------------------
HOST_ENV = "DEBUG_SERVER_HOST"
SIGNAL_STACKS_ENV = "DEBUG_SERVER_SIGNAL_STACKS"
PYSPY_ENV = "DEBUG_SERVER_PYSPY"
PTRACER_ENV = "DEBUG_SERVER_PTRACER"
RECORDER_ENV = "DEBUG_SERVER_RECORDER"
MARKS_ENV = "DEBUG_SERVER_START_MARKS"
TIMING_OPT_ENV = "DEBUG_SERVER_NCCL_TIMING"
C10D_TIMING_ENV = "DEBUG_SERVER_C10D_TIMING"
AGENT_ENV = "DEBUG_SERVER_AGENT"
AGENT_ID_ENV = "DEBUG_SERVER_AGENT_ID"
TOKEN_ENV = "DEBUG_SERVER_AUTH_TOKEN"
FRONTEND_CONFIG_FD_ENV = "DEBUG_SERVER_FRONTEND_CONFIG_FD"
TOKEN_FROM_STORE_ENV = "DEBUG_SERVER_AGENT_TOKEN_FROM_STORE"
ORPHAN_EXIT_ENV = "DEBUG_SERVER_ORPHAN_EXIT_S"
CLOCK_OFFSET_ENV = "DEBUG_SERVER_CLOCK_OFFSET_NS"
DUMP_PATH_ENV = "TORCHCOMM_FR_DUMP_TEMP_FILE"
FR_BUFFER_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
NCCL_TIMING_ENV = "TORCH_NCCL_ENABLE_TIMING"


class ConfigError(ValueError):
    """A bad setting; the message names the variable or argument and the bad value."""


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _flag(name: str, raw: str) -> bool:
    v = raw.strip().lower()
    if v in _TRUE or v in _FALSE:
        return v in _TRUE
    raise ConfigError(f"environment variable {name}={raw!r}: expected 1 or 0")


def _text(name: str, raw: str) -> str | None:
    return raw.strip() or None


def _int_of(name: str, raw: str) -> int:
    try:
        return int(raw.strip())
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None


def _positive_float(name: str, raw: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(f"environment variable {name}={raw[:40]!r} must be a number > 0")
    return value


def _choice(*allowed: str) -> Callable[[str, str], str]:
    def parse(name: str, raw: str) -> str:
        v = raw.strip().lower()
        if v not in allowed:
            raise ConfigError(f"environment variable {name}={raw!r}: expected "
                              f"{', '.join(allowed[:-1])} or {allowed[-1]}")
        return v
    return parse


def _setting(env: str | tuple[str, ...], default: Any, doc: str, parse: Callable[[str, str], Any],
             *, type_: str, owner: str = "debug_server", shown: str | None = None) -> Any:
    # One declaration: the variable(s), the parser, the type and default as the table shows
    # them, and the doc line. ``owner``: ours, torch's (read or set by us), or a hand-off
    # between our own processes (never set by a user).
    names = (env,) if isinstance(env, str) else env
    meta = {"env": names, "doc": doc, "parse": parse, "type": type_, "owner": owner,
            "shown": shown if shown is not None else ("unset" if default is None else str(default))}
    return field(default=default, metadata=meta, repr=env != TOKEN_ENV)


@dataclass(frozen=True, kw_only=True, slots=True)
class Settings:
    """Every environment variable the package reads, parsed once (``from_env``)."""

    host: str | None = _setting(
        HOST_ENV, None, "The address this rank's servers advertise to other hosts; wins over "
        "any guess (default: the interface that reaches `MASTER_ADDR`).", _text, type_="str")
    signal_stacks: bool = _setting(
        SIGNAL_STACKS_ENV, False, "`1`: stacks by signal for a rank that py-spy cannot read "
        "and whose worker does not answer (a signal interrupts sleeps); "
        "`start_debug_server(signal_stacks=)` wins.", _flag, type_="bool", shown="0")
    pyspy: str | None = _setting(
        PYSPY_ENV, None, "Path of the py-spy binary; `0` turns py-spy off (default: `py-spy` "
        "on `PATH` or next to Python).", _text, type_="path")
    ptracer: str = _setting(
        PTRACER_ENV, "1", "Who may ptrace a rank under Yama `ptrace_scope=1`: `1` its host's "
        "reader (the agent, else the frontend; `prctl(PR_SET_PTRACER, pid)`), `any` every "
        "process of the user (a py-spy run by hand), `0` leave the setting alone.",
        _choice("1", "any", "0"), type_="1, any, 0")
    orphan_exit_s: float = _setting(
        ORPHAN_EXIT_ENV, 120.0, "Once rank 0 is gone, the frontend serves on while any rank "
        "answers or runs, and exits after this many seconds without a sign of the job.",
        _positive_float, type_="float")
    clock_offset_ns: int = _setting(
        CLOCK_OFFSET_ENV, 0, "For tests: shift every time a rank's worker reports by this "
        "many ns (a host whose clock is off), to check the straggler page corrects it.",
        _int_of, type_="int", owner="hand-off")
    recorder: str = _setting(
        RECORDER_ENV, "auto", "Which recorder holds a communicator's ops: `auto` (c10d's on "
        "NCCL when it is on, ours elsewhere), `c10d` (c10d's wherever it records), `python` "
        "(ours everywhere).", _choice("auto", "c10d", "python"), type_="auto, c10d, python")
    start_marks: str = _setting(
        MARKS_ENV, "1", "Start marks of c10d-backed CUDA communicators: `1` the first "
        "collective of a burst, `all` every collective, `0` none.", _choice("1", "all", "0"),
        type_="1, all, 0")
    nccl_timing: bool = _setting(
        TIMING_OPT_ENV, False, "`1`: c10d-backed NCCL communicators' groups record c10d's "
        "timing events (which give `duration_ms`; 2-20 % of a launch-bound step on H200).",
        _flag, type_="bool", shown="0")
    c10d_timing: bool = _setting(
        C10D_TIMING_ENV, True, "`0`: leave c10d's start timing as torch has it. By default "
        "`start_debug_server` turns it on for NCCL groups (`TORCH_NCCL_ENABLE_TIMING=1` for "
        "groups made later, torch's `_enable_collectives_timing` on the ones that exist), so "
        "a GPU that never started its collective is told apart from one inside it.",
        _flag, type_="bool", shown="1")
    agent: bool | None = _setting(
        AGENT_ENV, None, "`1`: a per-host agent even on a single-host job; `0`: never "
        "(default: on jobs that span several hosts).", _flag, type_="bool")
    agent_id: str | None = _setting(
        AGENT_ID_ENV, None, "This host's agent id (default: the host name); ranks that share "
        "it share one agent.", _text, type_="str")
    auth_token: str | None = _setting(
        TOKEN_ENV, None, "The access token of an attached frontend (`python -m "
        "debug_server.frontend --store ...`) or the post-mortem viewer; read once and removed "
        "from the environment.", _text, type_="secret")
    dump_prefix: str | None = _setting(
        DUMP_PATH_ENV, None, "Each rank's pickle goes to `<prefix><rank>` (default: "
        "`<dump_dir>/per_rank/rank_` under `start_debug_server(dump_dir=)`, else "
        "`~/.cache/torch/comm_lib_trace_rank_`).", _text, type_="path", owner="torch")
    fr_buffer_size: int | None = _setting(
        FR_BUFFER_ENV, None, "Entries of c10d's own Flight Recorder (the first name set wins; "
        "torch < 2.8 reads only the second). Unset: `start_debug_server` sets the name this "
        "torch reads to 2000 until `stop()`, when no process group exists yet.", _int_of,
        type_="int", owner="torch")
    frontend_config_fd: int | None = _setting(
        FRONTEND_CONFIG_FD_ENV, None, "The inherited descriptor that holds a spawned "
        "frontend's whole config (JSON).", _int_of, type_="int", owner="hand-off")
    agent_token_from_store: bool = _setting(
        TOKEN_FROM_STORE_ENV, False, "An agent whose local rank 0 lacks the token reads it "
        "from the store.", _flag, type_="bool", owner="hand-off", shown="0")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Parse every variable once; a malformed one raises ``ConfigError`` naming it."""
        env = os.environ if env is None else env
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            for name in f.metadata["env"]:
                raw = env.get(name)
                if raw is not None and raw.strip() != "":
                    kwargs[f.name] = f.metadata["parse"](name, raw)
                    break
        return cls(**kwargs)


def take_secrets(env: MutableMapping[str, str] | None = None) -> Settings:
    """``Settings.from_env``, then the token and the hand-offs are removed from ``env``: read
    once, they must not reach this process's own children (py-spy)."""
    env = os.environ if env is None else env
    settings = Settings.from_env(env)
    for name in (TOKEN_ENV, FRONTEND_CONFIG_FD_ENV, TOKEN_FROM_STORE_ENV):
        env.pop(name, None)
    return settings


SET_BY_US: tuple[tuple[str, str], ...] = (
    (FR_BUFFER_ENV[0], "`start_debug_server` before the first process group, when neither "
     "buffer variable is set: 2000 (the name this torch reads; `TORCH_NCCL_TRACE_BUFFER_SIZE` "
     "on torch < 2.8), taken back by `stop()`."),
    (NCCL_TIMING_ENV, "`start_debug_server`, unless it is set or `DEBUG_SERVER_C10D_TIMING=0`: "
     "`1` (for NCCL groups made later; the existing ones get torch's "
     "`_enable_collectives_timing`), taken back by `stop()`."),
    (NCCL_TIMING_ENV, "`1` around the creation of a c10d-backed NCCL communicator's own group "
     "when `DEBUG_SERVER_NCCL_TIMING=1`, then put back."),
)
"""Torch's variables that the package sets, and when (a name may appear twice)."""


def settings_markdown() -> str:
    """The settings tables of ``docs/settings.md``, generated from ``Settings`` and ``SET_BY_US``."""
    out = ["# Settings", "",
           "Generated by `python -m debug_server.config --markdown` from the declarations in",
           "`debug_server/config.py`; `tests/test_config.py` keeps this page equal to them.", ""]
    heads = {"debug_server": "## Environment variables you may set",
             "torch": "## Torch's variables the debug server reads",
             "hand-off": "## Set by the debug server for its own child processes"}
    for owner, head in heads.items():
        out += [head, "", "| variable | type | default | what |", "|---|---|---|---|"]
        for f in dataclasses.fields(Settings):
            m = f.metadata
            if m["owner"] == owner:
                names = " / ".join(f"`{n}`" for n in m["env"])
                out.append(f"| {names} | {m['type']} | {m['shown']} | {m['doc']} |")
        out.append("")
    out += ["## Torch's variables the debug server sets", "", "| variable | when |", "|---|---|"]
    out += [f"| `{name}` | {doc} |" for name, doc in SET_BY_US]
    return "\n".join(out) + "\n"


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


def orphan_exit_from_env(env: Mapping[str, str] | None = None) -> float:
    """``FrontendConfig.orphan_exit_s`` as rank 0's environment sets it (default 120)."""
    return Settings.from_env(env).orphan_exit_s


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


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m debug_server.config --markdown``: print the settings tables."""
    p = argparse.ArgumentParser(prog="python -m debug_server.config",
                                description="The debug server's settings (environment variables).")
    p.add_argument("--markdown", action="store_true", help="print docs/settings.md")
    args = p.parse_args(argv)
    if args.markdown:
        sys.stdout.write(settings_markdown())
        return 0
    for f in dataclasses.fields(Settings):
        print(f"{' / '.join(f.metadata['env'])}: {f.metadata['doc']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
