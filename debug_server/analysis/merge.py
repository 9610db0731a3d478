"""The cross-rank merge's state: rank classes, interned tables, and what matching produces.

:class:`Merge` is built once per analysis from the digests; the matchers (:mod:`.match`,
:mod:`.p2p`) append collective rows and findings to it, and :mod:`.verdict` and
:mod:`.progress` read it. Full digests are kept once per class of identical ranks, so memory
stays O(distinct behaviours), not O(ranks x entries).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from debug_server.analysis.digest import STATES, RankDigest, SharedDigests, SharedRank
from debug_server.analysis.groups import Group, GroupKey, RankClass
from debug_server.analysis.streams import ClassOps, class_ops

__all__ = ["FINDING_KINDS", "INFO_KINDS", "MISMATCH_KINDS", "Merge"]

FINDING_KINDS = (
    "order_inversion",
    "missing_ranks",
    "type_mismatch",
    "size_mismatch",
    "dtype_mismatch",
    "unmatched_p2p",
    "stuck_everywhere",
    "history_lost",
)
# Only these findings are evidence of a hang or a desync; history_lost says the record is
# incomplete, which is normal for any job that ran longer than the ring.
INFO_KINDS = frozenset({"history_lost"})
MISMATCH_KINDS = ("type_mismatch", "size_mismatch", "dtype_mismatch")

# Above this many (rank, op) pairs the JSON keeps per-rank NCCL call rows only for failing
# collectives and the newest ones per group: 4096 ranks x 2000 entries would be 8M rows.
NCCL_CALLS_FULL_LIMIT = 100_000
NCCL_CALLS_TAIL = 50


class RankInfo(NamedTuple):
    """What the merge keeps per rank besides its class (the parts of a digest that differ).

    Ranks sharing one digest's parts share its ``status`` dict and ``pg_progress`` (read only)."""

    status: dict[str, int]
    oldest_ns: int
    snap_ns: int
    pg_progress: tuple[tuple[str, int, int], ...]


def _int_keyed(m: Mapping[Any, str] | None) -> dict[int, str]:
    """rank -> text with int ranks (JSON gives str keys); a dict keyed by ints already is
    copied as it is (one C-level copy at 131072 ranks, not an int() per rank)."""
    if not m:
        return {}
    if type(m) is dict and all(type(k) is int for k in m):
        return dict(m)
    return {int(k): v for k, v in m.items()}


class Merge:
    """Every rank's digest folded into classes; the output lists the matchers fill."""

    def __init__(
        self,
        digests: Iterable[RankDigest | SharedRank] | SharedDigests,
        world_size: int | None,
        stacks: Mapping[int, str] | None,
        unavailable: Mapping[int, str] | None,
        extra_notes: Sequence[str],
        processes: Mapping[int, Mapping[str, Any]] | None = None,
    ) -> None:
        self.notes: list[str] = list(extra_notes)
        self.processes = {int(k): v for k, v in (processes or {}).items()}
        """rank -> its process as read from outside (``silent``'s docstring has the keys)."""
        self.total_entries = 0
        self.stacks = _int_keyed(stacks)
        self.unavailable = {int(k): str(v) for k, v in (unavailable or {}).items()}
        self.classes: dict[tuple[Any, ...], RankClass] = {}
        self.class_list: list[RankClass] = []
        self.digest_of: dict[int, RankInfo] = {}
        self.class_of: dict[int, RankClass] = {}
        self.sigs: list[tuple[Any, ...]] = []
        self.sig_ids: dict[tuple[Any, ...], int] = {}
        self.frames: list[list[dict[str, Any]]] = []
        self.fr_ids: dict[tuple[Any, ...], int] = {}
        self.any_snap = False  # some dump says when it was taken: the skew rules can apply
        self.newer_memo: dict[tuple[int, int], int] = {}
        self._by_parts: dict[tuple[int, ...], tuple[RankDigest, RankClass]] = {}
        """The ids of a digest's key parts -> (that digest, kept alive; its class): digests
        sharing their parts by identity (one dump's, or the fan-out's shared copies) are
        classed without hashing the key."""
        self._bases: dict[int, tuple[RankDigest, RankClass, dict[str, int], int, list[int]]] = {}
        """id(digest) -> (that digest, its class, its status dict, the largest rank its groups
        name, the ranks of its progress group): what a :class:`SharedRank` of it needs."""
        self._status: dict[int, tuple[tuple[tuple[str, int], ...], dict[str, int]]] = {}
        self.progress_groups: dict[tuple[int, int], tuple[tuple[tuple[str, int, int], ...],
                                                         RankClass, list[int]]] = {}
        """(id of a ``pg_progress``, class idx) -> (that ``pg_progress``, the class, its ranks):
        ranks with the same progress and class, for per-class rather than per-rank loops
        (``progress``)."""
        max_rank = -1
        add, add_shared, bases, digest_of = self._add, self._add_shared, self._bases, self.digest_of
        class_of, new_info = self.class_of, tuple.__new__
        triples: Iterable[tuple[Any, int, int]] = (
            zip(digests.digests, digests.ranks, digests.snaps, strict=True)
            if isinstance(digests, SharedDigests) else ((d, -1, 0) for d in digests))
        for d, r, snap in triples:
            if type(d) is SharedRank:
                r, snap, d = d
            elif r == -1 or d.rank == r:
                mr = add(d)
                if mr > max_rank:
                    max_rank = mr
                continue
            # A shared rank: _add_shared inlined for the common case (once per rank).
            held = bases.get(id(d))
            if held is None or held[0] is not d or r in digest_of:
                mr = add_shared(SharedRank(r, snap, d))
            else:
                b, c, status, mr, prog_ranks = held
                digest_of[r] = new_info(RankInfo, (status, b.oldest_ns, snap, b.pg_progress))
                if snap > 0:
                    self.any_snap = True
                self.total_entries += b.n_entries
                c.ranks.append(r)
                class_of[r] = c
                prog_ranks.append(r)
                if r > mr:
                    mr = r
            if mr > max_rank:
                max_rank = mr
        max_rank = max(max(self.unavailable, default=-1), max(self.stacks, default=-1), max_rank)
        self.world_size = world_size if world_size is not None else max_rank + 1
        self.data_ranks = sorted(self.digest_of)
        self.collectives: list[dict[str, Any]] = []
        self.findings: list[dict[str, Any]] = []
        self.calls_src: list[tuple[dict[str, Any], list[tuple[list[int], int]]]] = []
        """Per collective row the NCCL calls keep: (row, [(a class's ranks there, state)])."""
        self.waiting: list[dict[str, Any]] = []
        self.groups: dict[GroupKey, Group] = {}
        """Every group the entries name (``groups.resolve_groups``), filled before matching."""
        self._ops: dict[int, ClassOps] = {}

    def ops(self, c: RankClass) -> ClassOps:
        """Class ``c``'s ops across groups in issue order (``streams.class_ops``), once."""
        held = self._ops.get(c.idx)
        if held is None:
            held = self._ops[c.idx] = class_ops(c, self.groups)
        return held

    def _add(self, d: RankDigest) -> int:
        """Fold one digest in; the largest rank it names (-1 for a duplicate)."""
        if d.rank in self.digest_of:
            self.notes.append(f"rank {d.rank}: more than one dump; kept the first")
            return -1
        held_status = self._status.get(id(d.status))
        if held_status is None:
            held_status = self._status[id(d.status)] = (d.status, dict(d.status))
        self.digest_of[d.rank] = RankInfo(held_status[1], d.oldest_ns, d.snap_ns, d.pg_progress)
        self.any_snap = self.any_snap or d.snap_ns > 0
        self.total_entries += d.n_entries
        self.notes.extend(d.notes)
        max_pg = -1
        for _, _, rs in d.pg:
            if rs:
                max_pg = max(max_pg, rs[-1])
        parts = (id(d.pg), id(d.sigs), id(d.frames), id(d.colls), id(d.p2p),
                 id(d.pending_order), id(d.threads))
        held = self._by_parts.get(parts)
        if held is not None:
            c = held[1]
            c.ranks.append(d.rank)
        else:
            k = d.key()
            c = self.classes.get(k)
            if c is None:
                c = self.classes[k] = RankClass(len(self.class_list), d)
                self.class_list.append(c)
                c.sig_g = [self._intern_sig(s) for s in d.sigs]
                c.fr_g = [self._intern_frames(f) for f in d.frames]
            else:
                c.ranks.append(d.rank)
            self._by_parts[parts] = (d, c)
        self.class_of[d.rank] = c
        pkey = (id(d.pg_progress), c.idx)
        pg = self.progress_groups.get(pkey)
        if pg is None:
            pg = self.progress_groups[pkey] = (d.pg_progress, c, [])
        pg[2].append(d.rank)
        if not d.notes:
            self._bases.setdefault(id(d), (d, c, held_status[1], max_pg, pg[2]))
        return max(d.rank, max_pg)

    def _add_shared(self, s: SharedRank) -> int:
        """Fold in a rank that shares ``s.base``'s digest (folded in before it): a few list
        appends and one small record, no digest built."""
        held = self._bases.get(id(s.base))
        if held is None or held[0] is not s.base:
            return self._add(s.digest())
        r = s.rank
        if r in self.digest_of:
            self.notes.append(f"rank {r}: more than one dump; kept the first")
            return -1
        d, c, status, max_pg, prog_ranks = held
        self.digest_of[r] = RankInfo(status, d.oldest_ns, s.snap_ns, d.pg_progress)
        if s.snap_ns > 0:
            self.any_snap = True
        self.total_entries += d.n_entries
        c.ranks.append(r)
        self.class_of[r] = c
        prog_ranks.append(r)
        return r if r > max_pg else max_pg

    def _intern_sig(self, sig: tuple[Any, ...]) -> int:
        i = self.sig_ids.get(sig)
        if i is None:
            i = self.sig_ids[sig] = len(self.sigs)
            self.sigs.append(sig)
        return i

    def _intern_frames(self, ft: tuple[Any, ...]) -> int:
        i = self.fr_ids.get(ft)
        if i is None:
            i = self.fr_ids[ft] = len(self.frames)
            self.frames.append([{"name": n, "filename": f, "line": ln} for n, f, ln in ft])
        return i

    def no_data(self) -> list[int]:
        """Ranks below the world size that sent no dump."""
        have = self.digest_of
        if len(have) >= self.world_size and (not have or (min(have) >= 0 and max(have) <
                                                          self.world_size)):
            return []  # every rank's (asked per page at 131072 ranks: no loop over them)
        return [r for r in range(self.world_size) if r not in have]

    def finding(
        self,
        kind: str,
        g: Group,
        seq: int | None,
        op: str | None,
        ranks: list[int],
        detail: str,
        **extra: Any,
    ) -> dict[str, Any]:
        """Append one finding (``FINDING_KINDS``) and return it, for later amendments."""
        f = {
            "kind": kind,
            "severity": "info" if kind in INFO_KINDS else "error",
            "group": g.id,
            "group_label": g.label,
            "seq": seq,
            "op": op,
            "ranks": sorted(set(ranks)),
            "detail": detail,
        }
        f.update(extra)
        self.findings.append(f)
        return f

    def add_row(
        self, g: Group, sig_id: int, frames_id: int, *, seq: int | None, p2p_seq: int | None,
        state: int, missing: list[int], present: list[int], expected: list[int],
        lost: list[int], in_flight: list[int], mismatch: str | None,
    ) -> dict[str, Any]:
        """Append one row of the result's ``collectives`` (a collective or a P2P pairing)."""
        sig = self.sigs[sig_id]
        row = {
            "id": len(self.collectives),
            "group": g.id,
            "group_desc": g.desc,
            "group_ranks": g.ranks,
            "seq": seq,
            "p2p_seq": p2p_seq,
            "op": sig[1],
            "profiling_name": sig[0],
            "state": STATES[state],
            "pass_check": not missing and mismatch is None,
            "missing_ranks": missing,
            "present_ranks": present,
            "expected_ranks": expected,
            "history_lost_ranks": lost,
            "in_flight_ranks": in_flight,
            "input_sizes": [list(x) for x in sig[2]],
            "output_sizes": [list(x) for x in sig[3]],
            "input_dtypes": list(sig[4]),
            "output_dtypes": list(sig[5]),
            "mismatch": mismatch,
            "frames": self.frames[frames_id] if frames_id >= 0 else [],
        }
        self.collectives.append(row)
        return row
