"""Configuration of the debug server: what the job's environment says, and what the user chose.

One module per thing it holds:

- ``settings``: ``Settings``, every environment variable the package reads (ours
  and the torch variables it reads or sets), declared once with its type, default and one line
  of doc; built once by each entry point (``Settings.from_env``) and passed down as values;
- ``job``: ``JobEnv``, where this process sits in the job, read from torchrun's environment;
- ``configs``: ``ServerConfig`` (what the user chose in ``start_debug_server``) and
  ``FrontendConfig`` (one frontend process's whole configuration);
- ``handover``: a ``FrontendConfig`` handed to the frontend process whole, as JSON in an
  inherited unnamed file (``write_inherited`` / ``read_inherited``);
- ``docs``: ``python -m debug_server.config --markdown`` prints ``docs/settings.md``.

This package imports nothing else of ours but ``errors`` (``auth`` builds on it, not the
reverse); the names below are the ones the rest of the package imports.
"""

from __future__ import annotations

from debug_server.config.configs import (
    ALL_DUMPS,
    DEFAULT_KEEP_BYTES,
    DEFAULT_PORT,
    FrontendConfig,
    ServerConfig,
    check_token_text,
)
from debug_server.config.docs import main, settings_markdown
from debug_server.config.handover import read_inherited, write_inherited
from debug_server.config.job import LOOPBACK, JobEnv, default_bind_host, is_loopback
from debug_server.config.settings import (
    AGENT_ENV,
    AGENT_ID_ENV,
    C10D_TIMING_ENV,
    CLOCK_OFFSET_ENV,
    DUMP_PATH_ENV,
    FR_BUFFER_ENV,
    FRONTEND_CONFIG_FD_ENV,
    HOST_ENV,
    MARKS_ENV,
    NCCL_TIMING_ENV,
    ORPHAN_EXIT_ENV,
    PTRACER_ENV,
    PYSPY_ENV,
    RECORDER_ENV,
    SET_BY_US,
    SIGNAL_STACKS_ENV,
    TIMING_OPT_ENV,
    TOKEN_ENV,
    TOKEN_FROM_STORE_ENV,
    TREE_HOSTS_ENV,
    ConfigError,
    Settings,
    take_secrets,
)

__all__ = [
    "AGENT_ENV", "AGENT_ID_ENV", "TREE_HOSTS_ENV", "ALL_DUMPS", "C10D_TIMING_ENV", "CLOCK_OFFSET_ENV",
    "DEFAULT_KEEP_BYTES", "DEFAULT_PORT", "DUMP_PATH_ENV", "FRONTEND_CONFIG_FD_ENV",
    "FR_BUFFER_ENV", "HOST_ENV", "LOOPBACK", "MARKS_ENV", "NCCL_TIMING_ENV", "ORPHAN_EXIT_ENV",
    "PTRACER_ENV", "PYSPY_ENV", "RECORDER_ENV", "SET_BY_US", "SIGNAL_STACKS_ENV",
    "TIMING_OPT_ENV", "TOKEN_ENV", "TOKEN_FROM_STORE_ENV", "ConfigError", "FrontendConfig",
    "JobEnv", "ServerConfig", "Settings", "check_token_text", "default_bind_host", "is_loopback",
    "main", "read_inherited", "settings_markdown", "take_secrets", "write_inherited",
]
