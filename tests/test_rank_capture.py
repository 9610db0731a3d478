"""The worker handlers torch_profile and wait_counter_values, on a real worker app."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from debug_server.rank import rank_capture
from debug_server.rank.worker import StaticProvider, make_worker_app


@pytest.fixture
async def worker(aiohttp_client: Any) -> Any:
    return await aiohttp_client(make_worker_app(StaticProvider({"version": "2.10", "entries": []})))


@pytest.mark.parametrize(("query", "reason"), [
    ("", "parameter duration: is required (seconds, 0 < S <= 30)"),
    ("?duration=0", "parameter duration: must be seconds with 0 < S <= 30"),
    ("?duration=31", "parameter duration: must be seconds with 0 < S <= 30"),
    ("?duration=nan", "parameter duration: must be seconds with 0 < S <= 30"),
    ("?duration=abc", "parameter duration: must be a number of seconds, 0 < S <= 30"),
    ("?duration=1&x=1", "unknown parameter 'x' (allowed: duration)"),
])
async def test_bad_profile_requests_are_400_in_one_line(worker: Any, query: str,
                                                        reason: str) -> None:
    resp = await worker.post(f"/handler/torch_profile{query}")
    assert (resp.status, await resp.text()) == (400, reason)


async def test_profile_reply_is_a_chrome_trace_of_the_requested_window(worker: Any) -> None:
    resp = await worker.post("/handler/torch_profile?duration=0.3")
    assert resp.status == 200 and resp.content_type == "application/json"
    trace = json.loads(await resp.text())
    span = next(e for e in trace["traceEvents"] if e.get("cat") == "Trace")
    assert span["name"].startswith("PyTorch Profiler") and 250_000 < span["dur"] < 5_000_000


async def _capturing(worker: Any, duration: float) -> asyncio.Future[Any]:
    """A profile request, returned once its capture runs (holds the process's capture lock)."""
    capture = asyncio.ensure_future(worker.post(f"/handler/torch_profile?duration={duration}"))
    deadline = time.monotonic() + 30
    while not rank_capture._capture_lock.locked():
        assert not capture.done(), await (await capture).text()
        assert time.monotonic() < deadline, "the capture never started"
        await asyncio.sleep(0.01)
    return capture


async def test_worker_answers_other_handlers_while_it_profiles(worker: Any) -> None:
    capture = await _capturing(worker, 3.0)
    ping = asyncio.ensure_future(worker.post("/handler/ping"))
    done, _ = await asyncio.wait({capture, ping}, return_when=asyncio.FIRST_COMPLETED)
    assert done == {ping}, "the ping waited for the capture to end"
    resp = ping.result()
    assert (resp.status, await resp.text()) == (200, "pong")
    assert (await capture).status == 200


async def test_second_profile_while_one_runs_is_409(worker: Any) -> None:
    first = await _capturing(worker, 3.0)
    second = await worker.post("/handler/torch_profile?duration=1")
    text = await second.text()
    assert second.status == 409 and text.startswith("a profile is already being captured"), text
    assert (await first).status == 200


async def test_profile_is_refused_while_the_users_profiler_runs(worker: Any) -> None:
    import torch

    # Starting a second torch profiler in this process would crash it; the handler must refuse.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        resp = await worker.post("/handler/torch_profile?duration=0.1")
        text = await resp.text()
    assert resp.status == 409 and text.startswith("another torch.profiler is active"), text


async def test_wait_counter_values_reports_a_counter_that_fired(worker: Any) -> None:
    from torch.monitor import _WaitCounter

    with _WaitCounter("pytorch.wait_counter.debug_server_test").guard():
        pass
    resp = await worker.post("/handler/wait_counter_values")
    counters = json.loads(await resp.text())
    got = counters["pytorch.wait_counter.debug_server_test"]
    assert got["total_calls"] >= 1 and got["active_count"] == 0


async def test_wait_counter_values_takes_no_parameters(worker: Any) -> None:
    resp = await worker.post("/handler/wait_counter_values?x=1")
    assert (resp.status, await resp.text()) == (400, "unknown parameter 'x' (allowed: none)")


async def test_handler_list_names_the_new_handlers(worker: Any) -> None:
    names = await (await worker.get("/handler/")).json()
    assert {"torch_profile", "wait_counter_values"} <= set(names)
