"""c10d's own Flight Recorder merged into ours: one FR dump per rank, keyed by process group.

Most training code never calls our communicators: DDP, FSDP, torchtitan and plain
``dist.all_reduce`` issue their collectives on c10d process groups, and c10d records those in its
own Flight Recorder (on by default in recent torch; ``TORCH_FR_BUFFER_SIZE``). This module reads
that recorder inside the rank and merges it with our hooks' snapshot, so everything that serves
or writes a rank's FR (the worker's ``torchcomms_fr_trace_json``, ``torchcomms_fr_dump_file``,
the dumper's pickles) carries both, in torch FR schema "2.10":

* **Groups.** Our communicators appear once, under their names (``main_comm``). c10d also
  records every op a communicator issues, on the communicator's own process group: those c10d
  entries are dropped, so an op appears once. Every other c10d group appears under c10d's name
  and description (``0`` / ``default_pg``, the groups of DDP, FSDP, DeviceMesh). ``pg_config``
  is rebuilt from the process's own groups (torch's gloo recorder writes one entry with an empty
  name and often no ranks) and says the backend (``"backend": "gloo"``). A group with a gloo
  and an NCCL backend (``cpu:gloo,cuda:nccl``) counts each backend's collectives apart; its gloo
  side is the group ``<name>:gloo``.
* **State.** c10d's CPU recorder (gloo) never moves ``state`` past ``scheduled``: for these
  groups it means "state unknown", never "not started". gloo retires an op when it ends, so
  ``retired`` is the evidence an op is over (readers, ``only_active`` here and the analyzer,
  use it), but an op that timed out or failed is retired too, so ``state`` is left as c10d
  wrote it rather than claimed ``completed``. Health uses progress in ``pg_status`` instead
  (see :class:`StallWatch`).
* **Sequence numbers** stay as c10d counts them (from 1; ours count from 0), so they match
  torch's own dumps and its watchdog's messages (``SeqNum=5``).
* **Names.** ``gloo:all_reduce`` becomes ``nccl:all_reduce``, as our own entries are written:
  older torch ``fr_trace`` accepts only nccl/xccl names; the backend is in ``pg_config``.
* **record_id** is renumbered along the merged timeline (``time_created_ns``) when c10d
  entries are present: PyTorch's ``fr_trace`` aligns ranks on the first ``record_id``.

:func:`merge_c10d` is pure (unit-tested on captured c10d dumps); ``hooks.snapshot`` and
``hooks.dump_file``, the whole process's dump, read this process's recorders through this
module. It never imports the hooks: what it needs of them (the communicators they record, the
c10d groups those own) is passed in.
"""

from __future__ import annotations

import json
import logging
import operator
import os
import pickle
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from debug_server.config import FR_BUFFER_ENV as BUFFER_ENV
from debug_server.config import Settings
from debug_server.dumpio import FR_VERSION
from debug_server.errors import first_line
from debug_server.recording.lazy import FRESH, Cut, LazyDump, Source
from debug_server.recording.stall import StallWatch, _int, report

logger = logging.getLogger(__name__)

__all__ = [
    "BUFFER_ENV",
    "Backed",
    "DEFAULT_BUFFER_SIZE",
    "GroupInfo",
    "c10d_stalled_op",
    "group_exists",
    "backed_of",
    "merge_backed",
    "merge_c10d",
    "merge_lazy",
    "off_reason",
    "process_groups",
    "read_recorders",
    "turn_on_env",
    "warn_once",
]

# BUFFER_ENV: c10d reads the first one set when it creates its recorder (older torch only the
# second, newer torch warns on every rank when the second is set).
DEFAULT_BUFFER_SIZE = 2000

# (recorder, JSON dump, pickle dump): the CPU recorder holds gloo's ops, the NCCL one (CUDA
# builds only) NCCL's. They are separate rings; torch's own frontend shows them as two views.
_RECORDERS = (
    ("cpu", "_dump_fr_trace_json", "_dump_fr_trace"),
    ("nccl", "_dump_nccl_trace_json", "_dump_nccl_trace"),
)
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


# Frames of the op path itself, above the user's call site in c10d's stacks: dropped, as our own
# recorder drops comms.py and hooks.py.
_OP_PATH_FILES = tuple(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), n) for n in ("comms.py", "hooks.py"))
_TORCH_DIST = os.sep + os.path.join("torch", "distributed") + os.sep


def _backed_entry(e: Mapping[str, Any], b: Backed) -> dict[str, Any]:
    """c10d's entry of a backed communicator's op, as our recorder writes it: the group is the
    communicator, sequence numbers count from 0 (c10d's from 1), the communicator's timeout,
    and the stack starts at the user's call site."""
    ent = {**_ENTRY_DEFAULTS, **e}
    ent["process_group"] = (b.name, b.backend)
    ent["pg_id"] = b.pg_id
    if ent.get("is_p2p"):
        ent["p2p_seq_id"] = _int(ent.get("p2p_seq_id"), 1) - 1
    else:
        ent["collective_seq_id"] = _int(ent.get("collective_seq_id"), 1) - 1
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
            str(frames[i].get("filename", "")) in _OP_PATH_FILES
            or _TORCH_DIST in str(frames[i].get("filename", ""))):
        i += 1
    ent["frames"] = list(frames[i:]) if i < len(frames) else list(frames)
    return ent


def _backed_status(st: Mapping[str, Any]) -> dict[str, int]:
    # c10d's -1 ("none yet") stays -1; its seq n (from 1) is our n - 1.
    return {k: max(_int(st.get(k), -1) - 1, -1) if _int(st.get(k), -1) > 0 else -1 for k in _STATUS_KEYS}


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
        side = _side(recorder, pg_name, self.groups.get(pg_name))
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
                k: _int(st.get(k), -1) for k in _STATUS_KEYS}

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


def _side(recorder: str, pg_name: str, info: GroupInfo | None) -> str:
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


# ---------------------------------------------------------------------------------------------
# Reading this process's recorders and groups

_read_once = False


def _c10d() -> Any | None:
    try:
        import torch.distributed as dist
        from torch._C import _distributed_c10d as c10d
    except ImportError:
        return None
    # c10d sizes its recorder from the environment the first time anything touches it: a read
    # before the first process group would freeze the size before the user's settings apply.
    global _read_once
    if not (_read_once or (dist.is_available() and dist.is_initialized())):
        return None
    _read_once = True
    return c10d


def read_recorders(*, stacks: bool = False, include_collectives: bool = True,
                   unread: Iterable[str] = ()) -> list[tuple[str, dict[str, Any]]]:
    """c10d's recorders in this process as ``(recorder, dump)``; empty before the first group.

    Reads c10d's pickle dumps (half the time of its JSON ones, and ints where the JSON has
    strings), with each op's Python stack when ``stacks`` and that is safe (see
    :func:`_stacks_safe`), else without ``frames``. A torch with only the JSON dumps is read
    through those.

    ``unread``: c10d group names whose entries the caller drops (our communicators' own
    groups). A recorder whose every group is one of them gives its status only, no entries:
    c10d writes all of its ring on every dump (16 ms for 2000 entries), and in a job that runs
    only our communicators every one of them would be dropped (see :func:`_only_unread`).
    """
    c10d = _c10d()
    if c10d is None:
        return []
    stacks = stacks and _stacks_safe()
    unread = frozenset(unread)
    out = []
    for recorder, json_fn, pickle_fn in _RECORDERS:
        try:
            dump = None
            if include_collectives and unread:
                head = _read(c10d, pickle_fn, json_fn, False, False)
                if isinstance(head, dict) and _only_unread(recorder, head, unread):
                    dump = head
            if dump is None:
                dump = _read(c10d, pickle_fn, json_fn, include_collectives, stacks)
                if include_collectives and unread and isinstance(dump, dict):
                    _learn_names(recorder, dump)
        except Exception as e:  # a recorder that cannot be read must not cost the other one
            warn_once(recorder, f"reading c10d's {recorder} flight recorder failed: "
                       f"{first_line(e, 10_000)}")
            continue
        if isinstance(dump, dict):
            out.append((recorder, dump))
    return out


def _read(c10d: Any, pickle_fn: str, json_fn: str, include_collectives: bool,
          stacks: bool) -> Any:
    fn = getattr(c10d, pickle_fn, None)
    if fn is not None:
        # c10d's own bytes, made in this process from its ring (plain dicts, lists and
        # strings): no network data, so plain pickle (3x faster than the restricted one).
        return pickle.loads(fn(include_collectives, stacks, False))
    if (fn := getattr(c10d, json_fn, None)) is not None:
        raw = fn(include_collectives, False)
        return json.loads(raw.decode() if isinstance(raw, bytes) else raw)
    return None


# c10d keys pg_status by the group's id in its recorder and names entries' groups by the group's
# name; the two differ (a group made with use_local_synchronization has a hashed name). Ids are
# never reused in a process, so each pairing seen in a full read holds for good.
_pg_names: dict[tuple[str, str], str] = {}


_pg_ids: dict[tuple[str, str], str] = {}  # the reverse pairing: (recorder, name) -> id
_learned_at: dict[str, float] = {}


def _learn_names(recorder: str, dump: Mapping[str, Any]) -> None:
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
    _learn_names(recorder, dump)
    pairs = [(_pg_names.get((recorder, str(k))), str(k), v) for k, v in status.items()]
    # Unpaired ids first: a paired name equal to an unpaired id (a group "1" whose id is 2)
    # wins the key.
    out = {key: v for name, key, v in pairs if name is None}
    out.update({name: v for name, _, v in pairs if name is not None})
    return out


def status_row(recorder: str, status: Mapping[str, Any], name: str) -> Any:
    """The ``pg_status`` row of group ``name`` in a status-only read (keyed by id).

    An id not paired with ``name`` yet is learned by one full read of the recorder (entries,
    no stacks), at most every 2 s: that group's entries carry its id. Only then does ``name``
    itself count as a key (a torch that keys status by name): an id equal to ``name`` may be
    another group's.
    """
    pid = _pg_ids.get((recorder, name))
    if pid is None and time.monotonic() - _learned_at.get(recorder, -9.0) > 2:
        _learned_at[recorder] = time.monotonic()
        c10d = _c10d()
        for rec, json_fn, pickle_fn in _RECORDERS:
            if rec == recorder and c10d is not None:
                try:
                    dump = _read(c10d, pickle_fn, json_fn, True, False)
                except Exception:
                    logger.debug("reading c10d's %s recorder for group ids failed", recorder,
                                 exc_info=True)
                    dump = None
                if isinstance(dump, dict):
                    _learn_names(recorder, dump)
        pid = _pg_ids.get((recorder, name))
    if pid is not None and pid in status:
        return status[pid]
    return status.get(name)


def _only_unread(recorder: str, head: Mapping[str, Any], unread: frozenset[str]) -> bool:
    """Whether every entry of this recorder's ring belongs to a group in ``unread``, from its
    status alone: c10d adds a group's ``pg_status`` row at the group's first record and never
    removes it, so the rows name every group with an entry. A row whose group name is not known
    yet (no full read saw its entries) means no."""
    status = head.get("pg_status")
    if not isinstance(status, Mapping):
        return False
    return all(_pg_names.get((recorder, str(pg_id))) in unread for pg_id in status)


def group_exists() -> bool:
    """Whether this process has created its default process group (c10d sized its recorder)."""
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return bool(dist.is_available() and dist.is_initialized())


def _stacks_safe() -> bool:
    """Whether c10d may symbolise its stacks from this (the worker's) thread.

    c10d symbolises through ``torch._inductor``: the first time, that imports some 800 modules.
    From the worker's thread this races the trainer's own imports (seen: DDP's constructor,
    which imports ``torch._dynamo``, failing with an ImportError while a dump ran). Once the
    trainer has imported it (DDP does), symbolising imports nothing more.
    """
    mod = sys.modules.get("torch._inductor")
    return mod is not None and not getattr(getattr(mod, "__spec__", None), "_initializing", False)


_warned: set[str] = set()


def warn_once(what: str, msg: str, exc_info: bool = False) -> None:
    # Health reads c10d every few seconds: one warning per kind of failure, then debug lines.
    level = logging.DEBUG if what in _warned else logging.WARNING
    _warned.add(what)
    logger.log(level, "debug_server: %s", msg, exc_info=exc_info)


def process_groups() -> dict[str, GroupInfo]:
    """This process's live c10d groups by c10d name (empty without torch.distributed)."""
    try:
        import torch.distributed as dist
    except ImportError:
        return {}
    if not dist.is_available() or not dist.is_initialized():
        return {}
    world = dist.distributed_c10d._world
    out: dict[str, GroupInfo] = {}
    for pg, name in list(world.pg_names.items()):
        entry = world.pg_map.get(pg)
        # The backend string the group was made with: "gloo", "nccl" or "cpu:gloo,cuda:nccl".
        backend = str(entry[0]) if entry else ""
        out[str(name)] = GroupInfo(str(name), str(getattr(pg, "group_desc", "") or ""),
                                   tuple(sorted(world.pg_group_ranks.get(pg, {}))), backend)
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
            out[pg_name] = b._replace(first_open=max(_int(st.get("last_completed_collective"), 0), 0))
    return out


def backed_of(comms: Iterable[Any]) -> dict[str, Backed]:
    """c10d group name -> :class:`Backed` for the c10d-backed communicators among ``comms``."""
    out: dict[str, Backed] = {}
    for c in comms:
        name = c.c10d_group_name
        if name and getattr(c, "c10d_backed", False):
            out[name] = Backed(c.get_name(), c.get_backend(), tuple(c.global_ranks), c.pg_id,
                               int(c.timeout.total_seconds() * 1000),
                               getattr(c, "_c10d_frozen", None) if getattr(c, "_broken", None) else None,
                               c.started_mark if getattr(c, "_marks", False) else None)
    return out


def merge_backed(ours: Mapping[str, Any] | LazyDump, comms: Iterable[Any], *,
                 only_active: bool = False, include_collectives: bool = True, stacks: bool = True,
                 cut: Cut | None = None) -> dict[str, Any]:
    """A hook's dump (``ours``) with the entries c10d recorded for the hook's c10d-backed
    communicators among ``comms``, and nothing of c10d's other groups; ``cut`` as in
    :func:`merge_c10d`."""
    lazy = ours if isinstance(ours, LazyDump) else LazyDump.of(ours)
    comms = list(comms)
    backed = backed_of(comms)
    recorders = read_recorders(stacks=stacks, include_collectives=include_collectives) \
        if backed else []
    if not recorders:
        return lazy.finish(cut)
    out = merge_lazy(lazy, recorders, backed=backed, others=False, only_active=only_active,
                     include_collectives=include_collectives)
    for c in comms:
        if getattr(c, "c10d_backed", False) and getattr(c, "_broken", None) == "" and include_collectives:
            # Failing, not yet aborted (the abort hooks run now): keep c10d's states as they
            # are, from every entry's key (a cut builds only some entries).
            name = c.get_name()
            c._c10d_frozen = {k["collective_seq_id"]: k["state"] for k in out.keys()
                              if k["process_group"][0] == name and not k.get("is_p2p")}
    return out.finish(cut)


def c10d_stalled_op(watch: StallWatch, stall_timeout: float, owned: set[str],
                    now_ns: int | None = None) -> dict[str, Any] | None:
    """The first c10d op stalled beyond ``stall_timeout``, not on a group in ``owned`` (our
    communicators' own groups: ``hooks.owned_groups()``)."""
    recorders = read_recorders(include_collectives=False)
    if not recorders:
        return None
    groups = process_groups()
    now = time.time_ns() if now_ns is None else now_ns
    status: dict[str, Mapping[str, Any]] = {}
    for recorder, dump in recorders:
        for name, st in (dump.get("pg_status") or {}).items():
            if str(name) not in owned and isinstance(st, Mapping):
                status[_side(recorder, str(name), groups.get(str(name)))] = st
    unread = watch.update(status, now)
    if unread:
        by_group: dict[str, list[Mapping[str, Any]]] = {g: [] for g in unread}
        for recorder, dump in read_recorders():
            for e in dump.get("entries") or ():
                pg = e.get("process_group") if isinstance(e, Mapping) else None
                if isinstance(pg, (list, tuple)) and pg:
                    side = _side(recorder, str(pg[0]), groups.get(str(pg[0])))
                    if side in by_group:
                        by_group[side].append(e)
        for g, entries in by_group.items():
            watch.resolve(g, entries)
    stalled = watch.stalled(stall_timeout, now)
    if not stalled:
        return None
    group, age, p = stalled[0]
    return report(group, p.seq, p.op, age, group_desc=p.desc, source="c10d")


# ---------------------------------------------------------------------------------------------
# Turning c10d's recorder on, and saying when it is off


def buffer_env_name() -> str:
    """The buffer variable this torch reads: ``TORCH_FR_BUFFER_SIZE`` from torch 2.8 on (which
    warns "TORCH_NCCL_TRACE_BUFFER_SIZE is deprecated" on every rank when the old one is set),
    ``TORCH_NCCL_TRACE_BUFFER_SIZE`` before."""
    import torch

    version = tuple(_int(p, 0) for p in torch.__version__.split("+")[0].split(".")[:2])
    return BUFFER_ENV[0] if version >= (2, 8) else BUFFER_ENV[1]


def turn_on_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Set the buffer variable this torch reads to 2000 unless either is set; returns what it
    set (empty when the user's setting stands)."""
    env = os.environ if environ is None else environ
    if Settings.from_env(env).fr_buffer_size is not None:
        return {}
    added = {buffer_env_name(): str(DEFAULT_BUFFER_SIZE)}
    env.update(added)
    return added


def off_reason() -> str | None:
    """Why c10d's recorder records nothing in this process, or None when it is on (or unknown).

    Call after the default group exists. An explicit 0 in the environment turns it off; so does
    torch's own default on builds where that is 0, which shows as a CPU recorder that did not
    note the default gloo group (it notes each group at creation when on).
    """
    size = Settings.from_env().fr_buffer_size
    if size is not None:
        return f"{BUFFER_ENV[0]}={size}" if size <= 0 else None
    c10d = _c10d()
    if c10d is None or getattr(c10d, "_dump_fr_trace_json", None) is None:
        return None
    groups = process_groups()
    if not any(g.backend == "gloo" for g in groups.values()):
        return None  # NCCL notes its groups only at their first collective: cannot tell yet
    try:
        dump = json.loads(c10d._dump_fr_trace_json(False, False))
    except Exception:
        return None
    if not dump.get("pg_config"):
        return f"{BUFFER_ENV[0]} is not set and this torch's default is 0"
    return None
