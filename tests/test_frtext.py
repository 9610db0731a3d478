"""Cutting c10d's whole-ring JSON text to a window (``analysis.frtext``): exactly what parsing it
whole and cutting the dump gives, or None (parse it whole) where the text is not c10d's shape."""

from __future__ import annotations

import json
from typing import Any

import _scenarios as sc
import pytest
from fakefleet import c10d_dump, c10d_nccl_dump

from debug_server.protocol import frtext, frwindow
from debug_server.tools import synthetic

Dumps = dict[int, dict[str, Any]]


def _text(dump: dict[str, Any]) -> str:
    return json.dumps(dump, separators=(",", ":"))  # compact, keys in c10d's (sorted) order


def _windows(dumps: Dumps) -> list[frwindow.Window]:
    job = frwindow.frontier(dumps)
    return [frwindow.Window(slack=4), frwindow.Window(slack=0), frwindow.Window(since=job),
            frwindow.Window(since={}), frwindow.Window(since={g: s + 1 for g, s in job.items()})]


def _stuck_early() -> Dumps:
    """Rank 0 never finished seq 10 of 300 (its last completed stays 9)."""
    dumps = synthetic.hang_job(2, n_entries=300)
    dumps[0]["entries"][10]["state"] = "started"
    dumps[0]["entries"][150]["state"] = "scheduled"
    return dumps


JOBS = {
    "ops pending early and midway": _stuck_early,
    "hang, last rank missing": lambda: synthetic.hang_job(4, n_entries=300, missing_rank=3),
    "size mismatch completed on all": sc.size_mismatch,
    "two subcommunicators": sc.two_subcomms,
    "ring wrapped past the hang": lambda: sc.wrapped_ring(hang=True),
    "states differ": sc.state_difference,
    "stuck everywhere": sc.stuck_everywhere,
}


@pytest.mark.parametrize("schema", [c10d_dump, c10d_nccl_dump], ids=["gloo", "nccl"])
@pytest.mark.parametrize("job", list(JOBS), ids=list(JOBS))
def test_the_text_cut_equals_the_parsed_cut(job: str, schema: Any) -> None:
    dumps = {r: schema(d) for r, d in JOBS[job]().items()}
    for w in _windows(dumps):
        for r, d in dumps.items():
            text = frtext.cut_text(_text(d), w)
            assert text is not None, (r, w)
            assert json.loads(text) == w(json.loads(_text(d))), (r, w)


def test_a_group_name_with_quotes_and_backslashes_is_read_as_json_reads_it() -> None:
    dumps = synthetic.hang_job(2, n_entries=40, missing_rank=1, comm='tp "a\\b"')
    d = c10d_nccl_dump(dumps[0])
    w = frwindow.Window(slack=2)
    text = frtext.cut_text(_text(d), w)
    assert text is not None and json.loads(text) == w(d)
    assert {e["process_group"][1] for e in json.loads(text)["entries"]} == {'tp "a\\b"'}


def test_a_ring_with_p2p_ops_is_left_to_the_whole_parse() -> None:
    dumps = {r: c10d_nccl_dump(d) for r, d in sc.p2p_deadlock().items()}
    assert frtext.cut_text(_text(dumps[0]), frwindow.Window(slack=4)) is None


def test_text_not_in_c10ds_shape_is_left_to_the_whole_parse() -> None:
    ours = synthetic.hang_job(2, n_entries=20)[0]  # our recorder's schema, keys unsorted
    assert frtext.cut_text(json.dumps(ours), frwindow.Window(slack=4)) is None
    c10d = _text(c10d_dump(synthetic.hang_job(2, n_entries=20)[0]))
    assert frtext.cut_text(json.dumps(json.loads(c10d), indent=1), frwindow.Window(slack=4)) is None
    assert frtext.cut_text(c10d[:-40], frwindow.Window(slack=4)) is None  # cut short


def test_a_hung_rings_cut_parses_only_the_window() -> None:
    d = c10d_dump(synthetic.hang_job(2, n_entries=2000, missing_rank=1)[0])
    cut = json.loads(frtext.cut_text(_text(d), frwindow.Window(slack=4)) or "{}")
    assert [e["collective_seq_id"] for e in cut["entries"]] == [1994, 1995, 1996, 1997, 1998, 1999]
    assert cut["fr_window"] == {"since": {"0": 1994}, "ring_entries": 2000,
                                "ring_oldest_ns": d["entries"][0]["time_created_ns"]}


def test_the_rings_oldest_time_is_the_least_non_zero_one_as_numbers() -> None:
    d = c10d_nccl_dump(synthetic.hang_job(2, n_entries=6)[0])
    times = [1_000_000_000_000_000_005, 0, 999_999_999_999_999_999, -5, -70, 1_000_000_000_000_000_001]
    for e, t in zip(d["entries"], times, strict=True):
        e["time_created_ns"] = t
    w = frwindow.Window(since={})
    cut = json.loads(frtext.cut_text(_text(d), w) or "{}")
    assert cut["fr_window"]["ring_oldest_ns"] == -70 == w(d)["fr_window"]["ring_oldest_ns"]
