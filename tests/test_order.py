"""Device truth: order inversions across groups, a GPU that has not started its op, and
"GPU or network" only when every member's GPU is inside the op (issue 37)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from _jobsim import JobSim
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from debug_server.analysis.core import analyze
from debug_server.tools.synthetic import make_dump, make_entry
from debug_server.tools.view import make_view_app

TWO = {"grad": ("grad_sync", [0, 1, 2, 3]), "metrics": ("metrics", [0, 1, 2, 3])}


def _inverted(world: int, odd: list[int], *, blocking: bool, steps: int = 3) -> JobSim:
    """``steps`` healthy steps of grad_sync then metrics; at the next one ``odd`` reduce metrics
    first (a set iterated in another order on those ranks)."""
    groups = {k: (d, list(range(world))) for k, (d, _) in TWO.items()}
    sim = JobSim(world, groups)
    for _ in range(steps + 1):
        sim.coll("grad", line=45, blocking=blocking)
        sim.coll("metrics", line=50, blocking=blocking)
    for r in odd:
        sim.swap(r, -2, -1)
    return sim


def _first(r: dict[str, Any]) -> dict[str, Any]:
    return r["findings"][r["finding_order"][0]]


def test_nccl_like_inversion_names_the_odd_rank_and_both_orders() -> None:
    r = analyze(_inverted(4, [2], blocking=False).dumps())
    f = _first(r)
    assert (f["kind"], f["ranks"], f["others"], f["certain"]) == ("order_inversion", [2], [0, 1, 3], True)
    assert r["category"] == "cpu_divergence"
    assert r["verdict"].startswith(
        "Ranks issued collectives in different orders: rank 2 issued all_reduce #3 on pg 1 "
        "(metrics) (/job/train.py:50 in train_step) before all_reduce #3 on pg 0 (grad_sync) "
        "(/job/train.py:45 in train_step); ranks 0-1, 3 issued all_reduce #3 on pg 0 (grad_sync)")
    assert "suspect the GPU" not in r["verdict"]
    assert "issue these collectives in one order on every rank: rank 2 issued" in r["next_step"]


def test_two_ranks_inverted_pick_the_rank_that_left_the_previous_steps_order() -> None:
    for odd in ([0], [1]):
        r = analyze(_inverted(2, odd, blocking=False).dumps())
        f = _first(r)
        assert (f["kind"], f["ranks"]) == ("order_inversion", odd), r["verdict"]


def test_gloo_inversion_names_the_minority_not_the_three_healthy_ranks() -> None:
    r = analyze(_inverted(4, [2], blocking=True).dumps())
    f = _first(r)
    assert (f["kind"], f["ranks"], f["certain"]) == ("order_inversion", [2], False)
    assert (f["group_label"], f["seq"]) == ("pg 0 (grad_sync)", 3)
    assert r["category"] == "cpu_divergence"
    assert r["verdict"].startswith("Rank 2 never joined all_reduce #3 on pg 0 (grad_sync) "
                                   "(ranks 0-1, 3 wait in it): it issued all_reduce #3 on pg 1 "
                                   "(metrics)")
    assert "different orders" in r["verdict"]


def test_inversion_verdict_does_not_depend_on_the_order_dumps_arrive_in() -> None:
    dumps = _inverted(4, [2], blocking=True).dumps()
    first = analyze(dumps)
    rng = random.Random(7)
    for _ in range(20):
        keys = list(dumps)
        rng.shuffle(keys)
        again = analyze({k: dumps[k] for k in keys})
        assert (again["verdict"], again["category"]) == (first["verdict"], first["category"])


def test_streams_show_each_ranks_executing_op_and_what_waits_behind_it() -> None:
    r = analyze(_inverted(4, [2], blocking=False).dumps())
    by_rank = {rk: s for s in r["streams"] for rk in s["ranks"]}
    odd, usual = by_rank[2], by_rank[0]
    assert odd["ops"][odd["executing"]]["label"] == "pg 1 (metrics)" and odd["queued"] == 1
    assert usual["ops"][usual["executing"]]["label"] == "pg 0 (grad_sync)"
    assert [o["state"] for o in odd["ops"][-2:]] == ["started", "scheduled"]


@st.composite
def inverted_jobs(draw: st.DrawFn) -> dict[str, Any]:
    world = draw(st.integers(3, 8))
    n_groups = draw(st.integers(2, 3))
    core = sorted(draw(st.sets(st.integers(0, world - 1), min_size=3, max_size=world)))
    groups = {}
    for i in range(n_groups):
        extra = draw(st.sets(st.integers(0, world - 1), max_size=world))
        groups[f"k{i}"] = (draw(st.sampled_from(["tp", "dp", f"g{i}"])), sorted(set(core) | extra))
    odd = sorted(draw(st.sets(st.sampled_from(core), min_size=1, max_size=(len(core) - 1) // 2)))
    a, b = sorted(draw(st.sets(st.integers(0, n_groups - 1), min_size=2, max_size=2)))
    blocking = draw(st.booleans())
    steps = draw(st.integers(1, 4))
    sim = JobSim(world, groups, hashed=draw(st.booleans()))
    for step in range(steps + 1):
        for i in range(n_groups):
            sim.coll(f"k{i}", line=40 + i, blocking=blocking and step == steps)
    positions = {r: [j for j, it in enumerate(sim.prog[r]) if it.call > steps * n_groups]
                 for r in odd}
    for r in odd:
        last = positions[r]  # this rank's items of the last step, in group order
        sim.swap(r, last[a], last[b])
    note(f"world {world} groups {groups} odd {odd} swap k{a}/k{b} blocking {blocking} steps {steps}")
    return {"sim": sim, "odd": odd, "states": draw(st.sampled_from(["true", "scheduled"]))}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inverted_jobs())
def test_injected_swap_is_the_headline_and_stable(job: dict[str, Any]) -> None:
    dumps = job["sim"].dumps(states=job["states"])
    r = analyze(dumps)
    f = _first(r)
    assert (f["kind"], f["ranks"]) == ("order_inversion", job["odd"]), r["verdict"]
    assert r["category"] == "cpu_divergence"
    assert "different orders" in r["verdict"]
    for _ in range(3):
        keys = list(dumps)
        random.shuffle(keys)
        assert analyze({k: dumps[k] for k in keys})["verdict"] == r["verdict"]


def _ddp(states: dict[int, str], world: int = 2) -> dict[int, dict[str, Any]]:
    """Three completed all_reduces, then #3 in the given state per rank (c10d with timing)."""
    out = {}
    for r in range(world):
        ents = [make_entry(record_id=s, seq=s) for s in range(3)]
        ents.append(make_entry(record_id=3, seq=3, state=states[r]))
        dump = make_dump(ents, {"main_comm": range(world)})
        dump["dump_time_ns"] = ents[-1]["time_created_ns"] + 42_000_000_000
        out[r] = dump
    return out


def test_gpu_that_did_not_start_its_op_is_gpu_busy_and_named() -> None:
    r = analyze(_ddp({0: "started", 1: "scheduled"}))
    assert r["category"] == "gpu_busy"
    f = _first(r)
    assert (f["kind"], f["not_started"], f["started"]) == ("stuck_everywhere", [1], [0])
    assert "Rank 1's GPU has it enqueued but not started, while rank 0's GPU is inside it" in r["verdict"]
    assert "its stream last completed all_reduce #2 on main_comm" in r["verdict"]
    assert "was enqueued 42.0 s before its record was read" in r["verdict"]
    assert "network" not in r["verdict"]


def test_no_start_data_says_it_cannot_tell_and_how_to_turn_timing_on() -> None:
    r = analyze(_ddp({0: "scheduled", 1: "scheduled"}))
    assert r["category"] == "unknown"
    assert "TORCH_NCCL_ENABLE_TIMING=1" in r["next_step"]
    assert "cannot tell whether one GPU is behind" in r["verdict"]


def test_every_gpu_inside_the_op_is_gpu_or_network() -> None:
    r = analyze(_ddp({0: "started", 1: "started"}))
    assert r["category"] == "gpu_or_network"
    assert "every member's GPU is inside it" in r["verdict"]


def test_pipeline_stage_with_nothing_in_flight_is_cpu_divergence() -> None:
    # Stage 2 stops (a sleep, a loop that ended) instead of sending at step 3: c10d's dumps
    # hold nothing of it after step 2, and no stacks. It issued nothing else: not a mismatch.
    sim = JobSim(4, {"pp": ("pp", [0, 1, 2, 3]), "dp0": ("dp", [0, 1]), "dp1": ("dp", [2, 3])})
    for step in range(4):
        for s in range(3):
            sim.p2p("pp", [(s, s + 1)], skip=[2] if (step, s) == (3, 2) else [],
                    blocking_recv=True, line=40 + s)
        if step < 3:
            sim.coll("dp0", line=70, blocking=True)
            sim.coll("dp1", line=70, blocking=True)
    r = analyze(sim.dumps())
    assert r["category"] == "cpu_divergence", r["verdict"]
    assert r["next_step"].startswith("find out where rank 2 is: it has no op in flight")


LEAVING = """Thread 0x00007f9a41b0c740 (most recent call first):
  File "/usr/lib/python3/site-packages/torch/distributed/distributed_c10d.py", line 2100 in destroy_process_group
  File "/job/train.py", line 99 in main
  File "/job/train.py", line 120 in <module>
"""


def test_rank_in_destroy_process_group_is_said_to_be_leaving() -> None:
    from debug_server.tools.synthetic import hang_job

    r = analyze(hang_job(2, 5, missing_rank=1), stacks={1: LEAVING})
    assert r["category"] == "cpu_divergence"
    assert ("Rank 1 is leaving: it is tearing down its process groups (destroy_process_group) "
            "at train.py:99 in main, not in a collective.") in r["verdict"]
    assert "in a collective." not in r["verdict"].replace("not in a collective.", "")
    assert r["next_step"].startswith("find out why rank 1 is leaving")


async def test_fr_trace_page_draws_the_odd_ranks_lane_first(aiohttp_client: Any, tmp_path: Path) -> None:
    # The viewer serves the live pages from a dump dir: one JSON dump per rank here.
    d = tmp_path / "dumps"
    d.mkdir()
    for r, dump in _inverted(4, [2], blocking=False).dumps().items():
        (d / f"nccl_trace_rank_{r}.json").write_text(json.dumps(dump))
    client = await aiohttp_client(make_view_app(str(d)))
    html = await (await client.get("/fr_trace", headers={"Accept": "text/html"})).text()
    lanes = html[html.index("<h2>Streams</h2>"):html.index("<h2>Collectives</h2>")]
    assert lanes.index("Rank 2</strong>: its device runs all_reduce #3 on pg 1 (metrics)") < \
        lanes.index("Ranks 0-1, 3</strong>: its device runs all_reduce #3 on pg 0 (grad_sync)")
    assert '<td class="op-scheduled">all_reduce #3</td>' in lanes
    assert 'class="lane odd"' in lanes


def test_two_threads_issuing_on_one_group_are_named() -> None:
    # An async checkpoint thread's barrier and the training loop's all_reduce on one group:
    # rank 0 issued the all_reduce first, rank 1 the barrier: a type mismatch at #3.
    dumps = {}
    for r in range(2):
        ents = [make_entry(record_id=s, seq=s) for s in range(3)]
        first, second = ("all_reduce", "barrier") if r == 0 else ("barrier", "all_reduce")
        for i, op in enumerate((first, second)):
            e = make_entry(record_id=3 + i, seq=3 + i, op=op, state="started" if i == 0 else "scheduled")
            e["thread_name"] = "MainThread" if op == "all_reduce" else "ckpt_saver"
            ents.append(e)
        dumps[r] = make_dump(ents, {"main_comm": range(2)})
    r = analyze(dumps)
    assert r["findings"][r["finding_order"][0]]["kind"] == "type_mismatch"
    assert ("issued ops on main_comm from 2 threads (MainThread, ckpt_saver): the order in which "
            "two threads issue collectives differs between ranks") in r["verdict"]


def test_banner_names_the_inversion_not_its_ops_stuck_findings() -> None:
    r = analyze(_inverted(4, [2], blocking=False).dumps())
    assert [r["findings"][i]["kind"] for i in r["headline_findings"]] == ["order_inversion"]


def test_two_gloo_ranks_inverted_name_both_orders_without_blaming_one() -> None:
    # On gloo each rank blocks in its first op: rank 0 in grad_sync, rank 1 in metrics. One
    # rank each way: which one is odd (or skipped an op) the record cannot say.
    r = analyze(_inverted(2, [1], blocking=True).dumps())
    f = _first(r)
    assert (f["kind"], f["undecided"], f["ranks"], f["others"]) == ("order_inversion", True, [0, 1], [])
    assert r["category"] == "cpu_divergence"
    assert "cannot tell which side is odd" in r["verdict"]
