"""Work objects of ``async_op=True`` calls, and how a wait orders the caller after an op.

CUDA (NCCL): ``wait()`` makes the current stream wait for the op, the host does not; with an
explicit ``timeout`` the host polls (non-blocking queries) until the op completed or the
timeout ran out, then the abort path runs. gloo: the host waits, bounded by the timeout or the
communicator's. ``CommWork`` belongs to our recorder's ops (one ``OpRecord`` each),
``BackedWork`` to a c10d-backed communicator's (c10d records them). A communicator that timed
out or failed raises its error from ``wait()``.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

from debug_server.recording.abort import fail, fail_op, raise_broken
from debug_server.recording.commstate import CommState
from debug_server.recording.records import _SLOT_MASK, OpRecord, _as_timedelta, _record_event


class CommWork:
    """The work object of an ``async_op=True`` call: ``wait(timeout=None)``, ``is_completed()``."""

    __slots__ = ("_comm", "_record", "_work")

    def __init__(self, comm: CommState, record: OpRecord, work: Any) -> None:
        self._comm = comm
        self._record = record
        self._work = work

    @property
    def record(self) -> OpRecord:
        return self._record

    def is_completed(self) -> bool:
        """A non-blocking query: True once the op completed (or its communicator failed)."""
        self._record.refresh()
        return self._record.state == "completed" or bool(self._comm._broken)

    def wait(self, timeout: datetime.timedelta | float | None = None) -> bool:
        """Order the caller after the op (see the module doc).

        CUDA, no ``timeout``: the current stream waits for the op; the host does not. With a
        ``timeout``: the host waits too, at most that long, then the abort path runs. gloo: the
        host waits, bounded by ``timeout`` or the communicator's timeout. A communicator that
        timed out or failed raises its ``RuntimeError`` here.
        """
        rec = self._record
        comm = self._comm
        if rec.state == "completed" and self._work is None:
            return True
        if comm._broken is not None and rec.state != "completed":
            raise_broken(comm)
        if not comm._is_cuda:
            wait_host(comm, rec, self._work, timeout)
        elif timeout is None:
            wait_stream(comm, rec, self._work)
        else:
            wait_cuda_host(comm, rec, _as_timedelta(timeout))
            wait_stream(comm, rec, self._work)
        # The caller's reference to c10d's work (and so its tensors) ends with the wait, as
        # c10d's own wait() releases what it stashed.
        self._work = None
        return True


class BackedWork:
    """The work object of an ``async_op=True`` call on a c10d-backed communicator (same
    ``wait``/``is_completed`` semantics as :class:`CommWork`)."""

    __slots__ = ("_comm", "_op", "_seq", "_is_p2p", "_work")

    def __init__(self, comm: CommState, op: str, seq: int, is_p2p: bool, work: Any) -> None:
        self._comm = comm
        self._op = op
        self._seq = seq
        self._is_p2p = is_p2p
        self._work = work

    def is_completed(self) -> bool:
        work = self._work
        try:
            return work is None or bool(work.is_completed()) or bool(self._comm._broken)
        except RuntimeError:  # the op failed: it will not complete
            return bool(self._comm._broken)

    def wait(self, timeout: datetime.timedelta | float | None = None) -> bool:
        comm = self._comm
        work = self._work
        if work is None:
            return True
        if comm._broken is not None and not self.is_completed():
            raise_broken(comm)
        td = _as_timedelta(timeout)
        try:
            if not comm._is_cuda:
                work.wait() if td is None else work.wait(timeout=td)
            else:
                if td is not None:
                    deadline = time.monotonic() + td.total_seconds()
                    delay = 5e-5
                    while not work.is_completed():
                        if comm._broken is not None:
                            raise_broken(comm)
                        if time.monotonic() >= deadline:
                            fail_op(comm, self._op, self._seq, self._is_p2p, TimeoutError(
                                f"not completed within {td.total_seconds():g} s"), td, timed_out=True)
                        time.sleep(delay)
                        delay = min(delay * 2, 2e-3)
                work.wait()  # the current stream waits for the op
        except RuntimeError as exc:
            if comm._broken is not None:
                raise_broken(comm, cause=exc)
            fail_op(comm, self._op, self._seq, self._is_p2p, exc, td or comm._timeout)
        if comm._broken is not None and not comm._is_cuda:
            raise_broken(comm)
        self._work = None
        return True


def wait_host(comm: CommState, rec: OpRecord, work: Any, timeout: datetime.timedelta | float | None) -> None:
    """gloo: wait on the host, bounded by ``timeout`` or the group's (= our) timeout."""
    td = _as_timedelta(timeout) or comm._timeout
    try:
        if work is None:
            pass
        elif timeout is None:
            # gloo enforces the group's timeout (== this communicator's) by itself, and its
            # plain wait() is several microseconds cheaper per op than wait(timeout=...).
            work.wait()
        else:
            work.wait(timeout=td)
    except Exception as exc:
        fail(comm, rec, exc, td)
    rec._mark_completed()


def wait_stream(comm: CommState, rec: OpRecord, work: Any) -> None:
    """CUDA: the current stream waits for the op (c10d's wait() without timeout), not the host."""
    try:
        if work is not None:
            work.wait()
    except Exception as exc:
        fail(comm, rec, exc)
    if comm._broken is not None and rec.state != "completed":
        raise_broken(comm)
    if not rec.has_end and rec.state != "completed":
        # From here the end event tells completion, so the record lets go of c10d's work.
        _record_event(comm._ends[rec.op_id & _SLOT_MASK], comm._current_stream())
        rec.has_end = True
        rec.work = None


def wait_cuda_host(comm: CommState, rec: OpRecord, td: datetime.timedelta) -> None:
    """CUDA, explicit timeout: the host polls (non-blocking queries) until done or ``td``."""
    deadline = time.monotonic() + td.total_seconds()
    delay = 5e-5
    while True:
        if comm._broken is not None:
            raise_broken(comm)
        rec.refresh()
        if rec.state == "completed":
            return
        if time.monotonic() >= deadline:
            fail(comm, rec, TimeoutError(f"not completed within {td.total_seconds():g} s"), td, timed_out=True)
        time.sleep(delay)
        delay = min(delay * 2, 2e-3)
