"""A communicator with hooks over ``torch.distributed``.

``new_comm(backend, device, name)`` gives one process group per communicator, with the ops of
TorchComms' API and three kinds of callbacks: pre-op, post-op and abort.

Which recorder runs where:

* **NCCL, c10d's Flight Recorder on** (``TORCH_FR_BUFFER_SIZE``, else
  ``TORCH_NCCL_TRACE_BUFFER_SIZE``, > 0; unset means on, 2000 entries, in torch 2.11 and 2.13;
  ``start_debug_server`` sets 2000 when neither is set): the communicator is *c10d-backed*.
  c10d already records every op of the communicator's own process group, with its Python stack,
  in C++; the op path here only counts, calls torch and appends ``(seq, op, time)`` to an
  in-flight list for the watchdog: no stack capture, no CUDA events, no record object. The
  Flight Recorder hook records nothing per op; at dump time ``c10d_fr`` maps c10d's entries of
  that group to the communicator (its name, sequence numbers from 0, stacks from the user's
  call site, c10d's states). The group is made with ``TORCH_NCCL_ENABLE_TIMING`` so c10d's
  entries can say ``started``. A user's own pre/post hook turns on building an ``OpRecord``
  per op again (a few microseconds each).
* **gloo, or c10d's recorder off, or a torch without its dump API**: our own recorder. Every op
  builds one ``OpRecord`` (what, which sequence number, shapes, dtypes, true state); hooks such
  as the Flight Recorder keep references to those records instead of copying them.
* ``DEBUG_SERVER_RECORDER=python`` forces ours everywhere; ``=c10d`` forces c10d's wherever it
  records (on gloo too, where c10d never moves an op past ``scheduled``; the tests use it).

Measured on 2x H200, torch 2.11 (``benchmarks/bench_record.py``, ``bench_step.py``; the README
has the table): c10d's recorder adds 2.4-5.2 us per op; the c10d-backed path adds 8.3-9.2 us,
of which the start events of its group 3.0-5.3 us, our Python path 0.75 us, and (sync ops, in
that run) ~4.6 us of c10d's async-call path, which sync collectives no longer take (not yet
re-measured). ``DEBUG_SERVER_NCCL_TIMING=0`` leaves the start events out (no ``started``).

Semantics worth knowing (those of ``torch.distributed`` and TorchComms):

* Ranks passed to ops (``root``, ``dst``, ``src``) and to ``split`` are ranks *in the
  communicator*, as in TorchComms.
* CUDA (NCCL): ``async_op=False`` enqueues the op and returns; the current stream is ordered after
  the collective, the host does not wait. ``CommWork.wait()`` makes the current stream wait for
  the op, again without blocking the host. The host blocks only when asked: ``work.wait(timeout=
  ...)`` with an explicit timeout, or a stream/device synchronize. (``barrier`` blocks the host, as
  c10d's does.)
* gloo (CPU): ``async_op=False`` and ``wait()`` wait on the host, bounded by the communicator's
  timeout, as gloo always does.
* Timeouts: a per-process watchdog thread sees an op in flight longer than its communicator's
  timeout, runs the abort hooks (the recorder writes this rank's pickle), aborts the NCCL
  communicator, and the next op or ``wait()`` on that communicator raises a ``RuntimeError``
  naming the op, the communicator and its sequence number; with
  ``abort_process_on_timeout_or_error=True`` the process aborts after the hooks ran instead. The
  process group gets a longer timeout, so this happens before c10d's own watchdog acts. A gloo op
  that times out on the host raises the same error at the call site. After a timeout (or any
  failure on NCCL) the communicator is unusable.
* States are true, found by non-blocking queries when read: ``scheduled`` -> ``started`` (CUDA:
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

import atexit
import bisect
import collections
import datetime
import itertools
import logging
import operator
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, NoReturn

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

__all__ = ["Comm", "CommWork", "HookHandle", "OpRecord", "ReduceOp", "add_watchdog_check", "new_comm"]

logger = logging.getLogger(__name__)

_DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)
_pg_counter = itertools.count()
# One counter per process across all communicators, like c10d's record ids: every hook that
# keeps a record sees the same id, so snapshots of several hooks merge without renumbering.
_record_ids = itertools.count()
_raw_stream: Callable[[int], int] = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (lambda i: 0)
# Per-communicator CUDA event slots (see Comm.__init__); a power of two.
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
        comm: Comm,
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
                    self.error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
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


class CommWork:
    """The work object of an ``async_op=True`` call: ``wait(timeout=None)``, ``is_completed()``."""

    __slots__ = ("_comm", "_record", "_work")

    def __init__(self, comm: Comm, record: OpRecord, work: Any) -> None:
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
            comm._raise_broken()
        if not comm._is_cuda:
            comm._wait_host(rec, self._work, timeout)
        elif timeout is None:
            comm._wait_stream(rec, self._work)
        else:
            comm._wait_cuda_host(rec, _as_timedelta(timeout))
            comm._wait_stream(rec, self._work)
        # The caller's reference to c10d's work (and so its tensors) ends with the wait, as
        # c10d's own wait() releases what it stashed.
        self._work = None
        return True


def _dtype_tuple(tensors: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    return tuple(t.dtype for t in tensors)


def _shape_tuple(tensors: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    return tuple(t.shape for t in tensors)


def _as_timedelta(timeout: datetime.timedelta | float | None) -> datetime.timedelta | None:
    if timeout is None or isinstance(timeout, datetime.timedelta):
        return timeout
    return datetime.timedelta(seconds=float(timeout))


def _c10d_group_name(pg: Any) -> str | None:
    try:
        name = dist.distributed_c10d._world.pg_names.get(pg) or getattr(pg, "group_name", None)
    except Exception:  # a torch without either
        return None
    return str(name) if name else None


_first = operator.itemgetter(0)

# -- which recorder runs (see the module doc) ---------------------------------------------------
RECORDER_ENV = "DEBUG_SERVER_RECORDER"
"""``auto`` (default): c10d's recorder on NCCL when it is on, ours elsewhere; ``c10d``: c10d's
wherever it records (gloo too: the tests use it); ``python``: ours everywhere."""
_FR_BUFFER_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
# c10d's pickle dump of each recorder (pg_config, pg_status and, when asked, entries).
_C10D_DUMP = {"nccl": "_dump_nccl_trace", "gloo": "_dump_fr_trace"}


def _c10d_fr_on() -> bool:
    """Whether c10d's Flight Recorder records: c10d reads the first of ``TORCH_FR_BUFFER_SIZE``
    and ``TORCH_NCCL_TRACE_BUFFER_SIZE`` that is set (torch 2.11 and 2.13), and records by
    default (2000 entries) when neither is."""
    for k in _FR_BUFFER_ENV:
        v = os.environ.get(k)
        if v:
            try:
                return int(v) > 0
            except ValueError:
                return False
    return True


def _c10d_dump_fn(backend: str) -> Callable[..., Any] | None:
    try:
        from torch._C import _distributed_c10d as c10d
    except ImportError:
        return None
    name = _C10D_DUMP.get(backend)
    return getattr(c10d, name, None) if name else None


def _c10d_backed(backend: str) -> bool:
    """Whether a new communicator on ``backend`` lets c10d's recorder record its ops."""
    mode = os.environ.get(RECORDER_ENV, "auto").strip().lower() or "auto"
    if mode not in ("auto", "c10d", "python"):
        raise ValueError(f"{RECORDER_ENV}={mode!r}: expected auto, c10d or python")
    if mode == "python" or not _c10d_fr_on() or _c10d_dump_fn(backend) is None:
        return False
    return mode == "c10d" or backend == "nccl"


# c10d's pg_status of its NCCL groups, read once per watchdog pass (see Comm._watch_backed).
_status_at = -1
_status: dict[str, Any] | None = None


def _c10d_nccl_status(now: int) -> dict[str, Any] | None:
    """``{group: {"last_completed_collective": ..}}`` from c10d's NCCL recorder, or None when it
    cannot be read. No entries are copied (that would hold c10d's recorder lock for ms)."""
    global _status_at, _status
    if _status_at == now:
        return _status
    _status_at = now
    fn = _c10d_dump_fn("nccl")
    try:
        import pickle

        # c10d's own bytes made in this process (plain dicts and ints), not network data.
        dump = pickle.loads(fn(False, False, False)) if fn is not None else None
        _status = dump.get("pg_status") if isinstance(dump, dict) else None
    except Exception:
        logger.debug("reading c10d's NCCL pg_status failed", exc_info=True)
        _status = None
    return _status


class InFlight(NamedTuple):
    """An op of a c10d-backed communicator not yet seen completed (``Comm.in_flight()``): what
    the stall check and health need; the full entry is in c10d's recorder."""

    comm: Comm
    op: str
    seq: int
    p2p_seq: int
    is_p2p: bool
    time_created_ns: int

    @property
    def record_id(self) -> tuple[Any, ...]:
        return ("c10d", self.comm.pg_id, self.is_p2p, self.p2p_seq if self.is_p2p else self.seq)


class BackedWork:
    """The work object of an ``async_op=True`` call on a c10d-backed communicator (same
    ``wait``/``is_completed`` semantics as :class:`CommWork`)."""

    __slots__ = ("_comm", "_op", "_seq", "_is_p2p", "_work")

    def __init__(self, comm: Comm, op: str, seq: int, is_p2p: bool, work: Any) -> None:
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
            comm._raise_broken()
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
                            comm._raise_broken()
                        if time.monotonic() >= deadline:
                            comm._fail_op(self._op, self._seq, self._is_p2p, TimeoutError(
                                f"not completed within {td.total_seconds():g} s"), td, timed_out=True)
                        time.sleep(delay)
                        delay = min(delay * 2, 2e-3)
                work.wait()  # the current stream waits for the op
        except RuntimeError as exc:
            if comm._broken is not None:
                comm._raise_broken(cause=exc)
            comm._fail_op(self._op, self._seq, self._is_p2p, exc, td or comm._timeout)
        if comm._broken is not None and not comm._is_cuda:
            comm._raise_broken()
        self._work = None
        return True


class Comm:
    """A communicator: one process group, its own sequence numbers, and hooks."""

    def __init__(
        self,
        pg: Any,
        name: str,
        backend: str,
        device: torch.device,
        ranks: list[int],
        timeout: datetime.timedelta,
        abort_process_on_timeout_or_error: bool,
        c10d_backed: bool = False,
    ) -> None:
        self._pg = pg
        self._name = name
        self._backend = backend
        self._device = device
        self._ranks = ranks  # global ranks, index = rank in this communicator
        self._timeout = timeout
        self._abort_process = abort_process_on_timeout_or_error
        self._rank = ranks.index(dist.get_rank())
        self._pg_id = next(_pg_counter)
        # c10d's name of the group, taken now (a finalized group leaves c10d's registry): c10d's
        # own Flight Recorder records our ops under it, and the worker drops those duplicates.
        self._c10d_name = _c10d_group_name(pg)
        self._seq = 0
        self._p2p_seq = 0
        self._op_id = 0
        self._lock = threading.Lock()
        self._pre_hooks: list[Callable[[OpRecord], None]] = []
        self._post_hooks: list[Callable[[OpRecord], None]] = []
        self._abort_hooks: list[Callable[[OpRecord, BaseException], None]] = []
        self._split_listeners: list[Callable[[Comm], None]] = []
        self._children: list[Comm] = []
        self._finalized = False
        self._is_cuda = device.type == "cuda"
        self._streams: dict[int, Any] = {}
        self._dev_idx = (device.index if device.index is not None else torch.cuda.current_device()) if (
            device.type == "cuda") else -1
        # CUDA: op ``op_id`` records its start (end) event in slot ``op_id & _SLOT_MASK``. Fixed
        # arrays instead of an event per op: no allocation and no hand-back on the hot path. A
        # slot reused by a later op only ever reports the later point, i.e. too late, never a
        # state the op has not reached.
        self._starts: list[Any] = []
        self._ends: list[Any] = []
        # c10d-backed (see the module doc): c10d's own recorder has every op; the op path only
        # counts and remembers what is in flight for the watchdog. The events are made only if
        # a pre/post hook asks for our records (_ensure_slots).
        self._backed = bool(c10d_backed) and self._c10d_name is not None
        if self._is_cuda and not self._backed:
            self._ensure_slots()
        # c10d-backed in-flight ops, appended by the op's thread, trimmed by the watchdog:
        # (seq, op, time_ns) of NCCL collectives (completion from c10d's pg_status), and
        # (seq, op, time_ns, is_p2p, work) of ops whose c10d work tells completion (gloo async
        # ops, NCCL P2P, and NCCL collectives once P2P ran: c10d's status then mixes counters).
        self._pend: list[tuple[int, str, int]] = []
        self._pend_w: list[tuple[int, str, int, bool, Any]] = []
        self._had_p2p = False
        self._status_warned = False
        self._host: dict[tuple[bool, int], tuple[int, str, int, bool]] = {}  # gloo sync ops running
        # Ops the watchdog still watches (see _watch_pass): collectives in issue order (CUDA),
        # records queried one by one (CUDA P2P, gloo async), async CUDA collectives holding
        # c10d's work.
        self._inflight: list[OpRecord] = []
        self._loose: list[OpRecord] = []
        self._async_recs: collections.deque[OpRecord] = collections.deque()
        # Every collective with op_id <= _done_op_id has completed (found at _done_ns).
        self._done_op_id = -1
        self._done_ns = 0
        # Set once a timeout or failure aborts this communicator: "" while the abort path runs
        # (hooks, dump), then the RuntimeError message that every later op and wait() raises.
        self._broken: str | None = None
        _watchdog_add(self)

    def _ensure_slots(self) -> None:
        """CUDA: create the start/end event slots (once) that our own records' states use."""
        if not self._is_cuda or self._starts:
            return
        starts = [torch.cuda.Event() for _ in range(_SLOTS)]
        ends = [torch.cuda.Event() for _ in range(_SLOTS)]
        # torch creates a CUDA event at its first record: do that here, not on the hot path.
        stream = self._current_stream()
        for ev in starts + ends:
            _record_event(ev, stream)
        self._ends = ends
        self._starts = starts

    def _current_stream(self) -> Any:
        # torch.cuda.current_stream() builds a Stream object per call (~5 us on an H200 host);
        # the raw handle costs 0.1 us, so Stream objects are cached per raw stream.
        raw = _raw_stream(self._dev_idx)
        stream = self._streams.get(raw)
        if stream is None:
            stream = self._streams[raw] = torch.cuda.current_stream(self._dev_idx)
        return stream

    # -- identity ----------------------------------------------------------------------------
    def get_rank(self) -> int:
        return self._rank

    def get_size(self) -> int:
        return len(self._ranks)

    def get_name(self) -> str:
        return self._name

    def get_backend(self) -> str:
        return self._backend

    def get_device(self) -> torch.device:
        return self._device

    @property
    def global_ranks(self) -> list[int]:
        return list(self._ranks)

    @property
    def pg_id(self) -> int:
        return self._pg_id

    @property
    def timeout(self) -> datetime.timedelta:
        return self._timeout

    @property
    def next_seq(self) -> int:
        """The collective sequence number the next collective will get."""
        return self._seq

    @property
    def process_group(self) -> Any:
        return self._pg

    @property
    def c10d_group_name(self) -> str | None:
        """c10d's name of this communicator's process group (``process_group[0]`` of the
        entries c10d's own Flight Recorder writes for its ops), or None when unknown."""
        return self._c10d_name

    @property
    def c10d_backed(self) -> bool:
        """True when c10d's own Flight Recorder records this communicator's ops (the op path
        builds no record; the Flight Recorder hook reads c10d's entries at dump time)."""
        return self._backed

    def in_flight(self) -> list[InFlight]:
        """c10d-backed: the ops not yet seen completed (as of the watchdog's last pass)."""
        if not self._backed:
            return []
        out = [InFlight(self, op, seq, 0, False, t) for seq, op, t in list(self._pend)]
        for seq, op, t, p2p, *_ in list(self._pend_w) + list(self._host.values()):
            out.append(InFlight(self, op, -1 if p2p else seq, seq if p2p else 0, p2p, t))
        out.sort(key=lambda x: x.time_created_ns)
        return out

    def __repr__(self) -> str:
        return f"Comm(name={self._name!r}, backend={self._backend!r}, rank={self._rank}, size={len(self._ranks)})"

    # -- hooks --------------------------------------------------------------------------------
    def register_pre_hook(self, fn: Callable[[OpRecord], None]) -> HookHandle:
        """``fn(record)`` runs before each op is issued (on a c10d-backed communicator this
        turns on building an ``OpRecord`` per op: a few microseconds each)."""
        self._ensure_slots()
        self._pre_hooks.append(fn)
        return HookHandle(self._pre_hooks, fn)

    def register_post_hook(self, fn: Callable[[OpRecord], None]) -> HookHandle:
        """``fn(record)`` runs after each op call returns (completed if sync, issued if async);
        like a pre-hook, it turns on building records on a c10d-backed communicator."""
        self._ensure_slots()
        self._post_hooks.append(fn)
        return HookHandle(self._post_hooks, fn)

    def register_abort_hook(self, fn: Callable[[OpRecord, BaseException], None]) -> HookHandle:
        """``fn(record, error)`` runs on a timeout or error, before it propagates or aborts."""
        self._abort_hooks.append(fn)
        return HookHandle(self._abort_hooks, fn)

    def register_split_listener(self, fn: Callable[[Comm], None]) -> HookHandle:
        """``fn(child)`` runs for each communicator later split from this one."""
        self._split_listeners.append(fn)
        return HookHandle(self._split_listeners, fn)

    @property
    def children(self) -> list[Comm]:
        return list(self._children)

    # -- the op path --------------------------------------------------------------------------
    def _record1(self, op: str, tensor: torch.Tensor, async_op: bool, peer: str = "") -> OpRecord:
        """The common single-tensor, in-place case: ``_new_record`` inlined (the hot path)."""
        if self._finalized:
            raise RuntimeError(f"communicator {self._name!r} is finalized")
        shapes = (tensor.shape,)
        dtypes = (tensor.dtype,)
        with self._lock:
            seq = self._seq
            p2p_seq = self._p2p_seq
            if peer:
                self._p2p_seq = p2p_seq + 1
            else:
                self._seq = seq + 1
            op_id = self._op_id
            self._op_id = op_id + 1
        return OpRecord(self, op, seq, p2p_seq, op_id, bool(peer), peer, shapes, dtypes, shapes, dtypes, async_op)

    def _record(
        self,
        op: str,
        inputs: Sequence[torch.Tensor],
        outputs: Sequence[torch.Tensor],
        async_op: bool,
        peer: str = "",
        input_shapes: tuple[Any, ...] | None = None,
        output_shapes: tuple[Any, ...] | None = None,
    ) -> OpRecord:
        return self._new_record(
            op,
            input_shapes if input_shapes is not None else _shape_tuple(inputs),
            _dtype_tuple(inputs),
            output_shapes if output_shapes is not None else _shape_tuple(outputs),
            _dtype_tuple(outputs),
            async_op,
            peer,
        )

    def _new_record(
        self,
        op: str,
        input_shapes: tuple[Any, ...],
        input_dtypes: tuple[Any, ...],
        output_shapes: tuple[Any, ...],
        output_dtypes: tuple[Any, ...],
        async_op: bool,
        peer: str,
    ) -> OpRecord:
        if self._finalized:
            raise RuntimeError(f"communicator {self._name!r} is finalized")
        is_p2p = bool(peer)
        with self._lock:
            seq = self._seq
            p2p_seq = self._p2p_seq
            if is_p2p:
                self._p2p_seq += 1
            else:
                self._seq += 1
            op_id = self._op_id
            self._op_id += 1
        return OpRecord(
            self,
            op,
            seq,
            p2p_seq,
            op_id,
            is_p2p,
            peer,
            input_shapes,
            input_dtypes,
            output_shapes,
            output_dtypes,
            async_op,
        )

    def _run(self, rec: OpRecord, fn: Callable[..., Any], args: tuple[Any, ...], kw: dict[str, Any]) -> CommWork | None:
        """Issue ``fn(*args, **kw)`` (a ``torch.distributed`` call) for ``rec``; the hot path."""
        if self._broken is not None:
            self._raise_broken()
        for f in self._pre_hooks:
            f(rec)
        if self._is_cuda:
            # The start event fires when the issuing stream reaches the collective, i.e. when
            # its kernel can start ("started"); the end event, recorded after a sync op (c10d
            # ordered the stream after it), fires when it completed.
            slot = rec.op_id & _SLOT_MASK
            stream = self._streams.get(_raw_stream(self._dev_idx)) or self._current_stream()
            _record_event(self._starts[slot], stream)
            try:
                work = fn(*args, **kw)
            except Exception as exc:  # the op could not even be issued
                self._fail(rec, exc)
            if rec.async_op:
                rec.work = work
                if rec.is_p2p:
                    self._loose.append(rec)
                else:
                    self._inflight.append(rec)
                    self._async_recs.append(rec)
                for f in self._post_hooks:
                    f(rec)
                return CommWork(self, rec, work)
            _record_event(self._ends[slot], stream)
            rec.has_end = True
            (self._loose if rec.is_p2p else self._inflight).append(rec)
            if self._broken is not None:  # c10d blocked the host (barrier) until we aborted
                self._raise_broken()
            for f in self._post_hooks:
                f(rec)
            return None
        # gloo runs the op at once and in order, so a queued async op is "started" too.
        rec.state = "started"
        rec.time_started_ns = rec.time_created_ns
        try:
            work = fn(*args, **kw)  # async_op=False: gloo waits, bounded by the group's timeout
        except Exception as exc:
            self._fail(rec, exc, self._timeout)
        if rec.async_op:
            rec.work = work
            self._loose.append(rec)
            for f in self._post_hooks:
                f(rec)
            return CommWork(self, rec, work)
        rec.time_completed_ns = time.time_ns()  # _mark_completed() inlined (the hot path)
        rec.state = "completed"
        for f in self._post_hooks:
            f(rec)
        return None

    def _issue(self, op: str, fn: Callable[..., Any], args: tuple[Any, ...], kw: dict[str, Any],
               async_op: bool, p2p: bool = False) -> BackedWork | None:
        """The c10d-backed op path: count, call torch (c10d records the op), remember it for the
        watchdog. No stack capture, no events, no record: c10d's recorder has all of that.

        A sync collective is the very call bare torch makes (``async_op=False``): no work is
        needed, c10d's pg_status says when it completed. Measured on H200 (torch 2.11), c10d
        makes an ``async_op=True`` call 4.6 us dearer on the host (its own stream, events and a
        stash) than a sync one, which it runs on the current stream. Async ops, P2P ops (as
        isend/irecv, then ``wait()`` when sync) and, once a communicator issued P2P, its
        collectives too, are issued async so that we hold c10d's work for the watchdog.
        """
        if self._broken is not None:
            self._raise_broken()
        if self._finalized:
            raise RuntimeError(f"communicator {self._name!r} is finalized")
        with self._lock:
            if p2p:
                seq = self._p2p_seq
                self._p2p_seq = seq + 1
            else:
                seq = self._seq
                self._seq = seq + 1
        host = not self._is_cuda and not async_op
        if host:
            # gloo, sync: the op runs while this thread waits; in flight for health and the
            # stall check until it returns (gloo itself enforces the timeout, at this call).
            self._host[(p2p, seq)] = (seq, op, time.time_ns(), p2p)
        try:
            if p2p:
                work = fn(*args, **kw)
            elif async_op or (self._had_p2p and self._is_cuda):
                work = fn(*args, async_op=True, **kw)
            else:
                # Exactly bare torch's call: NCCL orders the current stream after the op; gloo
                # waits on the host, bounded by the group's (= our) timeout.
                fn(*args, **kw)
                work = None
            if not async_op and work is not None:
                work.wait()
        except Exception as exc:
            self._fail_op(op, seq, p2p, exc, None if self._is_cuda else self._timeout)
        finally:
            if host:
                self._host.pop((p2p, seq), None)
        if not self._is_cuda:
            if not async_op:
                return None
            # gloo async: the work tells completion (and holds what gloo holds anyway).
            self._pend_w.append((seq, op, time.time_ns(), p2p, work))
            return BackedWork(self, op, seq, p2p, work)
        if p2p or self._had_p2p:
            if p2p:
                self._had_p2p = True
            self._pend_w.append((seq, op, time.time_ns(), p2p, work))
        else:
            # No work kept: it holds the tensors, and a loop of sync ops on fresh tensors would
            # pile them up until the watchdog's next pass. c10d's pg_status says completion.
            self._pend.append((seq, op, time.time_ns()))
        if async_op:
            return BackedWork(self, op, seq, p2p, work)
        if self._broken is not None:  # c10d blocked the host (barrier) until we aborted
            self._raise_broken()
        return None

    def _fail_op(self, op: str, seq: int, is_p2p: bool, exc: BaseException,
                 td: datetime.timedelta | None = None, timed_out: bool | None = None,
                 created_ns: int | None = None, wait_for_other: bool = True) -> NoReturn:
        """The abort path (``_fail``) for an op of the c10d-backed path, which has no record:
        one is made now, for the abort hooks and the message."""
        rec = OpRecord(self, op, seq if not is_p2p else self._seq, seq if is_p2p else self._p2p_seq,
                       -1, is_p2p, "?" if is_p2p else "", (), (), (), (), True)
        if created_ns is not None:
            rec.time_created_ns = created_ns
        self._fail(rec, exc, td, timed_out=timed_out, wait_for_other=wait_for_other)

    def _raise_broken(self, limit_s: float = 120.0, cause: BaseException | None = None) -> NoReturn:
        """Raise this communicator's failure, once its abort path (hooks, dump) has finished."""
        deadline = time.monotonic() + limit_s
        while not self._broken and time.monotonic() < deadline:
            time.sleep(0.01)
        raise RuntimeError(self._broken or f"communicator {self._name!r} failed") from cause

    def _wait_host(self, rec: OpRecord, work: Any, timeout: datetime.timedelta | float | None) -> None:
        """gloo: wait on the host, bounded by ``timeout`` or the group's (= our) timeout."""
        td = _as_timedelta(timeout) or self._timeout
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
            self._fail(rec, exc, td)
        rec._mark_completed()

    def _wait_stream(self, rec: OpRecord, work: Any) -> None:
        """CUDA: the current stream waits for the op (c10d's wait() without timeout), not the host."""
        try:
            if work is not None:
                work.wait()
        except Exception as exc:
            self._fail(rec, exc)
        if self._broken is not None and rec.state != "completed":
            self._raise_broken()
        if not rec.has_end and rec.state != "completed":
            # From here the end event tells completion, so the record lets go of c10d's work.
            _record_event(self._ends[rec.op_id & _SLOT_MASK], self._current_stream())
            rec.has_end = True
            rec.work = None

    def _wait_cuda_host(self, rec: OpRecord, td: datetime.timedelta) -> None:
        """CUDA, explicit timeout: the host polls (non-blocking queries) until done or ``td``."""
        deadline = time.monotonic() + td.total_seconds()
        delay = 5e-5
        while True:
            if self._broken is not None:
                self._raise_broken()
            rec.refresh()
            if rec.state == "completed":
                return
            if time.monotonic() >= deadline:
                self._fail(rec, TimeoutError(f"not completed within {td.total_seconds():g} s"), td, timed_out=True)
            time.sleep(delay)
            delay = min(delay * 2, 2e-3)

    def _fail(
        self,
        rec: OpRecord,
        exc: BaseException,
        td: datetime.timedelta | None = None,
        timed_out: bool | None = None,
        wait_for_other: bool = True,
    ) -> NoReturn:
        """The abort path: abort hooks (the recorder dumps), then abort or raise (module doc).

        A timeout, and any failure on NCCL, leave the communicator unusable: its NCCL
        communicator is aborted and every later op and wait() raises the same message. Called
        from the op's thread or from the watchdog; only the first failure runs the hooks.
        """
        text = str(exc)
        if timed_out is None:
            timed_out = "timed out" in text.lower() or "timeout" in text.lower()
        breaks = timed_out or self._is_cuda
        with self._lock:
            first = not (breaks and self._broken is not None)
            if first and breaks:
                self._broken = ""  # failing: ops and waits from now on wait for the message
        if not first:
            # Another thread (the watchdog, or a waiter) is running the abort path: wait for it,
            # so that this error, too, is raised only after the dump was written.
            self._raise_broken(120.0 if wait_for_other else 0.0, exc)
        what = "timed out" if timed_out else "failed"
        after = f" after {td.total_seconds():g} s" if td is not None and timed_out else ""
        seq = f"p2p #{rec.p2p_seq}" if rec.is_p2p else f"#{rec.seq}"
        msg = (
            f"{rec.op} {seq} on communicator {self._name!r} ({self._backend}, rank {self._rank} of "
            f"{len(self._ranks)}) {what}{after}: {text.splitlines()[0] if text else type(exc).__name__}"
        )
        rec.error = msg
        err = RuntimeError(msg)
        for fn in list(self._abort_hooks):
            try:
                fn(rec, err)
            except Exception:
                logger.exception("abort hook %r failed", fn)
        if self._abort_process:
            logger.critical("%s; aborting the process (abort_process_on_timeout_or_error=True)", msg)
            sys.stderr.write(msg + "; aborting the process\n")
            sys.stderr.flush()
            os.abort()
        if self._is_cuda:
            # The stuck NCCL kernel would otherwise hold the stream, and c10d's watchdog would kill
            # the process when the group's own (longer) timeout expires: abort the communicator
            # so the error can propagate as documented. The communicator is unusable afterwards.
            self._abort_nccl()
        if breaks:
            self._broken = msg
        raise err from exc

    def _abort_nccl(self) -> None:
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is None:
            return
        try:
            abort(self._pg)
        except Exception:
            logger.warning("aborting communicator %r failed", self._name, exc_info=True)

    # -- the watchdog's side (runs in the watchdog thread) -----------------------------------
    def _watch_pass(self, now: int) -> None:
        """Advance the completion watermark, let go of c10d works of completed ops, and run the
        abort path for an op in flight longer than the timeout. Non-blocking queries only."""
        if self._broken is not None or self._finalized:
            return
        limit_ns = int(self._timeout.total_seconds() * 1e9)
        if self._backed and self._watch_backed(now, limit_ns):
            return
        lst = self._inflight
        n = len(lst)
        if n:
            # Only the watchdog removes from the list (the op's thread appends at the end), so
            # indices below n stay valid.
            k = _first_not_done(lst, n)
            if k:
                self._done_ns = now  # before the id: a reader seeing the new id sees this time
                self._done_op_id = lst[k - 1].op_id
                del lst[:k]
            ar = self._async_recs
            dropped = 0
            while ar and ar[0].op_id <= self._done_op_id:
                ar.popleft()._mark_completed(now)  # lets go of c10d's work (and its tensors)
                dropped += 1
                if dropped % 64 == 0:
                    time.sleep(0)  # hand the GIL back now and then: a long pass stalls training
            if lst and now - lst[0].time_created_ns > limit_ns:
                self._watch_fire(lst[0], now)
                return
        loose = self._loose
        n = len(loose)
        keep: list[OpRecord] = []
        for i in range(n):
            rec = loose[i]
            if i % 64 == 63:
                time.sleep(0)  # hand the GIL back now and then: a long pass stalls training
            try:
                if self._is_cuda:
                    done = rec._done_now()
                else:
                    work = rec.work
                    done = rec.state == "completed" or (work is not None and work.is_completed())
                    if done and work is not None:
                        work.wait()  # returns at once when done; a failed gloo work raises here
            except Exception as exc:
                if not self._is_cuda:
                    self._watch_fire(rec, now, exc)
                    return
                done = False
            if done:
                rec._mark_completed(now)
            elif now - rec.time_created_ns > limit_ns:
                self._watch_fire(rec, now)
                return
            else:
                keep.append(rec)
        # One slice assignment (the op's thread may have appended meanwhile, past index n).
        loose[:n] = keep

    def _watch_backed(self, now: int, limit_ns: int) -> bool:
        """The c10d-backed in-flight ops: drop the completed ones, fire on one older than the
        timeout. Returns True when it fired."""
        pend = self._pend
        n = len(pend)
        if n:
            status = _c10d_nccl_status(now)
            st = status.get(self._c10d_name) if isinstance(status, dict) else None
            if st is None:
                # c10d's status cannot be read (c10d notes a group's status when it records the
                # group's first op, before our append): nothing can be known complete, so no
                # timeout either (c10d's own watchdog stays the backstop), and nothing is kept.
                if not self._status_warned:
                    self._status_warned = True
                    logger.warning("communicator %r: c10d's pg_status is unreadable; the debug_server "
                                   "watchdog cannot time its ops out", self._name)
                del pend[:n]
                return False
            try:
                # c10d counts collectives from 1, we from 0: our seq s is done when c10d's last
                # completed >= s + 1. Only the watchdog removes from the front, and seqs rise
                # along the list, so the first k (of the n seen) are done.
                last = int(st.get("last_completed_collective", -1))
            except (TypeError, ValueError):
                return False
            k = bisect.bisect_left(pend, last, 0, n, key=_first)
            if k:
                del pend[:k]
            if pend and now - pend[0][2] > limit_ns:
                seq, op, t = pend[0]
                self._watch_fire_op(op, seq, False, t, now)
                return True
        pw = self._pend_w
        n = len(pw)
        if not n:
            return False
        keep: list[tuple[int, str, int, bool, Any]] = []
        for i in range(n):
            item = pw[i]
            seq, op, t, p2p, work = item
            if i % 64 == 63:
                time.sleep(0)  # hand the GIL back now and then: a long pass stalls training
            try:
                done = work is None or work.is_completed()
                if done and work is not None and not self._is_cuda:
                    work.wait()  # returns at once when done; a failed gloo work raises here
            except Exception as exc:
                self._watch_fire_op(op, seq, p2p, t, now, exc)
                return True
            if done:
                continue
            if now - t > limit_ns:
                self._watch_fire_op(op, seq, p2p, t, now)
                return True
            keep.append(item)
        # One slice assignment (the op's thread may have appended meanwhile, past index n).
        pw[:n] = keep
        return False

    def _watch_fire_op(self, op: str, seq: int, is_p2p: bool, created_ns: int, now: int,
                       exc: BaseException | None = None) -> None:
        timed_out: bool | None = None
        if exc is None:
            exc = TimeoutError(f"in flight for {(now - created_ns) / 1e9:.1f} s without completing "
                               "(debug_server watchdog)")
            timed_out = True
        try:
            self._fail_op(op, seq, is_p2p, exc, self._timeout, timed_out=timed_out, created_ns=created_ns,
                          wait_for_other=False)
        except RuntimeError:
            pass  # raised to the op's thread by its next op or wait()

    def _watch_fire(self, rec: OpRecord, now: int, exc: BaseException | None = None) -> None:
        if exc is None:
            age = (now - rec.time_created_ns) / 1e9
            exc = TimeoutError(f"in flight for {age:.1f} s without completing (debug_server watchdog)")
            timed_out: bool | None = True
        else:
            timed_out = None
        try:
            self._fail(rec, exc, self._timeout, timed_out=timed_out, wait_for_other=False)
        except RuntimeError:
            pass  # raised to the op's thread by its next op or wait()

    # -- ops ----------------------------------------------------------------------------------
    # Each op passes torch.distributed's own function and async_op through: with
    # async_op=False, c10d orders the current stream after the collective (NCCL) or waits on the
    # host (gloo), exactly as a bare torch.distributed call does.
    def all_reduce(self, tensor: torch.Tensor, op: Any = ReduceOp.SUM, async_op: bool = False) -> CommWork | BackedWork | None:
        if self._backed and not self._pre_hooks and not self._post_hooks:
            return self._issue("all_reduce", dist.all_reduce, (tensor,), {"op": op, "group": self._pg}, async_op)
        rec = self._record1("all_reduce", tensor, async_op)
        return self._run(rec, dist.all_reduce, (tensor,), {"op": op, "group": self._pg, "async_op": async_op})

    def broadcast(self, tensor: torch.Tensor, root: int, async_op: bool = False) -> CommWork | BackedWork | None:
        if self._backed and not self._pre_hooks and not self._post_hooks:
            return self._issue("broadcast", dist.broadcast, (tensor,), {"src": self._ranks[root], "group": self._pg},
                               async_op)
        rec = self._record1("broadcast", tensor, async_op)
        src = self._ranks[root]
        return self._run(rec, dist.broadcast, (tensor,), {"src": src, "group": self._pg, "async_op": async_op})

    def reduce(
        self, tensor: torch.Tensor, root: int, op: Any = ReduceOp.SUM, async_op: bool = False
    ) -> CommWork | BackedWork | None:
        if self._backed and not self._pre_hooks and not self._post_hooks:
            return self._issue("reduce", dist.reduce, (tensor,),
                               {"dst": self._ranks[root], "op": op, "group": self._pg}, async_op)
        rec = self._record1("reduce", tensor, async_op)
        dst = self._ranks[root]
        return self._run(
            rec, dist.reduce, (tensor,), {"dst": dst, "op": op, "group": self._pg, "async_op": async_op}
        )

    def all_gather(
        self, tensor_list: list[torch.Tensor], tensor: torch.Tensor, async_op: bool = False
    ) -> CommWork | BackedWork | None:
        if self._backed and not self._pre_hooks and not self._post_hooks:
            return self._issue("all_gather", dist.all_gather, (tensor_list, tensor), {"group": self._pg}, async_op)
        # Sizes as c10d's recorder writes them: the outputs as one flattened tensor, so analyzers
        # apply the same numel rule (output = input x group size) to both APIs.
        out = (torch.Size([sum(t.shape[0] if t.dim() else 1 for t in tensor_list), *tensor.shape[1:]]),)
        rec = self._record("all_gather", (tensor,), tensor_list[:1], async_op, output_shapes=out)
        return self._run(rec, dist.all_gather, (tensor_list, tensor), {"group": self._pg, "async_op": async_op})

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False
    ) -> CommWork | BackedWork | None:
        if self._backed and not self._pre_hooks and not self._post_hooks:
            return self._issue("all_gather_single", dist.all_gather_into_tensor, (output, input),
                               {"group": self._pg}, async_op)
        rec = self._record("all_gather_single", (input,), (output,), async_op)
        return self._run(
            rec, dist.all_gather_into_tensor, (output, input), {"group": self._pg, "async_op": async_op}
        )

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input_list: list[torch.Tensor],
        op: Any = ReduceOp.SUM,
        async_op: bool = False,
    ) -> CommWork | BackedWork | None:
        if self._backed and not self._pre_hooks and not self._post_hooks:
            return self._issue("reduce_scatter", dist.reduce_scatter, (output, input_list),
                               {"op": op, "group": self._pg}, async_op)
        inp = (torch.Size([sum(t.shape[0] if t.dim() else 1 for t in input_list), *output.shape[1:]]),)
        rec = self._record("reduce_scatter", input_list[:1], (output,), async_op, input_shapes=inp)
        return self._run(
            rec, dist.reduce_scatter, (output, input_list), {"op": op, "group": self._pg, "async_op": async_op}
        )

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
        async_op: bool = False,
    ) -> CommWork | BackedWork | None:
        if self._backed and not self._pre_hooks and not self._post_hooks:
            return self._issue("all_to_all_single", dist.all_to_all_single,
                               (output, input, output_split_sizes, input_split_sizes), {"group": self._pg}, async_op)
        rec = self._record("all_to_all_single", (input,), (output,), async_op)
        return self._run(
            rec,
            dist.all_to_all_single,
            (output, input, output_split_sizes, input_split_sizes),
            {"group": self._pg, "async_op": async_op},
        )

    def send(self, tensor: torch.Tensor, dst: int, async_op: bool = False) -> CommWork | BackedWork | None:
        if self._backed and not self._pre_hooks and not self._post_hooks:
            return self._issue("send", dist.isend, (tensor,), {"dst": self._ranks[dst], "group": self._pg},
                               async_op, p2p=True)
        rec = self._record1("send", tensor, async_op, peer=f"{self._rank}->{dst}")
        fn = dist.isend if async_op else dist.send
        return self._run(rec, fn, (tensor,), {"dst": self._ranks[dst], "group": self._pg})

    def recv(self, tensor: torch.Tensor, src: int, async_op: bool = False) -> CommWork | BackedWork | None:
        if self._backed and not self._pre_hooks and not self._post_hooks:
            return self._issue("recv", dist.irecv, (tensor,), {"src": self._ranks[src], "group": self._pg},
                               async_op, p2p=True)
        rec = self._record1("recv", tensor, async_op, peer=f"{self._rank}<-{src}")
        fn = dist.irecv if async_op else dist.recv
        return self._run(rec, fn, (tensor,), {"src": self._ranks[src], "group": self._pg})

    def barrier(self, async_op: bool = False) -> CommWork | BackedWork | None:
        if self._backed and not self._pre_hooks and not self._post_hooks:
            return self._issue("barrier", dist.barrier, (), {"group": self._pg}, async_op)
        rec = self._record("barrier", (), (), async_op)
        return self._run(rec, dist.barrier, (), {"group": self._pg, "async_op": async_op})

    # -- lifecycle ----------------------------------------------------------------------------
    def split(self, ranks: Sequence[int], name: str) -> Comm:
        """A new communicator over ``ranks`` (ranks in this communicator), called by its members.

        Hooks that follow splits (the Flight Recorder does) are attached to the child.
        """
        local = sorted(set(int(r) for r in ranks))
        if self._rank not in local:
            raise ValueError(
                f"split({local}, {name!r}) called on rank {self._rank} of {self._name!r}, which is "
                "not a member; only members call split"
            )
        if any(r < 0 or r >= len(self._ranks) for r in local):
            raise ValueError(f"split ranks {local} out of range for a communicator of size {len(self._ranks)}")
        global_ranks = [self._ranks[r] for r in local]
        backed = self._backed and _c10d_backed(self._backend)
        pg = _new_group(global_ranks, self._backend, self._timeout, name, local_sync=True,
                        timing=backed and _timing_wanted(self._backend))
        child = Comm(pg, name, self._backend, self._device, global_ranks, self._timeout, self._abort_process,
                     c10d_backed=backed)
        self._children.append(child)
        for fn in list(self._split_listeners):
            fn(child)
        return child

    def finalize(self) -> None:
        """Release the process group; further ops raise. Idempotent."""
        if self._finalized:
            return
        self._finalized = True
        _watchdog_discard(self)
        try:
            dist.destroy_process_group(self._pg)
        except Exception:  # already torn down with the default group
            logger.debug("destroy_process_group(%s) failed", self._name, exc_info=True)


# Why the margin: c10d's NCCL watchdog tears the process down when a group's timeout expires. The
# communicator's own timeout (the host-side wait) must fire first, so the abort hooks can dump
# and the error can reach the caller.
_WATCHDOG_MARGIN = datetime.timedelta(seconds=60)


def _first_not_done(lst: list[OpRecord], n: int) -> int:
    """Index of the first op of ``lst[:n]`` not completed: a binary search (log n queries).

    Completion is monotone along the list: a communicator's collectives run in issue order.
    """
    try:
        if lst[n - 1]._done_now():
            return n
        lo, hi = 0, n - 1  # lst[hi] is not done
        while lo < hi:
            mid = (lo + hi) // 2
            if lst[mid]._done_now():
                lo = mid + 1
            else:
                hi = mid
        return lo
    except RuntimeError:  # a failed work or a lost CUDA context: nothing to advance
        return 0


# -- the watchdog ------------------------------------------------------------------------------
# One daemon thread per process. Every pass (every 0.1 s) each communicator makes a few
# non-blocking queries (_watch_pass) and other modules' checks run (the recorder's stall check,
# add_watchdog_check). The training thread only appends records to lists; timeouts, the
# watermark and letting go of completed works all happen here.
_WATCH_PERIOD = 0.1
_wd_lock = threading.Lock()
_wd_thread: threading.Thread | None = None
_wd_stop = threading.Event()
_wd_comms: weakref.WeakSet[Comm] = weakref.WeakSet()
_wd_checks: list[Callable[[], float | None]] = []


def add_watchdog_check(fn: Callable[[], float | None]) -> None:
    """Run ``fn()`` on every watchdog pass (once per ``fn``); it returns the period it needs in
    seconds (the pass runs at least that often), or None."""
    with _wd_lock:
        if fn not in _wd_checks:
            _wd_checks.append(fn)
    _ensure_watchdog()


def _watchdog_add(comm: Comm) -> None:
    with _wd_lock:
        _wd_comms.add(comm)
    _ensure_watchdog()


def _watchdog_discard(comm: Comm) -> None:
    with _wd_lock:
        _wd_comms.discard(comm)


def _ensure_watchdog() -> None:
    global _wd_thread
    with _wd_lock:
        if _wd_thread is None or not _wd_thread.is_alive():
            _wd_stop.clear()
            _wd_thread = threading.Thread(target=_watch_loop, name="debug-server-watchdog", daemon=True)
            _wd_thread.start()


@atexit.register
def _stop_watchdog() -> None:
    # Stop before interpreter teardown: querying a c10d work object while the process group's
    # C++ threads are being destroyed aborts the process ("terminate called...").
    _wd_stop.set()
    t = _wd_thread
    if t is not None and t.is_alive() and t is not threading.current_thread():
        t.join(timeout=2.0)


def _watch_loop() -> None:
    period = _WATCH_PERIOD
    while not _wd_stop.wait(period):
        with _wd_lock:
            comms = list(_wd_comms)
            checks = list(_wd_checks)
        now = time.time_ns()
        for comm in comms:
            # One bad pass must not end the watchdog for the rest of the run.
            try:
                comm._watch_pass(now)
            except Exception:
                logger.exception("watchdog pass over %r failed; continuing", comm)
        period = _WATCH_PERIOD
        for fn in checks:
            try:
                wanted = fn()
            except Exception:
                logger.exception("watchdog check %r failed; continuing", fn)
                wanted = None
            if wanted is not None:
                period = min(period, max(0.01, wanted))


_TIMING_ENV = "TORCH_NCCL_ENABLE_TIMING"
TIMING_OPT_ENV = "DEBUG_SERVER_NCCL_TIMING"
"""``0``: c10d-backed NCCL communicators' groups record no start events (cheaper per op; c10d's
entries then go from ``scheduled`` to ``completed`` without ``started``)."""


def _timing_wanted(backend: str) -> bool:
    return backend == "nccl" and os.environ.get(TIMING_OPT_ENV, "1").strip() != "0"


def _load_symbolizer() -> None:
    """Import what c10d symbolises its recorded stacks with (``torch._inductor``, ~1-2 s once)
    now, in the thread that creates the communicator. Dumps run in other threads (the worker,
    the watchdog); importing it from there races the trainer's own imports, so without this
    the dumps of a c10d-backed communicator would have to leave the stacks out."""
    if "torch._inductor" in sys.modules:
        return
    try:
        import torch._inductor  # noqa: F401
    except Exception:  # a torch without it: c10d_fr then dumps without stacks
        logger.debug("importing torch._inductor failed", exc_info=True)


def _new_group(
    global_ranks: list[int], backend: str, timeout: datetime.timedelta, name: str, local_sync: bool,
    timing: bool = False,
) -> Any:
    pg_timeout = timeout + _WATCHDOG_MARGIN if backend == "nccl" else timeout
    kwargs: dict[str, Any] = {"ranks": global_ranks, "backend": backend, "timeout": pg_timeout}
    if local_sync:
        kwargs["use_local_synchronization"] = True
    # c10d's recorder says "started" for an NCCL op only when its group records start events,
    # which ProcessGroupNCCL decides from TORCH_NCCL_ENABLE_TIMING when it is constructed. Set it
    # only around the creation of this communicator's own group, and put it back at once: the
    # user's other groups (DDP, FSDP) must not pay for events they did not ask for.
    saved = os.environ.get(_TIMING_ENV)
    if timing:
        os.environ[_TIMING_ENV] = "1"
    try:
        try:
            pg = dist.new_group(group_desc=name, **kwargs)
        except TypeError:  # torch without group_desc
            pg = dist.new_group(**kwargs)
    finally:
        if timing:
            if saved is None:
                os.environ.pop(_TIMING_ENV, None)
            else:
                os.environ[_TIMING_ENV] = saved
    if timing and pg is not None and hasattr(pg, "_enable_collectives_timing"):
        try:
            pg._enable_collectives_timing()  # the same switch, for a group made lazily
        except Exception:
            logger.debug("enabling collective timing on %r failed", name, exc_info=True)
    return pg


def new_comm(
    backend: str,
    device: torch.device | str,
    name: str,
    timeout: datetime.timedelta | float | None = None,
    abort_process_on_timeout_or_error: bool | None = None,
    store: Any = None,
) -> Comm:
    """Create a communicator called ``name`` over all ranks of the job.

    Args:
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (CUDA).
        device: the device tensors live on; for CUDA, this rank's GPU.
        name: the communicator's name; it is the group name in every FR entry and dump.
        timeout: per-op timeout (``timedelta`` or seconds); default 10 minutes.
        abort_process_on_timeout_or_error: abort the process after the abort hooks ran instead
            of raising (default False).
        store: a ``torch.distributed.Store`` for the rendezvous when the default group is not
            initialised yet; otherwise torchrun's ``env://`` variables are used.

    All ranks must call ``new_comm`` in the same order (it creates a process group).
    """
    dev = torch.device(device)
    td = _as_timedelta(timeout) or _DEFAULT_TIMEOUT
    if not dist.is_initialized():
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        kwargs: dict[str, Any] = {"backend": backend, "timeout": td}
        if store is not None:
            kwargs.update(store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        dist.init_process_group(**kwargs)
    world = dist.get_world_size()
    ranks = list(range(world))
    backed = _c10d_backed(backend)
    if backed:
        _load_symbolizer()
    pg = _new_group(ranks, backend, td, name, local_sync=False, timing=backed and _timing_wanted(backend))
    return Comm(pg, name, backend, dev, ranks, td, bool(abort_process_on_timeout_or_error), c10d_backed=backed)
