"""Stacks of a rank whose worker cannot answer, captured by a signal (no GIL needed there).

A rank whose main thread holds the GIL inside a C call (a long kernel launch, a C extension
that never releases it) cannot run its worker thread: the HTTP request for its stacks times
out. faulthandler can still print that rank's Python stacks: its signal handler is C code that
walks the thread states and writes to a file descriptor without taking the GIL.

So at start every rank registers ``faulthandler`` for a free real-time signal, writing to a
per-rank file under the temp dir (opened for append), and publishes signal, file and fd in its
discovery sidecar next to its pid and host. When a ``dump_traceback`` request times out, the
frontend (on rank 0's host) checks that the rank is on its own host and that the pid is still
that process (``/proc/<pid>/fd/<fd>`` is the published file: guards against a reused pid),
empties the file, sends the signal, and reads the file back with a bounded wait. The section
is marked ``(captured by signal; worker not answering)``.

Like any signal, it interrupts a ``sleep()`` or ``poll()`` that C code is blocked in (EINTR;
``nanosleep``, ``poll``, ``epoll_wait`` and ``select`` are never restarted, whatever SA_RESTART
says): the rank then runs on early and the page shows the line after the one it was stuck on.
So this path is off unless a rank opts in (``start_debug_server(signal_stacks=True)`` or
``Settings.signal_stacks``), and even then the frontend uses it only for a rank that
py-spy could not read (``pyspy``: absent, or ptrace not permitted).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

from debug_server.stacks import with_source

logger = logging.getLogger(__name__)

META_KEY = "sigstack"
"""Key of ``{"signal", "file", "fd"}`` in the discovery sidecar."""
FILE_PREFIX = "debug_server_sigstack_"
MARKER = "(captured by signal; worker not answering)"
CAPTURE_TIMEOUT_S = 1.0
_SETTLE_S = 0.05


def candidate_signals() -> list[int]:
    # Real-time signals nobody else in a training process uses by convention; SIGUSR1/2 are
    # often taken (torchelastic, profilers). Skipping the first few leaves room for libraries
    # that grab SIGRTMIN itself.
    rtmin = int(getattr(signal, "SIGRTMIN", 0))
    rtmax = int(getattr(signal, "SIGRTMAX", 0))
    return [s for s in range(rtmin + 6, rtmin + 14) if rtmin and s <= rtmax]


# ---------------------------------------------------------------------------------------------
# The frontend's side


def _same_process(pid: int, fd: int, path: str) -> bool:
    try:
        return os.path.realpath(os.readlink(f"/proc/{pid}/fd/{fd}")) == os.path.realpath(path)
    except OSError:
        return False


def capture(pid: int, meta: Mapping[str, Any], timeout: float = CAPTURE_TIMEOUT_S) -> str | None:
    """Signal ``pid`` and return the stacks it wrote, or None when that is not possible here.

    Blocking (up to ``timeout``); run it off the event loop.
    """
    try:
        signum, path, fd = int(meta["signal"]), str(meta["file"]), int(meta["fd"])
    except (KeyError, TypeError, ValueError):
        return None
    # Only a file of ours in the temp dir, only a real-time signal, only the very process that
    # opened it: a store entry cannot make the frontend read other files or signal others.
    if (not os.path.basename(path).startswith(FILE_PREFIX)
            or os.path.dirname(os.path.realpath(path)) != os.path.realpath(tempfile.gettempdir())
            or signum not in candidate_signals() or not _same_process(pid, fd, path)):
        return None
    try:
        with open(path, "r+b") as f:
            f.truncate(0)
        os.kill(pid, signum)
    except OSError as e:
        logger.debug("debug_server: signalling pid %d for stacks failed: %s", pid, e)
        return None
    deadline = time.monotonic() + timeout
    last = -1
    while time.monotonic() < deadline:
        time.sleep(_SETTLE_S)
        try:
            size = os.path.getsize(path)
        except OSError:
            return None
        if size > 0 and size == last:
            break
        last = size
    try:
        with open(path, "rb") as f:
            text = f.read(4 * 1024 * 1024).decode("utf-8", errors="replace")
    except OSError:
        return None
    # Read on the rank's own host: its source lines ship with the stack (debug_server.stacks).
    return with_source(text) if text else None


class SignalCapture:
    """Fills in timed-out stacks results by signal, one capture per rank at a time."""

    def __init__(self, timeout: float = CAPTURE_TIMEOUT_S) -> None:
        self.timeout = timeout
        self.host = socket.gethostname()
        self._locks: dict[int, asyncio.Lock] = {}

    def eligible(self, meta: Mapping[str, Any] | None) -> bool:
        return (isinstance(meta, Mapping) and meta.get("host") == self.host
                and isinstance(meta.get("pid"), int) and isinstance(meta.get(META_KEY), Mapping))

    async def capture(self, meta: Mapping[str, Any]) -> str | None:
        pid = meta["pid"]
        lock = self._locks.setdefault(pid, asyncio.Lock())
        async with lock:
            return await asyncio.get_running_loop().run_in_executor(
                None, capture, pid, meta[META_KEY], self.timeout)

    async def fill(self, results: Sequence[Any], metas: Mapping[int, Mapping[str, Any] | None],
                   timed_out: str) -> None:
        """Replace each timed-out result whose rank is on this host by the signal's capture."""
        todo = [r for r in results if r.status == timed_out and self.eligible(metas.get(r.rank))]
        if not todo:
            return
        texts = await asyncio.gather(*(self.capture(metas[r.rank]) for r in todo))  # type: ignore[index]
        for r, text in zip(todo, texts, strict=True):
            if text:
                r.body = f"{MARKER}\n{text}"
                why = r.error.split("; ", 1)[1] if r.error and "; " in r.error else None
                r.note = (f"worker timed out after {r.elapsed_s:.1f} s; stacks captured by signal"
                          + (f" ({why})" if why else ""))
                r.error = None
                r.status = "ok"
