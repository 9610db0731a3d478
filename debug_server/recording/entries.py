"""Our records as torch FR entries (schema "2.10"), built only for the entries a dump keeps.

``records_source(shared)`` is the ``lazy.Source`` of ``OpRecord``s in one dump: ``entry_key``
reads the fields a cut decides on (``lazy.KEY_FIELDS``), once; ``build_entry`` makes the whole
entry, its state from that key, so a cut and the entries it keeps agree even while the op
advances. Equal sizes, dtypes and groups within one dump are one value (``shared``).
"""

from __future__ import annotations

import functools
import operator
import threading
from collections.abc import Callable
from typing import Any

import torch

from debug_server.recording.frames import symbolized
from debug_server.recording.lazy import Source
from debug_server.recording.records import OpRecord

__all__ = ["build_entry", "dtype_name", "entry_key", "records_source"]

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


def dtype_name(dtype: Any) -> str:
    return _DTYPE_NAMES.get(dtype) or str(dtype).replace("torch.", "")


def _thread_name(ident: int | None) -> str:
    for t in threading.enumerate():
        if t.ident == ident:
            return t.name
    return f"thread-{ident}"


def _shared(shared: dict[Any, Any], key: Any, make: Callable[[], Any]) -> Any:
    """The value made for an equal ``key`` earlier in this dump, else ``make()`` remembered.

    Entries of one dump share their equal size, dtype and group values (as they share frame
    lists), so the pickle writes each once and refers back to it: unpickling and freeing a
    2000-entry ring takes 0.6x the time (fewer objects), and the analyzer's digest compares
    them by identity. Readers never mutate entries. An unhashable key (an odd shape type) just
    gets its own value.
    """
    try:
        hit = shared.get(key)
    except TypeError:
        return make()
    if hit is None:
        hit = shared[key] = make()
    return hit


def entry_key(rec: OpRecord, shared: dict[Any, Any]) -> dict[str, Any]:
    """The fields that decide whether an entry is kept (``lazy.KEY_FIELDS``), read once: the
    entry built from it (``build_entry``) takes its state from here."""
    comm = rec.comm
    pg_key = ("pg", comm.get_name(), comm.get_backend())
    state = rec.state
    return {
        "record_id": rec.record_id,
        "process_group": _shared(shared, pg_key, lambda: pg_key[1:]),
        "collective_seq_id": rec.seq,
        "profiling_name": rec.profiling_name,
        "state": state,
        "retired": state == "completed",
        "is_p2p": rec.is_p2p,
        "time_created_ns": rec.time_created_ns,
        "time_discovered_started_ns": rec.time_started_ns,
        "time_discovered_completed_ns": rec.time_completed_ns,
    }


def build_entry(rec: OpRecord, key: dict[str, Any] | None, shared: dict[Any, Any]) -> dict[str, Any]:
    """``rec``'s whole FR entry; its state from ``key`` when a cut made one."""
    comm = rec.comm
    if key is None:
        started, completed, state = rec.time_started_ns, rec.time_completed_ns, rec.state
    else:  # the state the cut saw
        started, completed = key["time_discovered_started_ns"], key["time_discovered_completed_ns"]
        state = key["state"]
    duration = (completed - started) / 1e6 if completed is not None and started is not None else None
    ins, outs, ind, outd = rec.input_shapes, rec.output_shapes, rec.input_dtypes, rec.output_dtypes
    pg_key = ("pg", comm.get_name(), comm.get_backend())
    return {
        "record_id": rec.record_id,
        "pg_id": comm.pg_id,
        "process_group": _shared(shared, pg_key, lambda: pg_key[1:]),
        "thread_name": rec.thread_name or _thread_name(rec.thread_id),
        "thread_id": rec.thread_id,
        "collective_seq_id": rec.seq,
        "p2p_seq_id": rec.p2p_seq,
        "op_id": rec.op_id,
        "profiling_name": rec.profiling_name,
        "time_created_ns": rec.time_created_ns,
        "duration_ms": duration,
        "input_sizes": _shared(shared, ("sizes", ins), lambda: [list(s) for s in ins]),
        "input_dtypes": _shared(shared, ("dtypes", ind), lambda: [dtype_name(d) for d in ind]),
        "output_sizes": _shared(shared, ("sizes", outs), lambda: [list(s) for s in outs]),
        "output_dtypes": _shared(shared, ("dtypes", outd), lambda: [dtype_name(d) for d in outd]),
        "state": state,
        "time_discovered_started_ns": started,
        "time_discovered_completed_ns": completed,
        "retired": state == "completed",
        "timeout_ms": int(comm.timeout.total_seconds() * 1000),
        "is_p2p": rec.is_p2p,
        "frames": symbolized(rec),
    }


def records_source(shared: dict[Any, Any]) -> Source:
    """Our records as ``lazy`` entries of one dump (``shared``: that dump's shared values, one
    dict per dump)."""
    return Source(functools.partial(entry_key, shared=shared), functools.partial(build_entry, shared=shared),
                  operator.attrgetter("time_created_ns"), fresh=True)
