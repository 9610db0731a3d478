"""The Flight Recorder hook: a cheap ring buffer of every op a communicator issues.

``FlightRecorderHook(max_entries=2000).register_with_comm(comm)`` keeps the newest
``max_entries`` ops of ``comm`` and of every communicator later split from it, each with the
Python stack at the user's call site. Recording stores a reference to the communicator's
``OpRecord`` and a raw captured traceback (symbolised only at dump time), so the hot path costs a
few microseconds. ``dump_json()`` gives the torch FR schema (version "2.10") that PyTorch's own
``fr_trace`` and our analyzer read; ``dump_file(rank)`` writes it as a pickle, atomically.
``dump_json(cut=...)`` builds only the entries a cut keeps (``lazy``: the worker's live window).

The module also keeps the list of live hooks of this process, which the per-rank worker serves
(``snapshot()``, ``dump_file()``, ``health()``) with no wiring by the user.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import weakref
from typing import Any

import torch

from debug_server.dumpio import FR_VERSION, write_dump_atomic
from debug_server.recording import c10d_fr, stall
from debug_server.recording.comms import Comm
from debug_server.recording.entries import records_source
from debug_server.recording.frames import capture, release_idle
from debug_server.recording.lazy import Cut, LazyDump
from debug_server.recording.records import HookHandle, InFlight, OpRecord
from debug_server.recording.watchdog import add_watchdog_check
from debug_server.stacks import capture_stacks

__all__ = [
    "FlightRecorderHook",
    "default_stall_timeout",
    "dump_file",
    "dump_path",
    "health",
    "lazy_snapshot",
    "owned_groups",
    "recorded_comms",
    "registered_hooks",
    "set_default_stall_timeout",
    "set_dump_prefix",
    "snapshot",
]

logger = logging.getLogger(__name__)

DEFAULT_DUMP_PREFIX = os.path.join("~", ".cache", "torch", "comm_lib_trace_rank_")

class FlightRecorderHook:
    """Records the newest ``max_entries`` ops of the communicators it is registered with.

    Args:
        max_entries: ring size; older ops are overwritten.
        dump_on_abort: write this rank's pickle (``dump_file``) when a communicator times out
            or fails, before the error propagates or the process aborts.
        stall_timeout: seconds an op may stay in flight before ``health()`` reports the rank
            unhealthy and the stall watchdog writes this rank's pickle and stacks at once. None
            (default): the process default, which ``start_debug_server(stall_timeout=...)`` sets
            (60 s unless told otherwise); with no debug server and no default, never.
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
        # next() on a C counter is atomic under the GIL: ops issued from several threads each
        # get their own slot (a read-then-store of an int would hand two of them the same one).
        self._counter = itertools.count()
        self._comms: dict[str, Comm] = {}
        self._handles: list[HookHandle] = []
        self._lock = threading.Lock()
        self._registered = False
        # The user's ``$TORCHCOMM_FR_DUMP_TEMP_FILE`` as ``new_comm`` read it (its communicator's
        # settings): where pickles go without a server's ``set_dump_prefix``.
        self._user_prefix: str | None = None

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
            self._user_prefix = self._user_prefix or comm.settings.dump_prefix
            if not comm.c10d_backed:
                # A c10d-backed communicator's ops are in c10d's own recorder (read at dump
                # time): no pre-hook, so its op path stays free of records and stacks.
                self._handles.append(comm.register_pre_hook(self._on_pre))
                add_watchdog_check(release_idle)  # see frames: a returned frame is let go
            self._handles.append(comm.register_abort_hook(self._on_abort))
            self._handles.append(comm.register_split_listener(self.register_with_comm))
        for child in comm.children:
            if child.get_name() not in self._comms:
                self.register_with_comm(child)
        _register(self)
        if self.effective_stall_timeout is not None:
            _ensure_watchdog()
        return self

    @property
    def effective_stall_timeout(self) -> float | None:
        """This hook's ``stall_timeout``, or the process default when it has none."""
        return self.stall_timeout if self.stall_timeout is not None else _default_stall_timeout

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
            # From the user's call site up: this function, Comm._run and the op method (ops)
            # are left out (a stack is symbolised from its first frame outside the op path,
            # frames.OP_PATH_FILES, so a deeper op path would only be dropped there).
            rec.traceback = capture(4)
        self._ring[next(self._counter) % self.max_entries] = rec

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
        recs = [r for r in self._ring if r is not None]
        recs.sort(key=lambda r: r.record_id)
        for r in recs:
            r.refresh()
        return recs

    def dump_json(
        self,
        include_completed: bool = True,
        only_active: bool = False,
        include_collectives: bool = True,
        c10d: bool = True,
        cut: Cut | None = None,
    ) -> dict[str, Any]:
        """This hook's FR dump as a dict in the torch FR schema (version "2.10").

        ``only_active`` or ``include_completed=False`` keep only ops not yet completed;
        ``include_collectives=False`` leaves ``entries`` empty (config and status only).
        The entries of c10d-backed communicators are read from c10d's recorder now, unless
        ``c10d`` is False (``snapshot`` maps them from its own read). ``cut`` (see
        ``lazy.Cut``, e.g. the worker's live window) picks the entries kept; only those are built.
        """
        out = self.lazy_dump(include_completed, only_active, include_collectives)
        comms = list(self._comms.values())
        if c10d and any(c.c10d_backed for c in comms):
            # Read only when a backed communicator is recorded.
            return c10d_fr.merge_backed(out, comms, only_active=only_active or not include_completed,
                                        include_collectives=include_collectives, cut=cut)
        return out.finish(cut)

    def lazy_dump(self, include_completed: bool = True, only_active: bool = False,
                  include_collectives: bool = True) -> LazyDump:
        """``dump_json(..., c10d=False)`` with its entries not built yet (``lazy``)."""
        # Read before the ring: every op issued before this instant is in the dump, which is
        # what lets the analyzer tell a rank read a moment early from one that never issued an op.
        taken_ns = time.time_ns()
        everything = self.records()  # one pass: refreshed states feed both status and entries
        recs = everything if include_collectives else []
        if only_active or not include_completed:
            recs = [r for r in recs if r.state != "completed"]
        out = LazyDump({
            "version": FR_VERSION,
            "comm_lib_version": f"debug_server/torch-{torch.__version__}",
            "dump_time_ns": taken_ns,
            "pg_config": self._pg_config(),
            "pg_status": self._pg_status(everything),
        })
        # One per dump: equal sizes/dtypes/groups are pickled once.
        out.extend(recs, records_source({}))
        return out

    def _pg_config(self) -> dict[str, dict[str, str]]:
        return {
            name: {"name": name, "desc": c.get_backend(), "ranks": str(c.global_ranks)}
            for name, c in self._comms.items()
        }

    def _pg_status(self, records: list[OpRecord]) -> dict[str, dict[str, int]]:
        status = {
            name: {
                "last_enqueued_collective": c.next_seq - 1,
                "last_started_collective": -1,
                "last_completed_collective": -1,
            }
            for name, c in self._comms.items()
        }
        for r in records:
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
        return write_dump_atomic(dump_path(rank, self._user_prefix), self.dump_json())

    def stall_dump(self, rec: OpRecord | InFlight, age_s: float) -> list[str]:
        """Evidence for a stalled op, written at once so it survives a later kill.

        Writes this rank's pickle and the Python stacks of all threads next to it
        (``stalled_stacks_r<rank>.txt``, a name PyTorch's fr_trace skips). Returns the paths.
        """
        comm = rec.comm
        rank = comm.global_ranks[comm.get_rank()]
        logger.error(
            "%s #%s on %r in flight for %.1f s (stall_timeout %s s): dumping flight recorder and stacks",
            rec.op, rec.p2p_seq if rec.is_p2p else rec.seq, comm.get_name(), age_s,
            self.effective_stall_timeout,
        )
        paths = [self.dump_file(rank)]
        stacks_path = os.path.join(os.path.dirname(paths[0]), f"stalled_stacks_r{rank}.txt")
        tmp = stacks_path + ".part"
        with open(tmp, "w") as f:
            # Each frame with its source line, as the worker's /stacks shows it.
            f.write(capture_stacks())
        os.replace(tmp, stacks_path)
        paths.append(stacks_path)
        return paths

    def in_flight(self) -> list[OpRecord | InFlight]:
        """Ops not completed: our records, and the c10d-backed communicators' in-flight ops."""
        out: list[OpRecord | InFlight] = [r for r in self.records() if r.state != "completed"]
        for c in list(self._comms.values()):
            out.extend(c.in_flight())
        return out

    def health(self) -> dict[str, Any]:
        """``{"healthy", "stalled_op", "in_flight", "oldest_in_flight_s"}``.

        Stalled (``stall``): in flight longer than ``effective_stall_timeout``; the oldest
        stalled op is reported.
        """
        return _health([self])


# Where pickles go: ``start_debug_server`` hands its choice over as a value (``set_dump_prefix``);
# without a server, the user's ``$TORCHCOMM_FR_DUMP_TEMP_FILE`` as ``new_comm`` read it (handed
# to the hooks with the communicator), else torch's default. Nothing here reads the environment.
_dump_prefix: str | None = None


def set_dump_prefix(prefix: str | None) -> None:
    """Set where this process's pickles go (``<prefix><rank>``); None: the user's (as
    ``new_comm`` read it) or torch's default (see ``config.Settings.dump_prefix``)."""
    global _dump_prefix
    _dump_prefix = prefix


def dump_path(rank: int | None, user_prefix: str | None = None) -> str:
    """Where this process's pickle for ``rank`` goes (``set_dump_prefix``, else ``user_prefix``,
    the user's ``$TORCHCOMM_FR_DUMP_TEMP_FILE``, else torch's default); ``rank`` None: this
    process's."""
    if rank is None:
        dist = torch.distributed
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    prefix = _dump_prefix or user_prefix or DEFAULT_DUMP_PREFIX
    return os.path.expanduser(prefix) + str(rank)


def _health(hooks: list[FlightRecorderHook], stall_timeout: float | None = None) -> dict[str, Any]:
    now = time.time_ns()
    ops = [(r, _limit(h.effective_stall_timeout, stall_timeout)) for h in hooks for r in h.in_flight()]
    stalled = stall.oldest_stalled(ops, now)
    oldest = min((r.time_created_ns for r, _ in ops), default=None)
    return {
        "healthy": stalled is None,
        "stalled_op": stall.report_op(*stalled) if stalled is not None else None,
        "in_flight": len(ops),
        "oldest_in_flight_s": round(stall.age_s(oldest, now), 3) if oldest is not None else None,
    }


def _limit(own: float | None, other: float | None) -> float | None:
    # Two limits on one op: whichever fires first.
    return own if other is None else other if own is None else min(own, other)


# -- stall check --------------------------------------------------------------------------------
# A check run by the communicators' per-process watchdog thread (debug_server.recording.comms), registered
# by the first hook with a stall_timeout. It only reads the rings (non-blocking state queries) and
# writes evidence once per stalled op, so it costs the training loop nothing; it needs the GIL, so
# a rank wedged in C code holding the GIL is caught from outside instead (the frontend's health
# polling).
# The stall timeout of hooks created with stall_timeout=None. start_debug_server sets it (60 s
# by default) so the watchdog works with no extra wiring, and resets it to None on stop.
_default_stall_timeout: float | None = None
_stall_reported: set[Any] = set()  # record ids already dumped (only stalled ops land here)
_stall_next = 0.0  # time.monotonic() of the next stall pass


def default_stall_timeout() -> float | None:
    """The process default used by hooks whose own ``stall_timeout`` is None."""
    return _default_stall_timeout


def set_default_stall_timeout(seconds: float | None) -> None:
    """Set the stall timeout of hooks without their own (None: such hooks never stall).

    Starts the watchdog when registered hooks now have a timeout.
    """
    global _default_stall_timeout
    if seconds is not None and not seconds > 0:
        raise ValueError(f"stall timeout must be > 0 seconds or None, got {seconds}")
    _default_stall_timeout = seconds
    if seconds is not None and registered_hooks():
        _ensure_watchdog()


def _ensure_watchdog() -> None:
    add_watchdog_check(_stall_check)


def _stall_check() -> float | None:
    """One stall pass when due; returns the period it needs (None: no hook has a timeout)."""
    global _stall_next
    hooks = [h for h in registered_hooks() if h.effective_stall_timeout is not None]
    if not hooks:
        return None
    period = max(0.05, min(1.0, min(h.effective_stall_timeout or 1.0 for h in hooks) / 4))
    if time.monotonic() < _stall_next:
        return period
    _stall_next = time.monotonic() + period
    now = time.time_ns()
    for h in hooks:
        limit = h.effective_stall_timeout
        # One bad pass (a dump that cannot be written, a record read while the training
        # thread mutates it) must not end the checks for the rest of the run.
        try:
            for rec in h.in_flight():
                age = stall.age_s(rec.time_created_ns, now)
                if stall.is_stalled(age, limit) and rec.record_id not in _stall_reported:
                    _stall_reported.add(rec.record_id)
                    h.stall_dump(rec, age)
        except OSError as exc:
            logger.error("stall dump failed: %s", exc)
        except Exception:
            logger.exception("stall check failed; continuing")
    return period


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


def recorded_comms() -> list[Comm]:
    """Every communicator a live hook of this process records (the worker uses their c10d
    groups to drop c10d's own Flight Recorder entries of the same ops)."""
    return [c for h in registered_hooks() for c in list(h._comms.values())]


def owned_groups() -> set[str]:
    """The c10d groups of the communicators our hooks record (c10d's entries on them are ours)."""
    return {n for c in recorded_comms() if (n := c.c10d_group_name)}


def snapshot(*, only_active: bool = False, include_collectives: bool = True,
             stacks: bool = False, cut: Cut | None = None) -> dict[str, Any]:
    """This process's FR dump: every live hook's entries with c10d's own merged in (the groups
    of DDP, FSDP, plain ``torch.distributed``); an empty valid dump when there is nothing.

    ``cut`` (``lazy.Cut``; the worker passes its live window, ``frwindow``) picks the entries
    kept from the merged timeline, and only those are built; c10d's rings are still read whole
    (c10d has no partial dump). ``stacks``: c10d's entries with their stacks.
    """
    # The hooks' own entries only: their c10d-backed communicators' entries are mapped here,
    # from the same read of c10d's recorders as everything else.
    ours = lazy_snapshot(only_active=only_active, include_collectives=include_collectives)
    owned, backed = owned_groups(), c10d_fr.backed_of(recorded_comms())
    recorders = c10d_fr.read_recorders(stacks=stacks, include_collectives=include_collectives,
                                       unread=owned - set(backed))
    if not recorders:
        return ours.finish(cut)
    try:
        return c10d_fr.merge_lazy(ours, recorders, owned=owned, groups=c10d_fr.process_groups(),
                                  only_active=only_active, include_collectives=include_collectives,
                                  backed=backed).finish(cut)
    except Exception:  # c10d's record must never cost us our own
        c10d_fr.warn_once("merge", "merging c10d's flight recorder failed", exc_info=True)
        return ours.finish(cut)


def lazy_snapshot(include_completed: bool = True, only_active: bool = False,
                  include_collectives: bool = True) -> LazyDump:
    """The live hooks' own entries (none of c10d's), not built yet (``lazy``)."""
    hooks = registered_hooks()
    merged = LazyDump({
        "version": FR_VERSION,
        "comm_lib_version": f"debug_server/torch-{torch.__version__}",
        "dump_time_ns": time.time_ns(),  # before any ring is read (see lazy_dump)
        "pg_config": {},
        "pg_status": {},
    })
    seen: set[int] = set()
    for h in hooks:
        d = h.lazy_dump(include_completed, only_active, include_collectives)
        merged.head["pg_config"].update(d.head["pg_config"])
        merged.head["pg_status"].update(d.head["pg_status"])
        for rec, source in zip(d.items, d.sources, strict=True):
            if rec.record_id not in seen:
                seen.add(rec.record_id)
                merged.items.append(rec)
                merged.sources.append(source)
    if len(hooks) > 1:
        order = sorted(range(len(merged.items)), key=lambda i: merged.items[i].record_id)
        merged.items = [merged.items[i] for i in order]
        merged.sources = [merged.sources[i] for i in order]
    return merged


def dump_file(rank: int | None = None) -> str:
    """Write this process's dump (``snapshot``, c10d's entries with their stacks) to
    ``<prefix><rank>`` (``set_dump_prefix``) atomically; returns the path."""
    user = next((h._user_prefix for h in registered_hooks() if h._user_prefix), None)
    return write_dump_atomic(dump_path(rank, user), snapshot(stacks=True))


def health(stall_timeout: float | None = None) -> dict[str, Any]:
    """Health over every live hook of this process (see ``FlightRecorderHook.health``).

    ``stall_timeout``: a limit on every op on top of each hook's own (whichever fires first).
    """
    return _health(registered_hooks(), stall_timeout)
