from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from fakes import closed_port_url

from debug_server.config import ServerConfig
from debug_server.fanout.collector import Collector
from debug_server.fanout.live import LiveCollector
from debug_server.frontend import dumps as dumps_mod
from debug_server.frontend.app import DUMPER, make_frontend_app
from debug_server.frontend.dumps import DumpDir, Dumper, FileThread, write_atomic
from debug_server.readers.storeview import StaticRegistry
from debug_server.tools import synthetic

NOW = time.mktime((2025, 1, 2, 3, 4, 5, 0, 0, -1))
STAMP = "20250102_030405"


def test_stamps_in_one_second_get_suffixes(tmp_path: Path) -> None:
    d = DumpDir(str(tmp_path))
    assert [d.new_stamp(NOW) for _ in range(3)] == [STAMP, f"{STAMP}_1", f"{STAMP}_2"]
    assert d.new_stamp(NOW + 1) == "20250102_030406"


def test_stamp_used_by_an_earlier_process_is_not_reused(tmp_path: Path) -> None:
    (tmp_path / f"stacks_{STAMP}.txt").write_text("old")
    assert DumpDir(str(tmp_path)).new_stamp(NOW) == f"{STAMP}_1"


def test_prune_keeps_newest_cycles_with_numeric_suffix_order(tmp_path: Path) -> None:
    d = DumpDir(str(tmp_path), keep=2)
    for stamp in [STAMP, f"{STAMP}_2", f"{STAMP}_10", "20250102_030406"]:
        for name in (f"stacks_{stamp}.txt", f"torchcomms_fr_trace_{stamp}.txt", f"fr_snapshot_{stamp}.json"):
            (tmp_path / name).write_text("x")
    (tmp_path / "notes.txt").write_text("mine")
    removed = d.prune()
    assert len(removed) == 6
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(["notes.txt", f"stacks_{STAMP}_10.txt", f"torchcomms_fr_trace_{STAMP}_10.txt",
                           f"fr_snapshot_{STAMP}_10.json", "stacks_20250102_030406.txt",
                           "torchcomms_fr_trace_20250102_030406.txt", "fr_snapshot_20250102_030406.json"])


def test_write_atomic_replaces_and_leaves_no_temp_files(tmp_path: Path) -> None:
    path = str(tmp_path / "a.txt")
    write_atomic(path, "one")
    write_atomic(path, b"two")
    assert Path(path).read_text() == "two" and os.listdir(tmp_path) == ["a.txt"]


async def test_file_thread_runs_calls_in_order_raises_their_errors_and_restarts_after_idle(
        tmp_path: Path) -> None:
    files = FileThread("test.dumps.files", idle_s=0.05)
    seen: list[int] = []
    await asyncio.gather(*(files.run(seen.append, i) for i in range(50)))
    assert seen == list(range(50))
    with pytest.raises(FileNotFoundError):
        await files.run(os.listdir, str(tmp_path / "missing"))
    deadline = time.monotonic() + 5
    while any(t.name == "test.dumps.files" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the idle file thread did not end"
        await asyncio.sleep(0.02)
    assert await files.run(lambda: threading.current_thread().name) == "test.dumps.files"


@pytest.fixture
async def collector() -> Any:
    sessions: list[aiohttp.ClientSession] = []

    def make(urls: list[str | None]) -> Collector:
        sessions.append(aiohttp.ClientSession())
        return LiveCollector(sessions[-1], StaticRegistry(urls), timeout=2)

    yield make
    for s in sessions:
        await s.close()


async def _job(fake_job: Any, tmp_path: Path) -> list[str]:
    per_rank = tmp_path / "dumps" / "per_rank"
    urls = await fake_job(synthetic.hang_job(2, n_entries=5, missing_rank=1),
                          dump_paths=[str(per_rank / "rank_0"), str(per_rank / "rank_1")])
    return [*urls, closed_port_url()]


async def test_cycle_writes_reports_snapshot_and_per_rank_pickles(fake_job: Any, collector: Any, tmp_path: Path) -> None:
    dumper = Dumper(collector(await _job(fake_job, tmp_path)), str(tmp_path / "dumps"), interval=60)
    written = await dumper.run_cycle()
    names = sorted(os.path.basename(p) for p in written)
    assert [re.sub(r"\d{8}_\d{6}", "TS", n) for n in names] == [
        "fr_snapshot_TS.json", "stacks_TS.txt", "torchcomms_fr_trace_TS.txt"]
    d = tmp_path / "dumps"
    assert sorted(os.listdir(d / "per_rank")) == ["rank_0", "rank_1"]

    fr = (d / names[2]).read_text()
    assert "Rank 1 never joined all_reduce #4" in fr
    assert f"Rank 0: OK - FR pickle written to {d / 'per_rank' / 'rank_0'}" in fr
    assert re.search(r"^Rank 2: unreachable after \d", fr, re.M)
    assert fr.index("--- Dump File ---") > fr.index("=== Verdict ===")

    stacks = (d / names[1]).read_text()
    assert stacks.startswith("--- Stack groups (main thread; odd ones first) ---\n")
    assert "\n=== Rank 0 ===\nThread 0x" in stacks
    assert re.search(r"=== Rank 2 ===\nrank 2: unreachable after", stacks)

    snap = json.loads((d / names[0]).read_text())
    # The snapshot holds what the analysis saw: each ring from the frontier on (both ranks
    # completed #3, so #1 onward), and what the ring held before the cut.
    assert [e["collective_seq_id"] for e in snap["0"]["entries"]] == [1, 2, 3, 4]
    assert [e["collective_seq_id"] for e in snap["1"]["entries"]] == [1, 2, 3]
    assert (snap["0"]["fr_window"]["ring_entries"], snap["1"]["fr_window"]["ring_entries"]) == (5, 4)
    assert snap["2"]["error"].startswith("rank 2: unreachable after")


async def test_cycles_in_one_second_get_unique_names_and_retention_applies(fake_job: Any, collector: Any, tmp_path: Path) -> None:
    dumper = Dumper(collector(await _job(fake_job, tmp_path)), str(tmp_path / "dumps"),
                    interval=60, keep=2, enabled={"stacks"})
    for _ in range(4):
        await dumper.run_cycle()
    left = sorted(os.listdir(tmp_path / "dumps"))
    assert len(left) == 2 and all(n.startswith("stacks_") for n in left)
    assert dumper.cycles == 4


async def test_enabled_dumps_limits_what_a_cycle_writes(fake_job: Any, collector: Any, tmp_path: Path) -> None:
    dumper = Dumper(collector(await _job(fake_job, tmp_path)), str(tmp_path / "dumps"),
                    interval=60, enabled={"fr_trace"})
    (path,) = await dumper.run_cycle()
    assert os.path.basename(path).startswith("torchcomms_fr_trace_")
    assert "--- Dump File ---" not in Path(path).read_text()
    assert not (tmp_path / "dumps" / "per_rank").exists()


async def test_unwritable_dump_dir_logs_once_and_pages_still_answer(
        aiohttp_client: Any, fake_job: Any, tmp_path: Path, caplog: Any) -> None:
    (tmp_path / "file").write_text("not a directory")
    urls = await fake_job(synthetic.hang_job(2, n_entries=5, missing_rank=1))
    config = ServerConfig(port=0, dump_dir=str(tmp_path / "file" / "dumps"), dump_interval=0.05,
                          enabled_dumps=frozenset({"stacks", "fr_trace"}), fetch_timeout=2)
    caplog.set_level(logging.ERROR, logger="debug_server.frontend.dumps")
    client = await aiohttp_client(make_frontend_app(config, StaticRegistry(urls)))
    dumper = client.app[DUMPER]
    for _ in range(3):
        await dumper.run_cycle()
    resp = await client.get("/stacks", headers={"Accept": "*/*"})
    assert resp.status == 200 and "=== Rank 1 ===" in await resp.text()
    errors = [r for r in caplog.records if "cannot write dumps" in r.getMessage()]
    assert len(errors) == 1 and str(tmp_path / "file" / "dumps") in errors[0].getMessage()
    assert dumper.cycles == 0


async def test_first_background_cycle_comes_soon_after_start(aiohttp_client: Any, fake_job: Any, tmp_path: Path) -> None:
    urls = await fake_job(synthetic.hang_job(2, n_entries=5, missing_rank=1))
    config = ServerConfig(port=0, dump_dir=str(tmp_path / "d"), dump_interval=600,
                          enabled_dumps=frozenset({"stacks"}), fetch_timeout=2)
    client = await aiohttp_client(make_frontend_app(config, StaticRegistry(urls)))
    deadline = time.monotonic() + 5
    while client.app[DUMPER].cycles == 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert client.app[DUMPER].cycles == 1
    assert [n[:7] for n in os.listdir(tmp_path / "d")] == ["stacks_"]


async def test_pages_answer_while_a_dump_write_hangs_and_the_writes_land_in_order_after(
        aiohttp_client: Any, fake_job: Any, tmp_path: Path, monkeypatch: Any) -> None:
    urls = await fake_job(synthetic.hang_job(2, n_entries=5, missing_rank=1))
    config = ServerConfig(port=0, dump_dir=str(tmp_path / "d"), dump_interval=600,
                          enabled_dumps=frozenset({"fr_trace", "stacks"}), fetch_timeout=2)
    entered, release = threading.Event(), threading.Event()
    names: list[str] = []

    def hung_nfs_write(path: str, data: str | bytes) -> None:
        names.append(os.path.basename(path))
        entered.set()
        release.wait(30)
        write_atomic(path, data)

    monkeypatch.setattr(dumps_mod, "write_atomic", hung_nfs_write)
    client = await aiohttp_client(make_frontend_app(config, StaticRegistry(urls)))
    loop = asyncio.get_running_loop()
    try:  # the first background cycle starts about a second after the app
        assert await loop.run_in_executor(None, entered.wait, 10)
        resp = await asyncio.wait_for(client.get("/fr_trace", headers={"Accept": "*/*"}), 10)
        assert resp.status == 200 and "Rank 1 never joined all_reduce #4" in await resp.text()
        resp = await asyncio.wait_for(client.get("/stacks", headers={"Accept": "*/*"}), 10)
        assert resp.status == 200 and "=== Rank 1 ===" in await resp.text()
        # Both pages came while the cycle's first write was still stuck.
        assert os.listdir(tmp_path / "d") == [] and client.app[DUMPER].cycles == 0
    finally:
        release.set()
    deadline = time.monotonic() + 10
    while client.app[DUMPER].cycles == 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert [re.sub(r"\d{8}_\d{6}", "TS", n) for n in names] == [
        "torchcomms_fr_trace_TS.txt", "stacks_TS.txt"]
    assert sorted(os.listdir(tmp_path / "d")) == sorted(names)


def _stack(func: str, line: int) -> str:
    return (
        "Thread 0x00007f0000000001 (most recent call first):\n"
        f'  File "/job/train.py", line {line} in {func}\n'
        '  File "/job/train.py", line 200 in <module>\n'
    )


def test_stacks_report_groups_identical_ranks_odd_one_first() -> None:
    from debug_server.fanout.transport import OK, RankResult
    from debug_server.frontend.dumps import stacks_report

    results = [
        RankResult(r, f"http://h:{r}", OK, body=_stack("hang_phase", 66) if r == 5 else _stack("step", 138))
        for r in range(8)
    ] + [RankResult(8, None, "not registered", error="not registered")]
    text = stacks_report(results)
    head = text.split("=== Rank 0 ===")[0].splitlines()
    assert head[1] == "1 rank (5): hang_phase at train.py:66  (not in a collective)"
    assert head[2] == "7 ranks (0-4, 6-7): step at train.py:138  (not in a collective)"
    assert "=== Rank 8 ===\nrank 8: not registered" in text


async def test_a_big_job_s_dump_cycles_come_less_often_and_not_at_start(tmp_path: Path,
                                                                        monkeypatch: Any) -> None:
    """Above ``interval x DUMP_RANKS_PER_S`` ranks a cycle (a whole-job fan-out) comes every
    ``world / DUMP_RANKS_PER_S`` s, the first one too: not 1 s after start, beside a new
    frontend's first pages. A small job keeps its first cycle soon after start."""

    class _Job:
        def __init__(self, world_size: int) -> None:
            self.world_size = world_size

    sleeps: list[float] = []
    cycles: list[int] = []

    async def sleep(s: float) -> None:
        sleeps.append(s)
        if len(sleeps) > 2:
            raise asyncio.CancelledError

    async def cycle() -> list[str]:
        cycles.append(1)
        return []

    monkeypatch.setattr(dumps_mod.asyncio, "sleep", sleep)
    for world, want in ((131072, [256.0, 256.0]), (8, [1.0, 60.0])):
        sleeps.clear()
        cycles.clear()
        dumper = Dumper(_Job(world), str(tmp_path / "d"), interval=60)  # type: ignore[arg-type]
        monkeypatch.setattr(dumper, "run_cycle", cycle)
        assert dumper.interval_s() == max(60.0, world / dumps_mod.DUMP_RANKS_PER_S)
        with pytest.raises(asyncio.CancelledError):
            await dumper.run_forever()
        assert [round(s) for s in sleeps[:2]] == want, (world, sleeps)
        assert len(cycles) == 2  # one after each of the two sleeps
