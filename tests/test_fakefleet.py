"""The benchmarks' fake fleet (``tests/fakefleet.py``): ranks in helper processes serve the hang."""

from __future__ import annotations

import json
import urllib.request

from fakefleet import RING, split, start_fleet, stop_fleet


def _entries(url: str) -> list[dict[str, object]]:
    req = urllib.request.Request(f"{url}/handler/torchcomms_fr_trace_json?onlyactive=false",
                                 method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["entries"]


def test_split_cuts_every_rank_into_one_non_empty_range() -> None:
    assert split(5, 2) == [(0, 2), (2, 5)]
    assert split(2, 4) == [(0, 1), (1, 2)]


def test_fleet_over_two_helpers_serves_a_hang_where_the_last_rank_is_missing() -> None:
    fleet, urls = start_fleet(5, 2)
    try:
        assert len(urls) == 5 and len(set(urls)) == 5
        first, last = _entries(urls[0]), _entries(urls[4])
    finally:
        stop_fleet(fleet)
    assert [p.returncode for p in fleet] == [0, 0]
    assert len(first) == RING and first[-1]["state"] == "started"
    assert first[-1]["profiling_name"] == "nccl:all_reduce"
    assert len(last) == RING - 1 and last[-1]["state"] == "completed"
