"""What a rank captures on request beyond stacks and Flight Recorder: a profile, wait counters.

Two worker handlers, named and parametrised as torch 2.13's own debug server names them, so
torch's frontend reads our workers and ours reads torch's:

* ``torch_profile?duration=S`` (0 < S <= 30): a ``torch.profiler`` trace of this whole process
  (CPU, plus CUDA where present, all threads) for S seconds, as Chrome trace JSON. Torch allows
  one profiler per process, and starting a second one while another runs crashes the process
  (seen on torch 2.13: a segfault), so a rank whose user already runs ``torch.profiler``
  answers 409 instead, and so does a second request while one capture runs.
* ``wait_counter_values``: torch's wait counters (``{name: {active_count, total_calls,
  total_time_us, max_time_us}}``), read through torch's own C++ control-plane handler; 404 with
  one line where this torch build has none.

The capture runs on a thread of its own, so this rank's worker keeps answering stacks and
health while it records.
"""

from __future__ import annotations

import asyncio
import logging
import math
import tempfile
import threading
import time
from collections.abc import Awaitable, Mapping
from pathlib import Path
from typing import Any

from aiohttp import web

from debug_server.protocol.names import DURATION, PROFILE_HANDLER, WAIT_COUNTERS_HANDLER
from debug_server.protocol.wire import HandlerError

logger = logging.getLogger(__name__)

MAX_PROFILE_S = 30.0
"""Longest capture a request may ask for (seconds)."""
MAX_TRACE_BYTES = 200 * 1024 * 1024
"""A trace larger than this is refused rather than sent (the frontend holds every rank's)."""

def _fail(status: int, reason: str) -> Exception:
    return HandlerError(status, reason)


_capture_lock = threading.Lock()  # one capture per process: torch.profiler is process-wide
_capture_started: list[float] = [0.0]


def parse_duration(raw: str | None) -> float:
    """``duration`` in seconds: a finite number with 0 < S <= 30; ``ValueError`` otherwise."""
    if raw is None:
        raise ValueError(f"is required (seconds, 0 < S <= {MAX_PROFILE_S:g})")
    try:
        s = float(raw)
    except ValueError:
        raise ValueError(f"must be a number of seconds, 0 < S <= {MAX_PROFILE_S:g}") from None
    if not math.isfinite(s) or not 0 < s <= MAX_PROFILE_S:
        raise ValueError(f"must be seconds with 0 < S <= {MAX_PROFILE_S:g}")
    return s


def _other_profiler_active() -> bool:
    # torch.profiler sets this process-wide flag while any profile (kineto or legacy) is on;
    # torch._C._autograd._profiler_enabled() only sees the calling thread's profiler.
    import torch.autograd.profiler as autograd_profiler

    return bool(getattr(autograd_profiler, "_is_profiler_enabled", False))


def capture_profile(duration: float) -> bytes:
    """Record this process for ``duration`` seconds; the Chrome trace as JSON bytes.

    Raises ``wire.HandlerError(409)`` while another capture or a user's ``torch.profiler`` runs.
    """
    if not _capture_lock.acquire(blocking=False):
        age = time.monotonic() - _capture_started[0]
        raise _fail(409, f"a profile is already being captured in this process "
                                f"(started {age:.0f} s ago)")
    try:
        _capture_started[0] = time.monotonic()
        if _other_profiler_active():
            raise _fail(409, "another torch.profiler is active in this process; torch "
                                    "allows one at a time, so this rank was not profiled")
        import torch
        from torch.profiler import ProfilerActivity, _ExperimentalConfig, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        try:
            # profile_all_threads: the training loop runs on the main thread, not on this one.
            config = _ExperimentalConfig(profile_all_threads=True)
        except TypeError:  # an older torch: CPU ops of this thread only (GPU kernels still all)
            logger.warning("debug_server: this torch cannot profile all threads; the profile "
                           "has CPU ops of the worker thread only")
            config = _ExperimentalConfig()
        with profile(activities=activities, record_shapes=True, experimental_config=config) as prof:
            time.sleep(duration)
        with tempfile.TemporaryDirectory(prefix="debug_server_profile_") as d:
            path = Path(d) / "trace.json"
            prof.export_chrome_trace(str(path))
            size = path.stat().st_size
            if size > MAX_TRACE_BYTES:
                raise _fail(500, f"trace of {size / 2**20:.0f} MiB exceeds the "
                                        f"{MAX_TRACE_BYTES / 2**20:.0f} MiB limit; profile "
                                        f"fewer seconds")
            return path.read_bytes()
    finally:
        _capture_lock.release()


async def _profile_reply(duration: float) -> web.Response:
    body = await asyncio.to_thread(capture_profile, duration)
    return web.Response(body=body, content_type="application/json")


def torch_profile(provider: object, params: Mapping[str, str]) -> Awaitable[web.Response]:
    """Worker handler ``torch_profile?duration=S`` (torch's name and parameter)."""
    extra = sorted(set(params) - {DURATION})
    if extra:
        raise _fail(400, f"unknown parameter {extra[0]!r} (allowed: duration)")
    try:
        duration = parse_duration(params.get(DURATION))
    except ValueError as e:
        raise _fail(400, f"parameter duration: {e}") from None
    return _profile_reply(duration)


# ---------------------------------------------------------------------------------------------
# Wait counters


def read_wait_counters() -> str:
    """torch's wait counters as JSON text, from its own ``wait_counter_values`` handler."""
    try:
        from torch._C import _distributed_c10d as c10d
    except ImportError:
        raise _fail(404, "wait counters are not available: this torch has no "
                                "torch.distributed build") from None
    get_handler = getattr(c10d, "_get_handler", None)
    names = getattr(c10d, "_get_handler_names", lambda: [])()
    if get_handler is None or WAIT_COUNTERS_HANDLER not in names:
        raise _fail(404, "wait counters are not available in this torch build (no "
                                "c10d control-plane handler 'wait_counter_values')")

    # torch's handlers write into a Response object; these subclasses keep what they write.
    class _Request(c10d._Request):
        def get_param(self, name: str) -> str:
            return ""

        def body(self) -> str:
            return ""

    class _Response(c10d._Response):
        def __init__(self) -> None:
            super().__init__()
            self.status = 200
            self.content: Any = ""

        def set_content(self, content: Any, content_type: str) -> None:
            self.content = content

        def set_status(self, status: int) -> None:
            self.status = int(status)

    resp = _Response()
    get_handler(WAIT_COUNTERS_HANDLER)(_Request(), resp)
    text = resp.content.decode() if isinstance(resp.content, bytes) else str(resp.content)
    if resp.status != 200:
        first = (text.strip().splitlines() or [""])[0][:300]
        raise _fail(500, f"torch's wait_counter_values answered {resp.status}: {first}")
    return text


def wait_counter_values(provider: object, params: Mapping[str, str]) -> web.Response:
    """Worker handler ``wait_counter_values`` (torch's name; no parameters)."""
    if params:
        raise _fail(400, f"unknown parameter {sorted(params)[0]!r} (allowed: none)")
    return web.Response(text=read_wait_counters(), content_type="application/json")


HANDLERS = {PROFILE_HANDLER: torch_profile, WAIT_COUNTERS_HANDLER: wait_counter_values}
"""Merged into ``debug_server.rank.worker.HANDLERS``."""
