"""Starting a host's agent from its local rank 0, and the names both sides share.

The agent itself (``python -m debug_server.agent``) is a frontend-side process: it
fans out to this host's rank workers and answers rank 0's frontend once per page for the whole
host (see that module). This module is the rank side's part: whether a job runs agents
(:func:`wanted`), which host id a rank names in its registration sidecar (:func:`rank_meta`),
which ranks an agent serves (:func:`host_ranks`), and the start itself (:func:`start_for_rank`),
by module name so the trainer never imports the frontend.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from debug_server.auth import TOKEN_ENV
from debug_server.config import AGENT_ENV as AGENT_ENV
from debug_server.config import AGENT_ID_ENV as AGENT_ID_ENV
from debug_server.config import TOKEN_FROM_STORE_ENV, JobEnv, ServerConfig, Settings
from debug_server.protocol.addrs import AGENT_META_KEY, format_ranks

logger = logging.getLogger(__name__)

AGENT_MODULE = "debug_server.agent"
MAX_ID_CHARS = 200


def host_id(settings: Settings) -> str:
    return (settings.agent_id or socket.gethostname())[:MAX_ID_CHARS]


def wanted(job: JobEnv, settings: Settings) -> bool:
    """Whether this job runs agents: on several hosts, or when asked (``Settings.agent``)."""
    flag = settings.agent
    return flag if flag is not None else not job.single_host


def local_rank(job: JobEnv, env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    raw = env.get("LOCAL_RANK", "")
    if raw.strip().isdigit():
        return int(raw)
    return job.rank % max(1, job.local_world_size)


def host_ranks(job: JobEnv, env: Mapping[str, str] | None = None) -> list[int]:
    """The ranks torchrun put on this host: contiguous from ``RANK - LOCAL_RANK``. A rank whose
    sidecar names another agent is left out at lookup time, so a layout that breaks this only
    sends those ranks to the frontend directly."""
    first = job.rank - local_rank(job, env)
    return [r for r in range(first, first + job.local_world_size) if 0 <= r < job.world_size]


def rank_meta(job: JobEnv, settings: Settings) -> dict[str, str]:
    """What a rank adds to its registration sidecar: the id of its host's agent."""
    return {AGENT_META_KEY: host_id(settings)} if wanted(job, settings) else {}


def start_for_rank(config: ServerConfig, job: JobEnv, advertised_host: str,
                   token_required: bool, settings: Settings,
                   env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes] | None:
    """On a host's local rank 0 of a job that runs agents: start this host's agent process and
    return it (it registers itself; the trainer never waits for it). Else None.

    ``token_required``: the job's servers require a token; rank 0 hands its own over, the other
    hosts' agents read it from the store as their ranks do.
    """
    env = os.environ if env is None else env
    if not wanted(job, settings) or local_rank(job, env) != 0:
        return None
    ranks = host_ranks(job, env)
    args = [sys.executable, "-m", AGENT_MODULE,
            "--host-id", host_id(settings), "--ranks", format_ranks(ranks),
            "--world-size", str(job.world_size),
            "--master-addr", job.master_addr, "--master-port", str(job.master_port),
            "--restart-count", str(job.restart_count),
            "--advertise", advertised_host,
            "--fetch-timeout", str(config.fetch_timeout),
            "--max-concurrency", str(config.max_concurrency),
            "--parent-pid", str(os.getpid())]
    if config.host is not None:
        args += ["--host", config.host]
    child_env = dict(env)
    child_env.pop(TOKEN_ENV, None)
    if config.auth_token:
        child_env[TOKEN_ENV] = config.auth_token  # not argv: visible to every user
    # c10d's C++ trace of each failed store call would reach the job's log; the agent says its
    # store's failures in one line of its own (as the frontend does: server.spawn_frontend).
    child_env["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    child_env.pop(TOKEN_FROM_STORE_ENV, None)
    if config.auth_token is None and token_required:
        child_env[TOKEN_FROM_STORE_ENV] = "1"  # rank 0 publishes it there
    pkg_root = str(Path(__file__).resolve().parents[2])
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
    try:
        return subprocess.Popen(args, env=child_env, stdin=subprocess.DEVNULL, close_fds=True)
    except OSError as e:  # no agent: the frontend asks this host's ranks directly
        logger.warning("debug_server: cannot start this host's agent: %s", e)
        return None
