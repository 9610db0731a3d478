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

:func:`merge_c10d` (``c10d_merge``, re-exported here) is pure: unit-tested on captured c10d
dumps. This module reads this process's recorders and groups (``read_recorders``,
``process_groups``), maps a hook's c10d-backed communicators (``backed_of``, ``merge_backed``),
finds c10d's stalled groups (``c10d_stalled_op``) and turns c10d's recorder on
(``turn_on_env``, ``off_reason``). ``hooks.snapshot`` and ``hooks.dump_file``, the whole
process's dump, read the recorders through it. It never imports the hooks: what it needs of
them (the communicators they record, the c10d groups those own) is passed in.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import sys
import time
from collections.abc import Iterable, Mapping
from typing import Any

from debug_server.config import FR_BUFFER_ENV as BUFFER_ENV
from debug_server.config import NCCL_TIMING_ENV, Settings
from debug_server.errors import first_line
from debug_server.recording.c10d_merge import (
    Backed,
    GroupInfo,
    id_of,
    learn_names,
    merge_c10d,
    merge_lazy,
    name_of,
    side_of,
    status_by_name,
)
from debug_server.recording.lazy import Cut, LazyDump
from debug_server.recording.stall import StallWatch, int_or, report

logger = logging.getLogger(__name__)

__all__ = [
    "BUFFER_ENV",
    "TIMING_ENV",
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
    "status_by_name",
    "status_row",
    "turn_on_env",
    "turn_on_timing",
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
                    learn_names(recorder, dump)
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


_learned_at: dict[str, float] = {}

def status_row(recorder: str, status: Mapping[str, Any], name: str) -> Any:
    """The ``pg_status`` row of group ``name`` in a status-only read (keyed by id).

    An id not paired with ``name`` yet is learned by one full read of the recorder (entries,
    no stacks), at most every 2 s: that group's entries carry its id. Only then does ``name``
    itself count as a key (a torch that keys status by name): an id equal to ``name`` may be
    another group's.
    """
    pid = id_of(recorder, name)
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
                    learn_names(recorder, dump)
        pid = id_of(recorder, name)
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
    return all(name_of(recorder, pg_id) in unread for pg_id in status)


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
                status[side_of(recorder, str(name), groups.get(str(name)))] = st
    unread = watch.update(status, now)
    if unread:
        by_group: dict[str, list[Mapping[str, Any]]] = {g: [] for g in unread}
        for recorder, dump in read_recorders():
            for e in dump.get("entries") or ():
                pg = e.get("process_group") if isinstance(e, Mapping) else None
                if isinstance(pg, (list, tuple)) and pg:
                    side = side_of(recorder, str(pg[0]), groups.get(str(pg[0])))
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

    version = tuple(int_or(p, 0) for p in torch.__version__.split("+")[0].split(".")[:2])
    return BUFFER_ENV[0] if version >= (2, 8) else BUFFER_ENV[1]


def turn_on_env(settings: Settings, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Set the buffer variable this torch reads to 2000 unless either is set (``settings``, as
    the entry point read them); returns what it set (empty when the user's setting stands)."""
    env = os.environ if environ is None else environ
    if settings.fr_buffer_size is not None:
        return {}
    added = {buffer_env_name(): str(DEFAULT_BUFFER_SIZE)}
    env.update(added)
    return added


TIMING_ENV = NCCL_TIMING_ENV
"""c10d reads it in each NCCL group's constructor: with it, a collective's record turns
``started`` when its GPU starts it (events on the NCCL stream), which is how the analysis tells
a GPU that has not started its op from one inside it (``gpu_busy``)."""


def turn_on_timing(settings: Settings, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Turn c10d's start timing on unless the user set ``TORCH_NCCL_ENABLE_TIMING``: the
    variable for NCCL groups made from now on, ``_enable_collectives_timing`` on the NCCL groups
    that exist already. Returns the variables it set (empty when the user's setting stands).

    Cost: one CUDA event recorded per collective on the NCCL stream; the step benchmark on GPUs
    is in docs/benchmarks.md (``scripts/gpu/run.sh timing``).
    """
    env = os.environ if environ is None else environ
    if TIMING_ENV in env or not settings.c10d_timing:
        return {}
    env[TIMING_ENV] = "1"
    if environ is None:
        _time_existing_groups()
    return {TIMING_ENV: "1"}


def _time_existing_groups() -> None:
    try:
        import torch.distributed as dist
    except ImportError:
        return
    if not dist.is_available() or not dist.is_initialized():
        return
    world = dist.distributed_c10d._world
    for pg, entry in list(world.pg_map.items()):
        if "nccl" not in str(entry[0] if entry else ""):
            continue
        try:
            pg._enable_collectives_timing()
        except Exception as e:  # noqa: BLE001 - an older torch or a backend without timing
            warn_once("timing", f"could not turn c10d's start timing on ({type(e).__name__}: "
                      f"{str(e)[:80]}); set TORCH_NCCL_ENABLE_TIMING=1 before init_process_group")
            return


def off_reason(settings: Settings) -> str | None:
    """Why c10d's recorder records nothing in this process, or None when it is on (or unknown).

    Call after the default group exists. An explicit 0 in the environment turns it off; so does
    torch's own default on builds where that is 0, which shows as a CPU recorder that did not
    note the default gloo group (it notes each group at creation when on).
    """
    size = settings.fr_buffer_size
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
