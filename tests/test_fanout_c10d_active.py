"""torch's C++ workers on a CUDA build, windowed: the NCCL recorder is asked for its active
entries first, and only a rank that completed what another member has not is asked for its
whole ring (``analysis.activecover``). The fake workers answer as ``FlightRecorderCuda.cpp``
says torch's do (``fakefleet.make_c10d_worker_app(nccl=...)``); each request is recorded with
its query."""

from __future__ import annotations

import asyncio
import collections
import json
from collections.abc import Awaitable, Callable
from typing import Any

import _scenarios as S
import aiohttp
import pytest
from aiohttp import web
from fakefleet import c10d_dump, c10d_empty_dump, c10d_nccl_dump, make_c10d_worker_app
from genjobs import FAILURES, error_findings, jobs
from hypothesis import HealthCheck, given, settings

from debug_server.fanout.leanhttp import LeanClient
from debug_server.fanout.live import LiveCollector
from debug_server.fanout.reply import FrData
from debug_server.frontend.dumps import analyze_fr
from debug_server.rank.worker import StaticProvider, make_worker_app
from debug_server.readers.storeview import StaticRegistry
from debug_server.tools import synthetic
from debug_server.tools.synthetic import make_dump, make_entry

EMPTY = json.dumps(c10d_empty_dump()).encode()
ACTIVE = "dump_nccl_trace_json?onlyactive=true"
WHOLE = "dump_nccl_trace_json"

Asked = collections.Counter[tuple[int, str]]
"""(rank, ``handler?query``) -> how often that rank was asked it."""


def _recorded(app: web.Application, rank: int, asked: Asked) -> web.Application:
    @web.middleware
    async def record(request: web.Request,
                     handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
                     ) -> web.StreamResponse:
        asked[(rank, request.path_qs.removeprefix("/handler/"))] += 1
        return await handler(request)

    app.middlewares.append(record)
    return app


def _torch_cuda(dump: dict[str, Any], cpu: bytes = EMPTY) -> web.Application:
    """torch's C++ worker of a CUDA build: ``cpu`` as its CPU recorder, ``dump`` in its NCCL
    recorder."""
    return make_c10d_worker_app(cpu, nccl=c10d_nccl_dump(dump))


async def _serve(apps: list[web.Application], asked: Asked) -> tuple[list[str],
                                                                    list[web.AppRunner]]:
    urls, runners = [], []
    for rank, app in enumerate(apps):
        runner = web.AppRunner(_recorded(app, rank, asked), handle_signals=False,
                               access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
    return urls, runners


async def _pages(apps: list[web.Application], *, n: int = 1, whole: bool = False,
                 ) -> tuple[list[FrData], Asked]:
    """``n`` default (windowed) pages over ``apps``, then one whole-ring fetch if ``whole``."""
    asked: Asked = collections.Counter()
    urls, runners = await _serve(apps, asked)
    http = LeanClient()
    try:
        async with aiohttp.ClientSession() as session:
            collector = LiveCollector(session, StaticRegistry(urls), timeout=10, http=http)
            frs = [await collector.fr() for _ in range(n)]
            if whole:
                frs.append(await collector.fr(whole=True))
            return frs, asked
    finally:
        http.close()
        for r in runners:
            await r.cleanup()


def _findings(fr: FrData, world: int) -> list[tuple[str, str, int, list[int]]]:
    return [(f["kind"], f["group"], f["seq"], f["ranks"])
            for f in analyze_fr(fr, None, world)["findings"]]


def _nccl_asks(asked: Asked, rank: int) -> dict[str, int]:
    return {q: n for (r, q), n in asked.items() if r == rank and q.startswith(WHOLE)}


async def test_a_rank_that_never_joins_is_found_without_any_whole_nccl_ring() -> None:
    dumps = synthetic.hang_job(8, n_entries=2000, missing_rank=5)
    (first, second), asked = await _pages([_torch_cuda(dumps[r]) for r in range(8)], n=2)
    for fr in (first, second):
        assert [r.status for r in fr.results] == ["ok"] * 8
        assert fr.window == {"0": 1999}
        assert _findings(fr, 8) == [("missing_ranks", "0", 1999, [5])]
    verdict = analyze_fr(second, None, 8)["verdict"]
    assert verdict.startswith("Rank 5 never joined all_reduce #1999 on pg 0"), verdict
    assert all(_nccl_asks(asked, r) == {ACTIVE: 2} for r in range(8))


def _size_mismatch(world: int, small: int, at: int) -> dict[int, dict[str, Any]]:
    """#``at``: rank ``small`` all_reduces 512 floats, which NCCL completes on its side, and goes
    on to #``at + 1``; the other ranks all_reduce 1024 and hang in #``at``."""
    groups = {"main_comm": list(range(world))}
    dumps = {}
    for r in range(world):
        last = at + 1 if r == small else at
        dumps[r] = make_dump([make_entry(
            record_id=s, seq=s, input_sizes=((512 if r == small and s == at else 1024,),),
            state="started" if s == last else "completed") for s in range(last + 1)], groups)
    return dumps


async def test_a_size_mismatch_asks_only_the_completed_side_for_its_whole_ring() -> None:
    dumps = _size_mismatch(8, small=3, at=1500)
    (fr,), asked = await _pages([_torch_cuda(dumps[r]) for r in range(8)])
    assert {r: _nccl_asks(asked, r) for r in range(8)} == {
        r: {ACTIVE: 1, WHOLE: 1} if r == 3 else {ACTIVE: 1} for r in range(8)}
    result = analyze_fr(fr, None, 8)
    (f,) = [f for f in result["findings"] if f["kind"] == "size_mismatch"]
    assert (f["group"], f["seq"], f["op"]) == ("0", 1500, "all_reduce")
    assert "[[512]]" in f["detail"] and "[[1024]]" in f["detail"], f["detail"]
    assert result["category"] == "misconfigured_collective"
    # The completed side's window: its #1500 (done) and #1501 (waiting), nothing older.
    assert [(e["collective_seq_id"], e["input_sizes"]) for e in fr.dumps[3]["entries"]] == [
        (1500, [[512]]), (1501, [[1024]])]


async def test_a_rank_missing_from_an_nccl_op_reads_missing_though_its_cpu_ring_is_newer(
        ) -> None:
    # Rank 2 never issued NCCL #9; its CPU recorder holds gloo ops made after #9. An active reply
    # does not say how old its NCCL ring is, so the merged dump must not claim the CPU ring's
    # oldest op as the rank's: #9 would read as evicted (history_lost) instead of missing.
    dumps = synthetic.hang_job(3, n_entries=10, missing_rank=2)
    newest = max(e["time_created_ns"] for d in dumps.values() for e in d["entries"])
    gloo = make_dump([make_entry(record_id=i, seq=i, comm="cpu_side",
                                 time_created_ns=newest + 1000 * (i + 1)) for i in range(3)],
                     {"cpu_side": [2]})
    apps = [_torch_cuda(dumps[r], json.dumps(c10d_dump(gloo)).encode() if r == 2 else EMPTY)
            for r in range(3)]
    (fr,), _ = await _pages(apps)
    assert fr.dumps[2]["fr_window"]["ring_oldest_ns"] == 0
    assert _findings(fr, 3) == [("missing_ranks", "0", 9, [2])]


async def test_ours_torch_cuda_and_torch_cpu_build_ranks_are_read_together() -> None:
    # Ranks 0-1 ours (our handler, window=4), 2-4 torch on CUDA (NCCL recorder active first),
    # 5-6 torch CPU builds (their only recorder, whole; NCCL 404 once, then not asked again).
    # All in group "0" of the same hang; rank 6 never issued #99.
    dumps = {r: c10d_nccl_dump(d)
             for r, d in synthetic.hang_job(7, n_entries=100, missing_rank=6).items()}
    apps = ([make_worker_app(StaticProvider(dumps[r])) for r in (0, 1)]
            + [make_c10d_worker_app(EMPTY, nccl=dumps[r]) for r in (2, 3, 4)]
            + [make_c10d_worker_app(json.dumps(dumps[r]).encode()) for r in (5, 6)])
    frs, asked = await _pages(apps, n=2)
    for fr in frs:
        assert [r.status for r in fr.results] == ["ok"] * 7
        assert fr.window == {"0": 99}
        assert _findings(fr, 7) == [("missing_ranks", "0", 99, [6])]
        assert [len(fr.dumps[r].get("entries", ())) for r in range(7)] == [1] * 6 + [0]
    assert {q for (r, q) in asked if r in (0, 1)} == {
        "torchcomms_fr_trace_json?window=4"}
    assert all(_nccl_asks(asked, r) == {ACTIVE: 2} for r in (2, 3, 4))
    assert all(_nccl_asks(asked, r) == {ACTIVE: 1} for r in (5, 6))  # 404, remembered


# ---------------------------------------------------------------------------------------------
# The cheaper path never changes an answer


async def _both(dumps: dict[int, dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The analysis of the default (active-first) fetch and of whole rings, same workers."""
    world = len(dumps)
    (live, whole), _ = await _pages([_torch_cuda(dumps[r]) for r in sorted(dumps)], whole=True)
    return analyze_fr(live, None, world), analyze_fr(whole, None, world)


def _answer(result: dict[str, Any]) -> tuple[Any, ...]:
    return (error_findings(result), result.get("category"), result.get("next_step"))


HANGS = {"missing_rank": S.missing_rank, "two_subcomms": S.two_subcomms,
         "p2p_deadlock": S.p2p_deadlock, "stuck_everywhere": S.stuck_everywhere,
         "wrapped_ring": lambda: S.wrapped_ring(hang=True),
         "state_difference": S.state_difference}


@pytest.mark.parametrize("name", sorted(HANGS))
async def test_scenarios_read_active_first_give_the_whole_rings_answer(name: str) -> None:
    live, whole = await _both(HANGS[name]())
    assert _answer(live) == _answer(whole)


GENERATED = settings(max_examples=6, deadline=None, derandomize=True, database=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
"""The histories of ``genjobs.jobs``: a few ranks, a sub-group, P2P, rings
wrapped at their own sizes, one failure each (a mismatch completes on one side at most)."""


@pytest.mark.parametrize("failure", FAILURES)
def test_generated_hangs_read_active_first_give_the_whole_rings_answer(failure: str) -> None:
    def check(job: tuple[dict[int, dict[str, Any]], dict[int, str]]) -> None:
        live, whole = asyncio.run(_both(job[0]))
        assert _answer(live) == _answer(whole)

    GENERATED(given(jobs(failure))(check))()


def _cpu_asks(asked: Asked, rank: int) -> int:
    return sum(n for (r, q), n in asked.items() if r == rank and q.startswith("fr_trace_json"))


async def test_an_empty_cpu_recorder_is_not_asked_again_on_the_next_page() -> None:
    # An NCCL-only job: every rank's CPU recorder is empty. Asked on the first page, it stands
    # for CPU_EMPTY_TTL_S; the NCCL recorder, where the hang is, is asked on every page.
    dumps = synthetic.hang_job(4, n_entries=50, missing_rank=3)
    frs, asked = await _pages([_torch_cuda(dumps[r]) for r in range(4)], n=3)
    assert all(_cpu_asks(asked, r) == 1 for r in range(4))
    assert all(_nccl_asks(asked, r) == {ACTIVE: 3} for r in range(4))
    for fr in frs:
        assert [r.status for r in fr.results] == ["ok"] * 4
        assert _findings(fr, 4) == [("missing_ranks", "0", 49, [3])]


async def test_a_cpu_recorder_with_groups_is_asked_on_every_page() -> None:
    gloo = synthetic.hang_job(2, n_entries=3)
    nccl = synthetic.hang_job(2, n_entries=50, missing_rank=1)
    apps = [_torch_cuda(nccl[r], json.dumps(c10d_dump(gloo[r])).encode()) for r in range(2)]
    _, asked = await _pages(apps, n=3)
    assert [_cpu_asks(asked, r) for r in range(2)] == [3, 3]
