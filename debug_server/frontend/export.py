"""Flight Recorder entries as a Chrome trace-event timeline (open it in https://ui.perfetto.dev).

:func:`chrome_trace` turns per-rank FR dumps (the torch FR schema the recorder writes) into the
JSON trace-event format: one process per rank (``pid`` = global rank), one thread per
communicator (``tid`` = a stable index of the communicator name, the same on every rank), a
complete event (``"ph": "X"``) per op from when it started (or was issued) to when it completed.
An op that has not completed is drawn up to the dump time, named ``... (in flight)``, with
``args.in_flight = true`` and an instant marker at its start, so the stuck collective is the
long bar at the right end of each waiting rank's track. Pure: no HTTP, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

IN_FLIGHT_SUFFIX = " (in flight)"
_OVERLAP_TID_STRIDE = 1000
"""Ops on one communicator that overlap without nesting (async ops) go to extra tracks:
``tid = lane * 1000 + communicator index``; Perfetto requires proper nesting per track."""
_Events = list[dict[str, Any]]


def _int(v: Any) -> int | None:
    if isinstance(v, bool) or v is None:
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def _comm(entry: Mapping[str, Any]) -> tuple[str, str]:
    pg = entry.get("process_group") or ("?", "")
    name = str(pg[0]) if len(pg) > 0 else "?"
    desc = str(pg[1]) if len(pg) > 1 else ""
    return name, desc


def _op_name(entry: Mapping[str, Any]) -> str:
    pname = str(entry.get("profiling_name") or "?")
    op = pname.split(":", 1)[1] if ":" in pname else pname
    if entry.get("is_p2p"):
        seq = _int(entry.get("p2p_seq_id"))
        return f"{op} p2p#{seq}" if seq is not None else op
    seq = _int(entry.get("collective_seq_id"))
    return f"{op} #{seq}" if seq is not None else op


def _latest_ns(dumps: Iterable[Mapping[str, Any]]) -> int | None:
    latest = None
    for dump in dumps:
        for e in dump.get("entries") or ():
            for key in ("time_created_ns", "time_discovered_started_ns",
                        "time_discovered_completed_ns"):
                t = _int(e.get(key))
                if t is not None and (latest is None or t > latest):
                    latest = t
    return latest


def _span(e: Mapping[str, Any], end_ns: int) -> tuple[int, int, bool] | None:
    """(start ns, end ns, in flight) of one entry; None when it has no time at all."""
    created = _int(e.get("time_created_ns"))
    started = _int(e.get("time_discovered_started_ns"))
    completed = _int(e.get("time_discovered_completed_ns"))
    start = started if started is not None else created
    if start is None:
        return None
    if e.get("state") == "completed":
        if completed is None:
            dur_ms = e.get("duration_ms")
            completed = start + int(float(dur_ms) * 1e6) if isinstance(dur_ms, int | float) else start
        return start, max(completed, start), False
    return start, max(end_ns, start), True


def _comm_names(by_rank: Mapping[int, Mapping[str, Any]]) -> tuple[set[str], dict[str, str]]:
    """Every communicator named in any dump, and its backend ("desc") where one is given."""
    names: set[str] = set()
    descs: dict[str, str] = {}
    for d in by_rank.values():
        for name, cfg in (d.get("pg_config") or {}).items():
            names.add(str(name))
            if isinstance(cfg, Mapping) and cfg.get("desc"):
                descs.setdefault(str(name), str(cfg["desc"]))
        for e in d.get("entries") or ():
            name, desc = _comm(e)
            names.add(name)
            if desc:
                descs.setdefault(name, desc)
    return names, descs


def _origin_ns(by_rank: Mapping[int, Mapping[str, Any]], end_ns: int) -> int:
    """The earliest creation time of any op (``ts`` 0); ``end_ns`` when no op has one."""
    origin = None
    for d in by_rank.values():
        for e in d.get("entries") or ():
            t = _int(e.get("time_created_ns"))
            if t is not None and (origin is None or t < origin):
                origin = t
    return origin if origin is not None else end_ns


class _Tracks:
    """One rank's tracks: a communicator's ops go to the first lane whose last op has ended."""

    def __init__(self) -> None:
        self.used: set[int] = set()
        self.lanes: dict[str, list[int]] = {}  # communicator -> end ns of the last op in each lane

    def place(self, name: str, start: int, stop: int, idx: int) -> int:
        lane_ends = self.lanes.setdefault(name, [])
        lane = next((i for i, t in enumerate(lane_ends) if t <= start), len(lane_ends))
        if lane == len(lane_ends):
            lane_ends.append(stop)
        else:
            lane_ends[lane] = stop
        tid = lane * _OVERLAP_TID_STRIDE + idx
        self.used.add(tid)
        return tid


def _op_args(e: Mapping[str, Any], name: str, backend: str, in_flight: bool) -> dict[str, Any]:
    frames = e.get("frames") or []
    top = frames[0] if frames and isinstance(frames[0], Mapping) else {}
    return {
        "state": e.get("state"), "in_flight": in_flight,
        "communicator": name, "backend": backend,
        "profiling_name": e.get("profiling_name"),
        "collective_seq_id": e.get("collective_seq_id"), "p2p_seq_id": e.get("p2p_seq_id"),
        "record_id": e.get("record_id"),
        "input_sizes": e.get("input_sizes"), "input_dtypes": e.get("input_dtypes"),
        "output_sizes": e.get("output_sizes"), "output_dtypes": e.get("output_dtypes"),
        "duration_ms": e.get("duration_ms"), "timeout_ms": e.get("timeout_ms"),
        "call_site": f"{top.get('filename')}:{top.get('line')} in {top.get('name')}"
                     if top else None,
    }


def _rank_meta(rank: int) -> _Events:
    return [{"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "ts": 0,
             "args": {"name": f"rank {rank}"}},
            {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "ts": 0,
             "args": {"sort_index": rank}}]


def _track_meta(rank: int, tid_of: Mapping[str, int], descs: Mapping[str, str],
                tracks: _Tracks) -> _Events:
    """Names and order of a rank's tracks: every communicator's first lane, and used extras."""
    meta: _Events = []
    for name, idx in tid_of.items():
        backend = descs.get(name, "")
        for lane in range(max(1, len(tracks.lanes.get(name, ())))):
            tid = lane * _OVERLAP_TID_STRIDE + idx
            if lane and tid not in tracks.used:
                continue
            label = f"{name} ({backend})" if backend else name
            meta.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "ts": 0,
                         "args": {"name": label + (f" overlap {lane}" if lane else "")}})
            meta.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid,
                         "ts": 0, "args": {"sort_index": tid}})
    return meta


def _rank_events(rank: int, dump: Mapping[str, Any], end_ns: int, origin: int,
                 tid_of: Mapping[str, int], descs: Mapping[str, str]) -> tuple[_Events, _Events]:
    """(metadata, events) of one rank: a complete event per op, an instant at in-flight starts."""

    def us(ns: int) -> float:
        return round((ns - origin) / 1000.0, 3)

    tracks = _Tracks()
    events: _Events = []
    entries = sorted(
        (e for e in dump.get("entries") or () if isinstance(e, Mapping)),
        key=lambda e: (_span(e, end_ns) or (0, 0, False))[0])
    for e in entries:
        span = _span(e, end_ns)
        if span is None:
            continue
        start, stop, in_flight = span
        name, desc = _comm(e)
        tid = tracks.place(name, start, stop, tid_of[name])
        label = _op_name(e)
        events.append({
            "name": label + (IN_FLIGHT_SUFFIX if in_flight else ""),
            "cat": "in_flight" if in_flight else "collective", "ph": "X",
            "pid": rank, "tid": tid, "ts": us(start),
            # Perfetto hides zero-length slices at most zoom levels; 1 µs keeps them visible.
            "dur": max(round((stop - start) / 1000.0, 3), 0.001 if in_flight else 0.0),
            "args": _op_args(e, name, desc or descs.get(name, ""), in_flight),
        })
        if in_flight:
            events.append({"name": f"in flight: {label}", "cat": "in_flight", "ph": "i",
                           "s": "t", "pid": rank, "tid": tid, "ts": us(start),
                           "args": {"state": e.get("state"), "communicator": name}})
    return _rank_meta(rank) + _track_meta(rank, tid_of, descs, tracks), events


def chrome_trace(dumps: Mapping[int, Mapping[str, Any]], *, end_ns: int | None = None) -> dict[str, Any]:
    """Per-rank FR dumps -> ``{"traceEvents": [...], "displayTimeUnit": "ms"}``.

    Args:
        dumps: global rank -> that rank's FR dump dict (``pg_config``, ``entries``...).
        end_ns: when the dumps were taken (epoch ns); ops not completed are drawn up to it.
            Defaults to the latest timestamp found in any dump.

    Timestamps (``ts``, µs) are relative to the earliest op of all ranks; ``otherData``
    records that origin (``time_origin_ns``) so absolute times can be recovered.
    """
    ranks = sorted(int(r) for r in dumps)
    by_rank = {int(r): d for r, d in dumps.items()}
    names, descs = _comm_names(by_rank)
    tid_of = {name: i + 1 for i, name in enumerate(sorted(names))}
    if end_ns is None:
        end_ns = _latest_ns(by_rank.values()) or 0
    origin = _origin_ns(by_rank, end_ns)
    meta: _Events = []
    events: _Events = []
    for rank in ranks:
        rank_meta, rank_events = _rank_events(rank, by_rank[rank], end_ns, origin, tid_of, descs)
        meta += rank_meta
        events += rank_events
    return {
        "traceEvents": meta + events,
        "displayTimeUnit": "ms",
        "otherData": {"source": "debug_server Flight Recorder", "time_origin_ns": origin,
                      "dump_time_ns": end_ns, "ranks": len(ranks)},
    }


__all__ = ["IN_FLIGHT_SUFFIX", "chrome_trace"]
