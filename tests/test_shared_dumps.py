"""Ranks that did the same thing share their dump's parts (issue 41): the same result as copies.

The fan-out hands the analysis one shallow copy per rank (``dict(rep)``, its own
``dump_time_ns``) over the representative's ``entries``, ``pg_config``, ``pg_status`` and
``fr_window``. Each scenario of the corpus is scaled to 8, 64, 512 and 4096 ranks (the extra ranks
do what one existing rank does, in every group it is in) and analyzed shared and as deep copies:
the whole result must be equal, and so must the frontier and the cut, which keeps the sharing.
"""

from __future__ import annotations

import gc
import pickle
from collections.abc import Callable
from typing import Any

import pytest
from _jobsim import JobSim
from _scenarios import (
    dtype_mismatch,
    missing_rank,
    size_mismatch,
    stuck_everywhere,
    type_mismatch,
    wrapped_ring,
)
from fakefleet import rank_dumps

from debug_server.analysis.core import analyze
from debug_server.analysis.digest import DigestMemo
from debug_server.analysis.merge import FINDING_KINDS, NCCL_CALLS_FULL_LIMIT
from debug_server.fanout.reply import cut_all
from debug_server.protocol import frwindow
from debug_server.tools.synthetic import make_dump, make_entry

Dumps = dict[int, dict[str, Any]]
SIZES = (8, 64, 512, 4096)
T0 = 1_800_000_000_000_000_000


def _p2p_deadlock() -> Dumps:
    """Ranks 0 and 1 each wait to receive from the other; rank 2 only all_reduces."""
    groups = {"main_comm": [0, 1, 2]}
    dumps = {}
    for r in range(3):
        ents = [make_entry(record_id=s, seq=s) for s in range(3)]
        if r < 2:
            ents.append(make_entry(record_id=3, seq=3, p2p_seq=1, op="recv", is_p2p=True,
                                   peer_desc=f"{r}<-{1 - r}", state="started"))
        dumps[r] = make_dump(ents, groups)
    return dumps


def _inverted() -> Dumps:
    """Rank 2 of 4 reduces metrics before grad_sync at the last step (``test_order``)."""
    sim = JobSim(4, {"grad": ("grad_sync", [0, 1, 2, 3]), "metrics": ("metrics", [0, 1, 2, 3])})
    for _ in range(4):
        sim.coll("grad", line=45)
        sim.coll("metrics", line=50)
    sim.swap(2, -2, -1)
    return sim.dumps()


def _malformed() -> Dumps:
    """Rank 0's ring holds a malformed entry (a note naming rank 0) and rank 1 misses #4."""
    dumps = missing_rank()
    del dumps[0]["entries"][1]["collective_seq_id"]
    dumps[0]["pg_config"]["bad"] = "not a dict"
    return dumps


# scenario -> (builder, the rank the extra ranks copy, the finding kind it must show)
SCENARIOS: dict[str, tuple[Callable[[], Dumps], int, str]] = {
    "missing_ranks": (missing_rank, 0, "missing_ranks"),
    "type_mismatch": (type_mismatch, 0, "type_mismatch"),
    "size_mismatch": (size_mismatch, 0, "size_mismatch"),
    "dtype_mismatch": (dtype_mismatch, 0, "dtype_mismatch"),
    "unmatched_p2p": (_p2p_deadlock, 2, "unmatched_p2p"),
    "stuck_everywhere": (stuck_everywhere, 0, "stuck_everywhere"),
    "order_inversion": (_inverted, 0, "order_inversion"),
    "history_lost": (wrapped_ring, 1, "history_lost"),
    "malformed": (_malformed, 0, "missing_ranks"),
}


def _widened(dump: dict[str, Any], source: int, extra: list[int]) -> dict[str, Any]:
    """``dump`` with every group that ``source`` is in widened by ``extra``."""
    out = pickle.loads(pickle.dumps(dump))
    for c in out.get("pg_config", {}).values():
        if not isinstance(c, dict):
            continue
        members = [int(x) for x in str(c["ranks"]).strip("[]").split(",") if x.strip()]
        if source in members:
            c["ranks"] = str(members + extra)
    return out


def scaled(build: Callable[[], Dumps], source: int, world: int) -> tuple[Dumps, Dumps]:
    """(shared, deep copies) of the scenario at ``world`` ranks: ranks past the scenario's own
    do what ``source`` does. Shared: one shallow copy per rank of its behaviour's dump, with its
    own ``dump_time_ns`` (where the dump has one); deep: each rank its own objects throughout."""
    base = build()
    extra = list(range(len(base), world))
    reps = {r: _widened(d, source, extra) for r, d in base.items()}
    # Read 10 s after the newest op where the scenario says nothing: no op is in flight.
    t_read = max((e.get("time_created_ns") or 0 for d in reps.values() for e in d["entries"]),
                 default=T0) + 10**10
    shared: Dumps = {}
    for r in range(world):
        rep = reps[r if r in reps else source]
        d = dict(rep)
        d["dump_time_ns"] = rep.get("dump_time_ns", t_read) + r
        shared[r] = d
    blobs = {id(d): pickle.dumps(d) for d in reps.values()}
    deep: Dumps = {}
    gc.disable()  # thousands of acyclic dicts: the cyclic collector would rescan them often
    try:
        for r, d in shared.items():
            own = pickle.loads(blobs[id(reps[r if r in reps else source])])
            own["dump_time_ns"] = d["dump_time_ns"]
            deep[r] = own
    finally:
        gc.enable()
    return shared, deep


@pytest.mark.parametrize("world", SIZES)
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_shared_dumps_analyze_as_their_deep_copies(name: str, world: int) -> None:
    build, source, kind = SCENARIOS[name]
    shared, deep = scaled(build, source, world)
    got = analyze(shared, world_size=world)
    assert got == analyze(deep, world_size=world)
    assert kind in {f["kind"] for f in got["findings"]}, got["verdict"]
    if name == "malformed":
        assert f"rank {world - 1}: skipped 1 malformed entry" in " ".join(got["notes"])


def test_every_finding_kind_is_covered() -> None:
    assert {k for _, _, k in SCENARIOS.values()} >= set(FINDING_KINDS)


@pytest.mark.parametrize("world", SIZES)
@pytest.mark.parametrize("name", ["missing_ranks", "history_lost", "unmatched_p2p"])
def test_frontier_and_cut_of_shared_dumps_equal_the_deep_copies_and_keep_the_sharing(
        name: str, world: int) -> None:
    build, source, _ = SCENARIOS[name]
    shared, deep = scaled(build, source, world)
    since = frwindow.frontier(shared, margin=1)
    assert since == frwindow.frontier(deep, margin=1)
    cut, cut_deep = cut_all(shared, since), cut_all(deep, since)
    assert cut == cut_deep
    for r, d in cut.items():
        twin = shared[source] if r >= len(build()) else shared[r]
        rep = cut[source] if r >= len(build()) else d
        assert d["entries"] is rep["entries"] and d.get("fr_window") is rep.get("fr_window")
        assert d["dump_time_ns"] == shared[r]["dump_time_ns"] and d is not shared[r]
        assert twin["entries"] is shared[r]["entries"]
    assert analyze(cut, world_size=world) == analyze(cut_deep, world_size=world)


def test_a_digest_memo_over_shared_dumps_gives_the_same_result_again() -> None:
    shared, deep = scaled(missing_rank, 0, 512)
    memo = DigestMemo()
    first = analyze(shared, world_size=512, digest_memo=memo)
    again = analyze({r: {**d, "dump_time_ns": d["dump_time_ns"] + 5} for r, d in shared.items()},
                    world_size=512, digest_memo=memo)
    assert memo.hits == 2  # one per distinct dump, not per rank
    assert first == analyze(deep, world_size=512)
    later = {r: {**d, "dump_time_ns": d["dump_time_ns"] + 5} for r, d in deep.items()}
    assert again == analyze(later, world_size=512)


def test_131072_ranks_in_two_classes_keep_the_nccl_calls_rows_per_class() -> None:
    world, odd = 131072, 77777
    full, missing = rank_dumps(world)
    dumps = {}
    for r in range(world):
        d = dict(missing if r == odd else full)
        d["dump_time_ns"] = T0 + r
        dumps[r] = d
    cut = cut_all(dumps, frwindow.frontier(dumps))
    assert len({id(d["entries"]) for d in cut.values()}) == 2
    result = analyze(cut, world_size=world)
    assert f"Rank {odd} never joined" in result["verdict"]
    calls = result["nccl_calls"]
    assert 0 < len(calls) <= 2 * len(result["collectives"]) < NCCL_CALLS_FULL_LIMIT
    assert {c["global_ranks"] for c in calls} <= {"0-77776,77778-131071", str(odd)}
    assert all(c["global_rank"] == int(c["global_ranks"].split("-")[0].split(",")[0])
               for c in calls)
