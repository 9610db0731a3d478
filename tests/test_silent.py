"""Silent ranks: a rank that gave no FR data but was read from outside (stack, process state)."""

from __future__ import annotations

from typing import Any

from debug_server.analysis import core as analysis
from debug_server.tools.synthetic import hang_job

GIL_STACK = """Thread 0x00007f9a41b0c740 [tid 11874, "MainThread", active, holds the GIL] (most recent call first):
  File "/job/train.py", line 47 in spin
  File "/job/train.py", line 90 in <module>
"""
IN_ALL_REDUCE = """Thread 0x00007f9a41b0c740 (most recent call first):
  File "/usr/lib/python3/torch/distributed/distributed_c10d.py", line 2800 in all_reduce
  File "/job/train.py", line 60 in step
  File "/job/train.py", line 90 in <module>
"""


def _three_of_four() -> dict[int, dict[str, Any]]:
    d = hang_job(4, 5, missing_rank=2)
    return {r: d[r] for r in (0, 1, 3)}


def _analyze(**kw: Any) -> dict[str, Any]:
    return analysis.analyze(_three_of_four(), world_size=4,
                            unavailable={2: "timed out after 5.0 s"}, **kw)


def test_silent_rank_holding_the_gil_outside_a_collective_is_the_missing_rank() -> None:
    r = _analyze(stacks={2: GIL_STACK})
    assert r["category"] == "cpu_divergence"
    f = r["findings"][0]
    assert (f["kind"], f["seq"], f["ranks"], f["waiting"]) == ("missing_ranks", 4, [2], [0, 1, 3])
    assert f["silent"]["2"]["holds_gil"] is True
    assert r["verdict"].startswith("Rank 2 never joined all_reduce #4 on main_comm (ranks 0-1, 3 wait in it). "
                                   "Rank 2 cannot answer: its main thread holds the GIL in a C call "
                                   "at train.py:47 in spin.")
    assert "holds the GIL" in r["next_step"] and "train.py:47" in r["next_step"]


def test_stopped_rank_without_a_stack_is_named_with_its_state_and_how_to_resume() -> None:
    proc = {"state": "stopped", "since": 1764300000.0, "holds_gil": None, "cpu_pct": 0.0,
            "wchan": "do_signal_stop", "pid": 4242}
    r = _analyze(processes={2: proc})
    assert r["category"] == "cpu_divergence"
    assert r["findings"][0]["ranks"] == [2]
    assert "Rank 2 cannot answer: its process is stopped" in r["verdict"]
    assert "since 03:20:00 UTC" in r["verdict"]
    assert "kill -CONT 4242" in r["next_step"]
    assert r["ranks"] == [{"rank": 2, "process": proc}]


def test_silent_rank_inside_a_collective_stays_unknown() -> None:
    r = _analyze(stacks={2: IN_ALL_REDUCE},
                 processes={2: {"state": "running", "holds_gil": False, "cpu_pct": 1.0}})
    assert r["findings"] == [] and r["category"] == "unknown"
    assert "may be the one missing" in r["verdict"]


def test_blocked_process_shows_its_wait_channel_in_the_verdict() -> None:
    proc = {"state": "blocked", "since": None, "holds_gil": None, "cpu_pct": 0.0,
            "wchan": "nfs_wait_on_request"}
    r = _analyze(processes={2: proc})
    assert "blocked in the kernel (nfs_wait_on_request)" in r["verdict"]
    assert r["category"] == "cpu_divergence" and "nfs_wait_on_request" in r["next_step"]


def test_no_outside_evidence_keeps_the_honest_unknown() -> None:
    r = _analyze()
    assert r["category"] == "unknown" and r["ranks"] == []


def test_rank_stopped_inside_a_collective_is_named_without_saying_it_never_joined() -> None:
    r = _analyze(stacks={2: IN_ALL_REDUCE}, processes={2: {"state": "stopped", "pid": 7}})
    assert r["category"] == "cpu_divergence" and r["findings"][0]["ranks"] == [2]
    assert r["verdict"].startswith("Ranks 0-1, 3 wait in all_reduce #4 on main_comm, and rank 2 "
                                   "cannot take part: stopped inside a collective.")
    assert "never joined" not in r["verdict"] and "kill -CONT 7" in r["next_step"]
