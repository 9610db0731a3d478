"""The one stall rule (``recording.stall``): which op is stalled, and how it is reported."""

from __future__ import annotations

from typing import NamedTuple

from debug_server.recording import stall
from debug_server.recording.stall import StallWatch

T0 = 1_700_000_000_000_000_000
S = 10**9


class _Comm(NamedTuple):
    name: str

    def get_name(self) -> str:
        return self.name


class _Op(NamedTuple):
    # The fields records.OpRecord and records.InFlight share.
    comm: _Comm
    op: str
    seq: int
    p2p_seq: int
    is_p2p: bool
    time_created_ns: int


MAIN = _Comm("main_comm")


def test_op_is_stalled_only_once_past_its_limit() -> None:
    assert [stall.is_stalled(a, 10.0) for a in (9.9, 10.0, 10.001)] == [False, False, True]
    assert stall.is_stalled(10**6, None) is False


def test_oldest_stalled_op_is_reported_whatever_the_order_listed() -> None:
    young = _Op(MAIN, "broadcast", 7, 0, False, T0 + 5 * S)
    old = _Op(MAIN, "all_reduce", 4, 0, False, T0)
    hit = stall.oldest_stalled([(young, 1.0), (old, 1.0)], T0 + 20 * S)
    assert hit is not None and stall.report_op(*hit) == {
        "group": "main_comm", "seq": 4, "op": "all_reduce", "age_s": 20.0}


def test_each_op_is_held_to_its_own_limit() -> None:
    unlimited = _Op(MAIN, "all_reduce", 1, 0, False, T0)
    limited = _Op(_Comm("pp"), "send", -1, 3, True, T0 + 10 * S)
    hit = stall.oldest_stalled([(unlimited, None), (limited, 5.0)], T0 + 16 * S)
    assert hit is not None and stall.report_op(*hit) == {
        "group": "pp", "seq": 3, "op": "send", "age_s": 6.0}
    assert stall.oldest_stalled([(limited, 7.0)], T0 + 16 * S) is None


def test_c10d_group_is_held_to_the_same_rule() -> None:
    w = StallWatch()
    st = {"0": {"last_enqueued_collective": 5, "last_completed_collective": 4}}
    w.update(st, T0)
    w.update(st, T0 + S)
    w.resolve("0", [{"process_group": ["0", "default_pg"], "collective_seq_id": 5,
                     "profiling_name": "gloo:all_reduce", "time_created_ns": T0, "retired": False,
                     "state": "scheduled"}])
    assert w.stalled(10.0, T0 + 10 * S) == []  # exactly at the limit: not yet
    [(group, age, p)] = w.stalled(10.0, T0 + 11 * S)
    assert stall.report(group, p.seq, p.op, age, group_desc=p.desc, source="c10d") == {
        "group": "0", "seq": 5, "op": "all_reduce", "age_s": 11.0, "group_desc": "default_pg",
        "source": "c10d"}
