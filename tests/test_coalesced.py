"""Coalesced and uneven collectives as c10d records them (issue 33).

The dumps follow the shapes of PyTorch's own analyzer tests (test_fr_analysis.py: a default
group and a per-rank ``sub_pg``, ``allreduce_coalesced``, a ``broadcast`` run closed by
``coalesced``, uneven all_gather as ``_broadcast_oop`` runs closed by ``ALLGATHER_coalesced``,
uneven reduce_scatter as ``_reduce_oop`` runs closed by ``REDUCE_SCATTER_coalesced``, an empty
coalesced call on one rank), with c10d's real sequence numbers: one per run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _scenarios as S
import pytest

from debug_server.analysis.core import analyze
from debug_server.dumpio import write_dump_atomic
from debug_server.tools import fr_trace
from debug_server.tools.synthetic import make_entry

Entry = dict[str, Any]


def _e(rid: int, op: str, ins: list, outs: list | None = None, *, seq: int = 0,
       pg: tuple[str, str] = ("0", "default_pg"), state: str = "completed") -> Entry:
    return make_entry(record_id=rid, comm=pg[0], backend=pg[1], seq=seq, op=op,
                      input_sizes=ins, output_sizes=ins if outs is None else outs, state=state)


def _torch_like(per_rank: dict[int, list[Entry]]) -> dict[int, dict[str, Any]]:
    """PyTorch's LOADED_FR_DETAIL_TEMPLATE: default_pg [0, 1] and a one-rank sub_pg "1"."""
    return {r: {"version": "2.10", "entries": ents, "pg_status": {},
                "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"},
                              "1": {"name": "1", "desc": "sub_pg", "ranks": f"[{r}]"}}}
            for r, ents in per_rank.items()}


def _errors(r: dict[str, Any]) -> list[tuple[str, int | None, list[int]]]:
    return [(f["kind"], f["seq"], f["ranks"]) for f in r["findings"] if f["severity"] == "error"]


def test_all_reduce_on_default_and_per_rank_sub_groups_is_clean() -> None:
    per = {r: [_e(0, "all_reduce", [[4, 4]]), _e(1, "all_reduce", [[5, 5]], pg=("1", "sub_pg"))]
           for r in (0, 1)}
    r = analyze(_torch_like(per))
    assert r["findings"] == []
    # Two groups named "1" with the same desc: told apart by their ranks.
    assert sorted(g["label"] for g in r["groups"]) == ["pg 0 (default_pg)", "pg 1 (sub_pg [0])",
                                                       "pg 1 (sub_pg [1])"]


def test_allreduce_coalesced_is_clean() -> None:
    per = {r: [_e(0, "allreduce_coalesced", [[4, 4]])] for r in (0, 1)}
    assert analyze(_torch_like(per))["findings"] == []


def test_broadcast_run_closed_by_coalesced_is_clean() -> None:
    per = {r: [_e(0, "broadcast", [[4, 4]]), _e(1, "broadcast", [[4, 4]]),
               _e(2, "coalesced", [[]])] for r in (0, 1)}
    r = analyze(_torch_like(per))
    assert r["findings"] == [] and [c["op"] for c in r["collectives"]] == ["coalesced"]


def test_uneven_all_gather_with_a_different_broadcast_is_a_size_mismatch() -> None:
    per = {r: [_e(0, "_broadcast_oop", [[4, 4]]), _e(1, "_broadcast_oop", [[5, 5] if r == 0 else [4, 4]]),
               _e(2, "ALLGATHER_coalesced", [[]])] for r in (0, 1)}
    r = analyze(_torch_like(per))
    assert _errors(r) == [("size_mismatch", 0, [0, 1])]
    assert "[[4, 4], [5, 5], []]" in r["findings"][0]["detail"]


def test_uneven_reduce_scatter_is_clean() -> None:
    per = {r: [_e(0, "_reduce_oop", [[4, 4]]), _e(1, "_reduce_oop", [[4, 4]]),
               _e(2, "REDUCE_SCATTER_coalesced", [[]])] for r in (0, 1)}
    assert analyze(_torch_like(per))["findings"] == []


def test_empty_coalesced_call_on_rank_0_is_not_a_missing_rank() -> None:
    # Rank 0's coalescing block had nothing to reduce: no entry, its next op is #2 like rank 1's.
    per = {0: [_e(0, "all_reduce", [[4, 4]], seq=0), _e(1, "all_reduce", [[4, 4]], seq=2)],
           1: [_e(0, "all_reduce", [[4, 4]], seq=0), _e(1, "_reduce_oop", [[4, 4]], seq=1),
               _e(2, "_reduce_oop", [[4, 4]], seq=1),
               _e(3, "REDUCE_SCATTER_coalesced", [[]], seq=1),
               _e(4, "all_reduce", [[4, 4]], seq=2)]}
    assert analyze(_torch_like(per))["findings"] == []


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter"])
def test_healthy_uneven_run_on_4_ranks_has_no_finding_and_exits_0(kind: str, tmp_path: Path) -> None:
    dumps = S.uneven(kind).dumps()
    r = analyze(dumps)
    assert r["findings"] == [] and "category" not in r
    for rank, d in dumps.items():
        write_dump_atomic(str(tmp_path / f"rank_{rank}"), d)
    assert fr_trace.main([str(tmp_path), "-p", "rank_", "--json"]) == 0


@pytest.mark.parametrize("kind,closer", [("all_gather", "ALLGATHER_coalesced"),
                                         ("reduce_scatter", "REDUCE_SCATTER_coalesced")])
def test_rank_missing_from_an_uneven_run_is_named(kind: str, closer: str) -> None:
    r = analyze(S.uneven(kind, missing=3).dumps())
    assert _errors(r) == [("missing_ranks", 2, [3])]
    assert r["category"] == "cpu_divergence"
    assert r["verdict"].startswith(f"Rank 3 never joined {closer} #2 on pg 0 (default_pg)")


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter"])
def test_real_mismatch_inside_an_uneven_run_names_the_odd_rank(kind: str) -> None:
    r = analyze(S.uneven(kind, bad=1).dumps())
    first = r["findings"][r["finding_order"][0]]
    assert (first["kind"], first["seq"], first["ranks"]) == ("size_mismatch", 2, [1])
    assert r["category"] == "misconfigured_collective"


def test_healthy_uneven_run_never_takes_the_headline_from_the_missing_rank() -> None:
    # The uneven all_gather (#2) is healthy; rank 3 then never joins the all_reduce #3.
    sim = S.uneven("all_gather")
    sim.coll("world", line=29, blocking=True, skip=[3])
    r = analyze(sim.dumps())
    assert _errors(r) == [("missing_ranks", 4, [3])]
    assert r["verdict"].startswith("Rank 3 never joined all_reduce #4 on pg 0 (default_pg)")


def test_tensor_coalesced_and_list_form_all_gather_follow_their_own_size_rules() -> None:
    w = 4
    per = {}
    for r in range(w):
        per[r] = [
            _e(0, "all_gather_into_tensor_coalesced", [[8], [3, 2]], [[8 * w], [3 * w, 2]], seq=0),
            _e(1, "reduce_scatter_tensor_coalesced", [[8 * w], [3 * w, 2]], [[8], [3, 2]], seq=1),
            # gloo's uneven all_gather into a list: rank r's own slot holds r + 1 elements.
            _e(2, "all_gather", [[r + 1]], [[k + 1] for k in range(w)], seq=2),
        ]
    dumps = {r: {"version": "2.10", "entries": e, "pg_status": {},
                 "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": str(list(range(w)))}}}
             for r, e in per.items()}
    assert analyze(dumps)["findings"] == []
    dumps[2]["entries"][0]["output_sizes"] = [[8 * w], [3, 2]]  # rank 2 forgot the group size
    assert _errors(analyze(dumps)) == [("size_mismatch", 0, [2])]
