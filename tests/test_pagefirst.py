"""A page's requests go before the hang watch's poll in the frontend's bound on requests in
flight (``fanout.pagefirst``): the slot order, cancellation, and a real poll against real
workers yielding to a page's fan-out."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from debug_server.fanout.live import LiveCollector
from debug_server.fanout.pagefirst import BACKGROUND, PageFirstSemaphore, in_background
from debug_server.frontend.hangreport import HangWatch
from debug_server.protocol.names import HEALTH_HANDLER
from debug_server.readers.storeview import StaticRegistry


async def _waiter(sem: PageFirstSemaphore, name: str, order: list[str]) -> None:
    async with sem:
        order.append(name)


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_freed_slot_goes_to_a_page_before_a_background_request_that_waited_longer() -> None:
    sem = PageFirstSemaphore(1)
    order: list[str] = []
    await sem.acquire()
    bg = in_background(_waiter(sem, "poll", order), name="poll")
    await _settle()
    page = asyncio.create_task(_waiter(sem, "page", order))
    await _settle()
    sem.release()
    await asyncio.gather(bg, page)
    assert order == ["page", "poll"]


async def test_a_background_request_waiting_past_the_limit_goes_before_a_page(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from debug_server.fanout import pagefirst

    monkeypatch.setattr(pagefirst, "BACKGROUND_MAX_WAIT_S", 0.05)
    sem = PageFirstSemaphore(1)
    order: list[str] = []
    await sem.acquire()
    bg = in_background(_waiter(sem, "poll", order), name="poll")
    await asyncio.sleep(0.1)  # the poll's request is now overdue
    page = asyncio.create_task(_waiter(sem, "page", order))
    await _settle()
    sem.release()
    await asyncio.gather(bg, page)
    assert order == ["poll", "page"]


async def test_requests_of_one_kind_get_slots_first_come_first_served() -> None:
    sem = PageFirstSemaphore(1)
    order: list[str] = []
    await sem.acquire()
    tasks = []
    for name in ("a", "b", "c"):
        tasks.append(asyncio.create_task(_waiter(sem, name, order)))
        await _settle()
    sem.release()
    await asyncio.gather(*tasks)
    assert order == ["a", "b", "c"]


async def test_a_cancelled_waiter_neither_takes_a_slot_nor_loses_one() -> None:
    sem = PageFirstSemaphore(2)
    await sem.acquire()
    await sem.acquire()
    gone = asyncio.create_task(sem.acquire())
    await _settle()
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    sem.release()
    sem.release()
    # Both slots are free again: two acquires return at once, a third waits.
    await asyncio.wait_for(sem.acquire(), 1)
    await asyncio.wait_for(sem.acquire(), 1)
    third = asyncio.create_task(sem.acquire())
    await _settle()
    assert not third.done()
    third.cancel()


async def test_a_waiter_cancelled_after_its_slot_was_handed_over_passes_the_slot_on() -> None:
    sem = PageFirstSemaphore(1)
    await sem.acquire()
    first = asyncio.create_task(sem.acquire())
    second = asyncio.create_task(sem.acquire())
    await _settle()
    sem.release()  # handed to ``first``, which is cancelled before it runs
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    await asyncio.wait_for(second, 1)


def test_a_semaphore_without_slots_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="at least one slot, not 0"):
        PageFirstSemaphore(0)


async def test_background_is_set_only_inside_tasks_started_in_background() -> None:
    async def flag() -> bool:
        return BACKGROUND.get()

    assert await in_background(flag(), name="flag") is True
    assert await asyncio.create_task(flag()) is False
    assert BACKGROUND.get() is False


async def test_a_page_fan_out_started_during_a_health_poll_is_served_before_the_polls_rest(
        aiohttp_server: Any) -> None:
    """Real worker app, real Collector with one request in flight, the real HangWatch.poll in
    the background: the page's 4 requests reach the workers before the poll's remaining 3."""
    seen: list[str] = []
    first_poll = asyncio.Event()

    async def handler(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        seen.append(name)
        if name == HEALTH_HANDLER:
            first_poll.set()
        await asyncio.sleep(0.05)
        return web.Response(text='{"healthy": true}' if name == HEALTH_HANDLER else "a stack")

    app = web.Application()
    app.router.add_post("/handler/{name}", handler)
    servers = [await aiohttp_server(app) for _ in range(4)]
    urls = [str(s.make_url("")) for s in servers]
    async with aiohttp.ClientSession() as session:
        collector = LiveCollector(session, StaticRegistry(urls), timeout=5, max_concurrency=1)
        watch = HangWatch(collector, None, interval=60.0)
        poll = in_background(watch.poll(), name="poll")
        await asyncio.wait_for(first_poll.wait(), 5)
        page = await collector.fetch("dump_traceback")
        await poll
    assert [r.rank for r in page if r.ok] == [0, 1, 2, 3]
    assert sorted(h.rank for h in watch.last) == [0, 1, 2, 3]
    assert seen == [HEALTH_HANDLER] + ["dump_traceback"] * 4 + [HEALTH_HANDLER] * 3


async def test_renew_keeps_the_slot_while_nobody_waits() -> None:
    sem = PageFirstSemaphore(1)
    await sem.acquire()
    await asyncio.wait_for(sem.renew(), 5)  # would wait for ever had it given the slot away
    other = asyncio.create_task(sem.acquire())
    await _settle()
    assert not other.done()  # the slot is still held
    sem.release()
    await asyncio.wait_for(other, 5)


async def test_a_background_renew_hands_the_slot_to_a_waiting_page_and_queues_behind_it() -> None:
    sem = PageFirstSemaphore(1)
    order: list[str] = []

    async def background_worker() -> None:
        await sem.acquire()
        order.append("background 1")
        await page_waits.wait()
        await sem.renew()  # between two of its requests
        order.append("background 2")
        sem.release()

    page_waits = asyncio.Event()
    worker = in_background(background_worker(), name="bg")
    await _settle()
    page = asyncio.create_task(_waiter(sem, "page", order))
    await _settle()
    page_waits.set()
    await asyncio.wait_for(asyncio.gather(worker, page), 5)
    assert order == ["background 1", "page", "background 2"]


async def test_a_page_renew_keeps_the_slot_before_background_waiters() -> None:
    sem = PageFirstSemaphore(1)
    order: list[str] = []
    await sem.acquire()
    bg = in_background(_waiter(sem, "background", order), name="bg")
    await _settle()
    await sem.renew()  # a page's worker between two ranks: its next request goes first
    order.append("page 2")
    sem.release()
    await asyncio.wait_for(bg, 5)
    assert order == ["page 2", "background"]
