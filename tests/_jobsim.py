"""A small model of a job's per-rank streams, to build Flight Recorder dumps of real layouts.

Each rank runs a program (the calls below, in call order). An op completes only when every rank
it needs issued its side and each of those ranks' earlier ops completed (one stream per rank,
in issue order, whatever the group: NCCL's picture). A blocking op (gloo, a ``wait()``, a
barrier) also stops the rank's CPU until it completes, so nothing after it is issued. Ops never
complete when their ranks' calls disagree (a mismatch). The dumps carry the resulting states:
``completed``, ``started`` (at the head of its stream) or ``scheduled`` (behind it); with
``states="scheduled"`` every unfinished op reads ``scheduled`` (a ring read before an abort).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from debug_server.tools.synthetic import make_dump, make_entry

T0 = 1_700_000_000_000_000_000
USER = "/job/train.py"
Sizes = tuple[tuple[int, ...], ...]


@dataclass(eq=False)
class _Item:
    """One rank's stream item: a collective (``parts`` of one seq) or a batch of P2P ops."""

    rank: int
    group: str
    call: int
    line: int
    blocking: bool
    parts: list[tuple[str, Sizes, Sizes]]  # (op, in sizes, out sizes); P2P: ("send", ...)
    peers: list[int] = field(default_factory=list)  # P2P: the global peer of each part
    p2p: bool = False
    seq: int = -1
    p2p_seq: int = -1
    t: int = 0
    done: bool = False


class JobSim:
    """Groups, per-rank programs, and the streams' outcome as per-rank dumps."""

    def __init__(self, world: int, groups: Mapping[str, tuple[str, Sequence[int]]], *,
                 hashed: bool = False, delay_ns: Mapping[int, int] | None = None) -> None:
        """``groups``: key -> (desc, member ranks); names are c10d's numbers ("1", "2"...) in
        this order, or 40-hex hashes (DeviceMesh, split groups) with ``hashed``. ``delay_ns``:
        ranks whose CPU runs behind by that much (their ops' issue times)."""
        self.world = world
        self.delay = dict(delay_ns or {})
        self.groups = {k: (d, sorted(rs)) for k, (d, rs) in groups.items()}
        self.names = {
            k: hashlib.sha1(f"{k}{sorted(rs)}".encode()).hexdigest() if hashed else str(i)
            for i, (k, (_, rs)) in enumerate(self.groups.items())
        }
        self.prog: dict[int, list[_Item]] = {r: [] for r in range(world)}
        self.calls = 0
        self._issued: dict[int, list[_Item]] | None = None

    def name(self, key: str) -> str:
        """The group's name in the dumps (``pg_config`` key, ``process_group[0]``)."""
        return self.names[key]

    def coll(self, key: str, op: str = "all_reduce", *, skip: Iterable[int] = (),
             ins: Sizes = ((1024,),), outs: Sizes | None = None,
             odd: Mapping[int, Mapping[str, Any]] | None = None,
             parts: Sequence[tuple[str, Sizes, Sizes]] | None = None,
             odd_parts: Mapping[int, Sequence[tuple[str, Sizes, Sizes]]] | None = None,
             line: int = 100, blocking: bool = False) -> None:
        """Every member of ``key`` but ``skip`` issues one collective (``parts``: a coalesced
        run sharing one seq, closer last); ``odd`` gives some ranks other ``op``/``ins``/``outs``,
        ``odd_parts`` other runs."""
        self.calls += 1
        for r in self.groups[key][1]:
            if r in set(skip):
                continue
            o = dict((odd or {}).get(r) or {})
            if odd_parts and r in odd_parts:
                parts_r: Sequence[tuple[str, Sizes, Sizes]] | None = odd_parts[r]
            else:
                parts_r = parts
            ps = list(parts_r) if parts_r is not None else [
                (o.get("op", op), o.get("ins", ins), o.get("outs", o.get("ins", ins) if outs is None else outs))
            ]
            self.prog[r].append(_Item(r, key, self.calls, line, blocking, ps))

    def p2p(self, key: str, pairs: Sequence[tuple[int, int]], *, skip: Iterable[int] = (),
            sizes: Sizes = ((1024,),), line: int = 200, blocking_recv: bool = False,
            batch: bool = False) -> None:
        """Sends ``src -> dst`` for each pair (global ranks); ``batch`` posts each rank's parts
        as one batch (``batch_isend_irecv``); ranks in ``skip`` post nothing."""
        self.calls += 1
        skip = set(skip)
        per_rank: dict[int, list[tuple[str, int]]] = {}
        for src, dst in pairs:
            per_rank.setdefault(src, []).append(("send", dst))
            per_rank.setdefault(dst, []).append(("recv", src))
        for r, ops in per_rank.items():
            if r in skip:
                continue
            chunks = [ops] if batch else [[o] for o in ops]
            for ch in chunks:
                blocking = not batch and blocking_recv and ch[0][0] == "recv"
                self.prog[r].append(_Item(r, key, self.calls, line, blocking,
                                          [(o, sizes, sizes) for o, _ in ch],
                                          [p for _, p in ch], p2p=True))

    def swap(self, rank: int, i: int, j: int) -> None:
        """Rank ``rank`` issues its program's items ``i`` and ``j`` in the other order (an
        order inversion: a set iterated in another order, a rank-dependent branch)."""
        prog = self.prog[rank]
        a, b = prog[i], prog[j]
        prog[i], prog[j] = b, a
        a.call, b.call = b.call, a.call

    # -- the streams ---------------------------------------------------------------------------

    def _run(self) -> dict[int, list[_Item]]:
        if self._issued is not None:
            return self._issued
        issued: dict[int, list[_Item]] = {r: [] for r in range(self.world)}
        seqs: dict[tuple[int, str], int] = {}
        pseqs: dict[tuple[int, str], int] = {}
        by_seq: dict[tuple[str, int], list[_Item]] = {}
        sends: dict[tuple[str, int, int], list[_Item]] = {}
        recvs: dict[tuple[str, int, int], list[_Item]] = {}
        progress = True
        while progress:
            progress = False
            for r in range(self.world):
                while len(issued[r]) < len(self.prog[r]):
                    last = issued[r][-1] if issued[r] else None
                    if last is not None and last.blocking and not last.done:
                        break
                    it = self.prog[r][len(issued[r])]
                    it.t = T0 + it.call * 1_000_000 + r * 1000 + self.delay.get(r, 0)
                    if it.p2p:
                        it.p2p_seq = pseqs.get((r, it.group), 0)
                        pseqs[(r, it.group)] = it.p2p_seq + 1
                        it.seq = seqs.get((r, it.group), 0)
                        for (op, _, _), peer in zip(it.parts, it.peers, strict=True):
                            pair = (it.group, r, peer) if op == "send" else (it.group, peer, r)
                            (sends if op == "send" else recvs).setdefault(pair, []).append(it)
                    else:
                        it.seq = seqs.get((r, it.group), 0)
                        seqs[(r, it.group)] = it.seq + 1
                        by_seq.setdefault((it.group, it.seq), []).append(it)
                    issued[r].append(it)
                    progress = True
            progress |= self._complete(issued, by_seq, sends, recvs)
        self._issued = issued
        return issued

    def _partners(self, it: _Item, by_seq: Mapping[tuple[str, int], list[_Item]],
                  sends: Mapping[tuple[str, int, int], list[_Item]],
                  recvs: Mapping[tuple[str, int, int], list[_Item]]) -> list[_Item] | None:
        """The items ``it`` completes together with, or None while one is missing or disagrees."""
        if not it.p2p:
            held = by_seq.get((it.group, it.seq), [])
            if len(held) < len(self.groups[it.group][1]):
                return None
            if len({tuple(h.parts) for h in held}) > 1:
                return None  # a mismatch never completes
            return held
        out = [it]
        for (op, _, _), peer in zip(it.parts, it.peers, strict=True):
            pair = (it.group, it.rank, peer) if op == "send" else (it.group, peer, it.rank)
            mine, theirs = (sends, recvs) if op == "send" else (recvs, sends)
            k = [x for x in mine.get(pair, []) if x.rank == it.rank].index(it)
            other = theirs.get(pair, [])
            if k >= len(other):
                return None
            out.append(other[k])
        return out

    def _closure(self, head: _Item, heads: Mapping[int, _Item | None], by_seq: Any, sends: Any,
                 recvs: Any) -> list[_Item] | None:
        """The items that complete together with ``head`` (a ring of batches is one), each at
        the head of its rank's stream; None while any is missing, disagrees or waits behind."""
        todo, seen = [head], {id(head): head}
        while todo:
            group = self._partners(todo.pop(), by_seq, sends, recvs)
            if group is None or any(heads.get(x.rank) is not x for x in group):
                return None
            for x in group:
                if id(x) not in seen:
                    seen[id(x)] = x
                    todo.append(x)
        return list(seen.values())

    def _complete(self, issued: dict[int, list[_Item]], by_seq: Any, sends: Any,
                  recvs: Any) -> bool:
        changed = False
        again = True
        while again:
            again = False
            heads = {r: next((x for x in items if not x.done), None) for r, items in issued.items()}
            for head in heads.values():
                group = self._closure(head, heads, by_seq, sends, recvs) if head else None
                if group is None:
                    continue
                for x in group:
                    x.done = True
                again = changed = True
                break
        return changed

    # -- the dumps -----------------------------------------------------------------------------

    def dumps(self, *, states: str = "true") -> dict[int, dict[str, Any]]:
        """Every rank's dump; ``states="scheduled"``: unfinished ops all read ``scheduled``."""
        issued = self._run()
        out = {}
        for r in range(self.world):
            entries: list[dict[str, Any]] = []
            head_seen = False
            for it in issued[r]:
                if it.done:
                    st = "completed"
                elif not head_seen and states != "scheduled":
                    st, head_seen = "started", True
                else:
                    st = "scheduled"
                entries.extend(self._entries(it, st, len(entries)))
            mine = {k: v for k, v in self.groups.items() if r in v[1]}
            groups = {self.names[k]: rs for k, (_, rs) in mine.items()}
            descs = {self.names[k]: d for k, (d, _) in mine.items()}
            out[r] = make_dump(entries, groups, descs=descs)
        return out

    def _entries(self, it: _Item, st: str, rid: int) -> list[dict[str, Any]]:
        desc, members = self.groups[it.group]
        frames = [{"name": "train_step", "filename": USER, "line": it.line},
                  {"name": "<module>", "filename": USER, "line": 300}]
        common = {"comm": self.names[it.group], "backend": desc, "state": st, "frames": frames,
                  "time_created_ns": it.t}
        ents = []
        for j, (op, ins, outs) in enumerate(it.parts):
            if it.p2p:
                me, peer = members.index(it.rank), members.index(it.peers[j])
                pd = f"{me}->{peer}" if op == "send" else f"{me}<-{peer}"
                ents.append(make_entry(record_id=rid + j, seq=it.seq, p2p_seq=it.p2p_seq, op=op,
                                       is_p2p=True, peer_desc=pd, input_sizes=ins,
                                       output_sizes=outs, **common))
            else:
                ents.append(make_entry(record_id=rid + j, seq=it.seq, op=op, input_sizes=ins,
                                       output_sizes=outs, **common))
        if it.p2p and len(it.parts) > 1:
            ents.append(make_entry(record_id=rid + len(ents), seq=it.seq, p2p_seq=it.p2p_seq,
                                   op="coalesced", is_p2p=True, input_sizes=(),
                                   output_sizes=(), **common))
        return ents

    def stacks(self) -> dict[int, str]:
        """Each rank's main thread: inside the op its CPU waits in, else asleep at line 77."""
        import _scenarios as S  # noqa: PLC0415 - _scenarios builds its layouts with this module

        issued = self._run()
        out = {}
        for r in range(self.world):
            waiting = next((x for x in issued[r] if x.blocking and not x.done), None)
            if waiting is None:
                out[r] = S.faulthandler_text([(USER, 77, "load_batch"), (USER, 300, "<module>")])
                continue
            op = waiting.parts[0][0]
            out[r] = S.faulthandler_text([(S.C10D, 2806, op), (USER, waiting.line, "train_step"),
                                          (USER, 300, "<module>")])
        return out
