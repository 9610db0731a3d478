"""torch's own C++ workers: their two Flight Recorders read as one dump per rank.

A rank served by torch's ``_WorkerServer`` alone (no sidecar of ours) has c10d's recorders only,
and they are two separate rings (``recording.c10d_fr`` reads the same two in-process):

- ``fr_trace_json``: the CPU recorder (gloo's ops). It ignores every parameter and sends the
  whole ring (``tests/test_c10d_worker_params.py`` checks this against a real worker);
- ``dump_nccl_trace_json``: the NCCL recorder (CUDA builds only; 404 elsewhere). It takes
  ``includecollectives`` and ``onlyactive`` and answers 400 to any other parameter, so it is
  asked with at most ``onlyactive`` (:func:`nccl_params`) and, like the CPU ring, cut to the
  window by the frontend as it arrives. A windowed fetch's first round asks it
  ``onlyactive=true`` instead, and only a rank that completed what another has not is asked
  for its whole ring (``analysis.activecover``).

Only ``fr_trace_json`` was asked before, so on an NCCL job every NCCL collective of such a rank
was invisible. :func:`merge` makes one dump of the two replies. A group both recorders name (the
default group of ``cpu:gloo,cuda:nccl`` has a gloo and an NCCL backend, each counting its own
sequence numbers) is two groups: the CPU recorder's becomes ``<name>:gloo``, as our own worker
names it. Pure: no HTTP.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from debug_server.protocol import fastjson
from debug_server.protocol.frwindow import ACTIVE_KEY as _ACTIVE_KEY
from debug_server.protocol.frwindow import WINDOW_KEY as _WINDOW_KEY

__all__ = ["EMPTY_CPU_BODY", "GLOO_SUFFIX", "NCCL_HANDLER", "collisions", "cpu_since", "has_groups",
           "is_empty", "is_empty_body", "merge", "nccl_params", "rename"]

NCCL_HANDLER = "dump_nccl_trace_json"
GLOO_SUFFIX = ":gloo"


def nccl_params(params: Mapping[str, str]) -> dict[str, str]:
    """What ``dump_nccl_trace_json`` is asked for a fan-out's ``params``: ``onlyactive`` where
    the fan-out asks it, else nothing (the whole ring; the window is cut on arrival)."""
    return {"onlyactive": params["onlyactive"]} if "onlyactive" in params else {}


def _is_map(x: Any) -> bool:
    # Parsed JSON: dicts. isinstance(x, Mapping) alone goes through abc's check, which was a
    # third of merging 4096 ranks' replies (profile at 4096 ranks, issue 31).
    return isinstance(x, dict) or isinstance(x, Mapping)


def _names(dump: Mapping[str, Any]) -> set[str]:
    out: set[str] = set()
    for key in ("pg_config", "pg_status"):
        part = dump.get(key)
        if _is_map(part):
            out.update(map(str, part))
    entries = dump.get("entries")
    for e in entries if isinstance(entries, list) else ():
        pg = e.get("process_group") if _is_map(e) else None
        if isinstance(pg, (list, tuple)) and pg:
            out.add(str(pg[0]))
    return out


def is_empty(dump: Mapping[str, Any]) -> bool:
    """A recorder that recorded nothing and names no group (the CPU recorder of an NCCL-only
    job): merging it changes nothing but the work done (:func:`merge` gives the other dump)."""
    return not dump.get("entries") and _WINDOW_KEY not in dump and not _names(dump)



EMPTY_CPU_BODY = ('{"comm_lib_version":"","nccl_comm_state":{},"pg_config":{},"pg_status":{},'
                  '"version":"2.10"}')
"""What an empty CPU recorder answers (torch 2.11-2.13: ``tests/data/c10d_nccl_worker.json``)."""


def is_empty_body(body: str) -> bool:
    """Whether ``body`` is a recorder's reply that names no group and holds no entry."""
    try:
        dump = fastjson.loads(body)
    except ValueError:
        return False
    return isinstance(dump, dict) and is_empty(dump)


def has_groups(dump: Mapping[str, Any]) -> bool:
    """Whether a recorder's dump names any group (a CUDA build's NCCL recorder in a job without
    NCCL groups writes an empty one)."""
    return bool(_names(dump))


def collisions(cpu: Mapping[str, Any], nccl: Mapping[str, Any]) -> frozenset[str]:
    """The CPU recorder's group names (and ids) that the NCCL recorder uses too."""
    return frozenset(_names(cpu) & _names(nccl))


def rename(dump: Mapping[str, Any], names: Iterable[str]) -> dict[str, Any]:
    """The CPU recorder's ``dump`` with each group of ``names`` called ``<name>:gloo``: in its
    entries, ``pg_config``, ``pg_status`` and the window facts of a cut (``fr_window``)."""
    names = frozenset(names)
    if not names:
        return dict(dump)

    def new(key: Any) -> Any:
        return f"{key}{GLOO_SUFFIX}" if str(key) in names else key

    out = dict(dump)
    cfg = dump.get("pg_config")
    if _is_map(cfg):
        out["pg_config"] = {
            new(k): ({**c, "name": new(c["name"])} if _is_map(c) and "name" in c
                     else c) for k, c in cfg.items()}
    status = dump.get("pg_status")
    if _is_map(status):
        out["pg_status"] = {new(k): v for k, v in status.items()}
    entries = dump.get("entries")
    if isinstance(entries, list):
        out["entries"] = [_renamed_entry(e, new) for e in entries]
    window = dump.get(_WINDOW_KEY)
    if _is_map(window) and _is_map(window.get("since")):
        out[_WINDOW_KEY] = {**window, "since": {new(k): v for k, v in window["since"].items()}}
    return out


def cpu_since(since: Mapping[str, int], names: Iterable[str]) -> dict[str, int]:
    """A window's cut (``since``, under the merged dump's names) as it applies to the CPU
    recorder's own dump, where the groups of ``names`` are still called ``<name>``: their cut
    is that of ``<name>:gloo``, never the NCCL group's of the same name."""
    names = frozenset(names)
    out = {g: s for g, s in since.items() if g not in names}
    for g in names:
        if g + GLOO_SUFFIX in since:
            out[g] = since[g + GLOO_SUFFIX]
    return out


def _renamed_entry(e: Any, new: Any) -> Any:
    pg = e.get("process_group") if _is_map(e) else None
    if not isinstance(pg, (list, tuple)) or not pg or new(pg[0]) == pg[0]:
        return e
    return {**e, "process_group": [new(pg[0]), *pg[1:]]}


def merge(cpu: Mapping[str, Any], nccl: Mapping[str, Any]) -> tuple[dict[str, Any],
                                                                    frozenset[str]]:
    """One rank's dump from its CPU and NCCL recorders' (each whole or cut to a window), and the
    CPU group names renamed (:func:`collisions`).

    The NCCL dump's head (``version``, ``comm_lib_version``, ``nccl_comm_state``) is kept; the
    groups are the union; the entries are one timeline by creation time, with record ids
    renumbered along it where both recorders have entries (each counts its own from 0).
    """
    if is_empty(cpu):
        return dict(nccl), frozenset()
    clash = collisions(cpu, nccl)
    gloo = rename(cpu, clash)
    out = dict(nccl)
    for key in ("pg_config", "pg_status"):
        a, b = gloo.get(key), nccl.get(key)
        out[key] = {**(a if _is_map(a) else {}), **(b if _is_map(b) else {})}
    ce, ne = gloo.get("entries"), nccl.get("entries")
    ce = ce if isinstance(ce, list) else []
    ne = ne if isinstance(ne, list) else []
    if ce and ne:
        both = sorted(ce + ne, key=_created)
        out["entries"] = [{**e, "record_id": i} if _is_map(e) else e
                          for i, e in enumerate(both)]
    elif ce or ne:
        out["entries"] = ce or ne
    window = _merged_facts(gloo, nccl)
    if window is not None:
        out[_WINDOW_KEY] = window
    return out, clash


def _created(e: Any) -> int:
    t = e.get("time_created_ns") if _is_map(e) else None
    return t if type(t) is int else 0


def _facts(dump: Mapping[str, Any]) -> dict[str, Any] | None:
    window = dump.get(_WINDOW_KEY)
    if _is_map(window):
        return dict(window)
    return None


def _whole_facts(dump: Mapping[str, Any]) -> dict[str, Any]:
    entries = dump.get("entries")
    entries = entries if isinstance(entries, list) else []
    times = [t for t in map(_created, entries) if t]
    return {"since": {}, "ring_entries": len(entries), "ring_oldest_ns": min(times, default=0)}


def _merged_facts(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any] | None:
    """The window facts of the merged dump: None where neither was cut (whole rings); else the
    union of the cuts, both rings' entry counts and the older of their oldest ops. Where one
    side is an ``onlyactive`` reply (``analysis.activecover``: its ring's length and oldest op
    unknown), so are the merged ring's, and its active groups stay listed."""
    fa, fb = _facts(a), _facts(b)
    if fa is None and fb is None:
        return None
    fa, fb = fa or _whole_facts(a), fb or _whole_facts(b)
    active = sorted({str(g) for f in (fa, fb) if isinstance(f.get(_ACTIVE_KEY), list)
                     for g in f[_ACTIVE_KEY]})
    oldest = [t for t in (fa.get("ring_oldest_ns"), fb.get("ring_oldest_ns"))
              if type(t) is int and t]
    counts = (fa.get("ring_entries"), fb.get("ring_entries"))
    out = {"since": {**(fa.get("since") or {}), **(fb.get("since") or {})},
           "ring_entries": None if None in counts else sum(int(n or 0) for n in counts),
           "ring_oldest_ns": 0 if active else min(oldest, default=0)}
    if active:
        out[_ACTIVE_KEY] = active
    return out
