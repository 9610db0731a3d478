"""The one watchdog thread per process: timeouts and completion found off the hot path.

Every pass (every 0.1 s, or sooner when a check asks) it makes a few non-blocking queries per
communicator (``watch_pass``): it advances the completion watermark of collectives (they run in
issue order), lets go of c10d's works (and so the tensors) of completed ops, and runs the abort
path (``abort.fail``) for an op in flight longer than its communicator's timeout; the next op
or ``wait()`` then raises. Other modules' checks run on the same thread
(``add_watchdog_check``: the recorder's stall check). The training thread only appends to lists.

What a user sees of a timeout: the watchdog finds an op in flight longer than its
communicator's timeout, runs the abort hooks (the recorder writes this rank's pickle), aborts the NCCL
communicator, and the next op or ``wait()`` on that communicator raises a ``RuntimeError``
naming the op, the communicator and its sequence number; with
``abort_process_on_timeout_or_error=True`` the process aborts after the hooks ran instead. The
process group gets a longer timeout, so this happens before c10d's own watchdog acts. A gloo op
that times out on the host raises the same error at the call site. After a timeout (or any
failure on NCCL) the communicator is unusable.
"""

from __future__ import annotations

import atexit
import bisect
import logging
import operator
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from debug_server.recording import c10d_fr
from debug_server.recording.abort import fail, fail_op
from debug_server.recording.commstate import CommState
from debug_server.recording.groups import _c10d_dump_fn
from debug_server.recording.records import OpRecord

logger = logging.getLogger(__name__)

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


_first = operator.itemgetter(0)


def watch_pass(comm: CommState, now: int) -> None:
    """Advance the completion watermark, let go of c10d works of completed ops, and run the
    abort path for an op in flight longer than the timeout. Non-blocking queries only."""
    if comm._broken is not None or comm._finalized:
        return
    limit_ns = int(comm._timeout.total_seconds() * 1e9)
    if comm._backed and _watch_backed(comm, now, limit_ns):
        return
    lst = comm._inflight
    n = len(lst)
    if n:
        # Only the watchdog removes from the list (the op's thread appends at the end), so
        # indices below n stay valid.
        k = _first_not_done(lst, n)
        if k:
            comm._done_ns = now  # before the id: a reader seeing the new id sees this time
            comm._done_op_id = lst[k - 1].op_id
            del lst[:k]
        ar = comm._async_recs
        dropped = 0
        while ar and ar[0].op_id <= comm._done_op_id:
            ar.popleft()._mark_completed(now)  # lets go of c10d's work (and its tensors)
            dropped += 1
            if dropped % 64 == 0:
                time.sleep(0)  # hand the GIL back now and then: a long pass stalls training
        if lst and now - lst[0].time_created_ns > limit_ns:
            _fire(comm, lst[0], now)
            return
    loose = comm._loose
    n = len(loose)
    keep: list[OpRecord] = []
    for i in range(n):
        rec = loose[i]
        if i % 64 == 63:
            time.sleep(0)  # hand the GIL back now and then: a long pass stalls training
        try:
            if comm._is_cuda:
                done = rec._done_now()
            else:
                work = rec.work
                done = rec.state == "completed" or (work is not None and work.is_completed())
                if done and work is not None:
                    work.wait()  # returns at once when done; a failed gloo work raises here
        except Exception as exc:
            if not comm._is_cuda:
                _fire(comm, rec, now, exc)
                return
            done = False
        if done:
            rec._mark_completed(now)
        elif now - rec.time_created_ns > limit_ns:
            _fire(comm, rec, now)
            return
        else:
            keep.append(rec)
    # One slice assignment (the op's thread may have appended meanwhile, past index n).
    loose[:n] = keep


def _watch_backed(comm: CommState, now: int, limit_ns: int) -> bool:
    """The c10d-backed in-flight ops: drop the completed ones, fire on one older than the
    timeout. Returns True when it fired."""
    pend = comm._pend
    n = len(pend)
    if n:
        status = _c10d_nccl_status(now)
        # c10d keys its status by group id, not by the name our communicator knows.
        st = c10d_fr.status_row("nccl", status, comm._c10d_name) if isinstance(status, dict) else None
        if st is None:
            # c10d's status cannot be read (c10d notes a group's status when it records the
            # group's first op, before our append): nothing can be known complete, so no
            # timeout either (c10d's own watchdog stays the backstop), and nothing is kept.
            if not comm._status_warned:
                comm._status_warned = True
                logger.warning("communicator %r: c10d's pg_status is unreadable; the debug_server "
                               "watchdog cannot time its ops out", comm._name)
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
            _fire_op(comm, op, seq, False, t, now)
            return True
    pw = comm._pend_w
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
            if done and work is not None and not comm._is_cuda:
                work.wait()  # returns at once when done; a failed gloo work raises here
        except Exception as exc:
            _fire_op(comm, op, seq, p2p, t, now, exc)
            return True
        if done:
            continue
        if now - t > limit_ns:
            _fire_op(comm, op, seq, p2p, t, now)
            return True
        keep.append(item)
    # One slice assignment (the op's thread may have appended meanwhile, past index n).
    pw[:n] = keep
    return False


def _fire_op(comm: CommState, op: str, seq: int, is_p2p: bool, created_ns: int, now: int,
                   exc: BaseException | None = None) -> None:
    timed_out: bool | None = None
    if exc is None:
        exc = TimeoutError(f"in flight for {(now - created_ns) / 1e9:.1f} s without completing "
                           "(debug_server watchdog)")
        timed_out = True
    try:
        fail_op(comm, op, seq, is_p2p, exc, comm._timeout, timed_out=timed_out, created_ns=created_ns,
                      wait_for_other=False)
    except RuntimeError:
        pass  # raised to the op's thread by its next op or wait()


def _fire(comm: CommState, rec: OpRecord, now: int, exc: BaseException | None = None) -> None:
    if exc is None:
        age = (now - rec.time_created_ns) / 1e9
        exc = TimeoutError(f"in flight for {age:.1f} s without completing (debug_server watchdog)")
        timed_out: bool | None = True
    else:
        timed_out = None
    try:
        fail(comm, rec, exc, comm._timeout, timed_out=timed_out, wait_for_other=False)
    except RuntimeError:
        pass  # raised to the op's thread by its next op or wait()


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
# non-blocking queries (watch_pass) and other modules' checks run (the recorder's stall check,
# add_watchdog_check). The training thread only appends records to lists; timeouts, the
# watermark and letting go of completed works all happen here.
_WATCH_PERIOD = 0.1
_wd_lock = threading.Lock()
_wd_thread: threading.Thread | None = None
_wd_stop = threading.Event()
_wd_comms: weakref.WeakSet[CommState] = weakref.WeakSet()
_wd_checks: list[Callable[[], float | None]] = []


def add_watchdog_check(fn: Callable[[], float | None]) -> None:
    """Run ``fn()`` on every watchdog pass (once per ``fn``); it returns the period it needs in
    seconds (the pass runs at least that often), or None."""
    with _wd_lock:
        if fn not in _wd_checks:
            _wd_checks.append(fn)
    _ensure_watchdog()


def _watchdog_add(comm: CommState) -> None:
    with _wd_lock:
        _wd_comms.add(comm)
    _ensure_watchdog()


def _watchdog_discard(comm: CommState) -> None:
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
                watch_pass(comm, now)
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

