"""A rank's side of who may read it: ``PR_SET_PTRACER`` kept on its host's reader.

Which pids a reader may read, and why the tracer slot matters, is ``readers.jobpids``'s
docstring; this module is what runs inside the rank (``PtracerKeeper``, in the registration
thread). A rank that holds the GIL cannot run this thread, so the tracer is set ahead of time,
when the rank starts and whenever a reader (re)publishes itself (checked every ``KEEP_POLL_S`` s).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import socket
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from debug_server.errors import first_line
from debug_server.protocol.addrs import agent_key
from debug_server.readers.jobpids import FRONTEND_READER_KEY, start_time

if TYPE_CHECKING:
    import torch.distributed as dist

    from debug_server.config import JobEnv

logger = logging.getLogger(__name__)

PR_SET_PTRACER = 0x59616D61
PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value
KEEP_POLL_S = 2.0
"""How often a rank re-reads which process reads it while it knows none."""
KEEP_SETTLED_S = 20.0
"""How often once it knows one (a restarted agent is picked up this late at worst; every rank
asks the store, so 16384 ranks at 2 s would be 16000 store requests a second)."""


def set_ptracer(pid: int | None, prctl: Callable[..., int] | None = None) -> bool:
    """``prctl(PR_SET_PTRACER, pid)`` (None: ``PR_SET_PTRACER_ANY``); True if it took.

    Linux only; a kernel without Yama answers EINVAL (nothing to allow there).
    """
    if prctl is None:
        if not sys.platform.startswith("linux"):
            return False
        try:
            prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            return False
    value = PR_SET_PTRACER_ANY if pid is None else pid
    rc = prctl(ctypes.c_int(PR_SET_PTRACER), ctypes.c_ulong(value), ctypes.c_ulong(0),
               ctypes.c_ulong(0), ctypes.c_ulong(0))
    if rc != 0:
        logger.debug("debug_server: prctl(PR_SET_PTRACER, %s) failed: %s", value,
                     os.strerror(ctypes.get_errno()))
    return rc == 0


def _reader(raw: bytes | None, restart: int, host: str) -> int | None:
    """The pid a published reader record names, if it is of this restart, runs on this host and
    still is the process that published it."""
    try:
        rec = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    if not isinstance(rec, dict) or rec.get("host") != host or rec.get("restart") != restart:
        return None
    pid, start = rec.get("pid"), rec.get("start")
    if not isinstance(pid, int) or start is None or start_time(pid) != start:
        return None
    return pid


def choose_reader(store: dist.Store, restart: int, agent_id: str | None,
                  host: str | None = None) -> int | None:
    """The pid that should be this rank's tracer: its host's agent, else the frontend when it
    runs on this host; None when neither does."""
    host = socket.gethostname() if host is None else host
    keys = ([agent_key(agent_id)] if agent_id else []) + [FRONTEND_READER_KEY]
    for key in keys:
        if store.check([key]):
            pid = _reader(store.get(key), restart, host)
            if pid is not None:
                return pid
    return None


class PtracerKeeper:
    """Keeps ``PR_SET_PTRACER`` on this rank's reader; runs in the registration thread."""

    def __init__(self, job: JobEnv, agent_id: str | None, ptracer: str = "1",
                 prctl: Callable[..., int] | None = None) -> None:
        self.job = job
        self.agent_id = agent_id
        self.stop = threading.Event()
        self.tracer: int | None | str = "unset"
        """The pid last set (None: any), or "unset"."""
        self._prctl = prctl
        # ``Settings.ptracer``, as start_debug_server read it.
        self.enabled = ptracer != "0"
        self.anyone = ptracer == "any"

    def apply(self, pid: int | None) -> None:
        if self.enabled and pid != self.tracer and set_ptracer(pid, self._prctl):
            self.tracer = pid
            logger.debug("debug_server: rank %d lets %s ptrace it", self.job.rank,
                         "any process" if pid is None else f"pid {pid}")

    def run(self, store: dist.Store) -> None:
        """Until ``stop``: point the tracer at the host's reader whenever it changes."""
        if not self.enabled or self.anyone:  # apply(None) at start already let anyone in
            return
        while not self.stop.is_set():
            try:
                self.apply(choose_reader(store, self.job.restart_count, self.agent_id))
            except Exception as e:
                # The store is gone (rank 0 hosted it and ended): no reader can publish itself
                # any more, so the last tracer stays; asking again would only log errors.
                logger.info("debug_server: rank %d stops following its readers: %s",
                            self.job.rank, first_line(e))
                if self.tracer == "unset":
                    self.apply(None)
                return
            self.stop.wait(KEEP_SETTLED_S if isinstance(self.tracer, int) else KEEP_POLL_S)
