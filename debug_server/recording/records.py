"""One op of a communicator as our recorder keeps it, and the small types around it.

``OpRecord`` is the single source of truth for an op's state (``scheduled`` -> ``started`` ->
``completed``, found by non-blocking queries, see ``OpRecord.refresh``); hooks keep references
to it. ``InFlight`` is what a c10d-backed communicator (no records) reports of an op not yet
seen completed. ``HookHandle`` removes a registration. The CUDA event slots that the states of
CUDA ops come from are sized here (``_SLOTS``); ``comms.Comm`` owns them.

States are true, found by non-blocking queries when read: ``scheduled`` -> ``started`` (CUDA:
an event recorded on the issuing stream before the op fired) -> ``completed`` (an event after
it, c10d's work, or a later collective of the same communicator completed). No record keeps a
tensor; a record keeps c10d's work only until the watchdog (or a reader) sees it completed.
c10d-backed: c10d computes the states from its own events when its recorder is read; the
watchdog learns completion from c10d's ``pg_status`` (one small read per pass, no entries) and
keeps no work of a collective, so no tensor either. P2P ops keep their work until the watchdog
sees it completed (c10d's status counts P2P and collectives with one number), and so do a
communicator's collectives once it has issued P2P.
"""

from __future__ import annotations

import datetime
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from debug_server.errors import first_line
from debug_server.recording.commstate import CommState

# One counter per process across all communicators, like c10d's record ids: every hook that
# keeps a record sees the same id, so snapshots of several hooks merge without renumbering.
_record_ids = itertools.count()
_raw_stream: Callable[[int], int] = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (lambda i: 0)
# Per-communicator CUDA event slots (see comms.Comm.__init__); a power of two.
_SLOTS = 1024
_SLOT_MASK = _SLOTS - 1
# The C method under torch.cuda.Event.record: the Python wrapper only looks up the current
# stream when none is given, and we always give one.
_record_event: Callable[[Any, Any], None] = getattr(
    torch.cuda.Event.__mro__[1], "record", torch.cuda.Event.record
)  # CPU builds have a stub base without it (and never record events)


class OpRecord:
    """One op issued on a communicator: the single source of truth for its state.

    ``state`` moves ``scheduled`` -> ``started`` -> ``completed`` and is only ever advanced by the
    communicator (when the op returns, when its work completes) or by ``refresh()`` (a
    non-blocking query of the work or CUDA event), never assumed.
    """

    __slots__ = (
        "record_id",
        "comm",
        "op",
        "seq",
        "p2p_seq",
        "op_id",
        "is_p2p",
        "peer",
        "input_shapes",
        "input_dtypes",
        "output_shapes",
        "output_dtypes",
        "async_op",
        "time_created_ns",
        "time_started_ns",
        "time_completed_ns",
        "state",
        "error",
        "work",
        "has_end",
        "traceback",
        "thread_id",
        "thread_name",
    )

    def __init__(
        self,
        comm: CommState,
        op: str,
        seq: int,
        p2p_seq: int,
        op_id: int,
        is_p2p: bool,
        peer: str,
        input_shapes: tuple[Any, ...],
        input_dtypes: tuple[Any, ...],
        output_shapes: tuple[Any, ...],
        output_dtypes: tuple[Any, ...],
        async_op: bool,
    ) -> None:
        self.record_id = next(_record_ids)
        self.comm = comm
        self.op = op
        self.seq = seq
        self.p2p_seq = p2p_seq
        self.op_id = op_id
        self.is_p2p = is_p2p
        self.peer = peer
        self.input_shapes = input_shapes
        self.input_dtypes = input_dtypes
        self.output_shapes = output_shapes
        self.output_dtypes = output_dtypes
        self.async_op = async_op
        self.time_created_ns = time.time_ns()
        self.time_started_ns: int | None = None
        self.time_completed_ns: int | None = None
        self.state = "scheduled"
        self.error: str | None = None
        self.work: Any = None
        # CUDA: the end event of this op's slot was recorded on the issuing stream after it.
        self.has_end = False
        self.traceback: Any = None
        # The ident only; the name is looked up at dump time (threading.current_thread() costs
        # more than the rest of this constructor).
        self.thread_id = threading.get_ident()
        self.thread_name: str | None = None

    @property
    def profiling_name(self) -> str:
        # Always the nccl: prefix: older torch analyzers accept only nccl/xccl names; the real
        # backend is in process_group.
        if self.peer:
            return f"nccl:{self.op} {self.peer}"
        return f"nccl:{self.op}"

    def refresh(self) -> None:
        """Advance the state from non-blocking queries made now (events, work), never a wait.

        CUDA: ``started`` when the start event recorded before the op on the issuing stream has
        fired; ``completed`` when the end event recorded after it has fired (sync ops and
        waited async ops), when c10d's work reports completion (async ops nobody waited on), or
        when a later collective of the same communicator completed (NCCL runs a communicator's
        collectives in issue order; the watchdog keeps that watermark).
        """
        if self.state == "completed":
            return
        comm = self.comm
        if comm._is_cuda:
            if not self.is_p2p and self.op_id <= comm._done_op_id:
                self._mark_completed(comm._done_ns)
                return
            if comm._broken is not None:
                # Aborting a communicator ends its kernels and completes its works: from then
                # on events and works no longer say what the op reached.
                return
            try:
                if self._done_now():
                    self._mark_completed()
                elif self.state == "scheduled" and comm._starts[self.op_id & _SLOT_MASK].query():
                    self.state = "started"
                    self.time_started_ns = time.time_ns()
            except RuntimeError:  # CUDA context gone or the work failed; keep what we know
                pass
            return
        work = self.work
        if work is not None:
            try:
                if not work.is_completed():
                    return
                work.wait()  # returns at once when done; raises if the op failed (gloo timeout)
            except Exception as exc:
                # Failed is not completed: keep the state the op reached, and say why.
                if self.error is None:
                    self.error = first_line(exc, 10_000)
                return
            self._mark_completed()

    def _done_now(self) -> bool:
        """CUDA: one non-blocking query of this op's completion (may raise RuntimeError)."""
        if self.state == "completed":
            return True
        if self.has_end:
            return bool(self.comm._ends[self.op_id & _SLOT_MASK].query())
        work = self.work
        return work is not None and bool(work.is_completed())

    def _mark_completed(self, now: int | None = None) -> None:
        if self.state != "completed":
            if now is None:
                now = time.time_ns()
            if self.time_started_ns is None or self.time_started_ns > now:
                self.time_started_ns = now
            self.time_completed_ns = now
            self.state = "completed"
        # No reference to c10d's work (which holds the tensors) once the op is done.
        self.work = None


class HookHandle:
    """Returned by every registration; ``remove()`` unregisters (idempotent)."""

    __slots__ = ("_items", "_fn")

    def __init__(self, items: list[Any], fn: Any) -> None:
        self._items = items
        self._fn = fn

    def remove(self) -> None:
        try:
            self._items.remove(self._fn)
        except ValueError:
            pass


def _dtype_tuple(tensors: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    return tuple(t.dtype for t in tensors)


def _shape_tuple(tensors: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    return tuple(t.shape for t in tensors)


def _as_timedelta(timeout: datetime.timedelta | float | None) -> datetime.timedelta | None:
    if timeout is None or isinstance(timeout, datetime.timedelta):
        return timeout
    return datetime.timedelta(seconds=float(timeout))


class InFlight(NamedTuple):
    """An op of a c10d-backed communicator not yet seen completed (``Comm.in_flight()``): what
    the stall check and health need; the full entry is in c10d's recorder."""

    comm: CommState
    op: str
    seq: int
    p2p_seq: int
    is_p2p: bool
    time_created_ns: int

    @property
    def record_id(self) -> tuple[Any, ...]:
        return ("c10d", self.comm.pg_id, self.is_p2p, self.p2p_seq if self.is_p2p else self.seq)

