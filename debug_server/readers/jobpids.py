"""Which processes the pages may read: the ranks this job announced, not the process tree.

Clusters start ranks through wrappers (``srun bash -c '... python train.py'``, ``timeout 3600
python ...``, ``numactl ... python ...``, ``nsys``), so the ranks of one host are cousins, not
siblings, and no rule over the process tree tells a rank of this job from any other process.
The job itself says who its ranks are:

- **Announce.** Each rank's registration sidecar (``discovery.register_worker``) carries its
  ``pid``, ``host``, process ``start`` time (``/proc/<pid>/stat`` field 22, clock ticks since
  boot: a pid reused by another process has another start time) and ``uid``. Sidecars of
  another elastic restart are not trusted (``discovery.lookup_workers``).
- **Check.** A reader (the frontend, a host's agent, a worker asked ``pyspy_dump?pid=``) reads a
  pid only if a rank of this job announced it on this host, its start time still matches, and
  it belongs to this reader's user (``check``); anything else is refused in one line.
- **Allow.** Under Yama ``ptrace_scope=1`` only a process's ancestors may ptrace it, unless it
  names one tracer with ``prctl(PR_SET_PTRACER, pid)`` (that process and its children: py-spy
  runs as one). Readers publish themselves in the store (the frontend under ``reader/frontend``,
  a host's agent under ``agent/<host id>``, both with pid, host and start time), and every rank
  keeps ``PR_SET_PTRACER`` pointed at its host's reader (``PtracerKeeper``): the agent where its
  host has one, else the frontend when it runs on this host. The slot holds one pid, so a host
  with neither (a multi-host job without agents) falls back to ``PR_SET_PTRACER_ANY`` there: its
  ranks are read by their sibling workers, any of which may hold the GIL-free slot.
  ``Settings.ptracer`` (docs/settings.md) ``0`` leaves the setting alone; ``=any`` lets every process of the
  user in (a ``py-spy`` started by hand from another shell), as ``ptrace_scope=0`` does.

A rank that holds the GIL cannot run this thread, so the tracer is set ahead of time, when the
rank starts and whenever a reader (re)publishes itself (checked every ``KEEP_POLL_S`` s).
"""

from __future__ import annotations

import json
import os
import signal
import socket
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch.distributed as dist

    from debug_server.protocol.addrs import WorkerAddr

FRONTEND_READER_KEY = "reader/frontend"
"""Store key (under the ``debug_server`` prefix) where the frontend publishes itself."""


# ---------------------------------------------------------------------------------------------
# A process's identity from /proc


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` from field 3 (state) on: ``comm`` may hold spaces and parentheses."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
        return raw.rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (a zombie does; another user's does)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def start_time(pid: int) -> int | None:
    """The process's start time (field 22: clock ticks after boot), None if there is none."""
    fields = _stat_fields(pid)
    try:
        return int(fields[19]) if fields is not None else None
    except (ValueError, IndexError):
        return None


def identity(pid: int | None = None) -> dict[str, Any]:
    """What a process announces about itself: pid, host, start time, uid."""
    pid = os.getpid() if pid is None else pid
    return {"pid": pid, "host": socket.gethostname(), "start": start_time(pid),
            "uid": os.geteuid()}


def fate(pid: int, start: int | None) -> str | None:
    """None while ``pid`` still runs as the process that started at ``start``; else how it
    ended, as far as ``/proc`` tells: a zombie (not yet reaped by its parent) still shows its
    exit status (field 52)."""
    fields = _stat_fields(pid)
    if fields is None or (start is not None and _int(fields, 19) != start):
        return "its process has ended"
    if fields[0] not in ("Z", "X"):
        return None
    status = _int(fields, 49)
    if status is None:
        return "its process has ended"
    if status & 0x7F:
        sig = status & 0x7F
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"killed by {name}"
    return f"exited with code {(status >> 8) & 0xFF}"


def local_fates(addrs: Sequence[WorkerAddr], host: str | None = None,
                ) -> list[tuple[int, str | None]]:
    """(rank, how it ended or None while it runs) of each rank announced on this host
    (``host``: this machine's name by default)."""
    host = socket.gethostname() if host is None else host
    return [(a.rank, fate(a.meta["pid"], a.meta.get("start"))) for a in addrs
            if a.meta is not None and a.meta.get("host") == host
            and isinstance(a.meta.get("pid"), int)]


def running_here(addrs: Sequence[WorkerAddr], host: str | None = None) -> bool:
    """Whether a rank announced on this host still runs (the frontend and an agent stay while
    one does)."""
    return any(how is None for _, how in local_fates(addrs, host))


def _int(fields: list[str], i: int) -> int | None:
    try:
        return int(fields[i])
    except (ValueError, IndexError):
        return None


# ---------------------------------------------------------------------------------------------
# The check every reader makes


def check(pid: int, announced: Mapping[str, Any] | None, host: str | None = None) -> str | None:
    """None if ``pid`` may be read here, else the one-line reason.

    ``announced``: the registration sidecar of the rank that claims ``pid`` (from a lookup of
    this restart's keys), or None when no rank of this job announced it.
    """
    host = socket.gethostname() if host is None else host
    if not isinstance(announced, Mapping) or announced.get("pid") != pid:
        return f"pid {pid} was not announced by any rank of this job"
    if announced.get("host") != host:
        return f"pid {pid} was announced on host {announced.get('host')!s:.80}, not on {host}"
    start = announced.get("start")
    if not isinstance(start, int):
        return (f"pid {pid}'s announcement carries no start time (a rank of an older "
                "debug_server): it cannot be told from a reused pid")
    now = start_time(pid)
    if now is None:
        return f"pid {pid} does not exist on {host}"
    if now != start:
        return f"pid {pid} is no longer the rank that announced it (started at another time)"
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return f"pid {pid} does not exist on {host}"
    if uid != os.geteuid() or announced.get("uid") not in (None, uid):
        return f"pid {pid} belongs to another user"
    return None


def publish_frontend(store: dist.Store, restart: int) -> None:
    """The frontend's announcement, read by every rank's ``PtracerKeeper``."""
    store.set(FRONTEND_READER_KEY, json.dumps({**identity(), "restart": restart}))
