"""The process group behind a communicator, and which recorder records its ops.

``_c10d_backed`` decides between c10d's own Flight Recorder and ours (below, and
``RECORDER_ENV``); ``_new_group`` makes the group: a longer timeout than the
communicator's on NCCL (so our watchdog acts before c10d's) and, when asked
(``TIMING_OPT_ENV``), c10d's own timing events; ``init_default_group`` the default group when
``new_comm`` makes it.

Which recorder runs where:

* **NCCL, c10d's Flight Recorder on** (``TORCH_FR_BUFFER_SIZE``, else
  ``TORCH_NCCL_TRACE_BUFFER_SIZE``, > 0; unset means on, 2000 entries, in torch 2.11 and 2.13;
  ``start_debug_server`` sets 2000 when neither is set): the communicator is *c10d-backed*.
  c10d already records every op of the communicator's own process group, with its Python stack,
  in C++; the op path (``comms.Comm._issue``) only counts, calls torch and appends ``(seq, op, time)`` to an
  in-flight list for the watchdog: no stack capture, no CUDA events, no record object. The
  Flight Recorder hook records nothing per op; at dump time ``c10d_merge`` maps c10d's entries of
  that group to the communicator (its name, sequence numbers from 0, stacks from the user's
  call site, c10d's states). c10d without its timing events never says ``started``; so a
  collective records one untimed CUDA event (a fixed slot, no allocation) on the issuing
  stream just before the call (``groups.MARKS_ENV``: by default on a collective issued
  ``groups.MARK_GAP_US`` or more after the previous one, the first of a burst; or on every
  collective, or none; on the GPU an event between two small kernels costs more than its host
  time). It fires when everything the stream did before the collective is done; the
  oldest collective c10d has not completed, whose mark fired, is ``started`` (``c10d_merge``
  applies this when it reads the recorder); one without a mark of its own is never called
  ``started``. ``TIMING_OPT_ENV=1`` makes
  the group with c10d's own timing events instead (``duration_ms`` too, at 3-5 us per op and
  more on the GPU). A user's own pre/post hook turns on building an ``OpRecord`` per op again
  (a few microseconds each).
* **gloo, or c10d's recorder off, or a torch without its dump API**: our own recorder. Every op
  builds one ``OpRecord`` (what, which sequence number, shapes, dtypes, true state); hooks such
  as the Flight Recorder keep references to those records instead of copying them.
* ``RECORDER_ENV=python`` forces ours everywhere; ``=c10d`` forces c10d's wherever it
  records (on gloo too, where c10d never moves an op past ``scheduled``; the tests use it).

Measured on 2x H200, torch 2.11 (``benchmarks/bench_record.py``, ``bench_step.py``; the README
has the table): c10d's recorder adds 2.4-5.2 us per op; the c10d-backed path adds 8.3-9.2 us,
of which the start events of its group 3.0-5.3 us, our Python path 0.75 us, and (sync ops, in
that run) ~4.6 us of c10d's async-call path, which sync collectives no longer take (not yet
re-measured). Those figures predate the direct C++ calls (``calls``), which leave out the
wrapper's 1.5-2.5 us per op (one CPU core; ``bench_record.py``'s "bare C++" column shows it on
any device). Since then c10d's timing events are opt-in (see ``groups.TIMING_OPT_ENV``): on 2x
H200 they cost 2-20 % of the mixed, small and DDP-like steps of ``bench_step.py``.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from debug_server.config import MARKS_ENV as MARKS_ENV
from debug_server.config import NCCL_TIMING_ENV as _TIMING_ENV
from debug_server.config import RECORDER_ENV as RECORDER_ENV
from debug_server.config import TIMING_OPT_ENV as TIMING_OPT_ENV
from debug_server.config import Settings

logger = logging.getLogger(__name__)

def _c10d_group_name(pg: Any) -> str | None:
    try:
        name = dist.distributed_c10d._world.pg_names.get(pg) or getattr(pg, "group_name", None)
    except Exception:  # a torch without either
        return None
    return str(name) if name else None


# -- which recorder runs (see the module doc) ---------------------------------------------------
# ``RECORDER_ENV``: ``auto`` (default): c10d's recorder on NCCL when it is on, ours elsewhere;
# ``c10d``: c10d's wherever it records (gloo too: the tests use it); ``python``: ours everywhere.
# c10d's pickle dump of each recorder (pg_config, pg_status and, when asked, entries).
_C10D_DUMP = {"nccl": "_dump_nccl_trace", "gloo": "_dump_fr_trace"}


def _c10d_fr_on(settings: Settings) -> bool:
    """Whether c10d's Flight Recorder records: c10d reads the first of ``TORCH_FR_BUFFER_SIZE``
    and ``TORCH_NCCL_TRACE_BUFFER_SIZE`` that is set (torch 2.11 and 2.13), and records by
    default (2000 entries) when neither is."""
    return settings.fr_buffer_size is None or settings.fr_buffer_size > 0


def _c10d_dump_fn(backend: str) -> Callable[..., Any] | None:
    try:
        from torch._C import _distributed_c10d as c10d
    except ImportError:
        return None
    name = _C10D_DUMP.get(backend)
    return getattr(c10d, name, None) if name else None


def _c10d_backed(backend: str, settings: Settings) -> bool:
    """Whether a new communicator on ``backend`` lets c10d's recorder record its ops."""
    mode = settings.recorder
    if mode == "python" or not _c10d_fr_on(settings) or _c10d_dump_fn(backend) is None:
        return False
    return mode == "c10d" or backend == "nccl"


# Why the margin: c10d's NCCL watchdog tears the process down when a group's timeout expires. The
# communicator's own timeout (the host-side wait) must fire first, so the abort hooks can dump
# and the error can reach the caller.
_WATCHDOG_MARGIN = datetime.timedelta(seconds=60)

# ``TIMING_OPT_ENV``: ``1``: c10d-backed NCCL communicators' groups record c10d's timing start
# events (``TORCH_NCCL_ENABLE_TIMING``), which also give ``duration_ms``. Off by default: on 2x
# H200 they cost 2-20 % of a step in the launch-bound and DDP-like shapes of ``bench_step.py``, while the
# communicator's own start marks (one untimed event per op on the issuing stream, ``comms``) give
# ``started`` for a fraction of that.


# ``MARKS_ENV``: start marks of c10d-backed CUDA communicators (see ``comms.Comm.started_mark``):
# ``1`` (the default) marks each collective issued ``MARK_GAP_US`` or more after the
# communicator's previous one, i.e. the first of a burst; ``all`` every collective; ``0`` none. A mark is an untimed CUDA
# event on the issuing stream, and costs a launch-bound step more than its host time: the GPU runs
# it between two small kernels. Collectives further apart than ``MARK_GAP_US`` (a training step's
# buckets and layers usually are) are each marked, at a cost bounded by one mark per
# ``MARK_GAP_US``; in a tight burst only the first is. An op without its own mark goes from
# ``scheduled`` to ``completed`` without ``started``, as c10d's own ops do without its timing
# events; a mark never reports a state its op has not reached. Measured on H100 and H200 (torch
# 2.11, ``benchmarks/bench_marks.py``, 200 x 4 KiB all_reduces per step on 2 and 4 ranks, over no
# mark): a mark on the first op of each step 1.000-1.017, one every 0.5 ms 1.01-1.06, one per op
# 1.04-1.09 (``bench_step.py``: 1.01-1.35 over bare torch, varying from run to run).
MARK_GAP_US = 500
"""``1``: the pause (microseconds since the previous collective) after which a collective is marked."""


def _mark_gap_ns(settings: Settings) -> int | None:
    """The pause in nanoseconds after which a collective is marked (``MARKS_ENV``; 0: every
    collective), or None for no marks."""
    v = settings.start_marks
    if v == "0":
        return None
    return 0 if v == "all" else MARK_GAP_US * 1000


def _timing_wanted(backend: str, settings: Settings) -> bool:
    return backend == "nccl" and settings.nccl_timing


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


def init_default_group(backend: str, dev: torch.device, timeout: datetime.timedelta, store: Any) -> None:
    """``init_process_group`` for a job that left it to ``new_comm``; on CUDA bound to ``dev``.

    Why ``device_id``: it makes the default group's NCCL communicator at once, and every group
    created after it (ours, the user's own, DDP's) is then split from it (``ncclCommSplit``).
    Without it each group is a communicator of its own, made at its first collective, and two
    such communicators run the same overlapped step up to 9 % apart, bare torch against bare
    torch (2 and 4 H200s, torch 2.11, NCCL 2.28.9, ``scripts/gpu/step_by_init_mode.py --plain``):
    whichever group a user compared with ours gained or lost that much. Split from one parent,
    ours / bare on a group of its own is 1.000 (issue 31).
    """
    kwargs: dict[str, Any] = {"backend": backend, "timeout": timeout}
    if store is not None:
        kwargs.update(store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    if dev.type == "cuda":
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
        kwargs["device_id"] = dev
    dist.init_process_group(**kwargs)
