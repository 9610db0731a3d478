"""The Python stack of an op's call site: captured raw on the hot path, symbolised at dump time.

``capture()`` (the Flight Recorder hook's pre-hook calls it once per op) keeps code objects and
instruction offsets only: no line numbers (computed lazily from the line table when a dump is
built), no frame objects in records (they would keep the caller's locals, tensors included,
alive; the one frame the anchor holds, below, is let go within two watchdog periods of the
last op). It walks only the frames below the anchor, a frame still running since an earlier
capture: the frames above it are the same, and their pairs are that capture's, shared.
``symbolized(rec)`` turns a record's raw capture into torch FR's frame list (``name``,
``filename``, ``line``, innermost first) once, starting at the user's call site: the frames of
the op path (``OP_PATH_FILES``) are dropped, as they are from c10d's own stacks (``c10d_merge``).
torch's CapturedTraceback (``torch._C._profiler.gather_traceback``) walks in C, but its
symbolisation takes milliseconds per stack (2.2 ms each, 2000 stacks 25 deep, this CPU box;
23 s for 2000 entries on an H200 host) and its frames cannot be read without it.
"""

from __future__ import annotations

import inspect
import os
import sys
from typing import Any

__all__ = ["OP_PATH_FILES", "capture", "frames_of", "release_idle", "symbolized"]

OP_PATH_FILES = tuple(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), name) for name in ("ops.py", "comms.py", "hooks.py")
)
"""The files of the op path between the user's call site and c10d (``ops``'s op methods,
``comms``'s ``_run`` and ``_issue``, the hook's pre-hook): their frames are never part of a
recorded stack."""


# The anchor: a frame of an earlier capture, still running when this one finds it, and the
# (code, lasti) pairs of the frames above it as that capture walked them. A frame that is still
# running has run without pause since then (a generator or coroutine frame, which can pause
# and be resumed from elsewhere, is never an anchor), so every frame above it is still
# suspended in the same call: the same frames at the same offsets. A capture that meets the
# anchor stops walking there; a training loop's frames above its call sites are walked once.
# Holding the frame keeps it alive: a frame that has returned keeps its locals until the next
# capture that misses it replaces the anchor, or the watchdog's next pass after a pass that
# saw no capture (``release_idle``). One anchor per process: two threads issuing ops by turns
# walk whole stacks, as without it.
_GENERATOR_FLAGS = (inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR
                    | inspect.CO_ITERABLE_COROUTINE)
_anchor: tuple[Any, tuple[Any, ...]] | None = None
_hit = False  # the anchor was met since it was set
_used = False  # the anchor was met since the last release_idle
_seen = 0  # id() of the anchor release_idle saw last (an id, not the anchor: it would hold it)
_reach = 1  # frames from the capture's start to the next anchor: doubled after an anchor no capture met


def capture(skip: int = 1) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """The stack from the frame ``skip`` frames up (1: this function's caller) to the root:
    ``(head, tail)``, two flat (code, lasti, code, lasti, ...) tuples, innermost first, whose
    concatenation is the whole stack.

    Every frame, as c10d records them. Walking costs about 0.1 us per frame (Python 3.11), and
    more in what it touches: every code object and offset it keeps, cold in the cache after
    the thread waited for its collective. So frames above the anchor are neither walked nor
    copied: ``tail`` is the anchor's tuple, shared by every capture that met it, and ``head``
    holds the frames up to the anchor (see above).
    """
    global _hit, _used, _reach
    f: Any = sys._getframe(skip)
    held = _anchor
    stop = held[0] if held is not None else None
    out: list[Any] = []
    app = out.append
    while f is not None:
        app(f.f_code)
        app(f.f_lasti)
        if f is stop:
            _used = True
            tail: tuple[Any, ...] = held[1]  # type: ignore[index]
            if len(out) // 2 - 1 > 2 * _reach:  # met far up (set by a shallower stack): nearer
                _anchor_at(skip + 1, out, tail)
            else:
                _hit = True
            return tuple(out), tail
        f = f.f_back
    # Walked to the root: a new anchor, further up than the last one if that one went unmet
    # (its frame had returned before the next capture).
    if held is not None and not _hit:
        _reach = min(_reach * 2, 64)
    _anchor_at(skip + 1, out, ())
    return tuple(out), ()


def _anchor_at(skip: int, out: list[Any], above: tuple[Any, ...]) -> None:
    """Anchor at the frame ``_reach`` frames up from the capture's start (``skip`` up from
    here), or the first one above it that is no generator; ``out`` + ``above``: the stack from
    the capture's start."""
    global _anchor, _hit
    _hit = False
    i = min(_reach, len(out) // 2 - 1)
    a: Any = sys._getframe(skip + i) if i > 0 else None
    while a is not None and a.f_code.co_flags & _GENERATOR_FLAGS:
        a = a.f_back
        i += 1
    _anchor = (a, tuple(out[2 * i + 2:]) + above) if a is not None else None


def release_idle() -> None:
    """Let go of the anchor when no capture met it since the previous call (a watchdog check:
    a frame that returned is kept for at most two watchdog periods after the last op)."""
    global _anchor, _used, _seen
    held = _anchor
    if held is not None and id(held) == _seen and not _used:
        _anchor = None
    _seen = id(held)
    _used = False


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


def frames_of(raw: tuple[tuple[Any, ...], tuple[Any, ...]]) -> list[dict[str, Any]]:
    """Symbolise a captured stack (``capture``'s ``(head, tail)``), innermost first, starting
    at the user's call site."""
    flat = raw[0] + raw[1]
    i = 0
    while i < len(flat) and flat[i].co_filename in OP_PATH_FILES:
        i += 2
    key = tuple(id(x) if j % 2 == 0 else x for j, x in enumerate(flat[i:]))
    cached = _stack_cache.get(key)
    if cached is not None:
        return cached
    if len(_stack_cache) > _INTERN_LIMIT or len(_frame_cache) > _INTERN_LIMIT:
        _stack_cache.clear()
        _frame_cache.clear()
    frames = [_frame(flat[j], flat[j + 1]) for j in range(i, len(flat), 2)]
    _stack_cache[key] = frames
    return frames


def symbolized(rec: Any) -> list[dict[str, Any]]:
    """``rec.traceback`` (an ``OpRecord``'s) as an interned frame list; the raw capture is
    replaced by it, once."""
    raw = rec.traceback
    if raw is not None and not isinstance(raw, list):
        rec.traceback = raw = frames_of(raw)
    return raw if isinstance(raw, list) else []
