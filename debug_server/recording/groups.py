"""The process group behind a communicator, and which recorder records its ops.

``_c10d_backed`` decides between c10d's own Flight Recorder and ours (see the ``comms`` module
doc and ``RECORDER_ENV``); ``_new_group`` makes the group: a longer timeout than the
communicator's on NCCL (so our watchdog acts before c10d's) and, when asked
(``TIMING_OPT_ENV``), c10d's own timing events.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

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


def _c10d_backed(backend: str) -> bool:
    """Whether a new communicator on ``backend`` lets c10d's recorder record its ops."""
    settings = Settings.from_env()
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


def _mark_gap_ns() -> int | None:
    """The pause in nanoseconds after which a collective is marked (``MARKS_ENV``; 0: every
    collective), or None for no marks."""
    v = Settings.from_env().start_marks
    if v == "0":
        return None
    return 0 if v == "all" else MARK_GAP_US * 1000


def _timing_wanted(backend: str) -> bool:
    return backend == "nccl" and Settings.from_env().nccl_timing


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

