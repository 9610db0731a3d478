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
from dataclasses import dataclass
from typing import Any

import _scenarios as S
import aiohttp
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from debug_server.config import ServerConfig
from debug_server.dumpio import write_dump_atomic
from debug_server.frontend.app import COLLECTOR, make_frontend_app
from debug_server.frontend.hangreport import HangWatch
from debug_server.rank.discovery import StaticRegistry
from debug_server.rank.worker import StaticProvider, make_worker_app
from debug_server.tools import fr_trace, synthetic

BASE_NS = 1_700_000_000_000_000_000
FAILURES = ("clean", "missing", "type", "size", "dtype", "stuck", "p2p")
SLEEPING = S.stack_sleeping("/job/train.py", 66)
IN_COLLECTIVE = S.stack_in_all_reduce()


# ---------------------------------------------------------------------------------------------
# A job's history, as each rank's recorder would hold it


@dataclass
class Op:
    group: str
    op: str
    numel: int = 1024
    dtype: str = "Float"
    src: int = -1
    dst: int = -1


class _Rank:
    def __init__(self, rank: int, groups: dict[str, list[int]]) -> None:
        self.rank = rank
        self.groups = {g: m for g, m in groups.items() if rank in m}
        self.entries: list[dict[str, Any]] = []
        self.seq = dict.fromkeys(self.groups, 0)
        self.p2p = dict.fromkeys(self.groups, 0)

    def issue(self, op: Op, t: int, state: str, *, numel: int | None = None,
              name: str | None = None, dtype: str | None = None) -> None:
        n = numel if numel is not None else op.numel
        members = self.groups[op.group]
        kind = name or op.op
        ins = outs = ((n,),)
        if kind == "all_gather":
            outs = ((n * len(members),),)
        common = dict(record_id=len(self.entries), comm=op.group, state=state,
                      dtype=dtype or op.dtype, time_created_ns=BASE_NS + t * 1000 + self.rank)
        if kind in ("send", "recv"):
            self.p2p[op.group] += 1
            desc = f"{op.src}->{op.dst}" if kind == "send" else f"{op.dst}<-{op.src}"
            self.entries.append(synthetic.make_entry(
                seq=self.seq[op.group], p2p_seq=self.p2p[op.group], op=kind, is_p2p=True,
                peer_desc=desc, input_sizes=ins, **common))  # type: ignore[arg-type]
            return
        self.entries.append(synthetic.make_entry(
            seq=self.seq[op.group], op=kind, input_sizes=ins, output_sizes=outs,
            **common))  # type: ignore[arg-type]
        self.seq[op.group] += 1

    def dump(self, ring: int) -> dict[str, Any]:
        kept = self.entries[-ring:]
        status = {}
        for g in self.groups:
            # As the recorder reports it: the issue counter goes on, started/completed come
            # from the ops the ring still holds.
            colls = [e for e in kept if e["process_group"][0] == g and not e["is_p2p"]]
            status[g] = {
                "last_enqueued_collective": self.seq[g] - 1,
                "last_started_collective": max((e["collective_seq_id"] for e in colls
                                                if e["state"] != "scheduled"), default=-1),
                "last_completed_collective": max((e["collective_seq_id"] for e in colls
                                                  if e["state"] == "completed"), default=-1),
            }
        return synthetic.make_dump(kept, self.groups, status=status)


@st.composite
def jobs(draw: st.DrawFn, failure: str) -> tuple[dict[int, dict[str, Any]], dict[int, str]]:
    world = draw(st.integers(2, 4))
    ranks = list(range(world))
    groups = {"main_comm": ranks}
    if world >= 3 and draw(st.booleans()):
        groups["sub_comm"] = sorted(draw(st.lists(st.sampled_from(ranks), min_size=2,
                                                  max_size=world, unique=True)))
    program: list[Op] = []
    for _ in range(draw(st.integers(0, 24))):
        g = draw(st.sampled_from(sorted(groups)))
        if g == "main_comm" and draw(st.integers(0, 4)) == 0:
            src, dst = draw(st.permutations(ranks))[:2]
            program.append(Op(g, "p2p", src=src, dst=dst))
        else:
            program.append(Op(g, draw(st.sampled_from(["all_reduce", "broadcast", "all_gather"])),
                              numel=draw(st.sampled_from([256, 1024]))))
    rs = {r: _Rank(r, groups) for r in ranks}
    t = 0
    for op in program:
        t += 1
        if op.op == "p2p":
            rs[op.src].issue(op, t, "completed", name="send")
            rs[op.dst].issue(op, t, "completed", name="recv")
            continue
        for r in groups[op.group]:
            rs[r].issue(op, t, "completed")
    away: set[int] = set()  # ranks that never reached the failing op (they sleep)
    t += 1
    if failure == "p2p":
        src, dst = draw(st.permutations(ranks))[:2]
        op = Op("main_comm", "p2p", src=src, dst=dst)
        holder, peer = (src, dst) if draw(st.booleans()) else (dst, src)
        rs[holder].issue(op, t, "started", name="send" if holder == src else "recv")
        away.add(peer)
    elif failure != "clean":
        g = draw(st.sampled_from(sorted(groups)))
        members = groups[g]
        op = Op(g, "all_reduce")
        odd = draw(st.sampled_from(members))
        if failure in ("missing", "stuck"):
            for r in members:
                if failure == "missing" and r == odd:
                    away.add(r)
                    continue
                rs[r].issue(op, t, "started")
        else:
            # NCCL completes a mismatched op on one side at most (the smaller count's).
            odd_done, rest_done = draw(st.sampled_from([(True, False), (False, True),
                                                        (False, False)]))
            then_next = draw(st.booleans())
            odd_kw: dict[str, Any] = {"type": {"name": "broadcast"}, "size": {"numel": 2048},
                                      "dtype": {"dtype": "Int"}}[failure]
            for r in members:
                done = odd_done if r == odd else rest_done
                rs[r].issue(op, t, "completed" if done else "started", **(odd_kw if r == odd else {}))
                if done and then_next:  # the completed side goes on to the next op, and waits
                    rs[r].issue(Op(g, "all_reduce"), t + 1, "started")
    dumps = {}
    for r in ranks:
        ring = draw(st.sampled_from([3, 5, 8, 13, 2000]))
        dumps[r] = rs[r].dump(ring)
    stacks = {r: SLEEPING if r in away else IN_COLLECTIVE for r in ranks}
    return dumps, stacks


# ---------------------------------------------------------------------------------------------
# The two paths


async def _live(dumps: dict[int, dict[str, Any]], stacks: dict[int, str]) -> dict[str, Any]:
    runners: list[web.AppRunner] = []

    async def serve(app: web.Application) -> str:
        runner = web.AppRunner(app, handle_signals=False, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    try:
        urls = [await serve(make_worker_app(StaticProvider(dumps[r], stacks=stacks[r])))
                for r in sorted(dumps)]
        app = make_frontend_app(ServerConfig(port=0, fetch_timeout=5.0), StaticRegistry(urls))
        base = await serve(app)
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{base}/fr_trace?format=json") as resp:
                assert resp.status == 200
                page = await resp.json()
            async with s.get(f"{base}/metrics") as resp:
                assert resp.status == 200
                metrics = await resp.text()
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
    assert code == (2 if _errors(result) else 0)
    return result


# ---------------------------------------------------------------------------------------------
# Comparison

_KEYS = ("kind", "group", "seq", "p2p_seq", "op", "ranks", "detail", "waiting", "signatures")


def _errors(result: dict[str, Any]) -> list[dict[str, Any]]:
    found = result["findings"]
    order = result.get("finding_order") or range(len(found))
    return [{k: found[i].get(k) for k in _KEYS} for i in order
            if found[i]["severity"] == "error"]


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
    assert _errors(page) == _errors(pm)
    assert _verdict_parts(page) == _verdict_parts(pm)
    assert _rows(page, page["fr_window"] or {}) == _rows(pm, page["fr_window"] or {})
    _assert_history_lost_only_where_the_cli_sees_it(page, pm)
    assert _errors(report["analysis"]) == _errors(pm)
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
    rs = {r: _Rank(r, groups) for r in (0, 1)}
    for t in range(good):
        for r in (0, 1):
            rs[r].issue(Op("main_comm", "all_reduce"), t, "completed")
    rs[0].issue(Op("main_comm", "all_reduce"), good, "completed", numel=1024)
    rs[1].issue(Op("main_comm", "all_reduce"), good, "started", numel=2048)
    return {r: rs[r].dump(ring) for r in (0, 1)}


def test_size_mismatch_completed_on_one_side_is_found_live_at_seq_3() -> None:
    out = _check(_size_mismatch_job(), {0: IN_COLLECTIVE, 1: IN_COLLECTIVE})
    (f,) = _errors(out["page"])
    assert (f["kind"], f["seq"], f["ranks"]) == ("size_mismatch", 3, [0, 1])
    assert out["page"]["category"] == "misconfigured_collective"
    assert not [x for x in out["page"]["findings"] if x["kind"] == "history_lost"]


def test_long_ring_is_fetched_from_the_frontier_not_whole() -> None:
    out = _check(_size_mismatch_job(good=500), {0: IN_COLLECTIVE, 1: IN_COLLECTIVE})
    # Rank 1 completed up to #499, so #497 on is all that can disagree.
    assert out["page"]["fr_window"] == {"main_comm": 497}
    assert [c["seq"] for c in out["page"]["collectives"]] == [497, 498, 499, 500]
    assert _errors(out["page"])[0]["seq"] == 500
