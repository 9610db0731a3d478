"""One rank's Flight Recorder dump reduced to a compact, hashable :class:`RankDigest`.

One pass over the entries, comparing each entry's group, name, sizes and dtypes with the
previous entry's, so the common case (the same op as before) is a few C-level comparisons.
Signatures and frame lists are interned per rank; the merge (:mod:`.core`) interns them again
across ranks, so ranks whose digests are equal form one class and are matched once.
:func:`digest_dump` is public so the CLI can digest files in worker processes and never hold all
dumps in memory.

PyTorch's own gloo dumps (empty ``pg_config`` names, ``state`` stuck at ``scheduled``) are
repaired here; a bad entry is skipped and counted in a note, never an exception.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

from debug_server.dumpio import DumpError, group_members

__all__ = ["DONE", "SNAPSHOT_TIME_KEY", "STATES", "THREADS_SCAN", "DigestMemo", "RankDigest",
           "SharedDigests", "SharedRank", "digest_dump", "rebind", "share_key", "snap_ns_of"]

STATES = ("scheduled", "started", "completed")
_STATE_CODE = {"scheduled": 0, "started": 1, "completed": 2}
DONE = 2
"""The state code of a completed op (an index into :data:`STATES`)."""

_P2P = frozenset({"send", "recv"})

SNAPSHOT_TIME_KEY = "dump_time_ns"
"""Top-level dump key: the wall clock (ns) of the rank when its ring was read; every op that rank
issued before it is in the dump (unless evicted)."""

# One C call fetches everything that decides group and signature; comparing that tuple with the
# previous entry's is the whole per-entry cost in the common case (same op as before).
_MAIN_FIELDS = operator.itemgetter(
    "process_group", "profiling_name", "input_sizes", "output_sizes", "input_dtypes",
    "output_dtypes",
)  # fmt: skip
_BAD_ENTRY = (KeyError, TypeError, IndexError, ValueError, AttributeError)

Frames = tuple[tuple[str, str, int], ...]
Cell = tuple[int, int, int, int]
"""A collective entry: (seq, signature index, state code, frames index or -1)."""


class RankDigest(NamedTuple):
    """One rank's dump reduced to what cross-rank matching needs (picklable, hashable parts).

    ``key()`` covers everything that two ranks doing the same thing share; ranks with equal keys
    are merged once.
    """

    rank: int
    version: str
    pg: tuple[tuple[str, str, tuple[int, ...] | None], ...]
    """pg_config as (name, desc, ranks or None when absent/empty/unparseable)."""
    sigs: tuple[tuple[Any, ...], ...]
    """Local signature table: (profiling_name, op, in_sizes, out_sizes, in_dtypes, out_dtypes)."""
    frames: tuple[Frames, ...]
    """Local frames table: ((name, filename, line), ...) innermost first."""
    colls: tuple[tuple[str, str, tuple[Cell, ...]], ...]
    """Per group (name, desc, ((seq, sig, state, frames), ...)) sorted by seq."""
    p2p: tuple[tuple[str, str, int, tuple[tuple[int, int, int, int, str, int, int], ...]], ...]
    """Per group (name, desc, n_done, pending ((p2p_seq, sig, state, frames, op, src, dst), ...))."""
    status: tuple[tuple[str, int], ...]
    """pg_status last_enqueued_collective per group name (only values >= 0)."""
    times: tuple[tuple[str, tuple[int, ...]], ...]
    """time_created_ns per collective entry, parallel to ``colls`` (not part of the class key)."""
    oldest_ns: int
    n_entries: int
    notes: tuple[str, ...]
    snap_ns: int = 0
    """``dump_time_ns`` of the dump (0: unknown); not part of the class key."""
    p2p_times: tuple[tuple[str, str, tuple[int, ...]], ...] = ()
    """time_created_ns per pending P2P entry, parallel to ``p2p`` (not part of the class key)."""
    pg_progress: tuple[tuple[str, int, int], ...] = ()
    """(group name, last enqueued seq, last completed seq) from ``pg_status``, -1 when unknown;
    groups only in ``pg_config`` are (name, -1, -1). Not part of the class key."""
    threads: tuple[tuple[str, str, tuple[str, ...]], ...] = ()
    """Groups on which two or more threads issued ops among the rank's newest
    :data:`THREADS_SCAN` entries: ((name, desc, (thread names...)), ...). Part of the class key."""
    pending_order: tuple[tuple[str, str, int], ...] = ()
    """The incomplete collectives of two or more groups in issue order, ((name, desc, seq),
    ...); empty when at most one group has any. Part of the class key: two ranks that issued
    the same ops in other orders across groups are not the same (``order``)."""

    def key(self) -> tuple[Any, ...]:
        """What identical ranks share (no rank number, no timestamps)."""
        return (self.pg, self.sigs, self.frames, self.colls, self.p2p, self.pending_order,
                self.threads)


def digest_dump(rank: int, dump: Mapping[str, Any]) -> RankDigest:
    """Reduce one rank's dump dict to a :class:`RankDigest`; bad entries become notes."""
    notes: list[str] = []
    pg = _pg_config(rank, dump.get("pg_config") or {}, notes)
    status, progress = _pg_status(dump.get("pg_status") or {}, pg)
    entries = dump.get("entries") or []
    b = _Builder()
    b.feed(entries)
    if b.bad:
        notes.append(
            f"rank {rank}: skipped {b.bad} malformed entr{'y' if b.bad == 1 else 'ies'} "
            f"({b.bad_example})"
        )
    oldest = b.oldest
    window = dump.get("fr_window")  # a live fetch cut the ring (frwindow): its own oldest op
    if isinstance(window, Mapping) and type(window.get("ring_oldest_ns")) is int:
        oldest = window["ring_oldest_ns"]
    colls, times = b.sorted_colls()
    return RankDigest(
        rank=rank,
        version=str(dump.get("version", "")),
        pg=tuple(sorted(set(pg), key=lambda x: (x[0], x[1], x[2] or ()))),
        sigs=tuple(b.sigs),
        frames=tuple(b.fr_tab),
        colls=colls,
        p2p=b.p2p_groups(),
        status=status,
        times=times,
        oldest_ns=oldest,
        n_entries=len(entries),
        notes=tuple(notes),
        snap_ns=snap_ns_of(dump.get(SNAPSHOT_TIME_KEY)),
        p2p_times=tuple((gk[0], gk[1], tuple(ts)) for gk, ts in sorted(b.p2p_t.items())),
        pg_progress=progress,
        pending_order=_pending_order(colls, times),
        threads=_threads(entries[-THREADS_SCAN:] if isinstance(entries, list) else ()),
    )


THREADS_SCAN = 64
"""Entries (the newest) in which a rank's threads per group are looked at: a second thread
issuing on a group (an async checkpoint beside the training loop) shows where it hangs."""


def _threads(entries: Any) -> tuple[tuple[str, str, tuple[str, ...]], ...]:
    """``RankDigest.threads`` from the newest entries (bad entries are passed over)."""
    seen: dict[tuple[str, str], set[str]] = {}
    for e in entries:
        try:
            pg = e["process_group"]
            who = e.get("thread_name") or e.get("thread_id")
            if who is None:
                continue
            seen.setdefault((str(pg[0]), str(pg[1]) if len(pg) > 1 else ""), set()).add(str(who))
        except _BAD_ENTRY:
            continue
    return tuple((n, d, tuple(sorted(ts))) for (n, d), ts in sorted(seen.items()) if len(ts) > 1)


def _pending_order(colls: tuple[tuple[str, str, tuple[Cell, ...]], ...],
                   times: tuple[tuple[str, tuple[int, ...]], ...]) -> tuple[tuple[str, str, int], ...]:
    """``RankDigest.pending_order``: the incomplete tail of each group, merged by issue time."""
    tails = []
    for (name, desc, cells), (_, ts) in zip(colls, times, strict=False):
        j = len(cells) - 1
        while j >= 0 and cells[j][2] != DONE:
            tails.append((ts[j] if j < len(ts) else 0, name, desc, cells[j][0]))
            j -= 1
    if len({(n, d) for _, n, d, _ in tails}) < 2:
        return ()
    return tuple((n, d, seq) for _, n, d, seq in sorted(tails))


def _pg_config(
    rank: int, cfg: Any, notes: list[str]
) -> list[tuple[str, str, tuple[int, ...] | None]]:
    """pg_config as (name, desc, ranks) rows; a group keyed apart from its name gets both."""
    pg: list[tuple[str, str, tuple[int, ...] | None]] = []
    if not isinstance(cfg, Mapping):
        return pg
    for key, c in cfg.items():
        if not isinstance(c, Mapping):
            notes.append(f"rank {rank}: pg_config[{key!r:.40}] is not a dict; ignored")
            continue
        name = str(c.get("name", key) if c.get("name", key) is not None else key)
        ranks: tuple[int, ...] | None = None
        try:
            ranks = group_members(c.get("ranks", "[]")) or None  # once per distinct text
        except DumpError as e:
            notes.append(f"rank {rank}: pg_config[{key!r:.40}]: {e}; ranks inferred instead")
        pg.append((name, str(c.get("desc", "") or ""), ranks))
        if str(key) != name:
            pg.append((str(key), str(c.get("desc", "") or ""), ranks))
    return pg


def _int_or(v: Any, default: int = -1) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


def _pg_status(
    pst: Any, pg: list[tuple[str, str, tuple[int, ...] | None]]
) -> tuple[tuple[tuple[str, int], ...], tuple[tuple[str, int, int], ...]]:
    """``status`` (last enqueued >= 0, what matching uses) and ``pg_progress`` (both counters)."""
    status: list[tuple[str, int]] = []
    progress: dict[str, tuple[int, int]] = {}
    if isinstance(pst, Mapping):
        for key, st in pst.items():
            if not isinstance(st, Mapping):
                continue
            v = _int_or(st.get("last_enqueued_collective", -1))
            progress[str(key)] = (v, _int_or(st.get("last_completed_collective", -1)))
            if v >= 0:
                status.append((str(key), v))
    for name, _, _ in pg:
        progress.setdefault(name, (-1, -1))
    return (tuple(sorted(status)),
            tuple(sorted((n, i, d) for n, (i, d) in progress.items())))  # fmt: skip


class SharedRank(NamedTuple):
    """A rank whose dump shares every part the digest reads with ``base``'s rank's dump (the
    fan-out's shallow copies, :func:`share_key`): its digest is ``base`` with this rank and read
    time (:meth:`digest`). The merge folds it in without building that digest (``merge``).
    Made only of a ``base`` without notes (notes name their rank)."""

    rank: int
    snap_ns: int
    base: RankDigest

    def digest(self) -> RankDigest:
        """The digest this rank's own dump gives (what :func:`digest_dump` would return)."""
        d = rebind(self.base, self.rank, self.snap_ns)
        assert d is not None  # made only of a base whose notes rebind
        return d


class SharedDigests:
    """Digests in rank order, ranks that share a dump's parts sharing one digest object:
    ``digests[i]`` is rank ``ranks[i]``'s digest when its ``rank`` is ``ranks[i]``, else the
    digest it shares, to be read as ``SharedRank(ranks[i], snaps[i], digests[i])``. What
    ``core.analyze`` hands the merge: per shared rank two ints in lists and a reference, no
    object (131072 :class:`SharedRank` tuples would cost the cyclic collector a tenth of a
    second)."""

    __slots__ = ("digests", "ranks", "snaps")

    def __init__(self) -> None:
        self.digests: list[RankDigest] = []
        self.ranks: list[int] = []
        self.snaps: list[int] = []

    def add(self, d: RankDigest) -> None:
        """A rank's own digest."""
        self.digests.append(d)
        self.ranks.append(d.rank)
        self.snaps.append(d.snap_ns)

    def __iter__(self) -> Iterator[RankDigest | SharedRank]:
        for d, r, snap in zip(self.digests, self.ranks, self.snaps, strict=True):
            yield d if d.rank == r else SharedRank(r, snap, d)


def share_key(dump: Any) -> tuple[Any, ...] | None:
    """What a dump's digest depends on besides its rank and read time, by object identity:
    ``entries``, ``pg_config``, ``pg_status``, ``fr_window`` and ``version``. Two dumps with
    the same key (both alive) have digests that differ only in ``rank``, ``snap_ns`` and the
    rank their notes name (:func:`rebind`). None for a dump that is not a mapping."""
    if not isinstance(dump, Mapping):
        return None
    get = dump.get
    v = get("version", "")
    return (id(get("entries")), id(get("pg_config")), id(get("pg_status")), id(get("fr_window")),
            v if type(v) is str else id(v))


def rebind(d: RankDigest, rank: int, snap_ns: int) -> RankDigest | None:
    """``d`` as the digest of another rank whose dump shares ``d``'s parts (:func:`share_key`),
    read at ``snap_ns``; None when a note of ``d`` does not start with its rank (it cannot be
    moved to another rank: digest that dump itself)."""
    if rank == d.rank and snap_ns == d.snap_ns:
        return d
    if not d.notes:
        return d._replace(rank=rank, snap_ns=snap_ns)
    old, new = f"rank {d.rank}: ", f"rank {rank}: "
    if not all(n.startswith(old) for n in d.notes):
        return None
    return d._replace(rank=rank, snap_ns=snap_ns,
                      notes=tuple(new + n[len(old):] for n in d.notes))


class DigestMemo:
    """Digests of the last analysis, used again for a dump made of the very same objects.

    A frontend that reuses the dumps it holds (an agent's "unchanged" reply, ``fanout.agents``)
    hands the analysis new dicts over the same entry, ``pg_config`` and ``pg_status`` objects
    (nothing mutates those after parsing). A dump that matches one of the last analysis by
    object identity of those parts, ``version`` and ring facts gets that dump's digest with its
    own rank and read time (``snap_ns``, :func:`rebind`) instead of a new pass over its entries.
    Each entry keeps its dump alive, so an identity it compares cannot belong to another object.
    The analysis asks once per distinct dump (``core.analyze``: ranks sharing a dump's parts
    share its digest), so :attr:`hits` counts distinct dumps found again.
    """

    def __init__(self) -> None:
        self._last: dict[tuple[Any, ...], tuple[Mapping[str, Any], RankDigest]] = {}
        self._next: dict[tuple[Any, ...], tuple[Mapping[str, Any], RankDigest]] = {}
        self.hits = 0
        self.misses = 0
        """Dumps digested anew (no dump of the last analysis had their parts)."""

    def digest(self, rank: int, dump: Mapping[str, Any]) -> RankDigest:
        entries = dump.get("entries")
        window = dump.get("fr_window")
        key = (id(dump.get("pg_config")), id(dump.get("pg_status")), str(dump.get("version", "")),
               window.get("ring_oldest_ns") if isinstance(window, Mapping) else None,
               tuple(map(id, entries)) if isinstance(entries, list) else id(entries))
        held = self._last.get(key)
        d = None
        if held is not None:
            d = rebind(held[1], rank, snap_ns_of(dump.get(SNAPSHOT_TIME_KEY)))
        if d is not None:
            self.hits += 1
        else:
            self.misses += 1
            d = digest_dump(rank, dump)
        self._next.setdefault(key, (dump, d))
        return d

    def done(self) -> None:
        """The analysis is over: its digests are the ones to match next time."""
        self._last, self._next = self._next, {}


def snap_ns_of(v: Any) -> int:
    """A usable ``dump_time_ns`` or 0 (absent, not an int, or not positive)."""
    return v if type(v) is int and v > 0 else 0


def _parse_name(pname: str) -> tuple[str, str | None, int, int]:
    """``nccl:send 0->1`` -> ("send", "send", 0, 1); ``gloo:all_reduce`` -> ("all_reduce", None, -1, -1)."""
    body = pname.partition(":")[2] if ":" in pname else pname
    op, _, meta = body.partition(" ")
    if op == "send" and "->" in meta:
        s, d = meta.split("->", 1)
        return op, "send", int(s), int(d)
    if op == "recv" and "<-" in meta:
        d, s = meta.split("<-", 1)
        return op, "recv", int(s), int(d)
    return op, (op if op in _P2P else None), -1, -1


def _tt(sizes: Any) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(s) for s in sizes)


class _Builder:
    """The tables one pass over a rank's entries fills (signatures, frames, per-group lists)."""

    def __init__(self) -> None:
        self.sig_index: dict[tuple[Any, ...], int] = {}
        self.sigs: list[tuple[Any, ...]] = []
        self.sig_p2p: list[tuple[str, int, int] | None] = []  # per sig: (kind, src, dst) for P2P
        self.name_cache: dict[str, tuple[str, str | None, int, int]] = {}
        self.fr_index: dict[Frames, int] = {}
        self.fr_tab: list[Frames] = []
        self.recent_frames: list[tuple[Any, int]] = []  # (raw frames list, idx), newest first
        self.recent_k: list[tuple[tuple[Any, ...], int, tuple[str, str]]] = []
        self.colls: dict[tuple[str, str], list[Cell]] = {}
        self.ctimes: dict[tuple[str, str], list[int]] = {}
        self.p2p: dict[tuple[str, str], list[Any]] = {}
        self.p2p_t: dict[tuple[str, str], list[int]] = {}
        self.p2p_done: dict[tuple[str, str], int] = {}
        self.oldest = 0
        self.bad = 0
        self.bad_example = ""

    def feed(self, entries: Any) -> None:
        """The hot loop: one entry costs a tuple comparison and two list scans in the common case."""
        state_code, sig_p2p, recent_frames = _STATE_CODE, self.sig_p2p, self.recent_frames
        recent_k = self.recent_k
        prev_k: tuple[Any, ...] = (None,) * 6
        prev_sig = -1
        gk: tuple[str, str] = ("", "")
        lst: list[Cell] = []
        tl: list[int] = []
        oldest = 0
        after_p2p = False  # the previous entry was a send/recv (a batch's closer may follow)
        for e in entries:
            try:
                k = _MAIN_FIELDS(e)
                if k != prev_k:
                    # A loop issues a few ops in turn (gradient buckets): the op before last is
                    # usually one of the last few distinct ones, so compare before converting.
                    for rk, rsig, rgk in recent_k:
                        if rk == k:
                            sidx, new_gk = rsig, rgk
                            break
                    else:
                        sidx, new_gk = self._new_sig(k)
                    # Commit only once the signature parsed: a bad entry must not switch groups.
                    if new_gk != gk or not self.colls:
                        gk = new_gk
                        lst, tl = self._group_lists(gk)
                    prev_k = k
                    prev_sig = sidx
                sidx = prev_sig
                st = state_code.get(e.get("state"), 0)
                # PyTorch's gloo FR never moves state past "scheduled"; retirement and completion
                # timestamps are the evidence that the op finished.
                if st != DONE and (e.get("retired") or e.get("time_discovered_completed_ns")):
                    st = DONE
                raw_frames = e.get("frames") or ()
                fidx = -1
                for obj, idx in recent_frames:
                    if obj == raw_frames:
                        fidx = idx
                        break
                if fidx < 0:
                    fidx = self._frames_index(raw_frames)
                t = e.get("time_created_ns") or 0
                if t and (not oldest or t < oldest):
                    oldest = t
                pp = sig_p2p[sidx]
                if pp is not None:
                    if pp[0] == "coalesced":
                        if after_p2p or e.get("is_p2p"):
                            # The entry that closes a batch of sends/recvs (batch_isend_irecv)
                            # carries a collective's number: it is no collective.
                            continue
                    else:
                        after_p2p = True
                        self._add_p2p(gk, e, (sidx, st, fidx, *pp), t)
                        continue
                after_p2p = False
                seq = e["collective_seq_id"]
                if type(seq) is not int:
                    seq = int(seq)
                if lst and lst[-1][0] == seq:
                    # Coalesced ops share one sequence number: compare them as one combined op.
                    lst[-1] = self._coalesce(lst[-1], sidx, st)
                    continue
                lst.append((seq, sidx, st, fidx))
                tl.append(int(t))
            except _BAD_ENTRY as ex:
                self.bad += 1
                if not self.bad_example:
                    self.bad_example = f"{type(ex).__name__}: {str(ex)[:60]}"
        self.oldest = oldest

    def _new_sig(self, k: tuple[Any, ...]) -> tuple[int, tuple[str, str]]:
        """(signature index, group key) of an entry's main fields, remembered as recent."""
        pgv = k[0]
        if not isinstance(pgv, (list, tuple)) or not pgv:
            raise TypeError(f"process_group is {type(pgv).__name__}")
        gk = (str(pgv[0]), str(pgv[1]) if len(pgv) > 1 else "")
        pname, ins, outs, ind, outd = k[1:]
        parsed = self.name_cache.get(pname)
        if parsed is None:
            parsed = self.name_cache[pname] = _parse_name(str(pname))
        sig = (str(pname), parsed[0], _tt(ins), _tt(outs), tuple(map(str, ind)),
               tuple(map(str, outd)))  # fmt: skip
        p2p = (parsed[1], parsed[2], parsed[3]) if parsed[1] is not None else None
        if parsed[0] == "coalesced":
            p2p = ("coalesced", -1, -1)  # a marker: is_p2p on the entry decides (feed)
        sidx = self._intern_sig(sig, p2p)
        self.recent_k.insert(0, (k, sidx, gk))
        del self.recent_k[8:]
        return sidx, gk

    def _intern_sig(self, sig: tuple[Any, ...], p2p: tuple[str, int, int] | None) -> int:
        sidx = self.sig_index.get(sig)
        if sidx is None:
            sidx = self.sig_index[sig] = len(self.sigs)
            self.sigs.append(sig)
            self.sig_p2p.append(p2p)
        return sidx

    def _group_lists(self, gk: tuple[str, str]) -> tuple[list[Cell], list[int]]:
        lst = self.colls.get(gk)
        if lst is None:
            lst = self.colls[gk] = []
            self.ctimes[gk] = []
        return lst, self.ctimes[gk]

    def _frames_index(self, raw_frames: Any) -> int:
        ft = tuple(
            (str(f.get("name", "?")), str(f.get("filename", "?")), int(f.get("line", 0) or 0))
            for f in raw_frames
        )
        fidx = self.fr_index.get(ft, -1)
        if fidx < 0:
            fidx = self.fr_index[ft] = len(self.fr_tab)
            self.fr_tab.append(ft)
        self.recent_frames.insert(0, (raw_frames, fidx))
        del self.recent_frames[4:]
        return fidx

    def _add_p2p(self, gk: tuple[str, str], e: Mapping[str, Any], rec: tuple[Any, ...],
                 t: int) -> None:
        if rec[1] == DONE:
            self.p2p_done[gk] = self.p2p_done.get(gk, 0) + 1
            return
        self.p2p.setdefault(gk, []).append((int(e["p2p_seq_id"]), *rec))
        self.p2p_t.setdefault(gk, []).append(int(t))

    def _coalesce(self, prev: Cell, sidx: int, st: int) -> Cell:
        a, b = self.sigs[prev[1]], self.sigs[sidx]
        op = b[1] if b[1].endswith("coalesced") else "coalesced"
        sig = (b[0], op, a[2] + b[2], a[3] + b[3], a[4] + b[4], a[5] + b[5])
        return (prev[0], self._intern_sig(sig, None), min(prev[2], st), prev[3])

    def sorted_colls(
        self,
    ) -> tuple[tuple[tuple[str, str, tuple[Cell, ...]], ...], tuple[tuple[str, tuple[int, ...]], ...]]:
        """Per-group entries and their times, each in seq order (a ring may hold them out of order)."""
        out_colls = []
        out_times = []
        for gk, lst in self.colls.items():
            times = self.ctimes[gk]
            seqs = [x[0] for x in lst]
            if seqs != sorted(seqs):
                order = sorted(range(len(lst)), key=lambda i: lst[i][0])
                lst = [lst[i] for i in order]
                times = [times[i] for i in order]
            if not lst:
                continue
            out_colls.append((gk[0], gk[1], tuple(lst)))
            out_times.append((gk[0], tuple(times)))
        return tuple(out_colls), tuple(out_times)

    def p2p_groups(self) -> tuple[tuple[str, str, int, tuple[Any, ...]], ...]:
        return tuple(
            (gk[0], gk[1], self.p2p_done.get(gk, 0), tuple(self.p2p.get(gk, ())))
            for gk in sorted(set(self.p2p) | set(self.p2p_done))
        )
