"""A communicator with hooks over ``torch.distributed``.

``new_comm(backend, device, name)`` gives one process group per communicator, with the ops of
TorchComms' API and three kinds of callbacks: pre-op, post-op and abort.

This module holds ``Comm`` and the op path (``_run``, ``_issue``); its op methods are ``ops``'s.
The frames of both lie between the user's call site and c10d, and the recorders drop them from
the stacks they keep (``frames.OP_PATH_FILES``). Each op makes c10d's C++ call itself, as
``torch.distributed``'s wrapper would, without the wrapper (``calls``). The rest lives beside
it: ``records`` (``OpRecord``), ``work`` (work objects and waits), ``watchdog`` (timeouts off
the hot path), ``abort`` (the abort path), ``groups`` (process groups, which recorder runs).

Which recorder records a communicator's ops (c10d's own Flight Recorder, the *c10d-backed*
path, or ours), and what each costs per op: the ``groups`` module doc.

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
* Timeouts and failures: the ``watchdog`` module doc. States (``scheduled``, ``started``,
  ``completed``), true when read, and what a record keeps: the ``records`` module doc.
"""

from __future__ import annotations

import collections
import datetime
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from debug_server.config import Settings
from debug_server.recording.abort import fail, fail_op, raise_broken
from debug_server.recording.calls import Call, DirectCalls
from debug_server.recording.groups import (
    RECORDER_ENV,
    TIMING_OPT_ENV,
    _c10d_backed,
    _c10d_group_name,
    _load_symbolizer,
    _mark_gap_ns,
    _new_group,
    _timing_wanted,
    init_default_group,
)
from debug_server.recording.ops import CommOps
from debug_server.recording.records import (
    _SLOT_MASK,
    _SLOTS,
    HookHandle,
    InFlight,
    OpRecord,
    _as_timedelta,
    _dtype_tuple,
    _raw_stream,
    _record_event,
    _shape_tuple,
)
from debug_server.recording.watchdog import _watchdog_add, _watchdog_discard, add_watchdog_check
from debug_server.recording.work import BackedWork, CommWork

__all__ = [
    "RECORDER_ENV", "TIMING_OPT_ENV", "BackedWork", "Comm", "CommWork", "HookHandle", "InFlight", "OpRecord",
    "ReduceOp", "add_watchdog_check", "new_comm",
]

logger = logging.getLogger(__name__)

_DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)
_pg_counter = itertools.count()

class Comm(CommOps):
    """A communicator: one process group, its own sequence numbers, and hooks (its op methods:
    ``ops.CommOps``)."""

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
        settings: Settings | None = None,
    ) -> None:
        self._pg = pg
        # The settings ``new_comm`` read (its variables: recorder, start marks, timing, the
        # pickle prefix); a split child inherits them. Defaults when built directly.
        self.settings = settings if settings is not None else Settings()
        self._name = name
        self._backend = backend
        self._device = device
        self._ranks = ranks  # global ranks, index = rank in this communicator
        self._timeout = timeout
        self._abort_process = abort_process_on_timeout_or_error
        self._rank = ranks.index(dist.get_rank())
        self._pg_id = next(_pg_counter)
        self._calls = DirectCalls(pg, ranks, self._rank)
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
        # c10d-backed on CUDA without c10d's timing: start marks in the slots (see _issue) on
        # each collective issued _mark_gap ns or more after the previous one (0: on every
        # collective); _mark_seq[slot] is the collective whose mark the slot holds.
        gap = (_mark_gap_ns(self.settings) if self._is_cuda and self._backed
               and not _timing_wanted(self._backend, self.settings) else None)
        self._marks = gap is not None
        self._mark_gap = gap or 0
        self._last_ns = 0  # when the previous collective was issued
        self._mark_seq = [-1] * _SLOTS if self._marks else []
        if self._is_cuda and (self._marks or not self._backed):
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
        # Ops the watchdog still watches (see watchdog.watch_pass): collectives in issue order (CUDA),
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

    def started_mark(self, seq: int) -> bool:
        """c10d-backed on CUDA: whether collective ``seq`` (ours, from 0) reached its stream.

        True once the untimed event recorded just before the call fired: all the issuing
        stream's earlier work is done, so the collective's kernel could start; if every earlier
        collective of this communicator completed too, it is running. False when unknown: no
        mark for this collective (by default only the first of a burst has one, ``groups.MARKS_ENV``), or its slot
        since reused by a later one.
        """
        if not self._marks or not 0 <= seq < self._seq:
            return False
        slot = seq & _SLOT_MASK
        if self._mark_seq[slot] != seq:
            return False
        try:
            return bool(self._starts[slot].query())
        except Exception:  # a CUDA error while reading: unknown, never claimed
            return False

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
        """The common single-tensor, in-place case of ``_record`` (the hot path)."""
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
        input_shapes: tuple[Any, ...] | None = None,
        output_shapes: tuple[Any, ...] | None = None,
    ) -> OpRecord:
        """A collective's record from its tensors (``_record1`` is the single-tensor case)."""
        if self._finalized:
            raise RuntimeError(f"communicator {self._name!r} is finalized")
        with self._lock:
            seq = self._seq
            self._seq = seq + 1
            op_id = self._op_id
            self._op_id = op_id + 1
        return OpRecord(
            self, op, seq, self._p2p_seq, op_id, False, "",
            input_shapes if input_shapes is not None else _shape_tuple(inputs), _dtype_tuple(inputs),
            output_shapes if output_shapes is not None else _shape_tuple(outputs), _dtype_tuple(outputs),
            async_op,
        )

    def _run(self, rec: OpRecord, call: Call) -> CommWork | None:
        """Make ``call`` (``calls.DirectCalls``) for ``rec``: our recorder's op path, the hot path.

        The C++ call is made here, in this file, so the stacks recorded for the op start at the
        user's call site once the recorders drop this file's frames.
        """
        if self._broken is not None:
            raise_broken(self)
        for f in self._pre_hooks:
            f(rec)
        fn, args, kw = call
        if self._is_cuda:
            # The start event fires when the issuing stream reaches the collective, i.e. when
            # its kernel can start ("started"); the end event, recorded after a sync op (c10d
            # ordered the stream after it), fires when it completed.
            slot = rec.op_id & _SLOT_MASK
            stream = self._streams.get(_raw_stream(self._dev_idx)) or self._current_stream()
            _record_event(self._starts[slot], stream)
            try:
                work = fn(*args, **kw)
                if not rec.async_op and work is not None:
                    work.wait()  # as torch's wrapper: the current stream waits, not the host
            except Exception as exc:  # the op could not even be issued
                fail(self, rec, exc)
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
                raise_broken(self)
            for f in self._post_hooks:
                f(rec)
            return None
        # gloo runs the op at once and in order, so a queued async op is "started" too.
        rec.state = "started"
        rec.time_started_ns = rec.time_created_ns
        try:
            work = fn(*args, **kw)
            if not rec.async_op and work is not None:
                work.wait()  # gloo waits on the host, bounded by the group's (= our) timeout
        except Exception as exc:
            fail(self, rec, exc, self._timeout)
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

    def _issue(self, op: str, call: Call, async_op: bool, p2p: bool = False) -> BackedWork | None:
        """The c10d-backed op path: count, make ``call`` (c10d records the op), remember it for
        the watchdog. No stack capture, no events, no record: c10d's recorder has all of that.

        A sync collective is the very C++ call bare torch makes (``asyncOp=False``) and the
        same wait: no work is kept, c10d's pg_status says when it completed. Measured on H200
        (torch 2.11), c10d makes an ``async_op=True`` call 4.6 us dearer on the host (its own
        stream, events and a stash) than a sync one, which it runs on the current stream. Async
        ops, P2P ops (c10d's send/recv always give a work, waited on when sync) and, once a
        communicator issued P2P, its collectives too (the op methods pass ``async_op or
        _had_p2p``), are issued async so that we hold c10d's work for the watchdog.
        """
        if self._broken is not None:
            raise_broken(self)
        if self._finalized:
            raise RuntimeError(f"communicator {self._name!r} is finalized")
        with self._lock:
            if p2p:
                seq = self._p2p_seq
                self._p2p_seq = seq + 1
            else:
                seq = self._seq
                self._seq = seq + 1
        now = time.time_ns()
        if self._marks and not p2p:
            if now - self._last_ns >= self._mark_gap or now < self._last_ns:
                # The start mark, on the first collective after a pause (groups.MARKS_ENV): it
                # fires once the issuing stream reached this collective, i.e. when its kernel
                # can start (see started_mark). The slot is claimed for ``seq`` only after the
                # record: a reader in between sees the slot's previous owner, never this
                # collective with the previous owner's (fired) event.
                slot = seq & _SLOT_MASK
                _record_event(self._starts[slot], self._streams.get(_raw_stream(self._dev_idx)) or self._current_stream())
                self._mark_seq[slot] = seq
            self._last_ns = now
        host = not self._is_cuda and not async_op
        if host:
            # gloo, sync: the op runs while this thread waits; in flight for health and the
            # stall check until it returns (gloo itself enforces the timeout, at this call).
            self._host[(p2p, seq)] = (seq, op, now, p2p)
        fn, args, kw = call
        try:
            work = fn(*args, **kw)
            if not async_op and work is not None:
                # As torch's wrapper: NCCL orders the current stream after the op; gloo waits
                # on the host, bounded by the group's (= our) timeout.
                work.wait()
        except Exception as exc:
            fail_op(self, op, seq, p2p, exc, None if self._is_cuda else self._timeout)
        finally:
            if host:
                self._host.pop((p2p, seq), None)
        # What the watchdog watches, now that c10d took the op.
        if not self._is_cuda:
            if not async_op:
                return None
            # gloo async: the work tells completion (and holds what gloo holds anyway).
            self._pend_w.append((seq, op, now, p2p, work))
            return BackedWork(self, op, seq, p2p, work)
        if p2p or self._had_p2p:
            if p2p:
                self._had_p2p = True
            self._pend_w.append((seq, op, now, p2p, work))
        else:
            # No work kept: it holds the tensors, and a loop of sync ops on fresh tensors would
            # pile them up until the watchdog's next pass. c10d's pg_status says completion.
            self._pend.append((seq, op, now))
        if async_op:
            return BackedWork(self, op, seq, p2p, work)
        if self._broken is not None:  # c10d blocked the host (barrier) until we aborted
            raise_broken(self)
        return None

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
        backed = self._backed and _c10d_backed(self._backend, self.settings)
        pg = _new_group(global_ranks, self._backend, self._timeout, name, local_sync=True,
                        timing=backed and _timing_wanted(self._backend, self.settings))
        child = Comm(pg, name, self._backend, self._device, global_ranks, self._timeout, self._abort_process,
                     c10d_backed=backed, settings=self.settings)
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

    When the default group is not initialised yet, ``new_comm`` initialises it, on CUDA bound
    to ``device`` (``device_id``): every group made after it is then split from one NCCL
    communicator, the user's own included (``groups.init_default_group`` says why).

    All ranks must call ``new_comm`` in the same order (it creates a process group).
    """
    dev = torch.device(device)
    td = _as_timedelta(timeout) or _DEFAULT_TIMEOUT
    if not dist.is_initialized():
        init_default_group(backend, dev, td, store)
    world = dist.get_world_size()
    ranks = list(range(world))
    # new_comm is the recording side's entry point (a user may call it without
    # start_debug_server): it reads the settings once and hands them to the communicator.
    settings = Settings.from_env()
    backed = _c10d_backed(backend, settings)
    if backed:
        _load_symbolizer()
    pg = _new_group(ranks, backend, td, name, local_sync=False,
                    timing=backed and _timing_wanted(backend, settings))
    return Comm(pg, name, backend, dev, ranks, td, bool(abort_process_on_timeout_or_error),
                c10d_backed=backed, settings=settings)

