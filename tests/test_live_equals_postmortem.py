"""Live equals post-mortem: what the frontend finds while a job hangs is what the CLI finds after.

Hypothesis writes the history of a small job (2-4 ranks, a world communicator and sometimes a
sub-communicator, collectives and P2P, each rank's ring wrapped at its own size) ending in one
failure: a rank missing, a type/size/dtype mismatch with one side completed as NCCL does, an
unmatched P2P op, a collective stuck everywhere, or none. The rings are served by real worker
apps (``make_worker_app`` over ``StaticProvider``, port 0) behind a real frontend app, and
written as pickles for ``python -m debug_server.fr_trace`` (run in-process). The error findings,
their order, the category and the next step of ``/fr_trace?format=json``, of the hang report
and (as counts, missing ranks and stuck seqs) of ``/metrics`` must equal the CLI's.

``history_lost`` is compared one way only: the live window reports a lost op only where the
CLI does too (never for entries it simply did not fetch); below the frontier it says nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from collections import Counter
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from fakes import serve
from genjobs import FAILURES, IN_COLLECTIVE, Op, RankRing, error_findings, jobs
from hypothesis import HealthCheck, given, settings
from prometheus_client.parser import text_string_to_metric_families

from debug_server.config import ServerConfig
from debug_server.dumpio import write_dump_atomic
from debug_server.frontend.app import COLLECTOR, make_frontend_app
from debug_server.frontend.hangreport import HangWatch
from debug_server.rank.worker import StaticProvider, make_worker_app
from debug_server.readers.storeview import StaticRegistry
from debug_server.tools import fr_trace

# ---------------------------------------------------------------------------------------------
# The two paths


async def _live(dumps: dict[int, dict[str, Any]], stacks: dict[int, str]) -> dict[str, Any]:
    runners: list[web.AppRunner] = []
    try:
        urls = [await serve(make_worker_app(StaticProvider(dumps[r], stacks=stacks[r])), runners)
                for r in sorted(dumps)]
        app = make_frontend_app(ServerConfig(port=0, fetch_timeout=5.0), StaticRegistry(urls))
        base = await serve(app, runners)
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{base}/fr_trace?format=json") as resp:
                assert resp.status == 200
                page = await resp.json()
            # /metrics is the frontend's last FR cycle (its first comes soon after start):
            # scrape until one is in (a scrape asks no rank).
            deadline = asyncio.get_running_loop().time() + 30
            while True:
                async with s.get(f"{base}/metrics") as resp:
                    assert resp.status == 200
                    metrics = await resp.text()
                if any(s.name == "debug_server_last_cycle_age_seconds" and s.labels["part"] == "fr"
                       for fam in text_string_to_metric_families(metrics) for s in fam.samples):
                    break
                assert asyncio.get_running_loop().time() < deadline, metrics
                await asyncio.sleep(0.02)
        report = await HangWatch(app[COLLECTOR], None, interval=1.0).write_report([], [])
        return {"page": page, "metrics": metrics, "report": report.to_json()}
    finally:
        for runner in reversed(runners):
            await runner.cleanup()


def _postmortem(dumps: dict[int, dict[str, Any]], stacks: dict[int, str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        for r, dump in dumps.items():
            write_dump_atomic(os.path.join(d, "per_rank", f"rank_{r}"), dump)
        stacks_file = os.path.join(d, "stacks.txt")
        with open(stacks_file, "w") as f:
            f.write("".join(f"=== Rank {r} ===\n{text}\n" for r, text in sorted(stacks.items())))
        out = os.path.join(d, "out.json")
        code = fr_trace.main([os.path.join(d, "per_rank"), "-p", "rank_", "--stacks",
                              stacks_file, "--json", "-o", out])
        with open(out) as f:
            result = json.load(f)
    assert code == (2 if error_findings(result) else 0)
    return result


# ---------------------------------------------------------------------------------------------
# Comparison

def _verdict_parts(result: dict[str, Any]) -> tuple[Any, Any]:
    return result.get("category"), result.get("next_step")


def _rows(result: dict[str, Any], window: dict[str, int]) -> list[tuple[Any, ...]]:
    keys = ("group", "seq", "p2p_seq", "op", "state", "pass_check", "missing_ranks",
            "present_ranks", "history_lost_ranks", "input_sizes", "mismatch")
    return [tuple(json.dumps(c[k]) for k in keys) for c in result["collectives"]
            if c["seq"] is None or c["seq"] >= window.get(c["group"], 0)]


def _metrics(text: str) -> tuple[Counter[str], set[tuple[str, str, str]], dict[str, int]]:
    kinds: Counter[str] = Counter()
    missing: set[tuple[str, str, str]] = set()
    stuck: dict[str, int] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "debug_server_findings":
                kinds[s.labels["kind"]] = int(s.value)
            elif s.name == "debug_server_missing_ranks":
                missing.add((s.labels["group"], s.labels["seq"], s.labels["rank"]))
            elif s.name == "debug_server_stuck_seq":
                stuck[s.labels["group"]] = int(s.value)
    return kinds, missing, stuck


def _expected_metrics(pm: dict[str, Any]) -> tuple[Counter[str], set[tuple[str, str, str]],
                                                   dict[str, int]]:
    errors = [f for f in pm["findings"] if f["severity"] == "error"]
    missing = {(f["group"], str(f["seq"]), str(r)) for f in errors
               if f["kind"] == "missing_ranks" for r in f["ranks"]}
    stuck: dict[str, int] = {}
    for f in errors:
        if isinstance(f["seq"], int):
            stuck[f["group"]] = min(stuck.get(f["group"], f["seq"]), f["seq"])
    return Counter(f["kind"] for f in errors), missing, stuck


def _assert_history_lost_only_where_the_cli_sees_it(live: dict[str, Any],
                                                    pm: dict[str, Any]) -> None:
    lost = {f["group"]: f for f in pm["findings"] if f["kind"] == "history_lost"}
    for f in live["findings"]:
        if f["kind"] != "history_lost":
            continue
        assert f["group"] in lost, f
        assert f["seq"] == lost[f["group"]]["seq"]
        assert set(f["ranks"]) <= set(lost[f["group"]]["ranks"])


def _check(dumps: dict[int, dict[str, Any]], stacks: dict[int, str]) -> dict[str, Any]:
    pm = _postmortem(dumps, stacks)
    got = asyncio.run(_live(dumps, stacks))
    page, report = got["page"], got["report"]
    assert error_findings(page) == error_findings(pm)
    assert _verdict_parts(page) == _verdict_parts(pm)
    assert _rows(page, page["fr_window"] or {}) == _rows(pm, page["fr_window"] or {})
    _assert_history_lost_only_where_the_cli_sees_it(page, pm)
    assert error_findings(report["analysis"]) == error_findings(pm)
    assert (report.get("category"), report.get("next_step")) == _verdict_parts(pm)
    _assert_history_lost_only_where_the_cli_sees_it(report["analysis"], pm)
    assert _metrics(got["metrics"]) == _expected_metrics(pm)
    return {"pm": pm, "page": page}


# ---------------------------------------------------------------------------------------------
# Tests


@pytest.mark.parametrize("failure", FAILURES)
def test_live_findings_equal_the_post_mortem_cli_on_generated_rings(failure: str) -> None:
    @settings(max_examples=6, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(jobs(failure))
    def check(job: tuple[dict[int, dict[str, Any]], dict[int, str]]) -> None:
        _check(*job)

    check()


def _size_mismatch_job(ring: int = 2000, good: int = 3) -> dict[int, dict[str, Any]]:
    """The issue's case: #0..#(good-1) fine, then rank 0 all_reduces 1024 floats (NCCL completes
    it) while rank 1 all_reduces 2048 and hangs."""
    groups = {"main_comm": [0, 1]}
    rs = {r: RankRing(r, groups) for r in (0, 1)}
    for t in range(good):
        for r in (0, 1):
            rs[r].issue(Op("main_comm", "all_reduce"), t, "completed")
    rs[0].issue(Op("main_comm", "all_reduce"), good, "completed", numel=1024)
    rs[1].issue(Op("main_comm", "all_reduce"), good, "started", numel=2048)
    return {r: rs[r].dump(ring) for r in (0, 1)}


def test_size_mismatch_completed_on_one_side_is_found_live_at_seq_3() -> None:
    out = _check(_size_mismatch_job(), {0: IN_COLLECTIVE, 1: IN_COLLECTIVE})
    (f,) = error_findings(out["page"])
    assert (f["kind"], f["seq"], f["ranks"]) == ("size_mismatch", 3, [0, 1])
    assert out["page"]["category"] == "misconfigured_collective"
    assert not [x for x in out["page"]["findings"] if x["kind"] == "history_lost"]


def test_long_ring_is_fetched_from_the_frontier_not_whole() -> None:
    out = _check(_size_mismatch_job(good=500), {0: IN_COLLECTIVE, 1: IN_COLLECTIVE})
    # Rank 1 completed up to #499, so #497 on is all that can disagree.
    assert out["page"]["fr_window"] == {"main_comm": 497}
    assert [c["seq"] for c in out["page"]["collectives"]] == [497, 498, 499, 500]
    assert error_findings(out["page"])[0]["seq"] == 500
