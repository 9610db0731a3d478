"""python -m debug_server.preflight on real 2-rank gloo jobs (tests/mpjob), plus its pure parts."""

from __future__ import annotations

import json

import pytest
from mpjob import assert_ok, run_job

from debug_server.tools import preflight

SCRIPT = """
import sys
from debug_server.tools.preflight import main
sys.exit(main(sys.argv[1:] or {args!r}))
"""


def run_preflight(tmp_path, *extra: str) -> dict:
    args = ["--max-size", str(1 << 20), "--iters", "6", "--warmup", "2",
            "--json", str(tmp_path / "preflight.json"), *extra]
    results = run_job(SCRIPT.format(args=args), 2, tmp_path, timeout=60)
    assert_ok(results)
    assert "== all_reduce bandwidth" in results[0].stdout
    assert results[1].stdout == ""  # only rank 0 prints
    return json.loads((tmp_path / "preflight.json").read_text())


@pytest.mark.job
@pytest.mark.timeout(90)
def test_rank_made_slow_with_sleep_is_flagged(tmp_path):
    report = run_preflight(tmp_path, "--simulate-delay", "1:0.05")
    flagged = report["stragglers"]["flagged"]
    assert [f["rank"] for f in flagged] == [1]
    assert flagged[0]["flags"] == ["late"]
    rows = {r["rank"]: r for r in report["stragglers"]["ranks"]}
    assert rows[1]["arrival_lateness_s"] > 0.04
    assert rows[0]["arrival_lateness_s"] < 0.01


@pytest.mark.job
@pytest.mark.timeout(90)
def test_even_job_writes_bandwidth_rows_and_flags_nothing(tmp_path):
    # Thresholds above this box's jitter under a parallel test run (a 1.5 ms barrier round
    # trip was flagged once at the 1 ms default floor), below the 50 ms the slow-rank test injects.
    report = run_preflight(tmp_path, "--rtt-floor-ms", "20", "--late-ms", "30")
    rows = report["bandwidth"]
    assert [r["size_bytes"] for r in rows] == [1 << k for k in range(10, 21)]
    for r in rows:
        assert r["count"] == r["size_bytes"] // 4
        for key in ("time_s", "algbw_gbps", "busbw_gbps"):
            assert isinstance(r[key], float) and r[key] > 0, (key, r)
        # busbw = algbw * 2(n-1)/n, and n = 2
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"])
    st = report["stragglers"]
    assert st["flagged"] == []
    assert [r["rank"] for r in st["ranks"]] == [0, 1]
    assert all(r["flags"] == [] for r in st["ranks"])
    assert [i["rank"] for i in report["identity"]] == [0, 1]
    assert report["identity"][0]["device"] == "cpu"
    assert report["env"]["1"]["WORLD_SIZE"] == "2"
    assert report["world_size"] == 2 and report["backend"] == "gloo"
    assert isinstance(report["warnings"], list)


def test_sweep_sizes_powers_of_two_and_four():
    assert preflight.sweep_sizes(1 << 20) == [1 << k for k in range(10, 21)]
    assert preflight.sweep_sizes(1 << 20, step=4) == [1 << k for k in range(10, 21, 2)]
    assert preflight.sweep_sizes(3000) == [1024, 2048]


def test_busbw_factor_is_two_n_minus_one_over_n():
    assert preflight.busbw_factor(2) == 1.0
    assert preflight.busbw_factor(8) == 1.75
    assert preflight.busbw_factor(1) == 0.0


def test_flag_stragglers_marks_late_arrival_not_its_victims():
    # Rank 2 arrives 50 ms late every time: it waits least, ranks 0 and 1 wait for it.
    raw = {
        "arrival": {0: [0.0502, 0.0501, 0.0503], 1: [0.0501, 0.0502, 0.0502], 2: [0.0002] * 3},
        "turns": {
            0: {0: [0.05] * 3, 1: [0.05] * 3, 2: [0.0002] * 3},   # spoiled by rank 2: no sample
            1: {0: [0.05] * 3, 1: [0.05] * 3, 2: [0.0002] * 3},
            2: {0: [0.052] * 3, 1: [0.052] * 3, 2: [0.0003] * 3},
        },
    }
    st = preflight.flag_stragglers(raw)
    assert [(f["rank"], f["flags"]) for f in st["flagged"]] == [(2, ["late"])]
    rows = {r["rank"]: r for r in st["ranks"]}
    assert rows[0]["barrier_median_s"] is None and rows[2]["barrier_median_s"] == 0.0003


def test_flag_stragglers_slow_round_trip():
    # Each rank in its own turn arrives last; rank 3's round trip is 10x the others'.
    rt = {0: 0.0002, 1: 0.0002, 2: 0.00025, 3: 0.003}
    turns = {r: {q: ([rt[r]] * 4 if q == r else [rt[r] + 0.002] * 4) for q in rt} for r in rt}
    raw = {"arrival": {r: [0.0002] * 4 for r in rt}, "turns": turns}
    st = preflight.flag_stragglers(raw)
    assert [(f["rank"], f["flags"]) for f in st["flagged"]] == [(3, ["slow_barrier"])]


def test_preflight_without_torchrun_env_is_one_line_error(monkeypatch, capsys):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert preflight.main(["--backend", "gloo"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "run under torchrun" in err[0]
