"""The benchmarks' fake fleet (``benchmarks/fakefleet.py``): ranks in helper processes serve the hang."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fakefleet import (
    RING,
    _nccl_handler,
    c10d_empty_dump,
    c10d_nccl_dump,
    split,
    start_fleet,
    stop_fleet,
)
from httpget import get_json

from debug_server.tools import synthetic


def _entries(url: str) -> list[dict[str, object]]:
    return get_json(f"{url}/handler/torchcomms_fr_trace_json?onlyactive=false", "POST")[
        "entries"]


def test_split_cuts_every_rank_into_one_non_empty_range() -> None:
    assert split(5, 2) == [(0, 2), (2, 5)]
    assert split(2, 4) == [(0, 1), (1, 2)]


@pytest.mark.job
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


# -- torch's C++ worker on a CUDA build, as captured on GPUs (tests/data/c10d_nccl_worker.json) --

def _shape(v: object) -> object:
    """A JSON value's form: key order and value types, not the values."""
    if isinstance(v, dict):
        return [(k, _shape(x)) for k, x in v.items()]
    if isinstance(v, list):
        return [_shape(v[0])] if v else []
    return type(v).__name__


def _captured() -> dict[str, Any]:
    return json.loads((Path(__file__).parent / "data" / "c10d_nccl_worker.json").read_text())


def _nccl_fake(params: dict[str, str]) -> dict[str, Any]:
    status, body = _nccl_handler(c10d_nccl_dump(synthetic.hang_job(2, n_entries=RING)[0]))(params)
    assert status == 200
    assert body == json.dumps(json.loads(body), separators=(",", ":")).encode()  # as c10d spaces it
    return json.loads(body)


def test_the_nccl_fake_writes_what_torchs_worker_writes_key_for_key() -> None:
    real, fake = _captured()["whole"], _nccl_fake({})
    assert list(fake) == list(real)
    for key in ("pg_config", "pg_status"):  # one group's row (the capture has two groups)
        assert _shape(fake[key]["0"]) == _shape(real[key]["0"])
    assert _shape(fake["nccl_comm_state"]) == _shape(real["nccl_comm_state"])
    assert _shape(fake["entries"][0]) == _shape(real["entries"][0])
    assert all("frames" not in e for e in real["entries"] + fake["entries"])
    assert len(fake["entries"]) == _captured()["whole_entries"] == RING


def test_the_nccl_fake_counts_and_states_as_c10d_does_without_timing_events() -> None:
    # No start events (torch's default): never "started", started times 0, last started -1.
    real, fake = _captured()["whole"], _nccl_fake({})
    for d in (real, fake):
        assert {st["last_started_collective"] for st in d["pg_status"].values()} == {"-1"}
        assert {e["state"] for e in d["entries"]} == {"completed", "scheduled"}
        assert {e["time_discovered_started_ns"] for e in d["entries"]} == {0}
        assert all(e["retired"] == (e["state"] == "completed") for e in d["entries"])
        assert all(isinstance(c["ranks"], str) and c["ranks"].startswith("[0, 1")
                   for c in d["pg_config"].values())


def test_the_nccl_fake_honours_onlyactive_and_includecollectives_as_torch_does() -> None:
    cap = _captured()
    fake = _nccl_fake({"onlyactive": "true"})
    assert [e["state"] for e in cap["active"]["entries"]] == [e["state"] for e in fake["entries"]] == [
        "scheduled"]
    assert list(cap["nocoll"]) == list(_nccl_fake({"includecollectives": "false"}))
    assert list(cap["cpu"]) == list(c10d_empty_dump())  # the CPU recorder of an NCCL-only job
