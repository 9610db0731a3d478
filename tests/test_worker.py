from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from httpget import post

from debug_server.analysis import stackparse
from debug_server.dumpio import safe_loads
from debug_server.rank.worker import (
    HandlerError,
    HooksProvider,
    StaticProvider,
    make_worker_app,
    start_worker_thread,
)
from debug_server.stacks import capture_stacks, with_source
from debug_server.tools import synthetic

HANDLER_NAMES = {"ping", "dump_traceback", "torchcomms_fr_trace_json", "fr_trace_json",
                 "torchcomms_fr_dump_file", "torchcomms_health_check", "pyspy_dump",
                 "torch_profile", "wait_counter_values", "process_state"}


def _dump() -> dict[str, Any]:
    return synthetic.hang_job(2, n_entries=5, missing_rank=1)[0]


@pytest.fixture
async def client(aiohttp_client: Any, tmp_path: Any) -> Any:
    provider = StaticProvider(_dump(), stacks="Thread 0x1 (most recent call first):\n  File \"t.py\", line 3 in <module>\n",
                              health={"healthy": False, "stalled_op": {"group": "main_comm", "seq": 4,
                                                                       "op": "all_reduce", "age_s": 12.0}},
                              dump_path=str(tmp_path / "per_rank" / "rank_0"))
    return await aiohttp_client(make_worker_app(provider))


async def test_get_handler_lists_every_handler_name_as_json(client: Any) -> None:
    resp = await client.get("/handler/")
    assert resp.status == 200
    assert set(await resp.json()) == HANDLER_NAMES


async def test_ping_answers_pong(client: Any) -> None:
    resp = await client.post("/handler/ping")
    assert (resp.status, await resp.text()) == (200, "pong")


async def test_unknown_handler_is_404_naming_it(client: Any) -> None:
    resp = await client.post("/handler/nope")
    assert resp.status == 404
    assert await resp.text() == "Handler nope not found"


@pytest.mark.parametrize("query", ["onlyactive=yes", "onlyactive=", "includecollectives=1",
                                   "onlyactive=true&bogus=1"])
async def test_bad_fr_parameter_is_400_with_one_line_reason(client: Any, query: str) -> None:
    resp = await client.post(f"/handler/torchcomms_fr_trace_json?{query}")
    assert resp.status == 400
    text = await resp.text()
    assert "\n" not in text.strip() and ("must be true or false" in text or "unknown parameter" in text)


async def test_fr_trace_json_serves_whole_ring_by_default(client: Any) -> None:
    resp = await client.post("/handler/torchcomms_fr_trace_json")
    dump = await resp.json()
    assert dump["version"] == "2.10"
    assert [e["collective_seq_id"] for e in dump["entries"]] == [0, 1, 2, 3, 4]


async def test_fr_trace_json_onlyactive_keeps_unfinished_entries(client: Any) -> None:
    resp = await client.post("/handler/torchcomms_fr_trace_json?onlyactive=TRUE&includecollectives=true")
    dump = await resp.json()
    assert [(e["collective_seq_id"], e["state"]) for e in dump["entries"]] == [(4, "started")]


async def test_fr_trace_json_includecollectives_false_drops_entries(client: Any) -> None:
    dump = await (await client.post("/handler/torchcomms_fr_trace_json?includecollectives=false")).json()
    assert dump["entries"] == [] and "main_comm" in dump["pg_config"]


async def test_dump_traceback_returns_provider_text(client: Any) -> None:
    resp = await client.post("/handler/dump_traceback")
    assert resp.status == 200 and "line 3 in <module>" in await resp.text()


async def test_health_check_returns_json(client: Any) -> None:
    health = await (await client.post("/handler/torchcomms_health_check")).json()
    assert health["healthy"] is False and health["stalled_op"]["seq"] == 4


async def test_dump_file_writes_pickle_and_says_where(client: Any, tmp_path: Any) -> None:
    reply = await (await client.post("/handler/torchcomms_fr_dump_file")).json()
    assert reply["path"] == str(tmp_path / "per_rank" / "rank_0")
    with open(reply["path"], "rb") as f:
        assert len(safe_loads(f.read())["entries"]) == 5


async def test_get_on_a_handler_is_not_allowed(client: Any) -> None:
    assert (await client.get("/handler/ping")).status == 405


class _Broken(StaticProvider):
    def stacks(self) -> str:
        raise RuntimeError("boom\nsecond line\nTraceback (most recent call last):")

    def dump_file(self) -> str:
        raise PermissionError(13, "Permission denied", "/ro/rank_0")

    def health(self) -> Mapping[str, Any]:
        raise HandlerError(503, "not ready")


async def test_failing_handler_is_500_with_one_line_and_no_traceback(aiohttp_client: Any, caplog: Any) -> None:
    client = await aiohttp_client(make_worker_app(_Broken(_dump())))
    resp = await client.post("/handler/dump_traceback")
    text = await resp.text()
    assert resp.status == 500
    assert text == "dump_traceback failed: RuntimeError: boom"


async def test_dump_file_oserror_is_500_naming_the_path(aiohttp_client: Any) -> None:
    client = await aiohttp_client(make_worker_app(_Broken(_dump())))
    resp = await client.post("/handler/torchcomms_fr_dump_file")
    assert resp.status == 500
    assert "/ro/rank_0" in await resp.text()


async def test_handler_error_status_passes_through(aiohttp_client: Any) -> None:
    client = await aiohttp_client(make_worker_app(_Broken(_dump())))
    resp = await client.post("/handler/torchcomms_health_check")
    assert (resp.status, await resp.text()) == (503, "not ready")


async def test_static_provider_has_no_c10d_fr(client: Any) -> None:
    resp = await client.post("/handler/fr_trace_json")
    assert resp.status == 404


def test_hooks_provider_without_hooks_serves_an_empty_valid_dump() -> None:
    dump = HooksProvider(0).fr_snapshot(only_active=False, include_collectives=True)
    assert dump["version"] == "2.10" and dump["entries"] == []


def test_hooks_provider_serves_c10d_builtin_fr_json() -> None:
    text = HooksProvider(0).c10d_fr_json(only_active=True, include_collectives=True)
    assert json.loads(text)["version"]


def _park(ready: threading.Event, done: threading.Event) -> None:
    ready.set()
    done.wait(10)  # PARK_LINE


def test_worker_thread_serves_real_stacks_of_all_threads_and_stops() -> None:
    ready, done = threading.Event(), threading.Event()
    parked = threading.Thread(target=_park, args=(ready, done), name="parked")
    parked.start()
    ready.wait(5)
    worker = start_worker_thread(HooksProvider(0))
    try:
        assert worker.port > 0
        status, text = post(f"http://127.0.0.1:{worker.port}/handler/dump_traceback", timeout=5)
        assert status == 200
        line = next(i for i, s in enumerate(Path(__file__).read_text().splitlines(), 1) if s.endswith("# PARK_LINE"))
        assert f'test_worker.py", line {line} in _park' in text
        assert "in test_worker_thread_serves_real_stacks_of_all_threads_and_stops" in text
    finally:
        done.set()
        parked.join()
        t0 = time.monotonic()
        worker.stop()
        worker.stop()
    assert time.monotonic() - t0 < 3
    assert not any(t.name == "debug_server.rank.worker" for t in threading.enumerate())


def test_worker_thread_on_a_taken_port_raises_naming_it() -> None:
    first = start_worker_thread(StaticProvider(_dump()))
    try:
        with pytest.raises(OSError, match=str(first.port)):
            start_worker_thread(StaticProvider(_dump()), port=first.port)
    finally:
        first.stop()


def test_capture_stacks_lists_the_calling_frame() -> None:
    text = capture_stacks()
    assert "most recent call first" in text
    assert "in test_capture_stacks_lists_the_calling_frame" in text


def _sleeper(ready: threading.Event, stop: threading.Event) -> None:
    ready.set()
    while not stop.is_set():
        time.sleep(0.05)  # SLEEP_LINE


def test_capture_stacks_ships_the_source_line_the_verdict_names() -> None:
    line = next(i for i, s in enumerate(Path(__file__).read_text().splitlines(), 1)
                if s.endswith("# SLEEP_LINE"))
    want = f'test_worker.py", line {line} in _sleeper\n    time.sleep(0.05)  # SLEEP_LINE\n'
    ready, stop = threading.Event(), threading.Event()
    sleeper = threading.Thread(target=_sleeper, args=(ready, stop), name="sleeper")
    sleeper.start()
    try:
        assert ready.wait(30)
        # The sleeper sleeps until told to stop: read until it is caught in its sleep (it is
        # between two sleeps for a moment now and then), however slow the machine.
        deadline = time.monotonic() + 30
        while want not in (text := capture_stacks()):
            assert time.monotonic() < deadline, text[-2000:]
    finally:
        stop.set()
        sleeper.join()
    [thread] = [t for t in stackparse.parse_threads(text)
                if t.frames and t.frames[0].function == "_sleeper"]
    assert stackparse.summarize(thread.frames).summary == f"time.sleep at test_worker.py:{line}"


def test_source_lines_are_added_once() -> None:
    text = capture_stacks()
    assert with_source(text) == text
    assert "    text = capture_stacks()\n" in text
