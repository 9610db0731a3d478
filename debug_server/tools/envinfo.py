"""The environment that decides whether a hang can be debugged, and the traps in it.

Pure functions (no process groups, no I/O beyond reading a mapping), so the preflight CLI, the
frontend and tests share them:

* ``collect_env(environ=None)``: the debug-relevant variables of one process.
* ``env_warnings(per_rank, multi_host)``: one line per known trap, naming the variable, the ranks
  that have it, and what to set instead.

Variable names and defaults follow torch 2.13's c10d (``FlightRecorder.hpp``,
``ProcessGroupNCCL.hpp``, ``distributed_c10d.py``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from debug_server.analysis.ranks import format_ranks

__all__ = ["DEBUG_PREFIXES", "DEBUG_VARS", "collect_env", "env_warnings"]

logger = logging.getLogger(__name__)

DEBUG_PREFIXES: tuple[str, ...] = ("NCCL_", "TORCH_NCCL_", "TORCH_FR_", "TORCHCOMM_")
"""Every variable with one of these prefixes is collected."""

DEBUG_VARS: tuple[str, ...] = (
    "TORCH_DISTRIBUTED_DEBUG",
    "TORCH_DISTRIBUTED_USE_TORCHCOMMS",
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
)
"""Single variables collected besides the prefixes."""

# Prefixes whose values must agree on all ranks: NCCL reads them per process, and a rank with a
# different transport, algorithm or interface choice is a classic cause of hangs at init or in
# the first large collective.
_MUST_AGREE_PREFIXES = ("NCCL_", "TORCH_NCCL_")

_TRUE = {"1", "true", "yes", "on", "y", "t"}


def collect_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The debug-relevant variables of one process, sorted by name.

    ``NCCL_*``, ``TORCH_NCCL_*``, ``TORCH_FR_*``, ``TORCHCOMM_*``, ``TORCH_DISTRIBUTED_DEBUG``,
    ``TORCH_DISTRIBUTED_USE_TORCHCOMMS`` and the rendezvous variables (``MASTER_ADDR``,
    ``MASTER_PORT``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``). ``environ`` defaults to ``os.environ``.
    """
    env = os.environ if environ is None else environ
    return {
        k: env[k]
        for k in sorted(env)
        if k.startswith(DEBUG_PREFIXES) or k in DEBUG_VARS
    }


def _int_or_none(raw: str) -> int | None:
    try:
        return int(raw.strip())
    except ValueError:
        return None


def _rank_traps(env: Mapping[str, str], multi_host: bool, world: int) -> list[str]:
    """The traps of one rank's environment (without the rank list, so ranks can be grouped)."""
    traps: list[str] = []

    # Flight Recorder size: c10d reads TORCH_FR_BUFFER_SIZE first, then the older
    # TORCH_NCCL_TRACE_BUFFER_SIZE; 0 turns the recorder off.
    fr_name = next(
        (n for n in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE") if env.get(n, "") != ""),
        None,
    )
    if fr_name is not None:
        size = _int_or_none(env[fr_name])
        if size is None:
            traps.append(
                f"{fr_name}={env[fr_name]!r} is not an integer: the Flight Recorder size is "
                f"undefined; set it to 2000"
            )
        elif size <= 0:
            traps.append(
                f"{fr_name}={env[fr_name]}: the c10d Flight Recorder is disabled, so a hang leaves "
                f"no record of the last collectives; set {fr_name}=2000"
            )
        other = "TORCH_NCCL_TRACE_BUFFER_SIZE" if fr_name == "TORCH_FR_BUFFER_SIZE" else ""
        if other and env.get(other, "") not in ("", env[fr_name]):
            traps.append(
                f"TORCH_FR_BUFFER_SIZE={env[fr_name]} and TORCH_NCCL_TRACE_BUFFER_SIZE="
                f"{env[other]} disagree (TORCH_FR_BUFFER_SIZE wins); set only one"
            )
    elif env.get("TORCH_DISTRIBUTED_USE_TORCHCOMMS", "").strip().lower() in _TRUE:
        # The torchcomms path of init_process_group defaults the recorder size to 0, unlike
        # c10d's own backends (2000).
        traps.append(
            "TORCH_DISTRIBUTED_USE_TORCHCOMMS is on and TORCH_FR_BUFFER_SIZE is unset: the "
            "torchcomms path defaults the Flight Recorder to 0 entries (disabled); set "
            "TORCH_FR_BUFFER_SIZE=2000"
        )

    if env.get("TORCH_NCCL_DUMP_ON_TIMEOUT", "").strip().lower() in {"0", "false", "no", "off"}:
        traps.append(
            f"TORCH_NCCL_DUMP_ON_TIMEOUT={env['TORCH_NCCL_DUMP_ON_TIMEOUT']}: the watchdog writes no "
            f"Flight Recorder dump when a collective times out; unset it or set it to 1"
        )

    # c10d reads the TORCH_ name first and the old NCCL_ alias only when it is unset.
    aeh = next(
        (n for n in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING") if env.get(n, "") != ""),
        None,
    )
    if aeh is not None and env[aeh].strip() == "1":
        # torchrun's elastic agent sets this to 1 for its workers unless the user did.
        traps.append(
            f"{aeh}=1: on a collective timeout the NCCL watchdog aborts the communicator and "
            f"tears the process down, so the hung ranks cannot be inspected and Python-side "
            f"dumps never run (torchrun sets 1 unless you export it); set {aeh}=2 (abort the "
            f"communicator, keep the process) or 0 while debugging a hang"
        )

    debug_file = env.get("NCCL_DEBUG_FILE", "")
    if debug_file:
        # NCCL opens the file with "w": ranks that expand to the same name overwrite each other.
        missing = []
        if multi_host and "%h" not in debug_file:
            missing.append("%h (host)")
        if world > 1 and "%p" not in debug_file:
            missing.append("%p (pid)")
        if missing:
            where = "hosts and ranks" if multi_host else "ranks on one host"
            traps.append(
                f"NCCL_DEBUG_FILE={debug_file!r} has no {' or '.join(missing)}: {where} write the "
                f"same file and overwrite each other's logs; use e.g. NCCL_DEBUG_FILE=nccl.%h.%p.log"
            )
    return traps


def _differing_vars(per_rank: Mapping[int, Mapping[str, str]]) -> list[str]:
    """One warning per NCCL_*/TORCH_NCCL_* variable whose value is not the same on every rank."""
    names = sorted(
        {k for env in per_rank.values() for k in env if k.startswith(_MUST_AGREE_PREFIXES)}
    )
    lines: list[str] = []
    for name in names:
        by_value: dict[str | None, list[int]] = {}
        for rank, env in per_rank.items():
            by_value.setdefault(env.get(name), []).append(rank)
        if len(by_value) <= 1:
            continue
        parts = [
            f"{'unset' if value is None else repr(value)} on {_ranks_phrase(ranks)}"
            for value, ranks in sorted(by_value.items(), key=lambda kv: min(kv[1]))
        ]
        lines.append(
            f"{name} differs between ranks ({'; '.join(parts)}): NCCL settings must agree on all "
            f"ranks, or init and collectives can hang or fail"
        )
    return lines


def _ranks_phrase(ranks: list[int]) -> str:
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {format_ranks(ranks)}"


def env_warnings(per_rank: Mapping[int, Mapping[str, str]], multi_host: bool) -> list[str]:
    """Known traps in the ranks' environments, one line each, with the ranks that have them.

    ``per_rank`` maps rank -> ``collect_env()`` of that rank; ``multi_host`` says whether the job
    spans hosts. Warned about:

    * Flight Recorder disabled: ``TORCH_FR_BUFFER_SIZE`` / ``TORCH_NCCL_TRACE_BUFFER_SIZE`` is 0
      (or not an integer, or the two disagree), or unset on the torchcomms path
      (``TORCH_DISTRIBUTED_USE_TORCHCOMMS=1``) whose default is 0;
    * ``TORCH_NCCL_DUMP_ON_TIMEOUT=0`` (no dump when the watchdog fires);
    * ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` (the process is torn down on timeout, before anyone
      can look at it);
    * ``NCCL_DEBUG_FILE`` without ``%h`` on a multi-host job or without ``%p`` with several ranks
      (the logs overwrite each other);
    * an ``NCCL_*`` / ``TORCH_NCCL_*`` variable that differs between ranks.

    Identical traps on several ranks are one line ("... (ranks 0-7)"). A clean environment gives
    an empty list.
    """
    world = len(per_rank)
    grouped: dict[str, list[int]] = {}
    for rank in sorted(per_rank):
        for trap in _rank_traps(per_rank[rank], multi_host, world):
            grouped.setdefault(trap, []).append(rank)
    lines = [f"{trap} ({_ranks_phrase(ranks)})" for trap, ranks in grouped.items()]
    lines.extend(_differing_vars(per_rank))
    return lines
