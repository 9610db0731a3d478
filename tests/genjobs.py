"""Hypothesis' job histories: a few ranks, each ring as its recorder would hold it, one failure.

``jobs(failure)`` draws a job of 2-4 ranks (a world communicator and sometimes a
sub-communicator, collectives and P2P, each rank's ring wrapped at its own size) ending in one of
``FAILURES``: a rank missing, a type/size/dtype mismatch with one side completed as NCCL does, an
unmatched P2P op, a collective stuck everywhere, or none. It gives ``(dumps, stacks)`` per rank.
``error_findings`` is what two analyses of one job must agree on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import _scenarios as S
from hypothesis import strategies as st

from debug_server.tools import synthetic

BASE_NS = 1_700_000_000_000_000_000

FAILURES = ("clean", "missing", "type", "size", "dtype", "stuck", "p2p")
SLEEPING = S.stack_sleeping("/job/train.py", 66)
IN_COLLECTIVE = S.stack_in_all_reduce()


@dataclass
class Op:
    group: str
    op: str
    numel: int = 1024
    dtype: str = "Float"
    src: int = -1
    dst: int = -1


class RankRing:
    """One rank's recorder: ``issue`` appends an entry, ``dump(ring)`` keeps the newest ``ring``."""

    def __init__(self, rank: int, groups: dict[str, list[int]]) -> None:
        self.rank = rank
        self.groups = {g: m for g, m in groups.items() if rank in m}
        self.entries: list[dict[str, Any]] = []
        self.seq = dict.fromkeys(self.groups, 0)
        self.p2p = dict.fromkeys(self.groups, 0)

    def issue(self, op: Op, t: int, state: str, *, numel: int | None = None,
              name: str | None = None, dtype: str | None = None) -> None:
        n = numel if numel is not None else op.numel
        members = self.groups[op.group]
        kind = name or op.op
        ins = outs = ((n,),)
        if kind == "all_gather":
            outs = ((n * len(members),),)
        common = dict(record_id=len(self.entries), comm=op.group, state=state,
                      dtype=dtype or op.dtype, time_created_ns=BASE_NS + t * 1000 + self.rank)
        if kind in ("send", "recv"):
            self.p2p[op.group] += 1
            desc = f"{op.src}->{op.dst}" if kind == "send" else f"{op.dst}<-{op.src}"
            self.entries.append(synthetic.make_entry(
                seq=self.seq[op.group], p2p_seq=self.p2p[op.group], op=kind, is_p2p=True,
                peer_desc=desc, input_sizes=ins, **common))  # type: ignore[arg-type]
            return
        self.entries.append(synthetic.make_entry(
            seq=self.seq[op.group], op=kind, input_sizes=ins, output_sizes=outs,
            **common))  # type: ignore[arg-type]
        self.seq[op.group] += 1

    def dump(self, ring: int) -> dict[str, Any]:
        kept = self.entries[-ring:]
        status = {}
        for g in self.groups:
            # As the recorder reports it: the issue counter goes on, started/completed come
            # from the ops the ring still holds.
            colls = [e for e in kept if e["process_group"][0] == g and not e["is_p2p"]]
            status[g] = {
                "last_enqueued_collective": self.seq[g] - 1,
                "last_started_collective": max((e["collective_seq_id"] for e in colls
                                                if e["state"] != "scheduled"), default=-1),
                "last_completed_collective": max((e["collective_seq_id"] for e in colls
                                                  if e["state"] == "completed"), default=-1),
            }
        return synthetic.make_dump(kept, self.groups, status=status)


@st.composite
def jobs(draw: st.DrawFn, failure: str) -> tuple[dict[int, dict[str, Any]], dict[int, str]]:
    world = draw(st.integers(2, 4))
    ranks = list(range(world))
    groups = {"main_comm": ranks}
    if world >= 3 and draw(st.booleans()):
        groups["sub_comm"] = sorted(draw(st.lists(st.sampled_from(ranks), min_size=2,
                                                  max_size=world, unique=True)))
    program: list[Op] = []
    for _ in range(draw(st.integers(0, 24))):
        g = draw(st.sampled_from(sorted(groups)))
        if g == "main_comm" and draw(st.integers(0, 4)) == 0:
            src, dst = draw(st.permutations(ranks))[:2]
            program.append(Op(g, "p2p", src=src, dst=dst))
        else:
            program.append(Op(g, draw(st.sampled_from(["all_reduce", "broadcast", "all_gather"])),
                              numel=draw(st.sampled_from([256, 1024]))))
    rs = {r: RankRing(r, groups) for r in ranks}
    t = 0
    for op in program:
        t += 1
        if op.op == "p2p":
            rs[op.src].issue(op, t, "completed", name="send")
            rs[op.dst].issue(op, t, "completed", name="recv")
            continue
        for r in groups[op.group]:
            rs[r].issue(op, t, "completed")
    away: set[int] = set()  # ranks that never reached the failing op (they sleep)
    t += 1
    if failure == "p2p":
        src, dst = draw(st.permutations(ranks))[:2]
        op = Op("main_comm", "p2p", src=src, dst=dst)
        holder, peer = (src, dst) if draw(st.booleans()) else (dst, src)
        rs[holder].issue(op, t, "started", name="send" if holder == src else "recv")
        away.add(peer)
    elif failure != "clean":
        g = draw(st.sampled_from(sorted(groups)))
        members = groups[g]
        op = Op(g, "all_reduce")
        odd = draw(st.sampled_from(members))
        if failure in ("missing", "stuck"):
            for r in members:
                if failure == "missing" and r == odd:
                    away.add(r)
                    continue
                rs[r].issue(op, t, "started")
        else:
            # NCCL completes a mismatched op on one side at most (the smaller count's).
            odd_done, rest_done = draw(st.sampled_from([(True, False), (False, True),
                                                        (False, False)]))
            then_next = draw(st.booleans())
            odd_kw: dict[str, Any] = {"type": {"name": "broadcast"}, "size": {"numel": 2048},
                                      "dtype": {"dtype": "Int"}}[failure]
            for r in members:
                done = odd_done if r == odd else rest_done
                rs[r].issue(op, t, "completed" if done else "started", **(odd_kw if r == odd else {}))
                if done and then_next:  # the completed side goes on to the next op, and waits
                    rs[r].issue(Op(g, "all_reduce"), t + 1, "started")
    dumps = {}
    for r in ranks:
        ring = draw(st.sampled_from([3, 5, 8, 13, 2000]))
        dumps[r] = rs[r].dump(ring)
    stacks = {r: SLEEPING if r in away else IN_COLLECTIVE for r in ranks}
    return dumps, stacks


_KEYS = ("kind", "group", "seq", "p2p_seq", "op", "ranks", "detail", "waiting", "signatures")


def error_findings(result: dict[str, Any]) -> list[dict[str, Any]]:
    found = result["findings"]
    order = result.get("finding_order") or range(len(found))
    return [{k: found[i].get(k) for k in _KEYS} for i in order
            if found[i]["severity"] == "error"]
