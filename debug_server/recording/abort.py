"""The abort path of a communicator: an op timed out or failed.

The abort hooks run first (the Flight Recorder hook writes this rank's pickle), then the
process aborts (``abort_process_on_timeout_or_error=True``) or, on NCCL, the communicator is
aborted so that a stuck kernel lets go; the error is raised to the caller. A timeout, and any
failure on NCCL, leave the communicator broken: every later op and ``wait()`` raises the same
``RuntimeError``, which names the op, the communicator and the sequence number. Runs in the
op's thread or in the watchdog's; only the first failure runs the hooks.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import time
from typing import NoReturn

import torch.distributed as dist

from debug_server.recording.commstate import CommState
from debug_server.recording.records import OpRecord

logger = logging.getLogger(__name__)


def fail_op(comm: CommState, op: str, seq: int, is_p2p: bool, exc: BaseException,
             td: datetime.timedelta | None = None, timed_out: bool | None = None,
             created_ns: int | None = None, wait_for_other: bool = True) -> NoReturn:
    """The abort path (``fail``) for an op of the c10d-backed path, which has no record:
    one is made now, for the abort hooks and the message."""
    rec = OpRecord(comm, op, seq if not is_p2p else comm._seq, seq if is_p2p else comm._p2p_seq,
                   -1, is_p2p, "?" if is_p2p else "", (), (), (), (), True)
    if created_ns is not None:
        rec.time_created_ns = created_ns
    fail(comm, rec, exc, td, timed_out=timed_out, wait_for_other=wait_for_other)


def raise_broken(comm: CommState, limit_s: float = 120.0, cause: BaseException | None = None) -> NoReturn:
    """Raise this communicator's failure, once its abort path (hooks, dump) has finished."""
    deadline = time.monotonic() + limit_s
    while not comm._broken and time.monotonic() < deadline:
        time.sleep(0.01)
    raise RuntimeError(comm._broken or f"communicator {comm._name!r} failed") from cause


def fail(
    comm: CommState,
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
    breaks = timed_out or comm._is_cuda
    with comm._lock:
        first = not (breaks and comm._broken is not None)
        if first and breaks:
            comm._broken = ""  # failing: ops and waits from now on wait for the message
    if not first:
        # Another thread (the watchdog, or a waiter) is running the abort path: wait for it,
        # so that this error, too, is raised only after the dump was written.
        raise_broken(comm, 120.0 if wait_for_other else 0.0, exc)
    what = "timed out" if timed_out else "failed"
    after = f" after {td.total_seconds():g} s" if td is not None and timed_out else ""
    seq = f"p2p #{rec.p2p_seq}" if rec.is_p2p else f"#{rec.seq}"
    msg = (
        f"{rec.op} {seq} on communicator {comm._name!r} ({comm._backend}, rank {comm._rank} of "
        f"{len(comm._ranks)}) {what}{after}: {text.splitlines()[0] if text else type(exc).__name__}"
    )
    rec.error = msg
    err = RuntimeError(msg)
    for fn in list(comm._abort_hooks):
        try:
            fn(rec, err)
        except Exception:
            logger.exception("abort hook %r failed", fn)
    if comm._abort_process:
        logger.critical("%s; aborting the process (abort_process_on_timeout_or_error=True)", msg)
        sys.stderr.write(msg + "; aborting the process\n")
        sys.stderr.flush()
        os.abort()
    if comm._is_cuda:
        # The stuck NCCL kernel would otherwise hold the stream, and c10d's watchdog would kill
        # the process when the group's own (longer) timeout expires: abort the communicator
        # so the error can propagate as documented. The communicator is unusable afterwards.
        _abort_nccl(comm)
    if breaks:
        comm._broken = msg
    raise err from exc


def _abort_nccl(comm: CommState) -> None:
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is None:
        return
    try:
        abort(comm._pg)
    except Exception:
        logger.warning("aborting communicator %r failed", comm._name, exc_info=True)
