"""Which Flight Recorder entries the live analysis needs, and cutting a dump down to them.

A live page cannot move every rank's whole ring (4096 ranks x 2000 entries), and it must not
move only the active entries either: under NCCL a size mismatch *completes* on the rank with the
smaller count while its peer hangs, so the op that disagrees is no longer active anywhere but on
one side. What can still disagree is everything some member has not completed. So, per
communicator, the frontend fetches from its **frontier** on:

    frontier(g) = min over g's members of min(last completed seq, first active seq - 1) - margin

Below it every member completed every collective of ``g`` in order; a member stuck at seq 3
keeps the frontier at or below 2 however far the others ran ahead. Collectives block, so the
members' own frontiers rarely differ by more than a seq or two, and one round trip does:

1. every worker cuts its ring at its *own* frontier less :data:`LOCAL_SLACK` (``window=4``,
   :func:`local_window`); its reply carries ``pg_status`` and every active entry, from which the
   frontend computes the job's :func:`frontier`;
2. only a rank whose cut lies above that frontier (:func:`covers`) is asked again, for exactly
   ``seq >= frontier(g)`` (``since={"g": seq}``).

A worker cuts inside its recorders (:func:`cutter`, ``recording.lazy``): the window is decided
from each entry's few key fields and only the kept entries are built, never the whole ring on
the rank's thread. Workers that know neither parameter (PyTorch's C++ worker: ``onlyactive``,
``includecollectives``, ``includestacktraces``) send whole rings, which :func:`window` cuts the
same way on arrival. Its NCCL recorder is asked ``onlyactive=true`` first instead: such a reply
is a cut too (``analysis.activecover``: groups listed under :data:`ACTIVE_KEY`), and a group
read so is cut without the margin (:func:`frontier`).

P2P entries carry their own ``p2p_seq_id`` and only pending ones are ever compared, so a window
keeps every pending P2P entry and drops completed ones (but the newest, so the group stays seen).
Groups with no frontier (a member reports no ``last_completed``, or the frontier is <= 0) are
kept whole. :func:`window` records what the ring held before the cut under ``"fr_window"``: the
analyzer needs the ring's oldest time to tell an evicted op from one never issued.

What a window cannot show: a mismatch that every member *completed* (NCCL let it through) below
the frontier. That op is not why anything hangs; the post-mortem CLI and ``?onlyactive=false``
still see it. Pure: no torch, no HTTP.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ACTIVE_KEY", "FRONTIER_MARGIN", "LOCAL_SLACK", "WINDOW_KEY", "Window",
           "config_members", "covers", "cutter", "format_since", "frontier", "local_window", "parse_since", "rank_groups",
           "since_for", "window", "window_all"]

WINDOW_KEY = "fr_window"
"""Dump key of what the ring held before the cut: ``since``, ``ring_entries``, ``ring_oldest_ns``."""
ACTIVE_KEY = "active"
"""``fr_window`` key: the groups a dump holds only the not-completed entries of (an
``onlyactive`` reply read as a cut: ``analysis.activecover``)."""
FRONTIER_MARGIN = 2
"""Sequence numbers kept below the lowest last-completed one (ops may complete out of order)."""
LOCAL_SLACK = 4
"""How far below its own frontier a worker cuts when asked ``window=`` (see :func:`local_window`)."""
MAX_SINCE_CHARS = 8000
"""``since`` travels in the query string, and aiohttp refuses request lines over 8190 bytes."""
MAX_SINCE_GROUPS = 4096
MAX_GROUP_NAME = 512
MAX_SEQ = 2**62

_P2P = ("send", "recv")


def parse_since(raw: str, max_chars: int = MAX_SINCE_CHARS) -> dict[str, int]:
    """``since`` as sent on the wire: a JSON object ``{"<group>": <first seq kept>}``.

    Raises ``ValueError`` with a one-line reason on anything else (size, type, range).
    """
    if len(raw) > max_chars:
        raise ValueError(f"longer than {max_chars} characters")
    try:
        obj = json.loads(raw)
    except ValueError:
        raise ValueError('must be a JSON object {"<group>": <seq>}') from None
    if not isinstance(obj, dict):
        raise ValueError('must be a JSON object {"<group>": <seq>}')
    if len(obj) > MAX_SINCE_GROUPS:
        raise ValueError(f"names more than {MAX_SINCE_GROUPS} groups")
    out: dict[str, int] = {}
    for k, v in obj.items():
        if len(k) > MAX_GROUP_NAME:
            raise ValueError(f"group name longer than {MAX_GROUP_NAME} characters")
        if type(v) is not int or not 0 <= v <= MAX_SEQ:
            raise ValueError(f"seq of group {k[:40]!r} must be an integer 0..2**62")
        out[k] = v
    return out


def format_since(since: Mapping[str, int]) -> str:
    """The compact JSON text of ``since`` (what :func:`parse_since` reads back)."""
    return json.dumps(dict(since), separators=(",", ":"), sort_keys=True)


def rank_groups(dump: Mapping[str, Any]) -> set[str]:
    """Every group one rank's dump names (config, status, entries)."""
    out = set(config_members(dump))
    cfg, status, entries = dump.get("pg_config"), dump.get("pg_status"), dump.get("entries")
    if isinstance(cfg, Mapping):
        out.update(str(c.get("name") if isinstance(c, Mapping) and c.get("name") is not None
                       else k) for k, c in cfg.items())
    if isinstance(status, Mapping):
        out.update(map(str, status))
    for e in entries if isinstance(entries, list) else ():
        g = _group(e) if isinstance(e, Mapping) else None
        if g is not None:
            out.add(g)
    return out


def since_for(since: Mapping[str, int], groups: set[str],
              max_chars: int = MAX_SINCE_CHARS - 100) -> str | None:
    """``since`` for one rank: only its own groups, largest cuts first, within the URL bound.

    None when nothing of it applies (ask for the whole ring). Groups left out come whole and
    are cut on arrival (:func:`window`), so leaving one out costs bytes, never correctness.
    """
    mine = sorted(((g, s) for g, s in since.items() if g in groups), key=lambda x: (-x[1], x[0]))
    picked: dict[str, int] = {}
    size = 2
    for g, s in mine:
        add = len(json.dumps(g)) + len(str(s)) + 2
        if size + add > max_chars:
            break
        picked[g] = s
        size += add
    return format_since(picked) if picked else None


def _int(v: Any, default: int = -1) -> int:
    # torch's c10d writes pg_status values as strings ("4"); ours are ints.
    if isinstance(v, bool):
        return default
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


def _group(e: Mapping[str, Any]) -> str | None:
    pg = e.get("process_group")
    if isinstance(pg, (list, tuple)) and pg:
        return str(pg[0])
    return None


def _is_p2p(e: Mapping[str, Any]) -> bool:
    # The analyzer tells P2P from collectives by the op name, so the window does the same.
    name = str(e.get("profiling_name", ""))
    body = name.partition(":")[2] if ":" in name else name
    return body.partition(" ")[0] in _P2P


def _done(e: Mapping[str, Any]) -> bool:
    # As the analyzer reads it: PyTorch's gloo FR leaves state at "scheduled" and marks
    # finished ops by retirement or a completion time.
    return bool(e.get("state") == "completed" or e.get("retired")
                or e.get("time_discovered_completed_ns"))


@functools.lru_cache(maxsize=4096)
def _members_text(raw: str) -> frozenset[int]:
    # Every member of a group sends the same member list: parsed once per distinct text, a
    # fan-out over N ranks costs O(N) here, not O(N^2) (16384 ranks x 16384-member world group).
    try:
        ranks = json.loads(raw)
        return frozenset(int(r) for r in ranks) if isinstance(ranks, list) else frozenset()
    except (ValueError, TypeError):
        return frozenset()


def config_members(dump: Mapping[str, Any]) -> dict[str, frozenset[int]]:
    """Each group's members as one rank's ``pg_config`` lists them (``ranks``: text or list)."""
    out: dict[str, frozenset[int]] = {}
    cfg = dump.get("pg_config")
    if not isinstance(cfg, Mapping):
        return out
    for key, c in cfg.items():
        if not isinstance(c, Mapping):
            continue
        name = c.get("name")
        name = str(key if name is None else name)
        raw = c.get("ranks")
        if isinstance(raw, str):
            members = _members_text(raw)
        else:
            try:
                members = frozenset(int(r) for r in raw) if isinstance(raw, list) else frozenset()
            except (ValueError, TypeError):
                members = frozenset()
        if members:
            prev = out.get(name)
            out[name] = members if prev is None else prev | members
    return out


def frontier(dumps: Mapping[int, Mapping[str, Any]],
             margin: int = FRONTIER_MARGIN) -> dict[str, int]:
    """Per group, the first sequence number the live analysis needs (see the module doc).

    ``dumps``: rank -> that rank's dump with ``pg_status`` and at least its active entries.
    Only groups with a frontier above 0 are returned; every other group is needed whole. A group
    that some dump holds only the active entries of (``fr_window`` lists it under
    :data:`ACTIVE_KEY`) is cut at the first seq some member has not completed, without
    ``margin``, and returned from 0 on (``analysis.activecover`` says why).

    Ranks whose dumps share ``pg_config``, ``pg_status``, ``entries`` and ``fr_window`` by
    identity (the fan-out's shallow copies of one rank that did the same thing) are read once:
    the cost is per distinct dump plus a dict lookup per rank.
    """
    # Distinct dumps by the identity of the parts read here: rank lists per distinct dump.
    kinds: dict[tuple[int, int, int, int], tuple[Mapping[str, Any], list[int]]] = {}
    for rank, d in dumps.items():
        get = d.get
        k = (id(get("pg_config")), id(get("pg_status")), id(get("entries")), id(get(WINDOW_KEY)))
        held = kinds.get(k)
        if held is None:
            kinds[k] = (d, [rank])
        else:
            held[1].append(rank)
    active: set[str] = set()
    # Per group: [(the ranks of one distinct dump, its bound)].
    bound: dict[str, list[tuple[list[int], int]]] = {}
    reporters: dict[str, set[int]] = {}  # group -> indexes of the distinct dumps reporting it
    # Distinct member sets per group (frozensets hash once): one union per distinct set at the
    # end, not one O(group size) update per rank.
    member_sets: dict[str, set[frozenset[int]]] = {}
    kind_ranks: list[list[int]] = []
    for ki, (d, ranks) in enumerate(kinds.values()):
        kind_ranks.append(ranks)
        for name, rs in config_members(d).items():
            member_sets.setdefault(name, set()).add(rs)
        cut = d.get(WINDOW_KEY)
        if type(cut) is dict and isinstance(cut.get(ACTIVE_KEY), list):
            active.update(map(str, cut[ACTIVE_KEY]))
        per: dict[str, int] = {}
        status = d.get("pg_status")
        if isinstance(status, Mapping):
            for g, st in status.items():
                per[str(g)] = (_int(st.get("last_completed_collective"))
                               if isinstance(st, Mapping) else -1)
        entries = d.get("entries")
        for e in entries if isinstance(entries, list) else ():
            # Most entries are done: a lookup or two each, the careful checks for the rest
            # (c10d's gloo entries stay "scheduled" and say done by "retired": _done).
            if type(e) is dict and (e.get("state") == "completed" or e.get("retired") is True):
                continue
            if not isinstance(e, Mapping) or _done(e) or _is_p2p(e):
                continue
            g = _group(e)
            seq = _int(e.get("collective_seq_id"))
            if g is None or seq < 0:
                continue
            per[g] = min(per[g], seq - 1) if g in per else -1
        for g, b in per.items():
            bound.setdefault(g, []).append((ranks, b))
            reporters.setdefault(g, set()).add(ki)
    # One distinct set (the usual case) is used as it is: a union would copy 16384 members.
    members = {g: next(iter(sets)) if len(sets) == 1 else frozenset().union(*sets)
               for g, sets in member_sets.items()}
    out: dict[str, int] = {}
    for g, per_kind in bound.items():
        # A member that answered but reports nothing for g may never have reached g's first op.
        # Only the distinct dumps that do not report g are looked at, each with one C-level
        # pass (an agent's 8 dumps of a 16384-member group must not cost a pass per member).
        mg = members.get(g, frozenset())
        rep = reporters[g]
        if mg and any(not mg.isdisjoint(kind_ranks[ki])
                      for ki in range(len(kind_ranks)) if ki not in rep):
            continue
        low = min(b for _, b in per_kind)
        if g in active:
            out[g] = max(0, low + 1)
            continue
        first = low - margin
        if first > 0:
            out[g] = first
    return out


def window(dump: Mapping[str, Any], since: Mapping[str, int]) -> dict[str, Any]:
    """``dump`` with the entries of each group in ``since`` cut to ``seq >= since[group]``.

    Groups not in ``since`` keep every entry; malformed entries are kept for the analyzer to
    report. Idempotent: cutting a cut dump again keeps the ring facts of the first cut.
    """
    if _as_it_is(dump, since):
        return dict(dump)
    entries = dump["entries"]
    picked, oldest = _pick(entries, since)
    out = dict(dump)
    out["entries"] = [entries[i] for i in picked]
    out[WINDOW_KEY] = _facts(dump.get(WINDOW_KEY), since, len(entries), oldest)
    return out


def window_all(dumps: Mapping[int, Mapping[str, Any]],
               since: Mapping[str, int]) -> dict[int, dict[str, Any]]:
    """:func:`window` of every dump, each distinct one cut once: dumps that share ``entries``
    and ``fr_window`` by identity (the fan-out's shallow copies) share the cut ``entries`` list
    and ``fr_window`` facts after it too (each keeps its own top-level dict, so its own
    ``dump_time_ns``), and the analysis digests them once (``analysis.digest.share_key``).

    A dump that this cut would leave as it is (cut at ``since`` already, by its host's agent:
    most are) is returned itself, not copied (131072 top-level copies a page at 131072 ranks):
    no dump is changed in place once parsed, by the fan-out or anyone after it."""
    cuts: dict[tuple[int, int], tuple[Mapping[str, Any], dict[str, Any] | None]] = {}
    out: dict[int, Any] = {}
    for r, d in dumps.items():
        k = (id(d.get("entries")), id(d.get(WINDOW_KEY)))
        held = cuts.get(k)
        if held is None:
            if _as_it_is(d, since):
                cuts[k] = (d, None)  # d keeps the ids of k alive while this runs
                out[r] = d
                continue
            w = window(d, since)
            cuts[k] = (d, w)
            out[r] = w
            continue
        cut = held[1]
        if cut is None:
            out[r] = d
            continue
        w = dict(d)
        w["entries"] = cut.get("entries")
        if WINDOW_KEY in cut:
            w[WINDOW_KEY] = cut[WINDOW_KEY]
        out[r] = w
    return out


def _as_it_is(dump: Mapping[str, Any], since: Mapping[str, int]) -> bool:
    """Whether cutting ``dump`` at ``since`` keeps it as it is: no entries list to cut, or
    cut there already."""
    return not isinstance(dump.get("entries"), list) or _cut_at(dump, since)


def _cut_at(dump: Mapping[str, Any], since: Mapping[str, int]) -> bool:
    """Whether ``dump`` is cut at ``since`` already, group for group (a host's agent cuts its
    ranks at the host's frontier, which is the job's on most hosts): cutting it again would keep
    every entry and the same facts."""
    prior = dump.get(WINDOW_KEY)
    cut = prior.get("since") if type(prior) is dict else None
    return type(cut) is dict and all(cut.get(g) == s for g, s in since.items())


def _pick(entries: list[Any], since: Mapping[str, int]) -> tuple[list[int], int]:
    """The indices :func:`window` keeps, in output order, and the ring's oldest creation time
    (0: none). Reads only ``process_group``, ``collective_seq_id``, ``profiling_name``,
    ``time_created_ns`` and what ``_done`` reads, so it runs on entries' keys as well."""
    kept: list[int] = []
    seen: set[str] = set()
    newest_done_p2p: dict[str, int] = {}  # group -> where its newest completed P2P op would go
    dropped_p2p: dict[str, int] = {}
    p2p_names: dict[Any, bool] = {}
    get = since.get
    none = 1 << 80
    oldest = none
    # The loop runs on the rank's worker thread over up to a whole ring: plain item access in
    # the common case, the careful path only for entries that break it.
    for i, e in enumerate(entries):
        try:
            t = e["time_created_ns"]
            if t is not None and t < oldest and t and type(t) is int:
                oldest = t
            g = e["process_group"][0]
            first = get(g)
            if first is None:
                kept.append(i)
                seen.add(g)
                continue
            name = e["profiling_name"]
            p2p = p2p_names.get(name)
            if p2p is None:
                p2p = p2p_names[name] = _is_p2p(e)
            if p2p:
                if not _done(e):
                    kept.append(i)
                    seen.add(g)
                else:
                    dropped_p2p[g] = i
                    newest_done_p2p[g] = len(kept)
            elif e["collective_seq_id"] >= first:
                kept.append(i)
                seen.add(g)
        except (KeyError, TypeError, IndexError):
            kept.append(i)  # malformed: the analyzer notes it
    # A group seen only through completed P2P ops stays visible through its newest one.
    for g in sorted((g for g in dropped_p2p if g not in seen),
                    key=lambda g: newest_done_p2p[g], reverse=True):
        kept.insert(newest_done_p2p[g], dropped_p2p[g])
    return kept, 0 if oldest == none else oldest


def _facts(prior: Any, since: Mapping[str, int], ring_entries: int, oldest: int) -> dict[str, Any]:
    if isinstance(prior, Mapping):
        return {**prior, "since": {**(prior.get("since") or {}), **since}}
    return {"since": dict(since), "ring_entries": ring_entries, "ring_oldest_ns": oldest}


def local_window(dump: Mapping[str, Any], slack: int = LOCAL_SLACK) -> dict[str, Any]:
    """``dump`` cut at this rank's own frontier less ``slack`` (one round trip for the frontend:
    other ranks' frontiers are rarely more than a seq or two lower, and the frontend checks)."""
    return window(dump, frontier({-1: dump}, margin=slack))


@dataclass(frozen=True, slots=True)
class Window:
    """One window as a value: :func:`window` at ``since``, or :func:`local_window` at ``slack``
    (exactly one). Called on a dump it cuts it; whoever holds the dump's JSON text instead can
    read which window it is (``analysis.frtext`` cuts c10d's text without parsing all of it)."""

    since: Mapping[str, int] | None = None
    slack: int | None = None

    def __post_init__(self) -> None:
        if (self.since is None) == (self.slack is None):
            raise ValueError("Window takes exactly one of since and slack")

    def __call__(self, dump: Mapping[str, Any]) -> dict[str, Any]:
        return window(dump, self.since_for(dump))

    def since_for(self, dump: Mapping[str, Any]) -> Mapping[str, int]:
        """The cut this window makes of ``dump`` (``dump`` needs ``pg_config``, ``pg_status``
        and at least the entries not done: :func:`frontier`); with ``slack``, as
        :func:`local_window` cuts."""
        if self.since is not None:
            return self.since
        assert self.slack is not None  # __post_init__: exactly one of the two
        return frontier({-1: dump}, margin=self.slack)


Cut = Callable[[Mapping[str, Any], Sequence[Mapping[str, Any]]],
               tuple[list[int], dict[str, Any]]]


def cutter(*, since: Mapping[str, int] | None = None, slack: int | None = None) -> Cut:
    """The window as a recorder's cut (``recording.lazy.Cut``): given a dump's head and its
    entries' keys, the entries :func:`window` (``since``) or :func:`local_window` (``slack``)
    keeps, and the ``fr_window`` facts; the recorder builds only those entries. Exactly one of
    ``since`` and ``slack``."""
    if (since is None) == (slack is None):
        raise ValueError("cutter takes exactly one of since and slack")

    def cut(head: Mapping[str, Any], keys: Sequence[Mapping[str, Any]]
            ) -> tuple[list[int], dict[str, Any]]:
        entries = keys if isinstance(keys, list) else list(keys)
        s = since if since is not None else frontier(
            {-1: {**head, "entries": entries}}, margin=slack if slack is not None else 0)
        picked, oldest = _pick(entries, s)
        return picked, {WINDOW_KEY: _facts(head.get(WINDOW_KEY), s, len(entries), oldest)}

    return cut


def not_covered(dumps: Mapping[int, Mapping[str, Any]], since: Mapping[str, int]) -> list[int]:
    """The ranks whose dumps do not hold every entry of ``since``'s window (:func:`covers`),
    each distinct window facts read once (ranks alike share them by identity)."""
    seen: dict[int, bool] = {}
    out: list[int] = []
    for r, d in dumps.items():
        facts = d.get(WINDOW_KEY)
        ok = seen.get(id(facts))
        if ok is None:
            ok = seen[id(facts)] = covers(d, since)
        if not ok:
            out.append(r)
    return out


def covers(dump: Mapping[str, Any], since: Mapping[str, int]) -> bool:
    """Whether a (possibly cut) dump holds every entry of ``since``'s window."""
    prior = dump.get(WINDOW_KEY)
    cut = prior.get("since") if isinstance(prior, Mapping) else None
    if not isinstance(cut, Mapping):
        return True  # a whole ring
    return all(g in since and since[g] >= s for g, s in cut.items())
