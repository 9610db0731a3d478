"""Every environment variable the package reads, declared once: ``Settings``.

Each field carries its variable(s), parser, type, default and one line of doc; ``Settings.from_env``
parses them all at once and names a bad variable and value in its error. Only the entry points
(``start_debug_server``, the frontend's and the agent's ``main``, the tools' ``main``) call it and
hand the record, or the values in it, down; ``tests/test_settings_read_once.py`` holds them to that.
This module and ``rank/server.py``'s docstring are the only places the names are spelled.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

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
TREE_HOSTS_ENV = "DEBUG_SERVER_TREE_HOSTS"
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


def _count(name: str, raw: str) -> int:
    value = _int_of(name, raw)
    if value < 0:
        raise ConfigError(f"environment variable {name}={raw!r} must be 0 or more")
    return value


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
    tree_hosts: int = _setting(
        TREE_HOSTS_ENV, 128, "Hosts per aggregator: the agents of every this many hosts "
        "answer the frontend through one of them (the first), and the frontend asks only the "
        "aggregators once a job has more hosts than this; `0`: no aggregators.", _count,
        type_="int")
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

