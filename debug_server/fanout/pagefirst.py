"""A page's requests go before the background polls' in the frontend's bound on requests in flight.

The frontend bounds its requests in flight with one semaphore (``Collector.semaphore``) shared by
the pages a user opens and its own background work: the hang watch's health poll and the dumper.
At 16384 ranks through agents one health poll is 2048 agent requests (16384 rank requests behind
them) every 32 s, and a page opened while it runs queued its requests behind all of the poll's:
the overview took the poll's seconds on top of its own.

:class:`PageFirstSemaphore` hands a free slot to a waiting page request before any waiting
background request, so a poll that is running when a page opens only finishes the requests it
already has in flight, then waits for the page's fan-outs. Background work is whatever runs in a
context where :data:`BACKGROUND` is true: tasks started with :func:`in_background`. Nothing is
skipped or reordered within one kind; the poll takes longer by the pages served meanwhile (its
interval is 32 s at that size, and the hang report's trigger is a rank's own stall timer). A
background request that has waited :data:`BACKGROUND_MAX_WAIT_S` goes before pages: pages that
reload themselves without pause (``?refresh=``) must never hold the hang watch back for ever.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from types import TracebackType
from typing import Any, TypeVar

__all__ = ["BACKGROUND", "BACKGROUND_MAX_WAIT_S", "PageFirstSemaphore", "in_background"]

T = TypeVar("T")

BACKGROUND: contextvars.ContextVar[bool] = contextvars.ContextVar("debug_server_background",
                                                                  default=False)
"""True inside the frontend's own background work (hang watch, dumper): it yields to pages."""

BACKGROUND_MAX_WAIT_S = 10.0
"""A background request waiting this long goes before the pages' (a hang report may come this
much later while pages keep the frontend busy, never more)."""


def in_background(coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
    """``coro`` as a task whose requests wait behind any page's (:data:`BACKGROUND` set in it)."""
    ctx = contextvars.copy_context()
    ctx.run(BACKGROUND.set, True)
    return asyncio.create_task(coro, name=name, context=ctx)


async def poll_forever(interval: Callable[[], float], poll: Callable[[], Awaitable[Any]],
                       failed: Callable[[Exception], None]) -> None:
    """The background watches' loop: wait ``interval()``, ``poll()``; a failure goes to
    ``failed`` (which logs it) and the next poll comes all the same."""
    while True:
        await asyncio.sleep(interval())
        try:
            await poll()
        except Exception as e:  # noqa: BLE001 - one bad poll must not end the watch
            failed(e)


class PageFirstSemaphore:
    """An ``asyncio.Semaphore`` whose freed slots go to waiting page requests first.

    Within each kind (page, background) waiters are served first come, first served. A freed
    slot is handed to the next waiter directly, so a newcomer never takes it from one.
    """

    def __init__(self, value: int) -> None:
        if value < 1:
            raise ValueError(f"a semaphore needs at least one slot, not {value}")
        self.size = value
        """How many slots it has (a fan-out starts no more workers than this)."""
        self._free = value
        # Waiters with the loop time they started waiting at.
        self._pages: deque[tuple[asyncio.Future[None], float]] = deque()
        self._background: deque[tuple[asyncio.Future[None], float]] = deque()

    async def acquire(self) -> None:
        if self._free > 0:  # slots are free only while nobody waits (release hands them over)
            self._free -= 1
            return
        await self._wait(self._background if BACKGROUND.get() else self._pages)

    async def renew(self) -> None:
        """Give back the slot this task holds and take one again, as a request that had queued
        for it before the slot was given back would (a fan-out's worker between two of its
        ranks: its next request is due, as a task per request was queued from the start).
        The slot is kept at once where no waiter would be served first."""
        bg, pages = self._background, self._pages
        while bg and bg[0][0].done():
            bg.popleft()
        while pages and pages[0][0].done():
            pages.popleft()
        if BACKGROUND.get():
            ahead = bool(pages or bg)
        else:
            ahead = bool(pages) or (bool(bg) and asyncio.get_running_loop().time() - bg[0][1]
                                    >= BACKGROUND_MAX_WAIT_S)
        if not ahead:
            return
        queue = bg if BACKGROUND.get() else pages
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        entry = (fut, loop.time())
        queue.append(entry)
        self.release()  # to a waiter ahead of this one
        await self._waiting(queue, fut, entry)

    async def _wait(self, queue: deque[tuple[asyncio.Future[None], float]]) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        entry = (fut, loop.time())
        queue.append(entry)
        await self._waiting(queue, fut, entry)

    async def _waiting(self, queue: deque[tuple[asyncio.Future[None], float]],
                       fut: asyncio.Future[None], entry: tuple[asyncio.Future[None], float],
                       ) -> None:
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # the slot was handed over: pass it on
                self.release()
            else:
                with contextlib.suppress(ValueError):
                    queue.remove(entry)
            raise

    def release(self) -> None:
        bg = self._background
        while bg and bg[0][0].done():
            bg.popleft()
        overdue = bool(bg) and asyncio.get_running_loop().time() - bg[0][1] >= BACKGROUND_MAX_WAIT_S
        for queue in (bg, self._pages) if overdue else (self._pages, bg):
            while queue:
                fut, _ = queue.popleft()
                if not fut.done():
                    fut.set_result(None)
                    return
        self._free += 1

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.release()
