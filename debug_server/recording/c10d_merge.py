"""c10d's own Flight Recorder merged into ours (pure): one FR dump per rank, keyed by process group.

The merge itself, on dumps already read (``c10d_fr`` reads this process's recorders and calls
it; the tests call it on captured c10d dumps). What it does to c10d's entries (``c10d_fr``'s
module doc says why): our communicators' own groups' entries are dropped (our hooks have the
ops), a c10d-backed communicator's become the communicator's (``Backed``: its name, sequence
numbers from 0, its timeout, stacks from the user's call site, start marks applied), every
other group keeps c10d's name and gets ``pg_config`` from this process's groups
(``GroupInfo``); ``gloo:`` names become ``nccl:``; one timeline by creation time, record ids
renumbered along it. Entries are built only when a cut keeps them (``lazy``).

c10d keys ``pg_status`` by group id and entries by group name: ``learn_names`` pairs the two
from the entries of every full read (``status_by_name``, ``name_of``, ``id_of``).
"""

from __future__ import annotations

import operator
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from debug_server.dumpio import FR_VERSION
from debug_server.recording.frames import OP_PATH_FILES
from debug_server.recording.lazy import FRESH, Cut, LazyDump, Source
from debug_server.recording.stall import int_or

__all__ = [
    "Backed",
    "GroupInfo",
    "id_of",
    "learn_names",
    "merge_c10d",
    "merge_lazy",
    "name_of",
    "side_of",
    "status_by_name",
]

_ENTRY_DEFAULTS: dict[str, Any] = {
    "duration_ms": None,
    "time_discovered_started_ns": None,
    "time_discovered_completed_ns": None,
    "frames": [],
    "is_p2p": False,
    "p2p_seq_id": 0,
}
_STATUS_KEYS = ("last_enqueued_collective", "last_started_collective", "last_completed_collective")


class GroupInfo(NamedTuple):
    """One c10d process group as this process knows it."""

    name: str
    """c10d's group name (``process_group[0]`` of its FR entries): ``"0"``, ``"1"``, a hash."""
    desc: str
    """The group's description (``default_pg``, ``undefined``, a DeviceMesh dim name)."""
    ranks: tuple[int, ...]
    """Global ranks of the members."""
    backend: str
    """As the group was made: ``gloo``, ``nccl``, ``cpu:gloo,cuda:nccl``..."""


class Backed(NamedTuple):
    """A communicator of ours whose ops only c10d's recorder records (``Comm.c10d_backed``):
    c10d's entries of its process group are this communicator's entries."""

    name: str
    """The communicator's name (``main_comm``), the group name its entries get."""
    backend: str
    ranks: tuple[int, ...]
    """Global ranks of the members."""
    pg_id: int
    timeout_ms: int
    """The communicator's timeout (its process group's is longer on NCCL, see comms)."""
    frozen: Mapping[int, str] | None = None
    """After the communicator failed: the states c10d gave its collectives just before it was
    aborted (by seq). Aborting ends the kernels, so c10d's later reads say "completed" for an
    op that never completed; these states are kept instead."""
    started: Callable[[int], bool] | None = None
    """``Comm.started_mark`` where the communicator records start marks (CUDA without c10d's
    timing events): whether collective ``seq`` (ours) reached its stream."""
    first_open: int = -1
    """Our seq of the oldest collective c10d has not completed (from its ``pg_status``, read with
    the entries); only that one can be running."""


_TORCH_DIST = os.sep + os.path.join("torch", "distributed") + os.sep


def _backed_entry(e: Mapping[str, Any], b: Backed) -> dict[str, Any]:
    """c10d's entry of a backed communicator's op, as our recorder writes it: the group is the
    communicator, sequence numbers count from 0 (c10d's from 1), the communicator's timeout,
    and the stack starts at the user's call site."""
    ent = {**_ENTRY_DEFAULTS, **e}
    ent["process_group"] = (b.name, b.backend)
    ent["pg_id"] = b.pg_id
    if ent.get("is_p2p"):
        ent["p2p_seq_id"] = int_or(ent.get("p2p_seq_id"), 1) - 1
    else:
        ent["collective_seq_id"] = int_or(ent.get("collective_seq_id"), 1) - 1
        was = b.frozen.get(ent["collective_seq_id"]) if b.frozen is not None else None
        if (was is None and b.frozen is None and b.started is not None
                and ent.get("state") == "scheduled" and ent["collective_seq_id"] == b.first_open
                and b.started(b.first_open)):
            # c10d without timing events never says "started": the oldest uncompleted
            # collective whose start mark fired has its stream's earlier work done and every
            # earlier collective completed, so its kernel is running.
            ent["state"] = "started"
        if was is not None and was != ent.get("state"):
            ent["state"] = was
            if was != "completed":
                ent["time_discovered_completed_ns"] = None
                ent["retired"] = False
    _normalize_times_and_name(ent)
    ent["timeout_ms"] = b.timeout_ms
    frames = ent.get("frames") or []
    i = 0
    while i < len(frames) and isinstance(frames[i], Mapping) and (
            str(frames[i].get("filename", "")) in OP_PATH_FILES
            or _TORCH_DIST in str(frames[i].get("filename", ""))):
        i += 1
    ent["frames"] = list(frames[i:]) if i < len(frames) else list(frames)
    return ent


def _backed_status(st: Mapping[str, Any]) -> dict[str, int]:
    # c10d's -1 ("none yet") stays -1; its seq n (from 1) is our n - 1.
    return {k: max(int_or(st.get(k), -1) - 1, -1) if int_or(st.get(k), -1) > 0 else -1 for k in _STATUS_KEYS}


# ---------------------------------------------------------------------------------------------
# The merge (pure)


def merge_c10d(ours: Mapping[str, Any] | LazyDump, recorders: Sequence[tuple[str, Mapping[str, Any]]],
               *, cut: Cut | None = None, **options: Any) -> dict[str, Any]:
    """Our hooks' FR dump with c10d's own entries merged in (see the module doc).

    ``ours``: our hooks' snapshot (``hooks.snapshot()``, or ``hooks.lazy_snapshot()`` with its
    entries not built yet); ``options`` as :func:`merge_lazy` takes them. ``cut`` picks the
    entries kept from the merged timeline (``lazy.Cut``; the worker's live window); only those
    are built. None: every entry.
    """
    if not isinstance(ours, LazyDump) and cut is None and not recorders:
        return dict(ours)
    lazy = ours if isinstance(ours, LazyDump) else LazyDump.of(ours)
    return merge_lazy(lazy, recorders, **options).finish(cut)


def merge_lazy(
    ours: LazyDump,
    recorders: Sequence[tuple[str, Mapping[str, Any]]],
    *,
    owned: Iterable[str] = (),
    groups: Mapping[str, GroupInfo] | None = None,
    only_active: bool = False,
    include_collectives: bool = True,
    backed: Mapping[str, Backed] | None = None,
    others: bool = True,
) -> LazyDump:
    """:func:`merge_c10d` with the entries not built yet (``ours`` is not changed): the
    result's keys hold every entry's group, seqs and state, for a cut (``lazy``).

    Args:
        ours: our hooks' snapshot, already filtered as asked.
        recorders: c10d's dumps as ``(recorder, dump)`` pairs, ``recorder`` ``"cpu"`` (gloo)
            or ``"nccl"``, each read in full (c10d's own ``onlyActive`` keeps every gloo entry).
        owned: c10d group names of process groups our recorded communicators own; their c10d
            entries are dropped (our hook has the same ops).
        groups: this process's c10d groups by name, the source of ``pg_config``; a group
            missing here (destroyed) keeps c10d's config when that has ranks.
        only_active: keep only c10d entries neither completed nor retired.
        include_collectives: False leaves c10d's entries out (config and status only).
        backed: c10d group names of our c10d-backed communicators (only c10d recorded their
            ops): their c10d entries become the communicator's (``_backed_entry``).
        others: False keeps only the backed communicators' entries (a hook's own dump).
    """
    m = _Merging(ours, set(owned), backed or {}, groups or {}, only_active, others)
    for recorder, dump in recorders:
        m.take(recorder, dump)
    return m.result(include_collectives)


class _Merging:
    """One :func:`merge_lazy`: c10d's recorders taken one by one, then the merged dump."""

    def __init__(self, ours: LazyDump, owned: set[str], backed: Mapping[str, Backed],
                 groups: Mapping[str, GroupInfo], only_active: bool, others: bool) -> None:
        self.ours, self.owned, self.backed, self.groups = ours, owned, backed, groups
        self.only_active, self.others = only_active, others
        self.our_cfg = dict(ours.head.get("pg_config") or {})
        self.our_status = dict(ours.head.get("pg_status") or {})
        # A c10d group whose name is also one of our communicators' names is renamed, never merged.
        self.taken = set(self.our_cfg) | set(self.our_status)
        self.cfg: dict[str, dict[str, Any]] = {}
        self.status: dict[str, dict[str, int]] = {}
        self.added: list[Mapping[str, Any]] = []
        self.kinds: list[Source] = []  # per entry of added: built (FRESH), or c10d's own (_C10D)
        self.seen: set[tuple[Any, ...]] = set()

    def key_of(self, recorder: str, pg_name: str) -> str:
        side = side_of(recorder, pg_name, self.groups.get(pg_name))
        return f"c10d_{side}" if side in self.taken else side

    def take(self, recorder: str, dump: Mapping[str, Any]) -> None:
        raw_status = status_by_name(recorder, dump)
        backed = _with_first_open(self.backed, raw_status)
        used: set[str] = set()
        descs: dict[str, str] = {}
        for e in dump.get("entries") or ():
            pg = e.get("process_group") if isinstance(e, Mapping) else None
            if not isinstance(pg, (list, tuple)) or not pg:
                continue  # not an entry c10d writes; the analyzer would only skip it too
            b = backed.get(str(pg[0]))
            if b is not None:
                self._take_backed(e, b)
            elif str(pg[0]) not in self.owned and self.others:
                used.add(str(pg[0]))
                descs.setdefault(str(pg[0]), str(pg[1]) if len(pg) > 1 else "")
                self._take_other(recorder, e, pg)
        if isinstance(raw_status, Mapping):
            self._take_status(recorder, raw_status, backed, used)
        raw_cfg = dump.get("pg_config") or {}
        for pg_name in used:
            key = self.key_of(recorder, pg_name)
            self.cfg[key] = _group_config(key, pg_name, self.groups.get(pg_name), raw_cfg,
                                          descs.get(pg_name, ""), recorder)

    def _take_backed(self, e: Mapping[str, Any], b: Backed) -> None:
        # Built now: few, and their keys need the mapped seqs and states.
        ent = _backed_entry(e, b)
        if self.only_active and (ent.get("state") == "completed" or ent.get("retired")):
            return
        ident = (ent["process_group"], ent.get("collective_seq_id"), ent.get("p2p_seq_id"),
                 ent.get("op_id"), ent.get("time_created_ns"))
        if ident not in self.seen:
            self.seen.add(ident)
            self.added.append(ent)
            self.kinds.append(FRESH)
            self.cfg[b.name] = {"name": b.name, "desc": b.backend, "ranks": str(list(b.ranks))}

    def _take_other(self, recorder: str, e: Mapping[str, Any], pg: Sequence[Any]) -> None:
        group = self.key_of(recorder, str(pg[0]))
        # As _repair_entry will write them (it leaves state, retired and seqs alone).
        if self.only_active and (e.get("state") == "completed" or e.get("retired")):
            return
        ident = ((group, str(pg[1]) if len(pg) > 1 else ""), e.get("collective_seq_id"),
                 e.get("p2p_seq_id", 0), e.get("op_id"), e.get("time_created_ns"))
        if ident in self.seen:  # an older torch whose two dump calls read one recorder
            return
        self.seen.add(ident)
        if group == pg[0]:
            # c10d's own entry is its key: the window reads the group, seqs, state and the op
            # after "nccl:"/"gloo:", which repairing leaves as they are (0 and None times read
            # alike); it is built only when kept.
            self.added.append(e)
            self.kinds.append(_C10D)
        else:  # renamed: built now, its own key
            self.added.append(_repair_entry(e, group))
            self.kinds.append(FRESH)

    def _take_status(self, recorder: str, raw_status: Mapping[str, Any],
                     backed: Mapping[str, Backed], used: set[str]) -> None:
        for pg_name, st in raw_status.items():
            b = backed.get(str(pg_name))
            if b is not None and isinstance(st, Mapping):
                self.status[b.name] = _backed_status(st)
                self.cfg[b.name] = {"name": b.name, "desc": b.backend, "ranks": str(list(b.ranks))}
                continue
            if str(pg_name) in self.owned or not isinstance(st, Mapping) or not self.others:
                continue
            used.add(str(pg_name))
            self.status[self.key_of(recorder, str(pg_name))] = {
                k: int_or(st.get(k), -1) for k in _STATUS_KEYS}

    def result(self, include_collectives: bool) -> LazyDump:
        added, kinds = (self.added, self.kinds) if include_collectives else ([], [])
        if not self.cfg and not added:
            return self.ours
        head = dict(self.ours.head)
        head["pg_config"] = {**self.our_cfg, **self.cfg}
        head["pg_status"] = {**self.our_status, **self.status}
        head.setdefault("version", FR_VERSION)
        if not added:
            return LazyDump(head, list(self.ours.items), list(self.ours.sources))
        # One timeline: ours and c10d's by creation time, record ids renumbered along it.
        return self.ours.merged(LazyDump({}, list(added), kinds), head)


def side_of(recorder: str, pg_name: str, info: GroupInfo | None) -> str:
    if recorder == "cpu" and info is not None and info.backend not in ("gloo", ""):
        # A group with a gloo and an NCCL backend ("cpu:gloo,cuda:nccl", the default when CUDA
        # is there) counts each backend's collectives apart: two groups here.
        return f"{pg_name}:gloo"
    return pg_name


def _repair_entry(e: Mapping[str, Any], key: str) -> dict[str, Any]:
    ent = {**_ENTRY_DEFAULTS, **e}
    pg = e["process_group"]
    ent["process_group"] = (key, str(pg[1]) if len(pg) > 1 else "")
    _normalize_times_and_name(ent)
    return ent


def _repair_own(e: Mapping[str, Any], key: Any) -> dict[str, Any]:
    return _repair_entry(e, e["process_group"][0])


_C10D = Source(lambda e: e, _repair_own, operator.methodcaller("get", "time_created_ns"),
              fresh=True)
"""c10d's entries of a group whose name stays: their own keys, repaired when kept."""


def _normalize_times_and_name(ent: dict[str, Any]) -> None:
    """In place: unknown discovery times become None (the JSON dump writes 0 for "not known"),
    and a non-NCCL backend's profiling name is spelled ``nccl:<op>`` as our recorder writes it."""
    for k in ("time_discovered_started_ns", "time_discovered_completed_ns"):
        if not ent[k]:
            ent[k] = None
    name = str(ent.get("profiling_name", ""))
    backend, sep, op = name.partition(":")
    if sep and backend not in ("nccl", "xccl"):
        ent["profiling_name"] = f"nccl:{op}"


def _group_config(key: str, pg_name: str, info: GroupInfo | None, raw_cfg: Any, desc: str,
                  recorder: str) -> dict[str, Any]:
    backend = "gloo" if recorder == "cpu" else recorder
    if info is not None:
        return {"name": key, "desc": info.desc or desc, "ranks": str(list(info.ranks)),
                "backend": info.backend if info.backend in ("gloo", "nccl") else backend}
    c = raw_cfg.get(pg_name) if isinstance(raw_cfg, Mapping) else None
    c = c if isinstance(c, Mapping) else {}
    return {"name": key, "desc": desc or str(c.get("desc", "")),
            "ranks": str(c.get("ranks", "[]")), "backend": backend}


# c10d keys pg_status by the group's id in its recorder and names entries' groups by the group's
# name; the two differ (a group made with use_local_synchronization has a hashed name). Ids are
# never reused in a process, so each pairing seen in a full read holds for good.
_pg_names: dict[tuple[str, str], str] = {}
_pg_ids: dict[tuple[str, str], str] = {}  # the reverse pairing: (recorder, name) -> id


def learn_names(recorder: str, dump: Mapping[str, Any]) -> None:
    """Pair status ids with group names from ``dump``'s entries (a read of ``recorder``)."""
    status = dump.get("pg_status")
    if isinstance(status, Mapping) and all((recorder, str(i)) in _pg_names for i in status):
        return  # every group of this ring is known already
    for e in dump.get("entries") or ():
        if isinstance(e, Mapping):
            pg = e.get("process_group")
            if isinstance(pg, (list, tuple)) and pg and "pg_id" in e:
                _pg_names[(recorder, str(e["pg_id"]))] = str(pg[0])
                _pg_ids[(recorder, str(pg[0]))] = str(e["pg_id"])


def status_by_name(recorder: str, dump: Mapping[str, Any]) -> dict[str, Any]:
    """``dump``'s ``pg_status`` keyed by group name, as its entries name groups.

    c10d keys it by the group's id; an id is paired with its name by this dump's entries or an
    earlier read's. An id never paired yet keeps its own key (for most groups it equals the
    name; a group made with use_local_synchronization has a hashed name instead).
    """
    status = dump.get("pg_status")
    if not isinstance(status, Mapping):
        return {}
    learn_names(recorder, dump)
    pairs = [(_pg_names.get((recorder, str(k))), str(k), v) for k, v in status.items()]
    # Unpaired ids first: a paired name equal to an unpaired id (a group "1" whose id is 2)
    # wins the key.
    out = {key: v for name, key, v in pairs if name is None}
    out.update({name: v for name, _, v in pairs if name is not None})
    return out


def _with_first_open(backed: Mapping[str, Backed], raw_status: Any) -> Mapping[str, Backed]:
    """``backed`` with each marked communicator's oldest uncompleted seq from c10d's status."""
    if not isinstance(raw_status, Mapping) or not any(b.started for b in backed.values()):
        return backed
    out = dict(backed)
    for pg_name, b in backed.items():
        st = raw_status.get(pg_name)
        if b.started is not None and isinstance(st, Mapping):
            # c10d's last completed n (from 1) is our n - 1: our first open one is n.
            out[pg_name] = b._replace(first_open=max(int_or(st.get("last_completed_collective"), 0), 0))
    return out


def name_of(recorder: str, pg_id: Any) -> str | None:
    """The group name paired with c10d's status id ``pg_id`` in ``recorder``, if seen yet."""
    return _pg_names.get((recorder, str(pg_id)))


def id_of(recorder: str, name: str) -> str | None:
    """c10d's status id of group ``name`` in ``recorder``, if seen yet."""
    return _pg_ids.get((recorder, name))
