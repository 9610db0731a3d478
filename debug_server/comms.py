"""A communicator with hooks over ``torch.distributed``.

``new_comm(backend, device, name)`` gives one process group per communicator, with the ops of
TorchComms' API and three kinds of callbacks: pre-op, post-op and abort. Every op builds one
``OpRecord`` (what, which sequence number, shapes, dtypes, true state); hooks such as the Flight
Recorder keep references to those records instead of copying them, so recording costs a few
microseconds.

Semantics worth knowing:

* Ranks passed to ops (``root``, ``dst``, ``src``) and to ``split`` are ranks *in the
  communicator*, as in TorchComms.
* ``async_op=False`` waits for the op on the host, bounded by the communicator's timeout, on every
  backend (what gloo always does and ``TORCH_NCCL_BLOCKING_WAIT=1`` does for NCCL). A timeout is
  therefore an exception at the call site, after the abort hooks ran. Use ``async_op=True`` and
  ``work.wait()`` later to overlap communication.
* On a timeout or error the abort hooks run first (the recorder dumps there), then the error
  propagates as ``RuntimeError`` naming the op, the communicator and its sequence number, or, with
  ``abort_process_on_timeout_or_error=True``, the process aborts.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

__all__ = ["Comm", "CommWork", "HookHandle", "OpRecord", "ReduceOp", "new_comm"]

logger = logging.getLogger(__name__)

_DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)
_pg_counter = itertools.count()
# One counter per process across all communicators, like c10d's record ids: every hook that
# keeps a record sees the same id, so snapshots of several hooks merge without renumbering.
_record_ids = itertools.count()


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
        "start_event",
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
        self.start_event: Any = None
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
        """Advance the state from non-blocking queries (work completion, CUDA start event)."""
        if self.state == "completed":
            return
        if self.state == "scheduled" and self.start_event is not None:
            try:
                if self.start_event.query():
                    self.state = "started"
                    self.time_started_ns = time.time_ns()
            except RuntimeError:  # CUDA context gone; keep what we know
                pass
        work = self.work
        if work is not None:
            try:
                done = work.is_completed()
            except RuntimeError:
                done = False
            if done:
                self._mark_completed()

    def _mark_completed(self) -> None:
        if self.state != "completed":
            now = time.time_ns()
            if self.time_started_ns is None:
                self.time_started_ns = now
            self.time_completed_ns = now
            self.state = "completed"
        # Drop references that keep tensors alive; the start event has fired (the op is done),
        # so it goes back to the communicator's pool for reuse.
        self.work = None
        ev = self.start_event
        if ev is not None:
            self.start_event = None
            self.comm._release_event(ev)


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
        self._record.refresh()
        return self._record.state == "completed"

    def wait(self, timeout: datetime.timedelta | float | None = None) -> bool:
        """Block until the op completes; a timeout runs the abort path (see module doc)."""
        if self._record.state != "completed":
            self._comm._wait(self._record, self._work, timeout)
        return True


def _dtype_tuple(tensors: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    return tuple(t.dtype for t in tensors)


def _shape_tuple(tensors: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    return tuple(t.shape for t in tensors)


def _as_timedelta(timeout: datetime.timedelta | float | None) -> datetime.timedelta | None:
    if timeout is None or isinstance(timeout, datetime.timedelta):
        return timeout
    return datetime.timedelta(seconds=float(timeout))


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
        # Reused start events: creating a CUDA event per op costs more than recording one.
        self._event_pool: list[Any] = []
        self._streams: dict[int, Any] = {}

    def _current_stream(self) -> Any:
        # torch.cuda.current_stream() builds a Stream object per call (~5 us on an H200 host);
        # the raw handle costs 0.1 us, so Stream objects are cached per raw stream.
        idx = self._device.index if self._device.index is not None else torch.cuda.current_device()
        raw = torch._C._cuda_getCurrentRawStream(idx)
        stream = self._streams.get(raw)
        if stream is None:
            stream = self._streams[raw] = torch.cuda.current_stream(idx)
        return stream

    def _release_event(self, ev: Any) -> None:
        if len(self._event_pool) < 1024:
            self._event_pool.append(ev)

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

    def __repr__(self) -> str:
        return f"Comm(name={self._name!r}, backend={self._backend!r}, rank={self._rank}, size={len(self._ranks)})"

    # -- hooks --------------------------------------------------------------------------------
    def register_pre_hook(self, fn: Callable[[OpRecord], None]) -> HookHandle:
        """``fn(record)`` runs before each op is issued."""
        self._pre_hooks.append(fn)
        return HookHandle(self._pre_hooks, fn)

    def register_post_hook(self, fn: Callable[[OpRecord], None]) -> HookHandle:
        """``fn(record)`` runs after each op call returns (completed if sync, issued if async)."""
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
        """The common single-tensor, in-place case, without building tuples generically."""
        shapes = (tensor.shape,)
        dtypes = (tensor.dtype,)
        return self._new_record(op, shapes, dtypes, shapes, dtypes, async_op, peer)

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

    def _run(self, rec: OpRecord, issue: Callable[[], Any]) -> CommWork | None:
        for fn in self._pre_hooks:
            fn(rec)
        if self._is_cuda:
            # Recorded on the issuing stream just before the op: it fires when the stream
            # reaches the collective, i.e. when the NCCL kernel can start ("started").
            pool = self._event_pool
            ev = pool.pop() if pool else torch.cuda.Event()
            ev.record(self._current_stream())
            rec.start_event = ev
        else:
            # On CPU the op is handed to gloo at once; gloo runs a group's ops in order, so a
            # queued async op is reported "started" too (see refresh() for the CUDA case).
            rec.state = "started"
            rec.time_started_ns = rec.time_created_ns
        try:
            work = issue()
        except Exception as exc:  # the op could not even be issued
            self._abort(rec, exc)
        if rec.async_op:
            rec.work = work
            for fn in self._post_hooks:
                fn(rec)
            return CommWork(self, rec, work)
        self._wait(rec, work, None)
        return None

    def _wait(self, rec: OpRecord, work: Any, timeout: datetime.timedelta | float | None) -> None:
        td = _as_timedelta(timeout) or self._timeout
        try:
            if work is None:
                pass
            elif timeout is None and not self._is_cuda:
                # gloo enforces the group's timeout (== this communicator's) by itself, and its
                # plain wait() is several microseconds cheaper per op than wait(timeout=...).
                work.wait()
            else:
                work.wait(timeout=td)
        except Exception as exc:
            self._abort(rec, exc, td)
        rec._mark_completed()
        if not rec.async_op:
            for fn in self._post_hooks:
                fn(rec)

    def _abort(
        self, rec: OpRecord, exc: BaseException, td: datetime.timedelta | None = None
    ) -> NoReturn:
        what = "timed out" if "timed out" in str(exc).lower() or "timeout" in str(exc).lower() else "failed"
        after = f" after {td.total_seconds():g} s" if td is not None and what == "timed out" else ""
        seq = f"p2p #{rec.p2p_seq}" if rec.is_p2p else f"#{rec.seq}"
        msg = (
            f"{rec.op} {seq} on communicator {self._name!r} ({self._backend}, rank {self._rank} of "
            f"{len(self._ranks)}) {what}{after}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
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
        raise err from exc

    def _abort_nccl(self) -> None:
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is None:
            return
        try:
            abort(self._pg)
        except Exception:
            logger.warning("aborting communicator %r failed", self._name, exc_info=True)

    # -- ops ----------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: Any = ReduceOp.SUM, async_op: bool = False) -> CommWork | None:
        rec = self._record1("all_reduce", tensor, async_op)
        return self._run(rec, lambda: dist.all_reduce(tensor, op=op, group=self._pg, async_op=True))

    def broadcast(self, tensor: torch.Tensor, root: int, async_op: bool = False) -> CommWork | None:
        rec = self._record1("broadcast", tensor, async_op)
        src = self._ranks[root]
        return self._run(rec, lambda: dist.broadcast(tensor, src=src, group=self._pg, async_op=True))

    def reduce(
        self, tensor: torch.Tensor, root: int, op: Any = ReduceOp.SUM, async_op: bool = False
    ) -> CommWork | None:
        rec = self._record1("reduce", tensor, async_op)
        dst = self._ranks[root]
        return self._run(rec, lambda: dist.reduce(tensor, dst=dst, op=op, group=self._pg, async_op=True))

    def all_gather(
        self, tensor_list: list[torch.Tensor], tensor: torch.Tensor, async_op: bool = False
    ) -> CommWork | None:
        # Sizes as c10d's recorder writes them: the outputs as one flattened tensor, so analyzers
        # apply the same numel rule (output = input x group size) to both APIs.
        out = (torch.Size([sum(t.shape[0] if t.dim() else 1 for t in tensor_list), *tensor.shape[1:]]),)
        rec = self._record("all_gather", (tensor,), tensor_list[:1], async_op, output_shapes=out)
        return self._run(
            rec, lambda: dist.all_gather(tensor_list, tensor, group=self._pg, async_op=True)
        )

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False
    ) -> CommWork | None:
        rec = self._record("all_gather_single", (input,), (output,), async_op)
        return self._run(
            rec, lambda: dist.all_gather_into_tensor(output, input, group=self._pg, async_op=True)
        )

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input_list: list[torch.Tensor],
        op: Any = ReduceOp.SUM,
        async_op: bool = False,
    ) -> CommWork | None:
        inp = (torch.Size([sum(t.shape[0] if t.dim() else 1 for t in input_list), *output.shape[1:]]),)
        rec = self._record("reduce_scatter", input_list[:1], (output,), async_op, input_shapes=inp)
        return self._run(
            rec, lambda: dist.reduce_scatter(output, input_list, op=op, group=self._pg, async_op=True)
        )

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
        async_op: bool = False,
    ) -> CommWork | None:
        rec = self._record("all_to_all_single", (input,), (output,), async_op)
        return self._run(
            rec,
            lambda: dist.all_to_all_single(
                output, input, output_split_sizes, input_split_sizes, group=self._pg, async_op=True
            ),
        )

    def send(self, tensor: torch.Tensor, dst: int, async_op: bool = False) -> CommWork | None:
        rec = self._record1("send", tensor, async_op, peer=f"{self._rank}->{dst}")
        gdst = self._ranks[dst]
        return self._run(rec, lambda: dist.isend(tensor, dst=gdst, group=self._pg))

    def recv(self, tensor: torch.Tensor, src: int, async_op: bool = False) -> CommWork | None:
        rec = self._record1("recv", tensor, async_op, peer=f"{self._rank}<-{src}")
        gsrc = self._ranks[src]
        return self._run(rec, lambda: dist.irecv(tensor, src=gsrc, group=self._pg))

    def barrier(self, async_op: bool = False) -> CommWork | None:
        rec = self._record("barrier", (), (), async_op)
        return self._run(rec, lambda: dist.barrier(group=self._pg, async_op=True))

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
        pg = _new_group(global_ranks, self._backend, self._timeout, name, local_sync=True)
        child = Comm(pg, name, self._backend, self._device, global_ranks, self._timeout, self._abort_process)
        self._children.append(child)
        for fn in list(self._split_listeners):
            fn(child)
        return child

    def finalize(self) -> None:
        """Release the process group; further ops raise. Idempotent."""
        if self._finalized:
            return
        self._finalized = True
        try:
            dist.destroy_process_group(self._pg)
        except Exception:  # already torn down with the default group
            logger.debug("destroy_process_group(%s) failed", self._name, exc_info=True)


# Why the margin: c10d's NCCL watchdog tears the process down when a group's timeout expires. The
# communicator's own timeout (the host-side wait) must fire first, so the abort hooks can dump
# and the error can reach the caller.
_WATCHDOG_MARGIN = datetime.timedelta(seconds=60)


def _new_group(
    global_ranks: list[int], backend: str, timeout: datetime.timedelta, name: str, local_sync: bool
) -> Any:
    pg_timeout = timeout + _WATCHDOG_MARGIN if backend == "nccl" else timeout
    kwargs: dict[str, Any] = {"ranks": global_ranks, "backend": backend, "timeout": pg_timeout}
    if local_sync:
        kwargs["use_local_synchronization"] = True
    try:
        return dist.new_group(group_desc=name, **kwargs)
    except TypeError:  # torch without group_desc
        return dist.new_group(**kwargs)


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
    pg = _new_group(ranks, backend, td, name, local_sync=False)
    return Comm(pg, name, backend, dev, ranks, td, bool(abort_process_on_timeout_or_error))
