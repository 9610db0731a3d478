"""The live FR window: the frontier, the cut, the worker's ``since`` and torch-only workers."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp import web

from debug_server.analysis import core as analysis
from debug_server.fanout.live import LiveCollector
from debug_server.protocol import frwindow
from debug_server.rank.worker import StaticProvider, make_worker_app
from debug_server.readers.storeview import StaticRegistry
from debug_server.tools import synthetic
from debug_server.tools.synthetic import make_dump, make_entry

GROUPS = {"main_comm": [0, 1]}


def _ring(last: int, *, active_from: int | None = None, comm: str = "main_comm",
          first: int = 0) -> list[dict[str, Any]]:
    return [make_entry(record_id=s, seq=s, comm=comm,
                       state="started" if active_from is not None and s >= active_from
                       else "completed") for s in range(first, last + 1)]


def test_frontier_is_lowest_last_completed_over_members_less_the_margin() -> None:
    dumps = {0: make_dump(_ring(40), GROUPS), 1: make_dump(_ring(30), GROUPS)}
    assert frwindow.frontier(dumps) == {"main_comm": 30 - frwindow.FRONTIER_MARGIN}


def test_frontier_goes_below_an_op_still_active_under_a_later_completed_one() -> None:
    ring = _ring(40)
    ring[20] = make_entry(record_id=20, seq=20, state="started")  # #40 completed, #20 not
    dumps = {0: make_dump(ring, GROUPS), 1: make_dump(_ring(40), GROUPS)}
    assert frwindow.frontier(dumps) == {"main_comm": 19 - frwindow.FRONTIER_MARGIN}


def test_member_without_status_for_the_group_keeps_the_group_whole() -> None:
    dumps = {0: make_dump(_ring(40), GROUPS), 1: make_dump([], {"other": [1]})}
    assert frwindow.frontier(dumps) == {}


def test_torch_string_status_values_are_read() -> None:
    dump = make_dump(_ring(40), GROUPS)
    dump["pg_status"]["main_comm"]["last_completed_collective"] = "40"
    assert frwindow.frontier({0: dump}) == {"main_comm": 38}


def test_since_naming_too_many_groups_is_refused() -> None:
    with pytest.raises(ValueError, match="more than 4096 groups"):
        frwindow.parse_since(json.dumps({f"g{i}": 1 for i in range(4097)}, separators=(",", ":")),
                             max_chars=10**6)


def test_window_cuts_collectives_keeps_pending_p2p_and_records_the_ring() -> None:
    ents = _ring(9) + _ring(3, comm="other_comm")
    ents.append(make_entry(record_id=50, seq=10, p2p_seq=1, op="send", is_p2p=True,
                           peer_desc="0->1", state="completed"))
    ents.append(make_entry(record_id=51, seq=10, p2p_seq=2, op="send", is_p2p=True,
                           peer_desc="0->1", state="started"))
    cut = frwindow.window(make_dump(ents, GROUPS), {"main_comm": 7})
    kept = [(e["process_group"][0], e["collective_seq_id"], e["p2p_seq_id"])
            for e in cut["entries"]]
    assert kept == [("main_comm", 7, 0), ("main_comm", 8, 0), ("main_comm", 9, 0),
                    ("other_comm", 0, 0), ("other_comm", 1, 0), ("other_comm", 2, 0),
                    ("other_comm", 3, 0), ("main_comm", 10, 2)]
    assert cut["fr_window"] == {"since": {"main_comm": 7}, "ring_entries": 16,
                                "ring_oldest_ns": ents[0]["time_created_ns"]}
    assert frwindow.window(cut, {"main_comm": 7}) == cut  # idempotent


@pytest.mark.parametrize("since", [{"main_comm": 7}, {"main_comm": 7, "other_comm": 2}, {},
                                   {"pp": 3}])
def test_a_dump_cut_at_the_same_window_is_kept_as_it_is_and_equals_cutting_it_again(
        since: dict[str, int], monkeypatch: pytest.MonkeyPatch) -> None:
    # An agent cuts its ranks at the host's frontier, on most hosts the job's: the frontend
    # keeps such a dump without a pass over its entries, and that is what the pass gives.
    ents = _ring(9) + _ring(3, comm="other_comm") + [
        make_entry(record_id=60 + i, comm="pp", seq=0, p2p_seq=i + 1, op="send", is_p2p=True,
                   peer_desc="0->1", state="completed" if i < 4 else "started")
        for i in range(6)]
    cut = frwindow.window(make_dump(ents, {**GROUPS, "pp": [0, 1]}), since)
    kept = frwindow.window(cut, since)
    assert kept["entries"] is cut["entries"]  # no pass
    monkeypatch.setattr(frwindow, "_cut_at", lambda dump, since: False)
    assert frwindow.window(cut, since) == kept == cut


def test_a_dump_cut_lower_than_the_window_is_cut_again() -> None:
    cut = frwindow.window(make_dump(_ring(9) + _ring(3, comm="other_comm"), GROUPS),
                          {"main_comm": 5})
    again = frwindow.window(cut, {"main_comm": 7})
    assert [e["collective_seq_id"] for e in again["entries"]
            if e["process_group"][0] == "main_comm"] == [7, 8, 9]
    assert again["fr_window"]["since"] == {"main_comm": 7}
    # A group the first cut kept whole is cut now.
    again = frwindow.window(cut, {"main_comm": 5, "other_comm": 2})
    assert [e["collective_seq_id"] for e in again["entries"]
            if e["process_group"][0] == "other_comm"] == [2, 3]


def test_group_seen_only_through_completed_p2p_keeps_its_newest_op() -> None:
    ents = [make_entry(record_id=i, comm="pp", seq=0, p2p_seq=i + 1, op="send", is_p2p=True,
                       peer_desc="0->1") for i in range(5)]
    cut = frwindow.window(make_dump(ents, {"pp": [0, 1]}), {"pp": 3})
    assert [e["p2p_seq_id"] for e in cut["entries"]] == [5]


@pytest.mark.parametrize(("raw", "why"), [
    ("x", "must be a JSON object"), ("[1]", "must be a JSON object"),
    ('{"g": -1}', "must be an integer"), ('{"g": true}', "must be an integer"),
    ('{"g": 1.5}', "must be an integer"), ("{" + "1" * 8050, "longer than 8000 characters"),
])
async def test_worker_refuses_a_bad_since_in_one_line(aiohttp_client: Any, raw: str,
                                                      why: str) -> None:
    client = await aiohttp_client(make_worker_app(StaticProvider(make_dump(_ring(3), GROUPS))))
    resp = await client.post("/handler/torchcomms_fr_trace_json", params={"since": raw})
    text = await resp.text()
    assert resp.status == 400 and text.startswith("parameter since: ") and why in text
    assert "\n" not in text.strip()


async def test_worker_applies_since_to_whatever_dict_it_serves(aiohttp_client: Any) -> None:
    client = await aiohttp_client(make_worker_app(StaticProvider(make_dump(_ring(99), GROUPS))))
    resp = await client.post("/handler/torchcomms_fr_trace_json",
                             params={"since": '{"main_comm": 97}'})
    body = await resp.json()
    assert [e["collective_seq_id"] for e in body["entries"]] == [97, 98, 99]
    assert body["fr_window"]["ring_entries"] == 100


def _torch_worker(dump: dict[str, Any], *, refuse_unknown: bool) -> web.Application:
    """PyTorch's C++ worker as far as the frontend can tell: only c10d's ``fr_trace_json``,
    only torch's parameters (an unknown one is refused, or ignored)."""
    async def handler(request: web.Request) -> web.Response:
        unknown = set(request.query) - {"onlyactive", "includecollectives", "includestacktraces"}
        if unknown and refuse_unknown:
            return web.Response(status=400, text=f"unknown parameter {sorted(unknown)[0]}")
        out = dict(dump)
        if request.query.get("onlyactive") == "true":
            out["entries"] = [e for e in dump["entries"] if e["state"] != "completed"]
        return web.json_response(out)

    app = web.Application()
    app.router.add_post("/handler/fr_trace_json", handler)
    return app


@pytest.mark.parametrize("refuse_unknown", [True, False])
async def test_torch_only_workers_get_whole_rings_cut_to_the_same_window(
        aiohttp_server: Any, refuse_unknown: bool) -> None:
    import aiohttp

    dumps = synthetic.hang_job(2, n_entries=50, missing_rank=1)
    urls = []
    for r in (0, 1):
        server = await aiohttp_server(_torch_worker(dumps[r], refuse_unknown=refuse_unknown))
        urls.append(str(server.make_url("")).rstrip("/"))
    async with aiohttp.ClientSession() as session:
        collector = LiveCollector(session, StaticRegistry(urls), timeout=5)
        for _ in range(2):  # the second page remembers which workers refuse since
            fr = await collector.fr()
            assert fr.window == {"main_comm": 48 - frwindow.FRONTIER_MARGIN}
            assert [len(fr.dumps[r]["entries"]) for r in (0, 1)] == [4, 3]
            result = analysis.analyze(fr.dumps)
            assert [(f["kind"], f["seq"], f["ranks"]) for f in result["findings"]] == [
                ("missing_ranks", 49, [1])]
        assert (collector.rounds._no_since == set(urls)) is refuse_unknown


def test_window_keeps_a_rank_busy_in_another_group_missing_not_history_lost() -> None:
    """Rank 1 went on in other_comm instead of joining main_comm #5; its ring now holds only
    other_comm ops, the oldest from before #5. Cut to other_comm's frontier, only the ring's own
    oldest time (``fr_window``) still tells "never issued" from "evicted"."""
    groups = {"main_comm": [0, 1], "other_comm": [1]}
    t0 = 1_700_000_000_000_000_000
    r0 = [make_entry(record_id=s, seq=s, time_created_ns=t0 + s * 100,
                     state="started" if s == 5 else "completed") for s in range(6)]
    r1 = [make_entry(record_id=10 + s, seq=s, comm="other_comm", time_created_ns=t0 + 450 + s * 100)
          for s in range(30)]
    status = {"main_comm": {"last_enqueued_collective": 4, "last_started_collective": -1,
                            "last_completed_collective": -1}}
    dumps = {0: make_dump(r0, {"main_comm": [0, 1]}), 1: make_dump(r1, groups, status=status)}
    whole = analysis.analyze(dumps)
    since = frwindow.frontier(dumps)
    assert since == {"other_comm": 27}
    live = analysis.analyze({r: frwindow.window(d, since) for r, d in dumps.items()})
    # #0-#4 were issued by rank 1 and evicted (lost); #5 it never issued (missing).
    expect = [("missing_ranks", "main_comm", 5, [1]), ("history_lost", "main_comm", 4, [1])]
    for result in (whole, live):
        assert [(f["kind"], f["group"], f["seq"], f["ranks"]) for f in result["findings"]] == expect


async def test_rank_cut_above_the_job_frontier_is_asked_again_for_the_job_window(
        fake_job: Any) -> None:
    import aiohttp

    # Rank 1 completed only #0-#20 (#21 in flight); rank 0 reports #0-#40 completed. Rank 0's own
    # cut (#36 on) misses #18-#35 of the job's window, so it is asked again with since=.
    dumps = {0: make_dump(_ring(40), GROUPS), 1: make_dump(_ring(21, active_from=21), GROUPS)}
    urls = await fake_job(dumps)
    async with aiohttp.ClientSession() as session:
        fr = await LiveCollector(session, StaticRegistry(urls), timeout=5).fr()
    assert fr.window == {"main_comm": 18}
    assert [e["collective_seq_id"] for e in fr.dumps[0]["entries"]] == list(range(18, 41))
    assert [e["collective_seq_id"] for e in fr.dumps[1]["entries"]] == list(range(18, 22))
    assert fr.dumps[0]["fr_window"]["ring_entries"] == 41
