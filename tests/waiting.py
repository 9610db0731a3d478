"""Waiting on a condition with a deadline: what a test does instead of a bare sleep.

``until`` asks ``probe`` until it returns something true and returns that; past the deadline it
fails naming what it waited for and the last answer. ``errors``: exceptions that mean "not yet"
(a server not listening yet), kept as the last answer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

_T = TypeVar("_T")


def until(what: str, limit_s: float, probe: Callable[[], _T], *, interval: float = 0.1,
          errors: tuple[type[BaseException], ...] = ()) -> _T:
    """``probe()``'s first true answer within ``limit_s`` seconds; else AssertionError."""
    deadline = time.monotonic() + limit_s
    last: Any = None
    while True:
        try:
            last = probe()
        except errors as e:
            last = e
        else:
            if last:
                return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not within {limit_s:g} s (last: {last!r})")
        time.sleep(interval)


async def until_async(what: str, limit_s: float, probe: Callable[[], _T | Awaitable[_T]], *,
                      interval: float = 0.05) -> _T:
    """``until`` on the event loop: ``probe`` may be a plain function or a coroutine function."""
    deadline = time.monotonic() + limit_s
    last: Any = None
    while True:
        last = probe()
        if asyncio.iscoroutine(last):
            last = await last
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not within {limit_s:g} s (last: {last!r})")
        await asyncio.sleep(interval)
