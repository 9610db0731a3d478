"""The Flight Recorder hook: a cheap ring buffer of every op a communicator issues.

``FlightRecorderHook(max_entries=2000).register_with_comm(comm)`` keeps the newest
``max_entries`` ops of ``comm`` and of every communicator later split from it, each with the
Python stack at the user's call site. Recording stores a reference to the communicator's
``OpRecord`` and a raw captured traceback (symbolised only at dump time), so the hot path costs a
few microseconds. ``dump_json()`` gives the torch FR schema (version "2.10") that PyTorch's own
``fr_trace`` and our analyzer read; ``dump_file(rank)`` writes it as a pickle, atomically.

The module also keeps the list of live hooks of this process, which the per-rank worker serves
(``snapshot()``, ``dump_file()``, ``health()``) with no wiring by the user.
"""

from __future__ import annotations

import atexit
import faulthandler
import logging
import os
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

import torch

from debug_server.dumpio import FR_VERSION, write_dump_atomic

if TYPE_CHECKING:
    from debug_server.comms import Comm, HookHandle, OpRecord

__all__ = ["FlightRecorderHook", "dump_file", "health", "registered_hooks", "snapshot"]

logger = logging.getLogger(__name__)

DEFAULT_DUMP_PREFIX = os.path.join("~", ".cache", "torch", "comm_lib_trace_rank_")

try:  # ~0.7 us per capture; symbolised in one batch at dump time
    from torch._C._profiler import gather_traceback as _gather
    from torch._C._profiler import symbolize_tracebacks as _symbolize

    def _capture() -> Any:
        return _gather(python=True, script=False, cpp=False)

except ImportError:  # pragma: no cover - torch builds without the profiler bindings

    _symbolize = None

    def _capture() -> Any:
        frames = []
        f: Any = sys._getframe(1)
        while f is not None:
            frames.append((f.f_code.co_name, f.f_code.co_filename, f.f_lineno))
            f = f.f_back
        return tuple(frames)


_OWN_FILES = tuple(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), name) for name in ("comms.py", "hooks.py")
)

# c10d's names for dtypes ("Float", not "torch.float32"), which PyTorch's analyzer compares.
_DTYPE_NAMES: dict[Any, str] = {
    torch.float32: "Float",
    torch.float64: "Double",
    torch.float16: "Half",
    torch.bfloat16: "BFloat16",
    torch.int64: "Long",
    torch.int32: "Int",
    torch.int16: "Short",
    torch.int8: "Char",
    torch.uint8: "Byte",
    torch.bool: "Bool",
    torch.complex64: "ComplexFloat",
    torch.complex128: "ComplexDouble",
}


def _dtype_name(dtype: Any) -> str:
    return _DTYPE_NAMES.get(dtype) or str(dtype).replace("torch.", "")


# Symbolised stacks are interned: a training loop issues the same few call sites again and
# again, so records share one frame list (and frames share one dict) instead of each holding
# ~20 fresh dicts. This keeps a full ring with stacks at well under a megabyte.
_INTERN_LIMIT = 50_000
_frame_cache: dict[tuple[Any, ...], dict[str, Any]] = {}
_stack_cache: dict[tuple[Any, ...], list[dict[str, Any]]] = {}


def _frames_of(raw: Any) -> list[dict[str, Any]]:
    """Drop the recorder's own frames so frames[0] is the user's call site (innermost first)."""
    keys = []
    for fr in raw:
        if not keys and fr["filename"] in _OWN_FILES:
            continue
        keys.append((fr["name"], fr["filename"], fr["line"]))
    stack_key = tuple(keys)
    cached = _stack_cache.get(stack_key)
    if cached is not None:
        return cached
    if len(_stack_cache) > _INTERN_LIMIT or len(_frame_cache) > _INTERN_LIMIT:
        _stack_cache.clear()
        _frame_cache.clear()
    frames = []
    for k in keys:
        d = _frame_cache.get(k)
        if d is None:
            d = _frame_cache[k] = {"name": k[0], "filename": k[1], "line": k[2]}
        frames.append(d)
    _stack_cache[stack_key] = frames
    return frames


def _symbolize_records(records: list[OpRecord]) -> None:
    """Replace raw tracebacks by frame lists in place (once per record, in one batch)."""
    pending = [r for r in records if r.traceback is not None and not isinstance(r.traceback, list)]
    if not pending:
        return
    if _symbolize is not None:
        symbolized = _symbolize([r.traceback for r in pending])
    else:
        symbolized = [
            [{"name": n, "filename": f, "line": ln} for (n, f, ln) in r.traceback] for r in pending
        ]
    for rec, frames in zip(pending, symbolized, strict=True):
        rec.traceback = _frames_of(frames)


def _thread_name(ident: int | None) -> str:
    for t in threading.enumerate():
        if t.ident == ident:
            return t.name
    return f"thread-{ident}"


def _entry(rec: OpRecord) -> dict[str, Any]:
    comm = rec.comm
    started = rec.time_started_ns
    completed = rec.time_completed_ns
    duration = (completed - started) / 1e6 if completed is not None and started is not None else None
    return {
        "record_id": rec.record_id,
        "pg_id": comm.pg_id,
        "process_group": (comm.get_name(), comm.get_backend()),
        "thread_name": rec.thread_name or _thread_name(rec.thread_id),
        "thread_id": rec.thread_id,
        "collective_seq_id": rec.seq,
        "p2p_seq_id": rec.p2p_seq,
        "op_id": rec.op_id,
        "profiling_name": rec.profiling_name,
        "time_created_ns": rec.time_created_ns,
        "duration_ms": duration,
        "input_sizes": [list(s) for s in rec.input_shapes],
        "input_dtypes": [_dtype_name(d) for d in rec.input_dtypes],
        "output_sizes": [list(s) for s in rec.output_shapes],
        "output_dtypes": [_dtype_name(d) for d in rec.output_dtypes],
        "state": rec.state,
        "time_discovered_started_ns": started,
        "time_discovered_completed_ns": completed,
        "retired": rec.state == "completed",
        "timeout_ms": int(comm.timeout.total_seconds() * 1000),
        "is_p2p": rec.is_p2p,
        "frames": rec.traceback if isinstance(rec.traceback, list) else [],
    }


class FlightRecorderHook:
    """Records the newest ``max_entries`` ops of the communicators it is registered with.

    Args:
        max_entries: ring size; older ops are overwritten.
        dump_on_abort: write this rank's pickle (``dump_file``) when a communicator times out
            or fails, before the error propagates or the process aborts.
        stall_timeout: seconds an op may stay in flight before ``health()`` reports the rank
            unhealthy (None: never).
    """

    def __init__(
        self,
        max_entries: int = 2000,
        *,
        dump_on_abort: bool = True,
        stall_timeout: float | None = None,
    ) -> None:
        if max_entries <= 0:
            raise ValueError(f"max_entries must be positive, got {max_entries}")
        self.max_entries = max_entries
        self.dump_on_abort = dump_on_abort
        self.stall_timeout = stall_timeout
        self._ring: list[OpRecord | None] = [None] * max_entries
        self._count = 0
        self._comms: dict[str, Comm] = {}
        self._handles: list[HookHandle] = []
        self._lock = threading.Lock()
        self._registered = False

    # -- registration -------------------------------------------------------------------------
    def register_with_comm(self, comm: Comm) -> FlightRecorderHook:
        """Record ``comm``'s ops, and those of communicators split from it later."""
        with self._lock:
            if comm.get_name() in self._comms and self._comms[comm.get_name()] is not comm:
                logger.warning(
                    "two communicators named %r registered with one FlightRecorderHook; their "
                    "entries share a group name",
                    comm.get_name(),
                )
            self._comms[comm.get_name()] = comm
            self._handles.append(comm.register_pre_hook(self._on_pre))
            self._handles.append(comm.register_abort_hook(self._on_abort))
            self._handles.append(comm.register_split_listener(self.register_with_comm))
        for child in comm.children:
            if child.get_name() not in self._comms:
                self.register_with_comm(child)
        _register(self)
        if self.stall_timeout is not None:
            _ensure_watchdog()
        return self

    def unregister(self) -> None:
        """Stop recording and leave this process's list of live hooks. Idempotent."""
        with self._lock:
            handles, self._handles = self._handles, []
        for h in handles:
            h.remove()
        _unregister(self)

    # -- hot path -----------------------------------------------------------------------------
    def _on_pre(self, rec: OpRecord) -> None:
        if rec.traceback is None:
            rec.traceback = _capture()
        # A single slot store: safe without the lock under the GIL, and cheap.
        n = self._count
        self._count = n + 1
        self._ring[n % self.max_entries] = rec

    def _on_abort(self, rec: OpRecord, err: BaseException) -> None:
        if not self.dump_on_abort:
            return
        comm = rec.comm
        rank = comm.global_ranks[comm.get_rank()]
        try:
            path = self.dump_file(rank)
            logger.error("%s; flight recorder dump written to %s", err, path)
        except OSError as exc:
            logger.error("%s; flight recorder dump failed: %s", err, exc)

    # -- reading ------------------------------------------------------------------------------
    def records(self) -> list[OpRecord]:
        """The retained records, oldest first, states refreshed (non-blocking)."""
        n = self._count
        size = self.max_entries
        if n <= size:
            recs = [r for r in self._ring[:n] if r is not None]
        else:
            start = n % size
            recs = [r for r in self._ring[start:] + self._ring[:start] if r is not None]
        recs.sort(key=lambda r: r.record_id)
        for r in recs:
            r.refresh()
        return recs

    def dump_json(
        self,
        include_completed: bool = True,
        only_active: bool = False,
        include_collectives: bool = True,
    ) -> dict[str, Any]:
        """This hook's FR dump as a dict in the torch FR schema (version "2.10").

        ``only_active`` or ``include_completed=False`` keep only ops not yet completed;
        ``include_collectives=False`` leaves ``entries`` empty (config and status only).
        """
        recs = self.records() if include_collectives else []
        if only_active or not include_completed:
            recs = [r for r in recs if r.state != "completed"]
        _symbolize_records(recs)
        return {
            "version": FR_VERSION,
            "comm_lib_version": f"debug_server/torch-{torch.__version__}",
            "pg_config": self._pg_config(),
            "pg_status": self._pg_status(),
            "entries": [_entry(r) for r in recs],
        }

    def _pg_config(self) -> dict[str, dict[str, str]]:
        return {
            name: {"name": name, "desc": c.get_backend(), "ranks": str(c.global_ranks)}
            for name, c in self._comms.items()
        }

    def _pg_status(self) -> dict[str, dict[str, int]]:
        status = {
            name: {
                "last_enqueued_collective": c.next_seq - 1,
                "last_started_collective": -1,
                "last_completed_collective": -1,
            }
            for name, c in self._comms.items()
        }
        for r in self.records():
            if r.is_p2p:
                continue
            s = status.get(r.comm.get_name())
            if s is None:
                continue
            if r.state in ("started", "completed"):
                s["last_started_collective"] = max(s["last_started_collective"], r.seq)
            if r.state == "completed":
                s["last_completed_collective"] = max(s["last_completed_collective"], r.seq)
        return status

    def dump_file(self, rank: int | None = None) -> str:
        """Write the dump as a pickle to ``$TORCHCOMM_FR_DUMP_TEMP_FILE<rank>`` atomically.

        The default prefix is ``~/.cache/torch/comm_lib_trace_rank_``. Returns the path.
        """
        return write_dump_atomic(_dump_path(rank), self.dump_json())

    def stall_dump(self, rec: OpRecord, age_s: float) -> list[str]:
        """Evidence for a stalled op, written at once so it survives a later kill.

        Writes this rank's pickle and the Python stacks of all threads next to it
        (``stalled_stacks_r<rank>.txt``, a name PyTorch's fr_trace skips). Returns the paths.
        """
        comm = rec.comm
        rank = comm.global_ranks[comm.get_rank()]
        logger.error(
            "%s #%s on %r in flight for %.1f s (stall_timeout %s s): dumping flight recorder and stacks",
            rec.op, rec.p2p_seq if rec.is_p2p else rec.seq, comm.get_name(), age_s, self.stall_timeout,
        )
        paths = [self.dump_file(rank)]
        stacks_path = os.path.join(os.path.dirname(paths[0]), f"stalled_stacks_r{rank}.txt")
        tmp = stacks_path + ".part"
        with open(tmp, "w") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
        os.replace(tmp, stacks_path)
        paths.append(stacks_path)
        return paths

    def in_flight(self) -> list[OpRecord]:
        return [r for r in self.records() if r.state != "completed"]

    def health(self) -> dict[str, Any]:
        """``{"healthy", "stalled_op", "in_flight"}``; stalled = in flight > ``stall_timeout``."""
        return _health([self])


def _dump_path(rank: int | None) -> str:
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    prefix = os.environ.get("TORCHCOMM_FR_DUMP_TEMP_FILE") or DEFAULT_DUMP_PREFIX
    return os.path.expanduser(prefix) + str(rank)


def _health(hooks: list[FlightRecorderHook]) -> dict[str, Any]:
    now = time.time_ns()
    oldest: OpRecord | None = None
    n = 0
    stalled: dict[str, Any] | None = None
    for h in hooks:
        for r in h.in_flight():
            n += 1
            if oldest is None or r.time_created_ns < oldest.time_created_ns:
                oldest = r
            age = (now - r.time_created_ns) / 1e9
            if h.stall_timeout is not None and age > h.stall_timeout and stalled is None:
                stalled = {
                    "group": r.comm.get_name(),
                    "seq": r.p2p_seq if r.is_p2p else r.seq,
                    "op": r.op,
                    "age_s": round(age, 3),
                }
    return {
        "healthy": stalled is None,
        "stalled_op": stalled,
        "in_flight": n,
        "oldest_in_flight_s": round((now - oldest.time_created_ns) / 1e9, 3) if oldest else None,
    }


# -- stall watchdog ------------------------------------------------------------------------------
# One daemon thread per process, started by the first hook with a stall_timeout. It only reads
# the rings (non-blocking state queries) and writes evidence once per stalled op, so it costs the
# training loop nothing; it needs the GIL, so a rank wedged in C code holding the GIL is caught
# from outside instead (the frontend's health polling).
_watchdog_lock = threading.Lock()
_watchdog: threading.Thread | None = None
_watchdog_stop = threading.Event()


def _ensure_watchdog() -> None:
    global _watchdog
    with _watchdog_lock:
        if _watchdog is None or not _watchdog.is_alive():
            _watchdog_stop.clear()
            _watchdog = threading.Thread(target=_watch, name="fr-stall-watchdog", daemon=True)
            _watchdog.start()


@atexit.register
def _stop_watchdog() -> None:
    # Stop before interpreter teardown: querying a c10d work object while the process group's
    # C++ threads are being destroyed aborts the process ("terminate called...").
    _watchdog_stop.set()
    t = _watchdog
    if t is not None and t.is_alive():
        t.join(timeout=2.0)


def _watch() -> None:
    reported: set[int] = set()  # record ids already dumped (only stalled ops land here)
    while not _watchdog_stop.is_set():
        hooks = [h for h in registered_hooks() if h.stall_timeout is not None]
        if not hooks:
            return
        period = max(0.05, min(1.0, min(h.stall_timeout or 1.0 for h in hooks) / 4))
        if _watchdog_stop.wait(period):
            return
        now = time.time_ns()
        for h in hooks:
            for rec in h.in_flight():
                age = (now - rec.time_created_ns) / 1e9
                if h.stall_timeout is not None and age > h.stall_timeout and rec.record_id not in reported:
                    reported.add(rec.record_id)
                    try:
                        h.stall_dump(rec, age)
                    except OSError as exc:
                        logger.error("stall dump failed: %s", exc)


# -- this process's live hooks (read by the per-rank worker) ------------------------------------
_live: list[weakref.ref[FlightRecorderHook]] = []
_live_lock = threading.Lock()


def _register(hook: FlightRecorderHook) -> None:
    with _live_lock:
        if not any(ref() is hook for ref in _live):
            _live.append(weakref.ref(hook))


def _unregister(hook: FlightRecorderHook) -> None:
    with _live_lock:
        _live[:] = [ref for ref in _live if ref() is not None and ref() is not hook]


def registered_hooks() -> list[FlightRecorderHook]:
    """The live, registered hooks of this process, oldest first."""
    with _live_lock:
        return [h for h in (ref() for ref in _live) if h is not None]


def snapshot(
    include_completed: bool = True, only_active: bool = False, include_collectives: bool = True
) -> dict[str, Any]:
    """One FR dump merging every live hook of this process (an empty valid dump when none)."""
    hooks = registered_hooks()
    merged: dict[str, Any] = {
        "version": FR_VERSION,
        "comm_lib_version": f"debug_server/torch-{torch.__version__}",
        "pg_config": {},
        "pg_status": {},
        "entries": [],
    }
    seen: set[int] = set()
    for h in hooks:
        d = h.dump_json(include_completed, only_active, include_collectives)
        merged["pg_config"].update(d["pg_config"])
        merged["pg_status"].update(d["pg_status"])
        for e in d["entries"]:
            if e["record_id"] not in seen:
                seen.add(e["record_id"])
                merged["entries"].append(e)
    if len(hooks) > 1:
        merged["entries"].sort(key=lambda e: e["record_id"])
    return merged


def dump_file(rank: int | None = None) -> str:
    """Write this process's merged dump (``snapshot()``) to ``$TORCHCOMM_FR_DUMP_TEMP_FILE<rank>``."""
    return write_dump_atomic(_dump_path(rank), snapshot())


def health() -> dict[str, Any]:
    """Health over every live hook of this process (see ``FlightRecorderHook.health``)."""
    return _health(registered_hooks())
