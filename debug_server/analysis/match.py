"""Collective matching, one group at a time, per ``collective_seq_id`` (never ``record_id``).

For each sequence number some member holds: who issued it, who is missing, whose ring no longer
reaches back to it (``history_lost``, not missing), who is read too early to tell (in flight,
:mod:`.skew`), and whether the calls agree (:mod:`.sigcheck`). One mismatch does not fail every
later collective: each kind is reported once per group, with a count of later repeats.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

from debug_server.analysis import sigcheck, skew
from debug_server.analysis.digest import DONE, Cell
from debug_server.analysis.groups import Group, GroupKey
from debug_server.analysis.merge import NCCL_CALLS_FULL_LIMIT, NCCL_CALLS_TAIL, Merge
from debug_server.analysis.ranks import ranks_phrase

__all__ = ["match_collectives"]


def match_collectives(m: Merge, g: Group, gkey: GroupKey) -> None:
    """Append ``g``'s collective rows, NCCL call sources and findings to ``m``."""
    cls: list[skew.ClassEntries] = []
    for c in m.class_list:
        for name, desc, ents in c.d.colls:
            if c.gkeys.get((name, desc)) == gkey and ents:
                times = next((t for n, t in c.d.times if n == name), ())
                cls.append((c, ents, times))
    if not cls:
        return
    scan = _GroupScan(m, g, cls)
    seqs = sorted(scan.cells)
    tail_start = max(0, len(seqs) - NCCL_CALLS_TAIL)
    for pos, seq in enumerate(seqs):
        scan.step(seq, pos >= tail_start)
    scan.finish()


class _GroupScan:
    """One group's entries laid out by seq, and what the scan has reported so far."""

    def __init__(self, m: Merge, g: Group, cls: list[skew.ClassEntries]) -> None:
        self.m, self.g, self.cls = m, g, cls
        member_set = g.rank_set
        # A class inside the group (the world group's every class) is taken whole: one C-level
        # check instead of a membership test per rank.
        self.cls_ranks = [c.ranks if member_set.issuperset(c.ranks)
                          else [r for r in c.ranks if r in member_set] for c, _, _ in cls]
        covered: set[int] = set()
        for rs in self.cls_ranks:
            covered.update(rs)
        # Member ranks that have data but no entry at all in this group (none when every rank
        # with data is covered already).
        self.no_entries = [] if len(covered) == len(m.digest_of) else \
            [r for r in g.ranks if r in m.digest_of and r not in covered]
        self.status = {r: m.digest_of[r].status.get(g.name, -1) for r in self.no_entries}
        self.all_present = sorted(covered)
        self.cells: dict[int, list[Cell]] = {}
        self.cover: dict[int, tuple[int, int]] = {}  # class index -> its [lo, hi] seq
        self.rep_time: dict[int, int] = {}
        for ci, (c, ents, times) in enumerate(cls):
            self.cover[ci] = (ents[0][0], ents[-1][0])
            sg, fg = c.sig_g, c.fr_g
            for j, (seq, sidx, st, fidx) in enumerate(ents):
                cell = self.cells.get(seq)
                if cell is None:
                    cell = self.cells[seq] = []
                    if j < len(times):
                        self.rep_time[seq] = times[j]
                cell.append((ci, sg[sidx], st, fg[fidx] if fidx >= 0 else -1))
        self.first_missing_done = False
        self.stuck_reported = False
        self.mismatch_seen: dict[str, dict[str, Any]] = {}
        self.lost_union: set[int] = set()
        self.lost_last_seq = -1
        self.lost_count = 0

    def step(self, seq: int, in_tail: bool) -> None:
        """Check one sequence number: presence, agreement, then its row and findings."""
        items = self.cells[seq]
        present, missing, lost, in_flight, lost_real = self._presence(seq, items)
        first = min(items, key=lambda it: it[0])
        ref_sig = self.m.sigs[first[1]]
        kind, culprits, mismatch = self._check(items, ref_sig, present, missing, lost)
        m = self.m
        row = m.add_row(
            self.g, first[1], first[3], seq=seq, p2p_seq=None, state=min(it[2] for it in items),
            missing=missing, present=present, expected=self.g.ranks, lost=lost,
            in_flight=in_flight, mismatch=mismatch,
        )
        if not row["pass_check"] or in_tail or m.total_entries <= NCCL_CALLS_FULL_LIMIT:
            m.calls_src.append((row, [(self.cls_ranks[it[0]], it[2]) for it in items]))
        if lost_real:
            self.lost_union.update(lost)
            self.lost_last_seq = seq
            self.lost_count += 1
        if missing and not self.first_missing_done:
            self.first_missing_done = True
            self._missing_finding(seq, items, ref_sig[1], missing, present)
        if kind is not None:
            self._mismatch_finding(kind, seq, items, ref_sig[1], culprits, mismatch)
        self._stuck_and_waiting(seq, items, ref_sig[1], present, missing)

    def _presence(
        self, seq: int, items: list[Cell]
    ) -> tuple[list[int], list[int], list[int], list[int], bool]:
        """(present, missing, history lost, in flight, lost for real) ranks for ``seq``."""
        n_cls = len(self.cls)
        if len(items) == n_cls and not self.no_entries:
            return self.all_present, [], [], [], False
        m, cls_ranks = self.m, self.cls_ranks
        missing: list[int] = []
        lost: list[int] = []
        lost_real = False  # some rank's ring lost it before the others were read
        issuing = {it[0] for it in items}
        present = sorted(chain.from_iterable(cls_ranks[it[0]] for it in items))
        for ci in range(n_cls):
            if ci in issuing:
                continue
            lo, hi = self.cover[ci]
            if lo <= seq:
                if not (hi > seq and self._empty_coalesced(items)):
                    missing.extend(cls_ranks[ci])
                continue
            lost.extend(cls_ranks[ci])
            # Only with read times: without them, a ring ahead is also what a lost one looks
            # like from the new end, and history_lost stays (test_snapshot_grace).
            if not (m.any_snap and (skew.ahead_of_holders(self.cover, ci, items, seq, lo)
                                    or skew.evicted_after_read(m, self.cls, ci, items, seq, lo))):
                lost_real = True
        t_seq = self.rep_time.get(seq, 0)
        for r in self.no_entries:
            # Its status says it got past this op, or its whole ring is newer than this op:
            # the group's entries were evicted.
            if self.status[r] >= seq or (t_seq and m.digest_of[r].oldest_ns > t_seq):
                lost.append(r)
                lost_real = True
            else:
                missing.append(r)
        missing.sort()
        lost.sort()
        in_flight: list[int] = []
        if missing and m.any_snap:
            in_flight = skew.read_before_issued(m, self.cls, items, seq, missing)
            if in_flight:
                missing = [r for r in missing if r not in in_flight]
        return present, missing, lost, in_flight, lost_real

    def _empty_coalesced(self, items: list[Cell]) -> bool:
        """A coalesced run every issuer completed: a rank without it went past it (its
        coalescing block had nothing to send, so c10d recorded no entry), it is not missing."""
        return (all(it[2] == DONE for it in items)
                and self.m.sigs[items[0][1]][1].endswith("coalesced"))

    def _check(
        self, items: list[Cell], ref_sig: tuple[Any, ...], present: list[int],
        missing: list[int], lost: list[int],
    ) -> tuple[str | None, list[int], str | None]:
        """Signature comparison: one set lookup in the common case (every rank the same op)."""
        gsize = len(self.g.ranks)
        if len({it[1] for it in items}) == 1:
            prob = sigcheck.intrinsic_problem(ref_sig, gsize)
            if prob:
                return "size_mismatch", list(present), f"{ref_sig[1]}: {prob}"
            return None, [], None
        complete = len(missing) + len(lost) == 0 and len(present) == gsize
        return sigcheck.compare(self.m, items, self.cls_ranks, gsize, complete)

    def _missing_finding(
        self, seq: int, items: list[Cell], op: str, missing: list[int], present: list[int]
    ) -> None:
        g = self.g
        waiting = [r for it in items if it[2] != DONE for r in self.cls_ranks[it[0]]]
        self.m.finding(
            "missing_ranks", g, seq, op, missing,
            f"{ranks_phrase(missing).capitalize()} never issued {op} #{seq} on {g.label}"
            f"; {ranks_phrase(present)} issued it"
            + (f" ({ranks_phrase(waiting)} still waiting)" if waiting else " and finished it"),
            waiting=sorted(waiting),
        )  # fmt: skip

    def _mismatch_finding(
        self, kind: str, seq: int, items: list[Cell], op: str, culprits: list[int],
        mismatch: str | None,
    ) -> None:
        seen = self.mismatch_seen.get(kind)
        if seen is not None:
            seen["_count"] += 1
            return
        f = self.m.finding(
            kind, self.g, seq, op, culprits, f"{op} #{seq} on {self.g.label}: {mismatch}",
            signatures=sigcheck.signatures(self.m, items, self.cls_ranks),
        )
        f["_count"] = 0
        self.mismatch_seen[kind] = f

    def _stuck_and_waiting(
        self, seq: int, items: list[Cell], op: str, present: list[int], missing: list[int]
    ) -> None:
        if any(it[2] == DONE for it in items):
            return
        # Nobody finished it, and a rank that issued a later op in this group is taken to have
        # finished it (on gloo that is the only evidence).
        newest_everywhere = all(self.cover[it[0]][1] == seq for it in items)
        if not newest_everywhere:
            return
        m, g = self.m, self.g
        gsize = len(g.ranks)
        if (not missing and not self.stuck_reported and len(present) == gsize
                and not (m.any_snap and skew.just_issued(self.cls, items, seq))):
            self.stuck_reported = True
            # Which members' devices started it (c10d with start timing, our recorder): the
            # ones that did not are behind on their own stream (``verdict``: gpu_busy).
            started = sorted(r for it in items if it[2] == 1 for r in self.cls_ranks[it[0]])
            m.finding(
                "stuck_everywhere", g, seq, op, list(present),
                f"all {gsize} ranks of {g.label} issued {op} #{seq} and none completed it",
                started=started, not_started=sorted(set(present) - set(started)),
            )
        m.waiting.append(
            {"group": g.id, "seq": seq, "op": op, "label": g.label,
             "ranks": [r for it in items for r in self.cls_ranks[it[0]]]}
        )  # fmt: skip

    def finish(self) -> None:
        """Repeat counts on the mismatch findings; one history_lost finding for the group."""
        g = self.g
        for f in self.mismatch_seen.values():
            n = f.pop("_count")
            if n:
                f["detail"] += f" (and {n} later sequence number{'s' if n > 1 else ''} on {g.label})"
        if self.lost_union:
            lost = sorted(self.lost_union)
            n = self.lost_count
            self.m.finding(
                "history_lost", g, self.lost_last_seq, None, lost,
                f"{ranks_phrase(lost).capitalize()} no longer hold{'s' if len(lost) == 1 else ''} {n} older "
                f"collective{'s' if n > 1 else ''} of {g.label} (ring wrapped, up to "
                f"#{self.lost_last_seq}); those were checked only on the ranks that still hold them",
            )  # fmt: skip
