"""The Python stack of an op's call site: captured raw on the hot path, symbolised at dump time.

``capture()`` (the Flight Recorder hook's pre-hook calls it once per op) keeps code objects and
instruction offsets only: no line numbers (computed lazily from the line table when a dump is
built), no frame objects (they would keep the caller's locals, tensors included, alive).
``symbolized(rec)`` turns a record's raw capture into torch FR's frame list (``name``,
``filename``, ``line``, innermost first) once, starting at the user's call site: the frames of
the op path (``OP_PATH_FILES``) are dropped, as they are from c10d's own stacks (``c10d_merge``).
torch's CapturedTraceback is cheaper to capture, but its symbolisation took seconds per dump on
CUDA builds (23 s for 2000 entries on an H200 host).
"""

from __future__ import annotations

import os
import sys
from typing import Any

__all__ = ["OP_PATH_FILES", "capture", "frames_of", "symbolized"]

OP_PATH_FILES = tuple(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), name) for name in ("ops.py", "comms.py", "hooks.py")
)
"""The files of the op path between the user's call site and c10d (``ops``'s op methods,
``comms``'s ``_run`` and ``_issue``, the hook's pre-hook): their frames are never part of a
recorded stack."""


def capture() -> tuple[Any, ...]:
    """The caller's caller's stack as a flat (code, lasti, code, lasti, ...) tuple: ~2 us at
    depth 20. Skips this function and its caller (the hook's pre-hook)."""
    f: Any = sys._getframe(2)
    out: list[Any] = []
    app = out.append
    while f is not None:
        app(f.f_code)
        app(f.f_lasti)
        f = f.f_back
    return tuple(out)


# Symbolised stacks are interned: a training loop issues the same few call sites again and
# again, so records share one frame list (and frames share one dict) instead of each holding
# ~20 fresh dicts. This keeps a full ring with stacks well under a megabyte. Keys use id(code);
# the cached value holds the code object, so an id is never reused while its entry lives.
_INTERN_LIMIT = 50_000
_frame_cache: dict[tuple[int, int], tuple[Any, dict[str, Any]]] = {}
_stack_cache: dict[tuple[int, ...], list[dict[str, Any]]] = {}


def _line_of(code: Any, lasti: int) -> int:
    for start, end, line in code.co_lines():
        if start <= lasti < end and line is not None:
            return int(line)
    return int(code.co_firstlineno)


def _frame(code: Any, lasti: int) -> dict[str, Any]:
    key = (id(code), lasti)
    hit = _frame_cache.get(key)
    if hit is not None:
        return hit[1]
    d = {"name": code.co_name, "filename": code.co_filename, "line": _line_of(code, lasti)}
    _frame_cache[key] = (code, d)
    return d


def frames_of(raw: tuple[Any, ...]) -> list[dict[str, Any]]:
    """Symbolise a captured stack, innermost first, starting at the user's call site."""
    i = 0
    while i < len(raw) and raw[i].co_filename in OP_PATH_FILES:
        i += 2
    key = tuple(id(x) if j % 2 == 0 else x for j, x in enumerate(raw[i:]))
    cached = _stack_cache.get(key)
    if cached is not None:
        return cached
    if len(_stack_cache) > _INTERN_LIMIT or len(_frame_cache) > _INTERN_LIMIT:
        _stack_cache.clear()
        _frame_cache.clear()
    frames = [_frame(raw[j], raw[j + 1]) for j in range(i, len(raw), 2)]
    _stack_cache[key] = frames
    return frames


def symbolized(rec: Any) -> list[dict[str, Any]]:
    """``rec.traceback`` (an ``OpRecord``'s) as an interned frame list; the raw capture is
    replaced by it, once."""
    raw = rec.traceback
    if raw is not None and not isinstance(raw, list):
        rec.traceback = raw = frames_of(raw)
    return raw if isinstance(raw, list) else []
