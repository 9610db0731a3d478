"""The dump cycle's files at 131072 ranks (issue 41): classes and ranges, bounded, read back alike.

``bench_dumps_scale.fleet``: ranks that issued the hang (shallow copies of one dump), rank 77777
that never joined it, ranks 100-199 unreachable. Each file the dumper writes stays under 1 MB and
names rank 77777 apart; the snapshot read back (``snapshot.expand``, the ``fr_trace`` CLI, the
post-mortem viewer's reader) analyzes to the live verdict.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_dumps_scale import fleet

from debug_server.analysis import stackparse
from debug_server.analysis.core import analyze
from debug_server.fanout.transport import OK, RankResult
from debug_server.frontend import dumps as dumper
from debug_server.frontend import snapshot
from debug_server.frontend.fetchfacts import FetchFacts
from debug_server.tools import fr_trace, view_disk

WORLD, ODD = 131072, 77777
MB = 1 << 20
STAMP = "20250102_030405"


class Big(tuple):  # type: ignore[type-arg]
    def __repr__(self) -> str:  # a failure's report must not print 131072 records
        return f"<fleet of {WORLD} ranks>"


@pytest.fixture(scope="module")
def big() -> tuple:
    fr, stacks, pickles, odd = fleet(WORLD)
    assert odd == ODD
    result = dumper.analyze_fr(fr, stacks, WORLD)
    return Big((fr, stacks, pickles, result))


def test_each_file_is_bounded_and_names_the_odd_rank_apart(big: tuple) -> None:
    fr, stacks, pickles, result = big
    snap = dumper.snapshot_json(fr)
    text = dumper.fr_trace_text(result, FetchFacts.of(fr), pickles)
    st = dumper.stacks_file(stacks)
    for body in (snap, text, st):
        assert len(body.encode()) < MB
    assert "=== Ranks 0-99, 200-77776, 77778-131071 (130971 ranks) ===" in st
    assert f"\n=== Rank {ODD} ===\n" in st and "=== Ranks 100-199 (100 ranks) ===\nranks 100-199: " in st
    assert "Ranks 0-99, 200-131071: OK - FR pickle written to /nonexistent/dump/per_rank/rank_<N>" in text
    assert "Ranks 100-199: unreachable after 2.0 s" in text
    assert "\n  ranks 100-199: unreachable after 2.0 s" in text  # the PARTIAL DATA block
    without = text.split("--- Ranks without data ---\n", 1)[1].split("\n\n", 1)[0]
    assert without == "ranks 100-199: unreachable after 2.0 s (ConnectTimeout)"
    obj = json.loads(snap)
    assert set(obj) == {"0", str(ODD), snapshot.SAME_KEY, snapshot.ERRORS_KEY, snapshot.MEMBERS_KEY}
    assert obj[snapshot.SAME_KEY]["0"]["ranks"] == "1-99,200-77776,77778-131071"
    assert obj[snapshot.ERRORS_KEY] == [{"ranks": "100-199",
                                        "error": "unreachable after 2.0 s (ConnectTimeout)"}]


def test_the_snapshot_reads_back_as_shared_copies_with_each_ranks_own_time(big: tuple) -> None:
    fr, _, _, _ = big
    back = snapshot.expand(json.loads(dumper.snapshot_json(fr)))
    assert len(back) == WORLD
    for r in (0, 1, 99, 200, ODD, WORLD - 1):
        assert back[str(r)]["dump_time_ns"] == fr.dumps[r]["dump_time_ns"]
    assert back["1"]["entries"] is back[str(WORLD - 1)]["entries"] is back["0"]["entries"]
    assert back["1"] is not back["0"]
    assert back["150"] == {"error": "rank 150: unreachable after 2.0 s (ConnectTimeout)"}
    assert back[str(ODD)]["pg_config"]["main_comm"]["ranks"] == json.dumps(list(range(WORLD)))


def test_the_cli_and_the_viewer_analyze_the_snapshot_to_the_live_verdict(
        big: tuple, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fr, stacks, _, live = big
    snap = tmp_path / f"fr_snapshot_{STAMP}.json"
    snap.write_text(dumper.snapshot_json(fr))
    st = tmp_path / f"stacks_{STAMP}.txt"
    st.write_text(dumper.stacks_file(stacks))
    out = tmp_path / "result.json"
    assert fr_trace.main([str(snap), "--stacks", str(st), "-o", str(out)]) == fr_trace.EXIT_FINDINGS
    cli = json.loads(out.read_text())
    assert cli["verdict"] == live["verdict"]
    assert cli["findings"] == live["findings"] and cli["nccl_calls"] == live["nccl_calls"]
    assert f"Rank {ODD} never joined all_reduce #1999" in capsys.readouterr().out
    # the viewer's reader: the same dumps and failures, stacks per rank again
    data = view_disk.load_cycle(view_disk.scan_dir(str(tmp_path)), view_disk.scan_dir(str(tmp_path)).cycles[0])
    assert data.problems == [] and len(data.dumps) == WORLD - 100 and data.world_size == WORLD
    assert data.fr_errors[150] == "rank 150: unreachable after 2.0 s (ConnectTimeout)"
    assert data.stack_errors[150] == "rank 150: unreachable after 2.0 s (ConnectTimeout)"
    assert "line 1 in sleep" in data.stacks[ODD] and "all_reduce" in data.stacks[0]
    viewed = analyze(data.dumps, world_size=data.world_size, stacks=data.stacks,
                     unavailable=data.fr_errors)
    assert viewed["verdict"] == live["verdict"] and viewed["findings"] == live["findings"]


def test_a_small_job_keeps_a_section_and_a_line_per_rank() -> None:
    results = [RankResult(r, None, OK, body="Thread 0x1 (most recent call first):\n  x\n")
               for r in range(4)]
    st = dumper.stacks_file(results)
    assert [f"=== Rank {r} ===" in st for r in range(4)] == [True] * 4
    assert dumper.stacks_file(results, grouped=True).count("=== Ranks 0-3 (4 ranks) ===") == 1
    grouped = stackparse.split_stacks_file(dumper.stacks_file(results, grouped=True))
    assert sorted(grouped) == [0, 1, 2, 3]


def test_an_old_snapshot_of_one_dump_per_rank_still_loads(big: tuple) -> None:
    fr, _, _, _ = big
    few = [(r, fr.dumps.get(r), f"rank {r}: unreachable") for r in (0, 1, 150, ODD)]
    old = snapshot.expand(json.loads(snapshot.encode_per_rank(few)))
    new = snapshot.expand(json.loads(snapshot.encode(few)))
    assert old == new and sorted(old, key=int) == ["0", "1", "150", str(ODD)]


@pytest.mark.parametrize("same", [
    "not a map",
    {"0": {"ranks": "5-3"}},                                 # a backwards range
    {"0": {"ranks": "0-2"}},                                  # rank 0 twice
    {"9": {"ranks": "4"}},                                    # names no dump
    {"0": {"ranks": "4-9999999"}},                            # past the rank limit
    {"0": {"ranks": "4-6", "dump_time_ns": "1*2"}},           # times that do not add up
    {"0": {"ranks": "4-6", "dump_time_ns": "x"}},
])
def test_a_bad_class_map_is_refused_in_one_line(tmp_path: Path, same: object,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    fr, _, _, _ = fleet(8)
    obj = json.loads(dumper.snapshot_json(fr))
    obj[snapshot.SAME_KEY] = same
    path = tmp_path / f"fr_snapshot_{STAMP}.json"
    path.write_text(json.dumps(obj))
    data = view_disk.CycleData(cycle=None)
    view_disk._load_snapshot(str(path), data)
    assert len(data.problems) == 1 and data.problems[0].startswith(f"fr_snapshot_{STAMP}.json: unusable (")
    assert "\n" not in data.problems[0] and not data.dumps
    assert fr_trace.main([str(path)]) == fr_trace.EXIT_UNUSABLE
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith(f"error: fr_snapshot_{STAMP}.json: not a usable snapshot (")
