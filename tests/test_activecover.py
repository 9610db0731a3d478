"""An ``onlyactive`` NCCL recorder reply read as a cut (``analysis.activecover``): the cut it
states, the job's window over groups read so, which ranks it leaves to a whole-ring re-ask, and
what the analyzer makes of a rank that holds only its active entries."""

from __future__ import annotations

import json
from typing import Any

from fakefleet import _nccl_handler, c10d_nccl_dump

from debug_server.analysis.core import analyze
from debug_server.protocol import activecover, frwindow
from debug_server.tools import synthetic
from debug_server.tools.synthetic import make_dump, make_entry

T0 = 1_700_000_000_000_000_000


def _active(dump: dict[str, Any]) -> dict[str, Any]:
    """``dump`` as a CUDA build's ``dump_nccl_trace_json?onlyactive=true`` serves it."""
    status, body = _nccl_handler(c10d_nccl_dump(dump))({"onlyactive": "true"})
    assert status == 200
    return json.loads(body)


def _ring(n: int, *, hang_at: int | None = None, sizes: dict[int, int] | None = None,
          done_past: bool = False) -> list[dict[str, Any]]:
    """all_reduce #0..#n-1 completed, but ``hang_at`` started (and later ones too unless
    ``done_past``); ``sizes``: seq -> element count where it is not 1024."""
    return [make_entry(record_id=s, seq=s, input_sizes=(((sizes or {}).get(s, 1024),),),
                       state="started" if hang_at is not None and s >= hang_at
                       and not (done_past and s == hang_at) else "completed")
            for s in range(n)]


def _size_mismatch(world: int = 4, small: int = 1, at: int = 30) -> dict[int, dict[str, Any]]:
    """#``at``: rank ``small`` all_reduces 512 floats (NCCL completes it there) and goes on to
    #``at + 1``; the others all_reduce 1024 and hang in #``at``."""
    groups = {"main_comm": list(range(world))}
    dumps = {}
    for r in range(world):
        if r == small:
            ents = _ring(at + 2, hang_at=at + 1, sizes={at: 512})
        else:
            ents = _ring(at + 1, hang_at=at)
        dumps[r] = make_dump(ents, groups)
    return dumps


def test_an_active_reply_states_the_cut_from_its_first_seq_not_completed() -> None:
    dump = _active(synthetic.hang_job(3, n_entries=2000, missing_rank=2)[0])
    assert [e["collective_seq_id"] for e in dump["entries"]] == [1999]
    assert activecover.facts(dump) == {"since": {"0": 1999}, "ring_entries": None,
                                       "ring_oldest_ns": 0, "active": ["0"]}


def test_a_reply_without_an_op_between_last_completed_and_last_enqueued_vouches_for_nothing(
        ) -> None:
    # pg_status says #1998 completed is not yet counted (last completed 1997), but the dump
    # already saw its completion: it is in neither the count nor the reply.
    d = c10d_nccl_dump(synthetic.hang_job(2, n_entries=2000)[0])
    d["pg_status"]["0"]["last_completed_collective"] = "1997"
    d["entries"] = [e for e in d["entries"] if not e["time_discovered_completed_ns"]]
    assert activecover.facts(d)["since"] == {"0": activecover.NOT_COVERED}


def test_a_group_with_entries_but_no_status_row_vouches_for_nothing() -> None:
    d = _active(synthetic.hang_job(2, n_entries=50)[0])
    d["entries"].append({**d["entries"][0], "process_group": ["e141ae", "split"]})
    assert activecover.facts(d)["since"] == {"0": 49, "e141ae": activecover.NOT_COVERED}


def test_status_and_config_naming_different_groups_vouch_for_nothing() -> None:
    # c10d keys pg_status by id and pg_config by name; a hashed split-group name breaks the pair.
    d = _active(synthetic.hang_job(2, n_entries=50)[0])
    d["pg_config"] = {"e141ae": d["pg_config"].pop("0")}
    assert activecover.facts(d)["since"] == {"0": activecover.NOT_COVERED}


def test_a_group_read_active_only_is_cut_at_the_first_seq_some_member_has_not_completed(
        ) -> None:
    dumps = {r: activecover.mark(_active(d))
             for r, d in synthetic.hang_job(4, n_entries=2000, missing_rank=3).items()}
    # No margin: #1996-#1998 completed everywhere, and no active reply holds them.
    assert frwindow.frontier(dumps) == {"0": 1999}
    assert all(frwindow.covers(d, {"0": 1999}) for d in dumps.values())


def test_a_group_whose_first_op_some_member_has_not_completed_is_cut_at_zero() -> None:
    dumps = {r: activecover.mark(_active(d))
             for r, d in synthetic.hang_job(2, n_entries=1, missing_rank=1).items()}
    assert frwindow.frontier(dumps) == {"0": 0}
    assert all(frwindow.covers(d, {"0": 0}) for d in dumps.values())


def test_groups_read_whole_keep_their_margin() -> None:
    dumps = synthetic.hang_job(2, n_entries=2000, missing_rank=1)
    assert frwindow.frontier(dumps) == {"main_comm": 1998 - frwindow.FRONTIER_MARGIN}


def test_only_the_rank_that_completed_what_others_have_not_needs_its_whole_ring() -> None:
    dumps = {r: activecover.mark(_active(d)) for r, d in _size_mismatch().items()}
    since = frwindow.frontier(dumps)
    assert since == {"0": 30}
    assert [r for r, d in dumps.items() if not frwindow.covers(d, since)] == [1]


def test_a_rank_busy_in_another_group_reads_missing_not_evicted_from_its_status() -> None:
    # Rank 1 never issued main_comm #5; it is stuck in other_comm, in an op made after #5. An
    # active reply's held entries are its newest, not its ring's oldest: were that oldest time
    # taken as the ring's, #5 would read as evicted (history_lost) on rank 1.
    groups = {"main_comm": [0, 1], "other_comm": [1]}
    r0 = [make_entry(record_id=s, seq=s, time_created_ns=T0 + s * 100,
                     state="started" if s == 5 else "completed") for s in range(6)]
    r1 = ([make_entry(record_id=s, seq=s, time_created_ns=T0 + s * 100) for s in range(5)]
          + [make_entry(record_id=10, seq=0, comm="other_comm", time_created_ns=T0 + 900,
                        state="started")])
    dumps = {0: make_dump(r0, {"main_comm": [0, 1]}), 1: make_dump(r1, groups)}
    active = {r: _active(d) for r, d in dumps.items()}
    unmarked = analyze(active, world_size=2)
    assert [(f["kind"], f["ranks"]) for f in unmarked["findings"]
            if f["group"] == "0"] == [("history_lost", [1])]  # what the marking prevents
    marked = analyze({r: activecover.mark(d) for r, d in active.items()}, world_size=2)
    assert [(f["kind"], f["group"], f["seq"], f["ranks"]) for f in marked["findings"]] == [
        ("missing_ranks", "0", 5, [1]), ("stuck_everywhere", "1", 0, [1])]


def test_mark_text_reads_as_mark_without_encoding_the_reply_again() -> None:
    dump = synthetic.hang_job(3, n_entries=40, missing_rank=2)[0]
    status, body = _nccl_handler(c10d_nccl_dump(dump))({"onlyactive": "true"})
    text = body.decode()
    parsed = json.loads(text)
    marked = activecover.mark_text(text + "\n", parsed)
    assert marked.startswith(text[:-1])  # the reply's own text, the facts appended
    assert json.loads(marked) == activecover.mark(parsed)
