"""Cross-rank Flight Recorder analysis: which rank is missing from which collective, and where.

Pure functions over dump dicts (no torch, no HTTP, no process groups), shared by the CLI
(``python -m debug_server.fr_trace``), the rank-0 frontend and the periodic dumper.

How it differs from PyTorch's ``fr_trace`` (each is a bug there):

* Collectives are matched per group (name plus member ranks) and ``collective_seq_id``; P2P ops
  per directed peer pair in ``p2p_seq_id`` order, never mixed with collectives.
* Ranks are never aligned on ``record_id`` (a per-process counter across groups).
* A wrapped ring is ``history_lost``, not a missing rank; one mismatch does not fail every later
  collective; a bad entry is skipped with a note, never an exception.
* PyTorch's own gloo dumps (empty ``pg_config`` names, ``state`` stuck at ``scheduled``) are
  repaired instead of raising ``KeyError``.
* Ranks are never read at one instant. A dump that says when it was taken (``dump_time_ns``)
  lets a collective issued less than :data:`IN_FLIGHT_GRACE_NS` before a rank's read be "in
  flight" for that rank (``in_flight_ranks``), not missing, unmatched or stuck; and a wrapped
  ring read after the others is not ``history_lost`` for the ops it pushed out since.

Speed: each rank is first reduced to a compact, hashable :class:`RankDigest` (one pass over its
entries, comparing each entry's sizes/dtypes with the previous entry's so the common case is a
few C-level comparisons). Ranks whose digests are identical form one class and are merged once,
so a 4096-rank job where 4095 ranks did the same thing costs little more than a 2-rank one.
:func:`digest_dump` is public so the CLI can digest files in worker processes and never hold
all dumps in memory.
"""

from __future__ import annotations

import bisect
import gc
import logging
import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from debug_server.analysis import stackparse
from debug_server.dumpio import DumpError, group_members

logger = logging.getLogger(__name__)

__all__ = [
    "FINDING_KINDS",
    "RankDigest",
    "analyze",
    "analyze_digests",
    "digest_dump",
    "format_ranks",
]

FINDING_KINDS = (
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
_MISMATCH_KINDS = ("type_mismatch", "size_mismatch", "dtype_mismatch")

CATEGORIES = ("cpu_divergence", "gpu_or_network", "misconfigured_collective", "unknown")
"""The result's ``category`` (PyTorch's Flight Recorder root-cause classes), absent when clean:
``cpu_divergence`` a rank never reached the collective (or issued collectives in another order);
``gpu_or_network`` every member issued it and none completed it, and nothing else explains that;
``misconfigured_collective`` mismatched op, size or dtype, or unmatched P2P;
``unknown`` the evidence is too thin (ranks without data)."""

CATEGORY_MEANING = {
    "cpu_divergence": "a rank never reached the collective",
    "gpu_or_network": "every member is inside the collective and it does not progress",
    "misconfigured_collective": "the ranks issued different ops, sizes or dtypes",
    "unknown": "too little evidence to tell",
}
"""One short phrase per :data:`CATEGORIES` entry, for the renderers' "Category:" line."""


def category_line(result: Mapping[str, Any]) -> str:
    """``Category: <name> (<meaning>).`` for a result with a category, else ``""``.

    The next step is already the verdict's last sentence, so this line does not repeat it.
    """
    cat = result.get("category")
    if not cat:
        return ""
    return f"Category: {cat} ({CATEGORY_MEANING.get(cat, '')})."

_STATES = ("scheduled", "started", "completed")
_STATE_CODE = {"scheduled": 0, "started": 1, "completed": 2}
_DONE = 2

_ALL_GATHER = frozenset(
    {
        "all_gather", "_all_gather_base", "all_gather_base", "all_gather_into_tensor",
        "all_gather_single", "allgather", "allgather_base", "all_gather_into_tensor_coalesced",
        "ALLGATHER_coalesced",
    }
)  # fmt: skip
_REDUCE_SCATTER = frozenset(
    {
        "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_base", "reduce_scatter_tensor",
        "reduce_scatter_single", "reduce_scatter_tensor_coalesced", "REDUCE_SCATTER_coalesced",
    }
)  # fmt: skip
_ALL_TO_ALL = frozenset(
    {
        "all_to_all",
        "all_to_all_single",
        "alltoall",
        "alltoall_base",
        "all_to_all_v_single",
        "all_to_all_v",
    }
)
_VARIABLE = frozenset({"all_gather_v", "reduce_scatter_v"})
_ALL_REDUCE = frozenset({"all_reduce", "allreduce", "allreduce_coalesced", "all_reduce_coalesced"})
_P2P = frozenset({"send", "recv"})

IN_FLIGHT_GRACE_NS = 1_000_000_000
"""A collective issued less than this before a rank's snapshot (``dump_time_ns``) is in flight:
ranks that do not hold it yet are not called missing, and nobody is called stuck in it. Why: the
frontend reads the ranks' rings one after another (an HTTP fan-out, sometimes a second round),
never at one instant, so on a job issuing collectives back to back the rank read first has not
yet issued the newest ones. 1 s is far above that skew at small scale and the clock offset of
NTP-synced hosts, and short against a hang: a page read a second into it names it, and the hang
report waits ``stall_timeout`` anyway. Dumps without ``dump_time_ns`` (PyTorch's own, older
pickles) get no grace."""
SNAPSHOT_TIME_KEY = "dump_time_ns"
"""Top-level dump key: the wall clock (ns) of the rank when its ring was read; every op that rank
issued before it is in the dump (unless evicted)."""

# Above this many (rank, op) pairs the JSON keeps per-rank NCCL call rows only for failing
# collectives and the newest ones per group: 4096 ranks x 2000 entries would be 8M rows.
NCCL_CALLS_FULL_LIMIT = 100_000
NCCL_CALLS_TAIL = 50


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
    frames: tuple[tuple[tuple[str, str, int], ...], ...]
    """Local frames table: ((name, filename, line), ...) innermost first."""
    colls: tuple[tuple[str, str, tuple[tuple[int, int, int, int], ...]], ...]
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

    def key(self) -> tuple[Any, ...]:
        """What identical ranks share (no rank number, no timestamps)."""
        return (self.pg, self.sigs, self.frames, self.colls, self.p2p)


# --------------------------------------------------------------------------------------------
# Per-rank digest
# --------------------------------------------------------------------------------------------


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


def digest_dump(rank: int, dump: Mapping[str, Any]) -> RankDigest:
    """Reduce one rank's dump dict to a :class:`RankDigest`; bad entries become notes."""
    notes: list[str] = []
    pg: list[tuple[str, str, tuple[int, ...] | None]] = []
    cfg = dump.get("pg_config") or {}
    if isinstance(cfg, Mapping):
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
    status: list[tuple[str, int]] = []
    pst = dump.get("pg_status") or {}
    if isinstance(pst, Mapping):
        for key, st in pst.items():
            try:
                v = int(st.get("last_enqueued_collective", -1))
            except (AttributeError, TypeError, ValueError):
                continue
            if v >= 0:
                status.append((str(key), v))

    sig_index: dict[tuple[Any, ...], int] = {}
    sigs: list[tuple[Any, ...]] = []
    fr_index: dict[tuple[tuple[str, str, int], ...], int] = {}
    fr_tab: list[tuple[tuple[str, str, int], ...]] = []
    recent_frames: list[tuple[Any, int]] = []  # (raw frames list, idx), newest first
    name_cache: dict[str, tuple[str, str | None, int, int]] = {}
    colls: dict[tuple[str, str], list[tuple[int, int, int, int]]] = {}
    ctimes: dict[tuple[str, str], list[int]] = {}
    p2p: dict[tuple[str, str], list[Any]] = {}
    p2p_t: dict[tuple[str, str], list[int]] = {}
    p2p_done: dict[tuple[str, str], int] = {}
    prev_sig = -1
    oldest = 0
    bad = 0
    bad_example = ""

    entries = dump.get("entries") or []
    sig_p2p: list[tuple[str, int, int] | None] = []  # per sig: (kind, src, dst) for P2P ops
    gk: tuple[str, str] = ("", "")
    lst: list[tuple[int, int, int, int]] = []
    tl: list[int] = []
    state_code = _STATE_CODE
    # One C call fetches everything that decides group and signature; comparing that tuple with
    # the previous entry's is the whole per-entry cost in the common case (same op as before).
    main_fields = operator.itemgetter(
        "process_group",
        "profiling_name",
        "input_sizes",
        "output_sizes",
        "input_dtypes",
        "output_dtypes",
    )
    prev_k: tuple[Any, ...] = (None,) * 6
    recent_k: list[tuple[tuple[Any, ...], int, tuple[str, str]]] = []
    for e in entries:
        try:
            k = main_fields(e)
            if k != prev_k:
                # A loop issues a few ops in turn (gradient buckets): the op before last is
                # usually one of the last few distinct ones, so compare before converting.
                for rk, rsig, rgk in recent_k:
                    if rk == k:
                        sidx, new_gk = rsig, rgk
                        break
                else:
                    sidx, new_gk = _new_sig(k, name_cache, sig_index, sigs, sig_p2p)
                    recent_k.insert(0, (k, sidx, new_gk))
                    del recent_k[8:]
                # Commit only once the whole entry parsed: a bad entry must not switch groups.
                if new_gk != gk or not colls:
                    gk = new_gk
                    lst = colls.get(gk)  # type: ignore[assignment]
                    if lst is None:
                        lst = colls[gk] = []
                        tl = ctimes[gk] = []
                    else:
                        tl = ctimes[gk]
                prev_k = k
                prev_sig = sidx
            sidx = prev_sig
            st = state_code.get(e.get("state"), 0)
            # PyTorch's gloo FR never moves state past "scheduled"; retirement and completion
            # timestamps are the evidence that the op finished.
            if st != _DONE and (e.get("retired") or e.get("time_discovered_completed_ns")):
                st = _DONE
            raw_frames = e.get("frames") or ()
            fidx = -1
            for obj, idx in recent_frames:
                if obj == raw_frames:
                    fidx = idx
                    break
            if fidx < 0:
                ft = tuple(
                    (
                        str(f.get("name", "?")),
                        str(f.get("filename", "?")),
                        int(f.get("line", 0) or 0),
                    )
                    for f in raw_frames
                )
                fidx = fr_index.get(ft, -1)
                if fidx < 0:
                    fidx = fr_index[ft] = len(fr_tab)
                    fr_tab.append(ft)
                recent_frames.insert(0, (raw_frames, fidx))
                del recent_frames[4:]
            t = e.get("time_created_ns") or 0
            if t and (not oldest or t < oldest):
                oldest = t
            pp = sig_p2p[sidx]
            if pp is not None:
                if st == _DONE:
                    p2p_done[gk] = p2p_done.get(gk, 0) + 1
                else:
                    p2p.setdefault(gk, []).append((int(e["p2p_seq_id"]), sidx, st, fidx, *pp))
                    p2p_t.setdefault(gk, []).append(int(t))
                continue
            seq = e["collective_seq_id"]
            if type(seq) is not int:
                seq = int(seq)
            if lst and lst[-1][0] == seq:
                # Coalesced ops share one sequence number: compare them as one combined op.
                lst[-1] = _coalesce(lst[-1], sidx, st, sigs, sig_index, sig_p2p)
                continue
            lst.append((seq, sidx, st, fidx))
            tl.append(int(t))
        except (KeyError, TypeError, IndexError, ValueError, AttributeError) as ex:
            bad += 1
            if not bad_example:
                bad_example = f"{type(ex).__name__}: {str(ex)[:60]}"
    if bad:
        notes.append(
            f"rank {rank}: skipped {bad} malformed entr{'y' if bad == 1 else 'ies'} ({bad_example})"
        )
    window = dump.get("fr_window")  # a live fetch cut the ring (frwindow): its own oldest op
    if isinstance(window, Mapping) and type(window.get("ring_oldest_ns")) is int:
        oldest = window["ring_oldest_ns"]

    out_colls = []
    out_times = []
    for gk, lst in colls.items():
        times = ctimes[gk]
        seqs = [x[0] for x in lst]
        if seqs != sorted(seqs):
            order = sorted(range(len(lst)), key=lambda i: lst[i][0])
            lst = [lst[i] for i in order]
            times = [times[i] for i in order]
        if not lst:
            continue
        out_colls.append((gk[0], gk[1], tuple(lst)))
        out_times.append((gk[0], tuple(times)))
    out_p2p = []
    for gk in sorted(set(p2p) | set(p2p_done)):
        out_p2p.append((gk[0], gk[1], p2p_done.get(gk, 0), tuple(p2p.get(gk, ()))))
    return RankDigest(
        rank=rank,
        version=str(dump.get("version", "")),
        pg=tuple(sorted(set(pg), key=lambda x: (x[0], x[1], x[2] or ()))),
        sigs=tuple(sigs),
        frames=tuple(fr_tab),
        colls=tuple(out_colls),
        p2p=tuple(out_p2p),
        status=tuple(sorted(status)),
        times=tuple(out_times),
        oldest_ns=oldest,
        n_entries=len(entries),
        notes=tuple(notes),
        snap_ns=_snap_ns(dump.get(SNAPSHOT_TIME_KEY)),
        p2p_times=tuple((gk[0], gk[1], tuple(ts)) for gk, ts in sorted(p2p_t.items())),
    )


def _snap_ns(v: Any) -> int:
    """A usable ``dump_time_ns`` or 0 (absent, not an int, or not positive)."""
    return v if type(v) is int and v > 0 else 0


def _new_sig(
    k: tuple[Any, ...],
    name_cache: dict[str, tuple[str, str | None, int, int]],
    sig_index: dict[tuple[Any, ...], int],
    sigs: list[tuple[Any, ...]],
    sig_p2p: list[tuple[str, int, int] | None],
) -> tuple[int, tuple[str, str]]:
    """(signature index, group key) of an entry's main fields; a new signature is added."""
    pgv = k[0]
    if not isinstance(pgv, (list, tuple)) or not pgv:
        raise TypeError(f"process_group is {type(pgv).__name__}")
    gk = (str(pgv[0]), str(pgv[1]) if len(pgv) > 1 else "")
    pname, ins, outs, ind, outd = k[1:]
    parsed = name_cache.get(pname)
    if parsed is None:
        parsed = name_cache[pname] = _parse_name(str(pname))
    sig = (str(pname), parsed[0], _tt(ins), _tt(outs), tuple(map(str, ind)), tuple(map(str, outd)))
    sidx = sig_index.get(sig)
    if sidx is None:
        sidx = sig_index[sig] = len(sigs)
        sigs.append(sig)
        sig_p2p.append((parsed[1], parsed[2], parsed[3]) if parsed[1] is not None else None)
    return sidx, gk


def _coalesce(
    prev: tuple[int, int, int, int],
    sidx: int,
    st: int,
    sigs: list[Any],
    sig_index: dict[Any, int],
    sig_p2p: list[Any],
) -> tuple[int, int, int, int]:
    a, b = sigs[prev[1]], sigs[sidx]
    op = b[1] if b[1].endswith("coalesced") else "coalesced"
    sig = (b[0], op, a[2] + b[2], a[3] + b[3], a[4] + b[4], a[5] + b[5])
    idx = sig_index.get(sig)
    if idx is None:
        idx = sig_index[sig] = len(sigs)
        sigs.append(sig)
        sig_p2p.append(None)
    return (prev[0], idx, min(prev[2], st), prev[3])


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def stack_groups(stacks: Mapping[int, str]) -> list[dict[str, Any]]:
    """Ranks grouped by where their main thread is, odd ones (smallest groups) first.

    ``stacks``: rank -> faulthandler text. Each group is ``{"ranks", "summary",
    "in_collective"}``, e.g. ``{"ranks": [5], "summary": "time.sleep at demo.py:66",
    "in_collective": False}``; the same groups as ``analyze(...)["stack_groups"]``.
    """
    return _group_stacks(stacks, [])[0]


def _group_stacks(
    stacks: Mapping[int, str], notes: list[str]
) -> tuple[list[dict[str, Any]], dict[int, stackparse.Position]]:
    by_summary: dict[tuple[str, bool], list[int]] = {}
    positions: dict[int, stackparse.Position] = {}
    cache: dict[str, stackparse.Position | None] = {}
    for r, text in sorted(stacks.items()):
        if text not in cache:
            try:
                cache[text] = stackparse.summarize_text(text)
            except Exception as e:  # noqa: BLE001 - unparseable stacks must not stop the analysis
                notes.append(f"rank {r}: stack text unparseable ({type(e).__name__})")
                cache[text] = None
        pos = cache[text]
        if pos is None:
            continue
        positions[r] = pos
        by_summary.setdefault((pos.summary, pos.in_collective), []).append(r)
    groups = [
        {"ranks": rs, "summary": s, "in_collective": ic}
        for (s, ic), rs in sorted(by_summary.items(), key=lambda kv: (len(kv[1]), kv[1][0]))
    ]
    return groups, positions


def format_ranks(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2, 5`` (sorted, ranges collapsed)."""
    rs = sorted(set(ranks))
    parts: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ", ".join(parts)


def _ranks_phrase(ranks: Sequence[int]) -> str:
    rs = sorted(set(ranks))
    return f"{'rank' if len(rs) == 1 else 'ranks'} {format_ranks(rs)}"


def _numel(sizes: tuple[tuple[int, ...], ...]) -> int:
    return sum(math.prod(s) for s in sizes)


def _intrinsic_problem(sig: tuple[Any, ...], group_size: int) -> str | None:
    """A size rule one rank's op breaks on its own (e.g. all_gather output != input x size)."""
    op, ins, outs = sig[1], sig[2], sig[3]
    if not ins or not outs:
        return None
    if op in _ALL_GATHER and _numel(outs) != _numel(ins) * group_size:
        return f"output numel {_numel(outs)} != input numel {_numel(ins)} x group size {group_size}"
    if op in _REDUCE_SCATTER and _numel(ins) != _numel(outs) * group_size:
        return f"input numel {_numel(ins)} != output numel {_numel(outs)} x group size {group_size}"
    if op in _ALL_REDUCE and ins != outs:
        return f"input sizes {_fmt_sizes(ins)} != output sizes {_fmt_sizes(outs)}"
    return None


def _fmt_sizes(sizes: tuple[tuple[int, ...], ...]) -> str:
    return str([list(s) for s in sizes])


_OWN_DIR = __file__.rsplit("/", 2)[0] + "/"  # the package root: debug_server/


def _user_line(frames: Sequence[Mapping[str, Any]]) -> str | None:
    """``train.py:148 in step``: the innermost frame outside torch and this package."""
    def inside(f: Mapping[str, Any]) -> bool:
        fn = str(f.get("filename", ""))
        return "/torch/" in fn or fn.startswith(_OWN_DIR) or fn.startswith("<frozen")

    top = next((f for f in frames if not inside(f)), frames[0] if frames else None)
    if top is None:
        return None
    return f"{top.get('filename')}:{top.get('line')} in {top.get('name')}"


def _sig_text(sig: Mapping[str, Any]) -> str:
    ins, outs = sig["input_sizes"], sig["output_sizes"]
    sizes = f"{ins}" if ins == outs else f"in {ins} out {outs}"
    return f"{sig['op']} {sizes} {'/'.join(sig['dtypes'])}".rstrip()


def _mismatch_step(f: Mapping[str, Any]) -> str:
    """Make the calls agree: each side's op, sizes and dtypes and its line, odd side first."""
    sigs = f.get("signatures") or []
    if len(sigs) < 2:
        where = f" at {sigs[0]['line']}" if sigs and sigs[0].get("line") else ""
        return f"fix the call{where}: {f['detail']}."
    sides = sorted(sigs, key=lambda s: (len(s["ranks"]), s["ranks"]))
    text = "; ".join(
        f"{_ranks_phrase(s['ranks'])} issue{'s' if len(s['ranks']) == 1 else ''} {_sig_text(s)}"
        + (f" at {s['line']}" if s.get("line") else "")
        for s in sides[:3]
    )
    return f"make the calls of {f['op']} #{f['seq']} on {f['group_label']} agree: {text}."


def _size_key(sig: tuple[Any, ...]) -> Any:
    op = sig[1]
    if op in _ALL_TO_ALL or op in _VARIABLE:
        return None
    if op == "scatter":
        return sig[3]
    if op == "gather":
        return sig[2]
    return (sig[2], sig[3])


def _dtype_key(sig: tuple[Any, ...]) -> tuple[str, ...]:
    return tuple(sorted(set(sig[4]) | set(sig[5])))


def _split_majority(groups: dict[Any, list[int]]) -> tuple[list[int], bool]:
    """Ranks outside the strict majority (culprits) and whether that was decidable."""
    counts = sorted((len(v) for v in groups.values()), reverse=True)
    if len(counts) > 1 and counts[0] > counts[1]:
        top = max(groups, key=lambda k: len(groups[k]))
        return sorted(r for k, v in groups.items() if k != top for r in v), True
    return sorted(r for v in groups.values() for r in v), False


class _Group:
    __slots__ = ("id", "name", "desc", "ranks", "inferred", "rank_set", "label")

    def __init__(
        self, gid: str, name: str, desc: str, ranks: tuple[int, ...], inferred: bool
    ) -> None:
        self.id = gid
        self.name = name
        self.desc = desc
        self.ranks = list(ranks)
        self.rank_set = frozenset(ranks)
        self.inferred = inferred
        # PyTorch's own groups are named "0", "1"...: "on pg 0 (default_pg)" reads better. The
        # gloo side of a "cpu:gloo,cuda:nccl" group is "0:gloo" (c10d_fr).
        self.label = (
            gid
            if not name.removesuffix(":gloo").isdigit()
            else (f"pg {gid} ({desc})" if desc and desc != "undefined" else f"pg {gid}")
        )


class _Class:
    __slots__ = ("idx", "ranks", "d", "sig_g", "fr_g", "gkeys")

    def __init__(self, idx: int, d: RankDigest) -> None:
        self.idx = idx
        self.ranks: list[int] = [d.rank]
        self.d = d
        self.sig_g: list[int] = []
        self.fr_g: list[int] = []
        self.gkeys: dict[tuple[str, str], tuple[str, tuple[int, ...]]] = {}


# --------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------


def analyze(
    dumps: Mapping[int, Mapping[str, Any]],
    *,
    world_size: int | None = None,
    stacks: Mapping[int, str] | None = None,
    unavailable: Mapping[int, str] | None = None,
    pg_filters: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Match every rank's Flight Recorder entries and say what hangs and why.

    Args:
        dumps: global rank -> that rank's dump dict (``version``, ``pg_config``, ``pg_status``,
            ``entries``) in the torch FR schema; ``process_group`` may be a list or a tuple.
        world_size: defaults to the largest rank seen (dumps, pg_config, unavailable, stacks) + 1.
        stacks: rank -> raw faulthandler text of that rank, joined into ``stack_groups`` and the
            verdict.
        unavailable: rank -> one-line reason for ranks that gave no data ("unreachable after
            2.0 s"); listed in ``ranks_without_data`` and named in the verdict.
        pg_filters: only analyze groups whose name or desc is in this list.

    Returns:
        The JSON-serializable result of DESIGN.md "Analysis result (JSON)": ``world_size``,
        ``ranks_with_data``, ``ranks_without_data``, ``unavailable``, ``groups``,
        ``collectives``, ``nccl_calls``, ``findings``, ``verdict``, ``stack_groups``, ``notes``;
        ``category`` (one of :data:`CATEGORIES`) and its one-line ``next_step`` unless the trace
        is clean; ``finding_order``, the indices of ``findings`` in the order the verdict takes
        them (root cause first). Never raises on bad data: a malformed dump or entry becomes a note.
    """
    digests = []
    notes: list[str] = []
    for rank, dump in sorted(dumps.items()):
        try:
            digests.append(digest_dump(int(rank), dump))
        except Exception as e:  # noqa: BLE001 - one unusable dump must not stop the analysis
            notes.append(f"rank {rank}: dump unusable ({type(e).__name__}: {str(e)[:80]})")
            logger.warning("rank %s: dump unusable: %s", rank, e)
    return analyze_digests(
        digests,
        world_size=world_size,
        stacks=stacks,
        unavailable=unavailable,
        pg_filters=pg_filters,
        extra_notes=notes,
    )


def analyze_digests(
    digests: Iterable[RankDigest],
    *,
    world_size: int | None = None,
    stacks: Mapping[int, str] | None = None,
    unavailable: Mapping[int, str] | None = None,
    pg_filters: Sequence[str] | None = None,
    extra_notes: Sequence[str] = (),
) -> dict[str, Any]:
    """:func:`analyze` over pre-computed digests (what the CLI's worker processes return)."""
    # The merge allocates millions of small acyclic tuples at scale; generational GC passes over
    # them cost more than the analysis itself, and there are no cycles to collect.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _Merge(digests, world_size, stacks, unavailable, pg_filters, extra_notes).run()
    finally:
        if was_enabled:
            gc.enable()


# --------------------------------------------------------------------------------------------
# Cross-rank merge
# --------------------------------------------------------------------------------------------


class _Merge:
    def __init__(
        self,
        digests: Iterable[RankDigest],
        world_size: int | None,
        stacks: Mapping[int, str] | None,
        unavailable: Mapping[int, str] | None,
        pg_filters: Sequence[str] | None,
        extra_notes: Sequence[str],
    ) -> None:
        self.notes: list[str] = list(extra_notes)
        self.total_entries = 0
        self.stacks = {int(k): v for k, v in (stacks or {}).items()}
        self.unavailable = {int(k): str(v) for k, v in (unavailable or {}).items()}
        self.pg_filters = set(pg_filters) if pg_filters else None
        self.classes: dict[tuple[Any, ...], _Class] = {}
        self.class_list: list[_Class] = []
        # rank -> (pg_status as dict, oldest retained entry ns, snapshot ns); full digests are kept once
        # per class, so memory stays O(distinct behaviours), not O(ranks x entries).
        self.digest_of: dict[int, tuple[dict[str, int], int, int]] = {}
        self.class_of: dict[int, _Class] = {}
        self.sigs: list[tuple[Any, ...]] = []
        self.sig_ids: dict[tuple[Any, ...], int] = {}
        self.frames: list[list[dict[str, Any]]] = []
        self.fr_ids: dict[tuple[Any, ...], int] = {}
        max_rank = -1
        self.any_snap = False  # some dump says when it was taken: the skew rules can apply
        self.newer_memo: dict[tuple[int, int], int] = {}
        for d in digests:
            if d.rank in self.digest_of:
                self.notes.append(f"rank {d.rank}: more than one dump; kept the first")
                continue
            self.digest_of[d.rank] = (dict(d.status), d.oldest_ns, d.snap_ns)
            self.any_snap = self.any_snap or d.snap_ns > 0
            self.total_entries += d.n_entries
            self.notes.extend(d.notes)
            max_rank = max(max_rank, d.rank)
            for _, _, rs in d.pg:
                if rs:
                    max_rank = max(max_rank, rs[-1])
            k = d.key()
            c = self.classes.get(k)
            if c is None:
                c = self.classes[k] = _Class(len(self.class_list), d)
                self.class_list.append(c)
                c.sig_g = [self._intern_sig(s) for s in d.sigs]
                c.fr_g = [self._intern_frames(f) for f in d.frames]
            else:
                c.ranks.append(d.rank)
            self.class_of[d.rank] = c
        for r in list(self.unavailable) + list(self.stacks):
            max_rank = max(max_rank, r)
        self.world_size = world_size if world_size is not None else max_rank + 1
        self.data_ranks = sorted(self.digest_of)
        self.collectives: list[dict[str, Any]] = []
        self.findings: list[dict[str, Any]] = []
        self.calls_src: list[tuple[dict[str, Any], list[tuple[int, int]]]] = []
        self.waiting: list[dict[str, Any]] = []

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

    # -- groups --------------------------------------------------------------------------------

    def _resolve_groups(self) -> dict[tuple[str, tuple[int, ...]], _Group]:
        world = tuple(range(self.world_size))
        referenced: dict[tuple[str, str], set[int]] = {}
        for c in self.class_list:
            for name, desc, _ in c.d.colls:
                referenced.setdefault((name, desc), set()).update(c.ranks)
            for name, desc, _, _ in c.d.p2p:
                referenced.setdefault((name, desc), set()).update(c.ranks)
        keys: dict[tuple[str, tuple[int, ...]], tuple[str, bool]] = {}
        for c in self.class_list:
            cfg = {name: (desc, rs) for name, desc, rs in c.d.pg if rs}
            unnamed = [rs for name, _, rs in c.d.pg if rs and name == ""]
            names = {(n, dsc) for n, dsc, _ in c.d.colls} | {(n, dsc) for n, dsc, _, _ in c.d.p2p}
            unresolved = [nd for nd in names if nd[0] not in cfg]
            for name, desc in names:
                inferred = False
                if name in cfg:
                    desc_cfg, rs = cfg[name]
                    desc = desc or desc_cfg
                elif desc == "default_pg" or (
                    len(unresolved) == 1 and unnamed and len(unnamed) == 1
                ):
                    # PyTorch's gloo FR names the world group "0" in entries but writes its
                    # pg_config under "" (or not at all): the default group is the world.
                    rs = unnamed[0] if (desc != "default_pg" and unnamed) else world
                    inferred = True
                else:
                    rs = tuple(sorted(referenced.get((name, desc), set())))
                    inferred = True
                    self.notes.append(
                        f"group {name or '?'}: no ranks in pg_config; members inferred from "
                        f"the ranks whose entries name it ({format_ranks(rs)})"
                    )
                c.gkeys[(name, desc)] = (name, rs)
                keys.setdefault((name, rs), (desc, inferred))
        by_name: dict[str, int] = {}
        for name, _ in keys:
            by_name[name] = by_name.get(name, 0) + 1
        groups: dict[tuple[str, tuple[int, ...]], _Group] = {}
        for (name, rs), (desc, inferred) in sorted(
            keys.items(), key=lambda kv: (kv[0][0], kv[0][1])
        ):
            gid = name if by_name[name] == 1 else f"{name}[{format_ranks(rs)}]"
            if not gid:
                gid = "?"
            groups[(name, rs)] = _Group(gid, name, desc, rs, inferred)
        return groups

    # -- collectives ---------------------------------------------------------------------------

    def _analyze_group_colls(self, g: _Group, gkey: tuple[str, tuple[int, ...]]) -> None:
        members = g.ranks
        member_set = g.rank_set
        gsize = len(members)
        # Classes with entries in this group, with their coverage [lo, hi].
        cls: list[tuple[_Class, tuple[tuple[int, int, int, int], ...], tuple[int, ...]]] = []
        for c in self.class_list:
            for name, desc, ents in c.d.colls:
                if c.gkeys.get((name, desc)) == gkey and ents:
                    times = next((t for n, t in c.d.times if n == name), ())
                    cls.append((c, ents, times))
        if not cls:
            return
        data_members = [r for r in members if r in self.digest_of]
        covered_by_cls: set[int] = set()
        for c, _, _ in cls:
            covered_by_cls.update(r for r in c.ranks if r in member_set)
        # Member ranks that have data but no entry at all in this group.
        no_entries = [r for r in data_members if r not in covered_by_cls]
        cells: dict[int, list[tuple[int, int, int, int]]] = {}
        cover: dict[int, tuple[int, int]] = {}
        rep_time: dict[int, int] = {}
        for ci, (c, ents, times) in enumerate(cls):
            cover[ci] = (ents[0][0], ents[-1][0])
            sg = c.sig_g
            fg = c.fr_g
            for j, (seq, sidx, st, fidx) in enumerate(ents):
                cell = cells.get(seq)
                if cell is None:
                    cell = cells[seq] = []
                    if j < len(times):
                        rep_time[seq] = times[j]
                cell.append((ci, sg[sidx], st, fg[fidx] if fidx >= 0 else -1))
        status = {r: self.digest_of[r][0].get(g.name, -1) for r in no_entries}
        all_present_list = sorted(covered_by_cls)
        cls_ranks = [[r for r in c.ranks if r in member_set] for c, _, _ in cls]
        n_cls = len(cls)
        first_missing_done = False
        mismatch_seen: dict[str, dict[str, Any]] = {}
        lost_union: set[int] = set()
        lost_last_seq = -1
        lost_count = 0
        stuck_reported = False
        seqs = sorted(cells)
        tail_start = max(0, len(seqs) - NCCL_CALLS_TAIL)
        for pos, seq in enumerate(seqs):
            items = cells[seq]
            missing: list[int] = []
            lost: list[int] = []
            in_flight: list[int] = []
            lost_real = False  # some rank's ring lost it before the others were read
            if len(items) == n_cls and not no_entries:
                present = all_present_list
            else:
                issuing = {it[0] for it in items}
                present = sorted(r for it in items for r in cls_ranks[it[0]])
                for ci in range(n_cls):
                    if ci in issuing:
                        continue
                    lo, _hi = cover[ci]
                    if lo <= seq:
                        missing.extend(cls_ranks[ci])
                        continue
                    lost.extend(cls_ranks[ci])
                    if not (self.any_snap and self._evicted_after_read(cls, ci, items, seq, lo)):
                        lost_real = True
                t_seq = rep_time.get(seq, 0)
                for r in no_entries:
                    if status[r] >= seq:
                        lost.append(r)
                        lost_real = True
                    elif t_seq and self.digest_of[r][1] > t_seq:
                        # Its whole ring is newer than this op: the group's entries were evicted.
                        lost.append(r)
                        lost_real = True
                    else:
                        missing.append(r)
                missing.sort()
                lost.sort()
                if missing and self.any_snap:
                    in_flight = self._read_before_issued(cls, items, seq, missing)
                    if in_flight:
                        missing = [r for r in missing if r not in in_flight]
            # Signature comparison: one dict lookup in the common case.
            sig_ids = {it[1] for it in items}
            first = min(items, key=lambda it: it[0])
            ref_sig = self.sigs[first[1]]
            mismatch = None
            kind = None
            culprits: list[int] = []
            if len(sig_ids) == 1:
                prob = _intrinsic_problem(ref_sig, gsize)
                if prob:
                    kind, culprits, mismatch = (
                        "size_mismatch",
                        list(present),
                        f"{ref_sig[1]}: {prob}",
                    )
            else:
                kind, culprits, mismatch = self._compare(
                    items, cls_ranks, gsize, len(missing) + len(lost) == 0 and len(present) == gsize
                )
            min_state = min(it[2] for it in items)
            any_done = any(it[2] == _DONE for it in items)
            row = {
                "id": len(self.collectives),
                "group": g.id,
                "group_desc": g.desc,
                "group_ranks": g.ranks,
                "seq": seq,
                "p2p_seq": None,
                "op": ref_sig[1],
                "profiling_name": ref_sig[0],
                "state": _STATES[min_state],
                "pass_check": not missing and mismatch is None,
                "missing_ranks": missing,
                "present_ranks": present,
                "expected_ranks": g.ranks,
                "history_lost_ranks": lost,
                "in_flight_ranks": in_flight,
                "input_sizes": [list(s) for s in ref_sig[2]],
                "output_sizes": [list(s) for s in ref_sig[3]],
                "input_dtypes": list(ref_sig[4]),
                "output_dtypes": list(ref_sig[5]),
                "mismatch": mismatch,
                "frames": self.frames[first[3]] if first[3] >= 0 else [],
            }
            self.collectives.append(row)
            if (
                not row["pass_check"]
                or pos >= tail_start
                or self.total_entries <= NCCL_CALLS_FULL_LIMIT
            ):
                per_rank = sorted((r, it[2]) for it in items for r in cls_ranks[it[0]])
                self.calls_src.append((row, per_rank))
            if lost_real:
                lost_union.update(lost)
                lost_last_seq = seq
                lost_count += 1
            if missing and not first_missing_done:
                first_missing_done = True
                waiting = [r for it in items if it[2] != _DONE for r in cls_ranks[it[0]]]
                self._finding(
                    "missing_ranks",
                    g,
                    seq,
                    ref_sig[1],
                    missing,
                    f"{_ranks_phrase(missing).capitalize()} never issued {ref_sig[1]} #{seq} on {g.label}"
                    f"; {_ranks_phrase(present)} issued it"
                    + (
                        f" ({_ranks_phrase(waiting)} still waiting)"
                        if waiting
                        else " and finished it"
                    ),
                    waiting=sorted(waiting),
                )
            if kind is not None:
                seen = mismatch_seen.get(kind)
                if seen is None:
                    mismatch_seen[kind] = self._finding(
                        kind,
                        g,
                        seq,
                        ref_sig[1],
                        culprits,
                        f"{ref_sig[1]} #{seq} on {g.label}: {mismatch}",
                        signatures=self._signatures(items, cls_ranks),
                    )
                    mismatch_seen[kind]["_count"] = 0
                else:
                    seen["_count"] += 1
            if not any_done and not missing and not stuck_reported and len(present) == gsize:
                # Nobody finished it, and a rank that issued a later op in this group is taken to
                # have finished it (on gloo that is the only evidence).
                if all(cover[it[0]][1] == seq for it in items) and not (
                    self.any_snap and self._just_issued(cls, items, seq)
                ):
                    stuck_reported = True
                    self._finding(
                        "stuck_everywhere",
                        g,
                        seq,
                        ref_sig[1],
                        list(present),
                        f"all {gsize} ranks of {g.label} issued {ref_sig[1]} #{seq} and none completed it",
                    )
            if not any_done and all(cover[it[0]][1] == seq for it in items):
                self.waiting.append(
                    {"group": g.id, "seq": seq, "op": ref_sig[1],
                     "label": g.label, "ranks": [r for it in items for r in cls_ranks[it[0]]]}
                )  # fmt: skip
        for f in mismatch_seen.values():
            n = f.pop("_count")
            if n:
                f["detail"] += f" (and {n} later sequence number{'s' if n > 1 else ''} on {g.id})"
        if lost_union:
            self._finding(
                "history_lost",
                g,
                lost_last_seq,
                None,
                sorted(lost_union),
                f"{_ranks_phrase(sorted(lost_union)).capitalize()} no longer hold {lost_count} older "
                f"collective{'s' if lost_count > 1 else ''} of {g.label} (ring wrapped, up to #{lost_last_seq}); "
                "those were checked only on the ranks that still hold them",
            )

    # -- snapshot skew (see IN_FLIGHT_GRACE_NS) -------------------------------------------------
    # A class's times are its first rank's; ranks merged into one class did the same ops, so
    # their issue and snapshot times differ by the skew these rules tolerate anyway.

    @staticmethod
    def _issue_time(entry: tuple[_Class, tuple[tuple[int, int, int, int], ...], tuple[int, ...]],
                    seq: int) -> int:
        """When the class's first rank issued ``seq`` (its wall clock, ns); 0 when unknown."""
        _, ents, times = entry
        j = bisect.bisect_left(ents, seq, key=operator.itemgetter(0))
        return times[j] if j < len(times) and ents[j][0] == seq else 0

    def _read_before_issued(
        self,
        cls: list[tuple[_Class, tuple[tuple[int, int, int, int], ...], tuple[int, ...]]],
        items: list[tuple[int, int, int, int]],
        seq: int,
        missing: list[int],
    ) -> list[int]:
        """The ``missing`` ranks whose dump is no evidence that they skipped ``seq``: it was
        taken less than the grace after the first issuer issued it (compares wall clocks of
        different hosts, which NTP keeps far closer than the grace). Not "every issuer was read
        just after issuing": an issuer frozen then, whose last dump is that moment, would hide
        a rank missing for good. A rank whose dump has no time gets no grace."""
        times = [t for ci in {it[0] for it in items} if (t := self._issue_time(cls[ci], seq))]
        if not times:
            return []
        first = min(times)
        return [r for r in missing
                if (snap := self.digest_of[r][2]) and snap - first < IN_FLIGHT_GRACE_NS]

    def _just_issued(
        self,
        cls: list[tuple[_Class, tuple[tuple[int, int, int, int], ...], tuple[int, ...]]],
        items: list[tuple[int, int, int, int]],
        seq: int,
    ) -> bool:
        """The newest read of an issuer of ``seq`` came less than the grace after its last
        member issued it: an op that nobody has completed yet is in flight, not stuck. (Not
        "some issuer was read just after issuing": a rank frozen right after issuing, whose
        last dump is that moment, would keep the op young forever.)"""
        newest_read = last_issue = 0
        for ci in {it[0] for it in items}:
            snap, t = cls[ci][0].d.snap_ns, self._issue_time(cls[ci], seq)
            if not (snap and t):
                return False
            newest_read, last_issue = max(newest_read, snap), max(last_issue, t)
        return newest_read - last_issue < IN_FLIGHT_GRACE_NS

    def _evicted_after_read(
        self,
        cls: list[tuple[_Class, tuple[tuple[int, int, int, int], ...], tuple[int, ...]]],
        ci: int,
        items: list[tuple[int, int, int, int]],
        seq: int,
        lo: int,
    ) -> bool:
        """Class ``ci``'s ring (oldest seq ``lo`` > ``seq`` here) was read after every holder of
        ``seq`` and has recorded at least ``lo - seq`` ops since the latest of those reads: each
        pushed one old entry out, so at the holders' instant it may still have held ``seq``.
        That is the read skew at the old end of a wrapped ring, not history lost."""
        snap_r = cls[ci][0].d.snap_ns
        held = [cls[j][0].d.snap_ns for j in {it[0] for it in items}]
        if not snap_r or not all(held):
            return False
        latest = max(held)
        if snap_r <= latest:
            return False
        key = (cls[ci][0].idx, latest)
        newer = self.newer_memo.get(key)
        if newer is None:
            # Per-group times run in seq order, which is issue order; P2P entries are not
            # counted, which can only make this say "lost" more often.
            newer = sum(len(t) - bisect.bisect_right(t, latest) for _, t in cls[ci][0].d.times)
            self.newer_memo[key] = newer
        return lo - seq <= newer

    def _signatures(
        self, items: list[tuple[int, int, int, int]], cls_ranks: list[list[int]]
    ) -> list[dict[str, Any]]:
        """What each side of a mismatch issued, and from which line (largest side first)."""
        by_sig: dict[int, tuple[list[int], int]] = {}
        for ci, sg, _, fr in items:
            rs, fr0 = by_sig.get(sg, ([], fr))
            rs.extend(cls_ranks[ci])
            by_sig[sg] = (rs, fr0)
        out = []
        for sg, (rs, fr) in sorted(by_sig.items(), key=lambda kv: (-len(kv[1][0]), min(kv[1][0]))):
            sig = self.sigs[sg]
            out.append({
                "ranks": sorted(rs), "op": sig[1],
                "input_sizes": [list(x) for x in sig[2]], "output_sizes": [list(x) for x in sig[3]],
                "dtypes": sorted(set(sig[4]) | set(sig[5])),
                "line": _user_line(self.frames[fr]) if fr >= 0 else None,
            })  # fmt: skip
        return out

    def _compare(
        self,
        items: list[tuple[int, int, int, int]],
        cls_ranks: list[list[int]],
        gsize: int,
        complete: bool,
    ) -> tuple[str | None, list[int], str | None]:
        by_sig: dict[int, list[int]] = {}
        for ci, sg, _, _ in items:
            by_sig.setdefault(sg, []).extend(cls_ranks[ci])
        for label, keyf in (
            ("type_mismatch", lambda s: s[1]),
            ("size_mismatch", _size_key),
            ("dtype_mismatch", _dtype_key),
        ):
            groups: dict[Any, list[int]] = {}
            for sg, rs in by_sig.items():
                groups.setdefault(keyf(self.sigs[sg]), []).extend(rs)
            if len(groups) > 1:
                culprits, decided = _split_majority(groups)
                desc = "; ".join(
                    f"{_ranks_phrase(rs)}: {self._describe(label, k)}"
                    for k, rs in sorted(groups.items(), key=lambda kv: (-len(kv[1]), min(kv[1])))
                )
                what = label.replace("_", " ")
                culprit_txt = f" (culprit {_ranks_phrase(culprits)})" if decided else ""
                return label, culprits, f"{what}{culprit_txt}: {desc}"
        # all_to_all: per-rank sizes legitimately differ; the totals must agree.
        sig0 = self.sigs[items[0][1]]
        if sig0[1] in _ALL_TO_ALL and complete:
            tin = sum(_numel(self.sigs[sg][2]) * len(rs) for sg, rs in by_sig.items())
            tout = sum(_numel(self.sigs[sg][3]) * len(rs) for sg, rs in by_sig.items())
            if tin != tout:
                rs = sorted(r for v in by_sig.values() for r in v)
                return (
                    "size_mismatch",
                    rs,
                    f"{sig0[1]}: total input numel {tin} != total output numel {tout}",
                )
        # Same op, sizes, dtypes: any intrinsic rule broken by some ranks?
        bad: list[int] = []
        prob = None
        for sg, rs in by_sig.items():
            p = _intrinsic_problem(self.sigs[sg], gsize)
            if p:
                bad.extend(rs)
                prob = p
        if bad:
            return "size_mismatch", sorted(bad), f"{sig0[1]} on {_ranks_phrase(bad)}: {prob}"
        return None, [], None

    @staticmethod
    def _describe(label: str, key: Any) -> str:
        if label == "type_mismatch":
            return str(key)
        if label == "dtype_mismatch":
            return "/".join(key) or "no tensors"
        if key is None:
            return "?"
        if isinstance(key, tuple) and len(key) == 2 and all(isinstance(k, tuple) for k in key):
            return f"in {_fmt_sizes(key[0])} out {_fmt_sizes(key[1])}"
        return _fmt_sizes(key)

    def _finding(
        self,
        kind: str,
        g: _Group,
        seq: int | None,
        op: str | None,
        ranks: list[int],
        detail: str,
        **extra: Any,
    ) -> dict[str, Any]:
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

    # -- P2P -----------------------------------------------------------------------------------

    def _analyze_group_p2p(self, g: _Group, gkey: tuple[str, tuple[int, ...]]) -> None:
        order = sorted(g.ranks)
        # (p2p_seq, sig, state, frames, rank, time created: the class's first rank's)
        sends: dict[tuple[int, int], list[tuple[int, int, int, int, int, int]]] = {}
        recvs: dict[tuple[int, int], list[tuple[int, int, int, int, int, int]]] = {}
        bad = 0
        for c in self.class_list:
            ptimes = {(n, dsc): ts for n, dsc, ts in c.d.p2p_times}
            for name, desc, _ndone, pending in c.d.p2p:
                if c.gkeys.get((name, desc)) != gkey:
                    continue
                ts = ptimes.get((name, desc), ())
                for j, (p2p_seq, sidx, st, fidx, op, src, dst) in enumerate(pending):
                    try:
                        gs, gd = order[src], order[dst]
                    except IndexError:
                        bad += 1
                        continue
                    rec = (p2p_seq, c.sig_g[sidx], st, c.fr_g[fidx] if fidx >= 0 else -1)
                    t = ts[j] if j < len(ts) else 0
                    for r in c.ranks:
                        if op == "send" and r == gs:
                            sends.setdefault((gs, gd), []).append((*rec, r, t))
                        elif op == "recv" and r == gd:
                            recvs.setdefault((gs, gd), []).append((*rec, r, t))
                        else:
                            bad += 1
        if bad:
            self.notes.append(
                f"group {g.id}: {bad} P2P entries name peers outside the group; skipped"
            )
        unmatched: list[str] = []
        unmatched_ranks: set[int] = set()
        first_seq = None
        first_op = None
        for pair in sorted(set(sends) | set(recvs)):
            src, dst = pair
            s_list = sorted(sends.get(pair, []))
            r_list = sorted(recvs.get(pair, []))
            # Pending sends and receives of one directed pair complete in order (NCCL and gloo
            # both require it), so the k-th pending send pairs with the k-th pending receive.
            for k in range(max(len(s_list), len(r_list))):
                s = s_list[k] if k < len(s_list) else None
                r = r_list[k] if k < len(r_list) else None
                ref = s or r
                assert ref is not None
                sig = self.sigs[ref[1]]
                missing: list[int] = []
                in_flight: list[int] = []
                mismatch = None
                if s is None or r is None:
                    holder = src if r is None else dst
                    peer = dst if r is None else src
                    peer_read = self.digest_of[peer][2] if peer in self.digest_of else 0
                    if peer not in self.digest_of:
                        self.notes.append(
                            f"{g.id}: rank {holder} waits in {sig[1]} with rank {peer}, which gave no data"
                        )
                    elif peer_read and ref[5] and peer_read - ref[5] < IN_FLIGHT_GRACE_NS:
                        # The peer was read before (or just after) this op was posted: it may
                        # post its side a moment later, or have matched and finished it already.
                        in_flight = [peer]
                    else:
                        missing = [peer]
                        verb = "send to" if r is None else "recv from"
                        need = "receive" if r is None else "send"
                        unmatched.append(
                            f"rank {holder} waits in {verb} rank {peer} (p2p #{ref[0]}) but rank {peer} "
                            f"has no matching {need}"
                        )
                        unmatched_ranks.add(holder)
                        if first_seq is None:
                            first_seq, first_op = ref[0], sig[1]
                elif self.sigs[s[1]][2] != self.sigs[r[1]][3]:
                    mismatch = (
                        f"size mismatch: send {_fmt_sizes(self.sigs[s[1]][2])} on rank {src} vs "
                        f"recv {_fmt_sizes(self.sigs[r[1]][3])} on rank {dst}"
                    )
                    self._finding(
                        "size_mismatch",
                        g,
                        None,
                        "send/recv",
                        [src, dst],
                        f"{g.id} p2p #{s[0]}: {mismatch}",
                        p2p_seq=s[0],
                    )
                present = sorted({x[4] for x in (s, r) if x is not None})
                row = {
                    "id": len(self.collectives),
                    "group": g.id,
                    "group_desc": g.desc,
                    "group_ranks": g.ranks,
                    "seq": None,
                    "p2p_seq": ref[0],
                    "op": sig[1],
                    "profiling_name": sig[0],
                    "state": _STATES[min(x[2] for x in (s, r) if x is not None)],
                    "pass_check": not missing and mismatch is None,
                    "missing_ranks": missing,
                    "present_ranks": present,
                    "expected_ranks": sorted({src, dst}),
                    "history_lost_ranks": [],
                    "in_flight_ranks": in_flight,
                    "input_sizes": [list(x) for x in sig[2]],
                    "output_sizes": [list(x) for x in sig[3]],
                    "input_dtypes": list(sig[4]),
                    "output_dtypes": list(sig[5]),
                    "mismatch": mismatch,
                    "frames": self.frames[ref[3]] if ref[3] >= 0 else [],
                }
                self.collectives.append(row)
                self.calls_src.append((row, [(x[4], x[2]) for x in (s, r) if x is not None]))
        if unmatched:
            more = f"; and {len(unmatched) - 4} more" if len(unmatched) > 4 else ""
            self._finding(
                "unmatched_p2p",
                g,
                None,
                first_op,
                sorted(unmatched_ranks),
                f"{g.id}: " + "; ".join(unmatched[:4]) + more,
                p2p_seq=first_seq,
            )

    # -- stacks and verdict --------------------------------------------------------------------

    def _stack_groups(self) -> tuple[list[dict[str, Any]], dict[int, stackparse.Position]]:
        return _group_stacks(self.stacks, self.notes)

    def _verdict(
        self, stack_groups: list[dict[str, Any]], positions: dict[int, stackparse.Position]
    ) -> tuple[str, str | None, str | None, list[int]]:
        """The verdict, its root-cause category and next step, and the order it takes findings in.

        Precedence: a mismatch (op, size, dtype) explains a stuck-everywhere at its seq, and
        ranks missing from later ops because they still wait in it; then ranks missing from a
        collective (CPU-side divergence); then unmatched P2P; only a stuck-everywhere nothing
        explains points at the GPU, the network or NCCL. The banner shows findings in the
        returned order, so no renderer decides this again.
        """
        parts: list[str] = []
        errors = [f for f in self.findings if f["severity"] == "error"]
        mismatches = [f for f in errors if f["kind"] in _MISMATCH_KINDS]
        missing = [f for f in errors if f["kind"] == "missing_ranks"]
        p2p = [f for f in errors if f["kind"] == "unmatched_p2p"]
        stuck = [f for f in errors if f["kind"] == "stuck_everywhere"]
        # A rank missing from one group because it waits in another group's collective is a
        # consequence; the root is a missing rank that is not waiting in any collective.
        waiting_ranks = {r for w in self.waiting for r in w["ranks"]}

        def is_root(f: dict[str, Any]) -> bool:
            rs = f["ranks"]
            if any(r in positions for r in rs):
                return any(not positions[r].in_collective for r in rs if r in positions)
            return not all(r in waiting_ranks for r in rs)

        missing.sort(key=lambda f: (not is_root(f), len(f["ranks"])))
        roots = [f for f in missing if is_root(f)]
        explained = {(f["group"], f["seq"]) for f in mismatches}
        stuck_at = {(f["group"], f["seq"]) for f in stuck}
        category, step = self._category(
            errors, mismatches, roots or ([] if stuck else missing), p2p, stuck, positions
        )
        said: dict[str, list[str]] = {"mismatch": [], "missing": [], "p2p": [], "stuck": []}
        if mismatches:
            f = mismatches[0]
            said["mismatch"].append(f"Mismatch in {f['detail']}.")
            said["mismatch"].extend(self._position_sentences(f["ranks"][:3], positions))
            if (f["group"], f["seq"]) in stuck_at:
                said["mismatch"].append(
                    f"The mismatch is why no rank completes {f['op']} #{f['seq']}: the GPU and "
                    "the network are not to blame."
                )
        for f in missing[:2]:
            rs = f["ranks"]
            subj = "Rank" if len(rs) == 1 else "Ranks"
            waiting = f.get("waiting") or []
            verb = "waits" if len(waiting) == 1 else "wait"
            tail = f" ({_ranks_phrase(waiting)} {verb} in it)" if waiting else ""
            said["missing"].append(
                f"{subj} {format_ranks(rs)} never joined {f['op']} #{f['seq']} on {f['group_label']}{tail}."
            )
            said["missing"].extend(self._position_sentences(rs, positions))
        if p2p:
            said["p2p"].append(f"P2P deadlock or missing peer: {p2p[0]['detail']}.")
        for f in stuck:
            if (f["group"], f["seq"]) in explained:
                continue
            said["stuck"].append(
                f"All {len(f['ranks'])} ranks of {f['group_label']} issued {f['op']} #{f['seq']} and "
                "none completed it"
                + ("; no rank is missing and no mismatch explains it, so suspect the GPU, the "
                   "network or the NCCL transport." if category == "gpu_or_network" else ".")
            )
            break
        kinds = (["stuck", "missing", "mismatch", "p2p"] if category == "gpu_or_network"
                 else ["mismatch", "missing", "p2p", "stuck"])
        for k in kinds:
            parts.extend(said[k])
        if not errors:
            n = sum(1 for c in self.collectives if c["seq"] is not None)
            if self.data_ranks:
                parts.append(
                    f"No hang or mismatch found in the Flight Recorder data "
                    f"({len(self.data_ranks)} rank{'s' if len(self.data_ranks) != 1 else ''}, {n} collectives checked)."
                )
            else:
                parts.append("No Flight Recorder data from any rank; nothing to match.")
            if self.waiting:
                w = self.waiting[0]
                no_data = [r for r in range(self.world_size) if r not in self.digest_of]
                if no_data:
                    parts.append(
                        f"{_ranks_phrase(w['ranks']).capitalize()} wait in {w['op']} #{w['seq']} on {w['label']}; "
                        f"{_ranks_phrase(no_data)} gave no data and may be the ones missing."
                    )
        if step:
            parts.append(f"Next step: {step}")
        if any(f["kind"] == "history_lost" for f in self.findings):
            parts.append(
                "Some ranks' rings wrapped (history_lost); older collectives were checked only where still recorded."
            )
        if self.unavailable:
            by_reason: dict[str, list[int]] = {}
            for r, why in sorted(self.unavailable.items()):
                by_reason.setdefault(why, []).append(r)
            parts.append(
                "No data from "
                + "; ".join(f"{_ranks_phrase(rs)} ({why})" for why, rs in by_reason.items())
                + "."
            )
        if stack_groups and len(stack_groups) > 1:
            desc = "; ".join(
                f"{_ranks_phrase(g['ranks'])}: {g['summary']}" for g in stack_groups[:6]
            )
            more = (
                f"; and {len(stack_groups) - 6} more stack groups" if len(stack_groups) > 6 else ""
            )
            parts.append(f"Main-thread stacks: {desc}{more}.")
        elif stack_groups:
            parts.append(f"All ranks with stacks are at {stack_groups[0]['summary']}.")
        by_kind = {"mismatch": mismatches, "missing": missing, "p2p": p2p, "stuck": stuck}
        ordered = [f for k in kinds for f in by_kind[k]]
        ids = {id(f) for f in ordered}
        ordered += [f for f in self.findings if id(f) not in ids]
        index = {id(f): i for i, f in enumerate(self.findings)}
        return " ".join(parts), category, step, [index[id(f)] for f in ordered]

    def _category(
        self,
        errors: list[dict[str, Any]],
        mismatches: list[dict[str, Any]],
        missing: list[dict[str, Any]],
        p2p: list[dict[str, Any]],
        stuck: list[dict[str, Any]],
        positions: dict[int, stackparse.Position],
    ) -> tuple[str | None, str | None]:
        """One of :data:`CATEGORIES` and its one-line next step; (None, None) when clean."""
        if mismatches:
            return "misconfigured_collective", _mismatch_step(mismatches[0])
        if missing:
            f = missing[0]
            r = next((r for r in f["ranks"] if r in positions), f["ranks"][0])
            pos = positions.get(r)
            what = f"{f['op']} #{f['seq']} on {f['group_label']}"
            if pos is not None:
                loc = pos.summary if pos.in_collective else pos.position.replace(" ", " in ", 1)
                return "cpu_divergence", (
                    f"find out why rank {r} never reached {what}: its main thread is at {loc} "
                    "(/stacks shows every rank)."
                )
            return "cpu_divergence", (
                f"look at rank {r}'s stack (/stacks, or stacks_<ts>.txt): it never issued {what}."
            )
        if p2p:
            f = p2p[0]
            peers = sorted({
                r for c in self.collectives
                if c["group"] == f["group"] and c["p2p_seq"] is not None
                for r in c["missing_ranks"]
            })  # fmt: skip
            away = [r for r in peers if r in positions and not positions[r].in_collective]
            if away:
                return "cpu_divergence", (
                    f"find out why rank {away[0]} never posted its side of the P2P op: its main "
                    f"thread is at {positions[away[0]].position.replace(' ', ' in ', 1)} "
                    "(/stacks shows every rank)."
                )
            return "misconfigured_collective", (
                "post the matching send/recv on the peer, in the same order on both sides "
                f"({f['detail'].split('; ')[0]})."
            )
        if stuck:
            return "gpu_or_network", (
                "run `python -m debug_server.preflight` on these hosts (or nccl-tests' "
                "all_reduce_perf), then read the NCCL_DEBUG=INFO logs with "
                "`python -m debug_server.nccl_log`."
            )
        no_data = [r for r in range(self.world_size) if r not in self.digest_of]
        if errors or (self.waiting and no_data):
            return "unknown", (
                f"find out why {_ranks_phrase(no_data) if no_data else 'some ranks'} gave no "
                "Flight Recorder data, and compare every rank's stack on /stacks."
            )
        return None, None

    @staticmethod
    def _position_sentences(
        ranks: Sequence[int], positions: dict[int, stackparse.Position]
    ) -> list[str]:
        out = []
        for r in list(ranks)[:3]:
            pos = positions.get(r)
            if pos is None:
                continue
            call = f" ({pos.call})" if pos.call and not pos.in_collective else ""
            where = "in a collective" if pos.in_collective else "not in a collective"
            loc = (
                pos.summary
                if pos.in_collective
                else f"{pos.position.replace(' ', ' in ', 1)}{call}"
            )
            out.append(f"Rank {r}'s main thread is at {loc}, {where}.")
        return out

    # -- run -----------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        groups = self._resolve_groups()
        shown = []
        for gkey, g in groups.items():
            if (
                self.pg_filters is not None
                and g.name not in self.pg_filters
                and g.desc not in self.pg_filters
                and g.id not in self.pg_filters
            ):
                continue
            shown.append(g)
            try:
                self._analyze_group_colls(g, gkey)
                self._analyze_group_p2p(g, gkey)
            except Exception as e:  # noqa: BLE001 - one broken group must not lose the others
                logger.exception("analysis of group %s failed", g.id)
                self.notes.append(
                    f"group {g.id}: analysis failed ({type(e).__name__}: {str(e)[:80]})"
                )
        calls: list[dict[str, Any]] = []
        elided = 0
        for row, per_rank in self.calls_src:
            for r, st in per_rank:
                calls.append(
                    {
                        "id": len(calls),
                        "collective_id": row["id"],
                        "group": row["group"],
                        "global_rank": r,
                        "collective_type": row["profiling_name"],
                        "sizes": row["input_sizes"],
                        "state": _STATES[st],
                    }
                )
        if self.total_entries > NCCL_CALLS_FULL_LIMIT:
            elided = self.total_entries - len(calls)
        stack_groups, positions = self._stack_groups()
        self.findings.sort(
            key=lambda f: FINDING_KINDS.index(f["kind"]) if f["kind"] != "history_lost" else 99
        )
        no_data = [r for r in range(self.world_size) if r not in self.digest_of]
        for r in self.unavailable:
            if r not in no_data and r not in self.digest_of:
                no_data.append(r)
        verdict, category, next_step, order = self._verdict(stack_groups, positions)
        return {
            "world_size": self.world_size,
            "ranks_with_data": self.data_ranks,
            "ranks_without_data": sorted(no_data),
            "unavailable": [
                {"rank": r, "reason": self.unavailable.get(r, "no data")} for r in sorted(no_data)
            ],
            "groups": [
                {
                    "id": g.id,
                    "name": g.name,
                    "desc": g.desc,
                    "ranks": g.ranks,
                    "inferred": g.inferred,
                }
                for g in shown
            ],
            "collectives": self.collectives,
            "nccl_calls": calls,
            "nccl_calls_elided": elided,
            "findings": self.findings,
            "verdict": verdict,
            **({"category": category, "next_step": next_step} if category else {}),
            "finding_order": order,
            "stack_groups": stack_groups,
            "notes": self.notes,
        }
