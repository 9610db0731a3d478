"""Bounded bytes: the dump cycle's snapshot, dump-dir retention, and the Perfetto download."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from debug_server.analysis import core as analysis
from debug_server.config import ServerConfig
from debug_server.fanout.collector import Collector
from debug_server.fanout.live import LiveCollector
from debug_server.frontend import app as frontend
from debug_server.frontend import snapshot
from debug_server.frontend.app import make_frontend_app
from debug_server.frontend.dumps import SNAPSHOT_PREFIX, Dumper
from debug_server.readers.storeview import StaticRegistry
from debug_server.tools import synthetic


@pytest.fixture
async def collector() -> AsyncIterator[Callable[[list[str | None]], Collector]]:
    """``collector(urls)``: a Collector over those workers; one client session per test."""
    async with aiohttp.ClientSession() as session:
        yield lambda urls: LiveCollector(session, StaticRegistry(urls), timeout=5)


def _snapshot_bytes(dump_dir: Path) -> int:
    (snap,) = [p for p in dump_dir.iterdir() if p.name.startswith(SNAPSHOT_PREFIX)]
    return snap.stat().st_size


async def _snapshot_of(fake_job: Any, collector: Any, tmp: Path, ring: int) -> tuple[int, dict[str, Any]]:
    urls = await fake_job(synthetic.hang_job(4, n_entries=ring, missing_rank=3))
    d = tmp / f"ring{ring}"
    await Dumper(collector(urls), str(d), interval=60, enabled={"snapshot"}).run_cycle()
    (snap,) = d.iterdir()
    return _snapshot_bytes(d), json.loads(snap.read_text())


async def test_snapshot_size_does_not_grow_with_ring_length(fake_job: Any, collector: Any,
                                                            tmp_path: Path) -> None:
    small, _ = await _snapshot_of(fake_job, collector, tmp_path, 100)
    big, snap = await _snapshot_of(fake_job, collector, tmp_path, 2000)
    assert big < small * 1.1  # 20x the ring, the same bytes (the window around the frontier)
    # and it still holds what the analysis needs: the hang, from the snapshot alone
    dumps = {int(r): d for r, d in snapshot.expand(snap).items()}
    result = analysis.analyze(dumps, world_size=4)
    missing = [f for f in result["findings"] if f["kind"] == "missing_ranks"]
    assert [(f["seq"], f["ranks"]) for f in missing] == [(1999, [3])]


def _dump(rank: int, members: list[int], n: int, pending_from: int) -> dict[str, Any]:
    entries = [synthetic.make_entry(record_id=seq, seq=seq,
                                    state="scheduled" if seq >= pending_from else "completed")
               for seq in range(n)]
    return synthetic.make_dump(entries, {"main_comm": members})


def test_snapshot_writes_a_long_member_list_once_and_expand_restores_it() -> None:
    members = list(range(512))
    dumps = [(r, _dump(r, members, 4, 4), None) for r in range(8)]
    text = snapshot.encode(dumps)
    # once, not once per rank; an ascending list as its range text (issue 41)
    assert text.count('"ranges": "0-511"') == 1 and json.dumps(members) not in text
    back = snapshot.expand(json.loads(text))
    assert sorted(back) == [str(r) for r in range(8)]  # the shared table is gone again
    assert {d["pg_config"]["main_comm"]["ranks"] for d in back.values()} == {json.dumps(members)}
    odd = members[::-1]  # not ascending: the list's own text, once
    text = snapshot.encode([(r, _dump(r, odd, 4, 4), None) for r in range(8)])
    assert text.count(json.dumps(json.dumps(odd))) == 1
    back = snapshot.expand(json.loads(text))
    assert {d["pg_config"]["main_comm"]["ranks"] for d in back.values()} == {json.dumps(odd)}


def test_snapshot_keeps_short_member_lists_inline() -> None:
    text = snapshot.encode([(0, _dump(0, [0, 1], 2, 2), None)])
    assert snapshot.MEMBERS_KEY not in json.loads(text)
    assert json.loads(text)["0"]["pg_config"]["main_comm"]["ranks"] == "[0, 1]"


def test_entry_cap_keeps_pending_then_newest_and_counts_the_rest() -> None:
    dump = _dump(0, [0, 1], 2000, 1990)  # a group with no frontier: whole ring in the window
    capped = snapshot.cap_entries(dump, 32)
    seqs = [e["collective_seq_id"] for e in capped["entries"]]
    assert seqs == list(range(1968, 2000))  # ring order, the 10 pending among them
    assert capped["fr_window"]["snapshot_dropped"] == 1968
    assert snapshot.cap_entries(capped, 32) is capped  # within the cap: untouched


def test_error_ranks_stay_one_line_in_the_snapshot() -> None:
    text = snapshot.encode([(5, None, "rank 5: unreachable after 2.0 s")])
    assert json.loads(text) == {"5": {"error": "rank 5: unreachable after 2.0 s"}}


# ---------------------------------------------------------------------------------------------
# Retention by bytes


def _cycle_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.iterdir() if p.is_file())


async def test_dump_dir_bytes_stay_under_keep_bytes_over_many_cycles(
        fake_job: Any, collector: Any, tmp_path: Path) -> None:
    urls = await fake_job(synthetic.hang_job(4, n_entries=200, missing_rank=3))
    probe = tmp_path / "probe"
    await Dumper(collector(urls), str(probe), interval=60,
                 enabled={"snapshot", "fr_trace", "stacks"}).run_cycle()
    one_cycle = _cycle_bytes(probe)
    bound = int(one_cycle * 3.5)  # room for 3 cycles, not 4
    d = tmp_path / "dumps"
    dumper = Dumper(collector(urls), str(d), interval=60, keep=50, keep_bytes=bound,
                    enabled={"snapshot", "fr_trace", "stacks"})
    for _ in range(12):
        await dumper.run_cycle()
        assert _cycle_bytes(d) <= bound
    stamps = {p.name.rsplit(".", 1)[0].split("_", 1)[1] for p in d.iterdir()
              if p.name.startswith(SNAPSHOT_PREFIX)}
    assert len(stamps) == 3 and dumper.cycles == 12


async def test_newest_cycle_stays_even_when_it_alone_exceeds_keep_bytes(
        fake_job: Any, collector: Any, tmp_path: Path) -> None:
    urls = await fake_job(synthetic.hang_job(2, n_entries=20, missing_rank=1))
    d = tmp_path / "dumps"
    dumper = Dumper(collector(urls), str(d), interval=60, keep_bytes=1, enabled={"snapshot"})
    for _ in range(3):
        await dumper.run_cycle()
    assert len(os.listdir(d)) == 1


def test_keep_bytes_below_one_is_refused_by_name() -> None:
    from debug_server.config import ConfigError

    with pytest.raises(ConfigError, match=r"keep_bytes=0 must be >= 1"):
        ServerConfig(keep_bytes=0)


# ---------------------------------------------------------------------------------------------
# The Perfetto download at scale


async def test_perfetto_download_above_the_whole_ring_bound_is_the_capped_window(
        fake_job: Any, aiohttp_client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(frontend, "TRACE_WHOLE_RANKS", 1)  # as if this were a big job
    monkeypatch.setattr(frontend, "TRACE_MAX_EVENTS", 40)
    urls = await fake_job(synthetic.hang_job(2, n_entries=500, missing_rank=1))
    client = await aiohttp_client(make_frontend_app(ServerConfig(port=0, fetch_timeout=5),
                                                    StaticRegistry(urls)))
    resp = await client.get("/fr_trace/trace.json")
    assert resp.status == 200 and resp.headers["X-Debug-Server-Trace-Scope"] == "window"
    trace = await resp.json()
    ops = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    per_rank = {pid: sum(1 for e in ops if e["pid"] == pid) for pid in {e["pid"] for e in ops}}
    assert per_rank and max(per_rank.values()) <= 20  # 40 events over 2 ranks
    assert "at most 20 entries per rank" in trace["otherData"]["scope"]


async def test_perfetto_download_of_a_small_job_holds_whole_rings(
        fake_job: Any, aiohttp_client: Any) -> None:
    urls = await fake_job(synthetic.hang_job(2, n_entries=300, missing_rank=1))
    client = await aiohttp_client(make_frontend_app(ServerConfig(port=0, fetch_timeout=5),
                                                    StaticRegistry(urls)))
    resp = await client.get("/fr_trace/trace.json")
    assert resp.headers["X-Debug-Server-Trace-Scope"] == "whole"
    ops = [e for e in (await resp.json())["traceEvents"] if e.get("ph") == "X"]
    assert len(ops) == 300 + 299  # rank 1 never issued the last all_reduce


def test_post_mortem_viewer_reads_shared_member_lists_back_inline(tmp_path: Path) -> None:
    from debug_server.tools import view_disk as view

    members = list(range(300))
    path = tmp_path / f"{SNAPSHOT_PREFIX}_20250102_030405.json"
    path.write_text(snapshot.encode([(r, _dump(r, members, 3, 2), None) for r in range(3)]))
    data = view.CycleData(cycle=None)
    view._load_snapshot(str(path), data)
    assert data.problems == [] and data.fr_errors == {}
    assert sorted(data.dumps) == [0, 1, 2]
    assert data.dumps[2]["pg_config"]["main_comm"]["ranks"] == json.dumps(members)
