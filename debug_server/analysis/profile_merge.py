"""Per-rank ``torch.profiler`` traces merged into one timeline, and each rank's GPU time split.

Pure functions over the Chrome traces the ranks send (``/handler/torch_profile``); no HTTP.

**Merge.** One Chrome/Perfetto trace where every rank is one process: ``pid`` = the rank, named
``rank N`` and sorted by rank; the rank's CPU threads and GPU streams are its threads, named as
the profiler named them. torch.profiler writes ``ts`` in microseconds after
``baseTimeNanoseconds`` (wall-clock time), so each rank is shifted onto the earliest rank's base
and all ranks share one clock: exact on one host, as good as the hosts' clock sync across hosts.
Flow and async ids are renumbered so that one rank's arrows never join another rank's events.

**GPU time.** Over the capture window of each rank (the profiler's own ``PyTorch Profiler``
span), from the intervals of its GPU kernels (``cat`` ``kernel``):

* *communication*: the union of the intervals of communication kernels, told by name
  (:data:`COMM_KERNEL`: ``nccl``/``rccl`` kernels, custom all-reduce/all-gather/reduce-scatter/
  all-to-all kernels);
* *compute*: the union of every other kernel;
* *overlap*: communication and compute at the same time (communication hidden by compute);
* *exposed communication*: communication while no compute kernel runs (= communication -
  overlap), the time a collective holds the GPU up.

All are fractions of the window. Memory copies and sets are neither. A rank without kernel
events says "no GPU activity"; nothing is made up for it. Ranks whose share stands out from the
median are flagged with :func:`debug_server.analysis.outliers.outliers` (the preflight's rule).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from debug_server.analysis.outliers import outliers
from debug_server.errors import first_line

COMM_KERNEL = re.compile(
    r"nccl|rccl|msccl|nvshmem|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all"
    r"|cross_device_reduce|multimem", re.IGNORECASE)
"""Kernel names counted as communication."""

FLAG_FLOOR = 0.05
"""A share must differ from the median by at least 5 points of the window to be flagged."""
FLAG_METRICS = {
    "comm_frac": "communication",
    "compute_frac": "compute",
    "exposed_frac": "exposed communication",
}
NO_GPU = "no GPU activity"
_ID_PHASES = frozenset("sftbenSTpFO")  # flow and async phases: their "id" pairs events
_Interval = tuple[float, float]
_INF = float("inf")
_PLAIN = (str, int)


class TraceError(ValueError):
    """A rank's reply is not a usable Chrome trace; the message is one line."""


# ---------------------------------------------------------------------------------------------
# Intervals


def union(intervals: Iterable[_Interval]) -> list[_Interval]:
    """Sorted, disjoint intervals covering exactly the same time as ``intervals``."""
    out: list[list[float]] = []
    for lo, hi in sorted(intervals):
        if hi <= lo:
            continue
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def length(u: Sequence[_Interval]) -> float:
    return sum(hi - lo for lo, hi in u)


def overlap_length(a: Sequence[_Interval], b: Sequence[_Interval]) -> float:
    """Time covered by both of two :func:`union` results (a two-pointer sweep)."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def clip(u: Sequence[_Interval], lo: float, hi: float) -> list[_Interval]:
    return [(max(a, lo), min(b, hi)) for a, b in u if b > lo and a < hi]


# ---------------------------------------------------------------------------------------------
# One rank


def events_of(trace: Any) -> list[Any]:
    """The ``traceEvents`` list of a parsed trace; :class:`TraceError` when there is none."""
    if isinstance(trace, list):  # the bare-array form of the Chrome format
        return trace
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise TraceError("not a Chrome trace (no traceEvents list)")
    return trace["traceEvents"]


def parse_trace(body: str | bytes) -> dict[str, Any]:
    """A rank's reply as a trace dict; :class:`TraceError` (one line) when it is not one."""
    try:
        trace = json.loads(body, parse_constant=_no_constant)
    except ValueError as e:
        raise TraceError(f"reply is not JSON ({first_line(e, 120)})") from None
    except RecursionError:
        raise TraceError("reply is nested too deeply to be a trace") from None
    if isinstance(trace, list):
        trace = {"traceEvents": trace}
    events_of(trace)
    return trace


def _no_constant(name: str) -> Any:
    # NaN/Infinity are not JSON; kept, they would make the merged download unreadable.
    raise ValueError(f"{name} is not a JSON number")


def _num(v: Any) -> float | None:
    t = type(v)
    if t is not float and (t is not int):  # bool is not int here: type(True) is bool
        return None
    return float(v) if v == v and abs(v) != _INF else None


@dataclass(slots=True)
class GpuSummary:
    """How one rank's GPU spent the capture window (microseconds; fractions of the window)."""

    rank: int
    window_us: float
    kernels: int
    comm_kernels: int
    comm_us: float
    compute_us: float
    overlap_us: float
    busy_us: float

    @property
    def gpu(self) -> bool:
        return self.kernels > 0

    @property
    def exposed_us(self) -> float:
        return self.comm_us - self.overlap_us

    def frac(self, us: float) -> float:
        return us / self.window_us if self.window_us > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        """The row of the page and the JSON (fractions rounded to 0.1 %)."""
        row: dict[str, Any] = {"rank": self.rank, "gpu": self.gpu,
                               "window_ms": round(self.window_us / 1e3, 3),
                               "kernels": self.kernels, "comm_kernels": self.comm_kernels}
        if not self.gpu:
            return row | {"note": NO_GPU}
        return row | {
            "comm_frac": round(self.frac(self.comm_us), 4),
            "compute_frac": round(self.frac(self.compute_us), 4),
            "overlap_frac": round(self.frac(self.overlap_us), 4),
            "exposed_frac": round(self.frac(self.exposed_us), 4),
            "idle_frac": round(max(0.0, 1.0 - self.frac(self.busy_us)), 4),
            "hidden_share": round(self.overlap_us / self.comm_us, 4) if self.comm_us else None,
            "comm_ms": round(self.comm_us / 1e3, 3),
            "compute_ms": round(self.compute_us / 1e3, 3),
            "exposed_ms": round(self.exposed_us / 1e3, 3),
        }


def summarize(rank: int, trace: Mapping[str, Any]) -> GpuSummary:
    """Rank ``rank``'s GPU time over its capture window, from its kernel events.

    The window is the profiler's own ``PyTorch Profiler`` span, else the span of every timed
    event. One pass over the events; each kernel name is classified once.
    """
    comm: list[_Interval] = []
    compute: list[_Interval] = []
    is_comm: dict[str, bool] = {}
    span: tuple[float, float] | None = None
    lo, hi = float("inf"), float("-inf")
    for e in events_of(trace):
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        ts, dur = _num(e.get("ts")), _num(e.get("dur"))
        if ts is None:
            continue
        end = ts + (dur or 0.0)
        lo, hi = min(lo, ts), max(hi, end)
        cat = e.get("cat")
        if cat == "Trace" and span is None and str(e.get("name", "")).startswith("PyTorch Profiler"):
            span = (ts, end)
        if cat != "kernel" and not (isinstance(cat, str) and cat.lower() == "kernel"):
            continue
        if dur is None or dur <= 0:
            continue
        name = str(e.get("name", ""))
        c = is_comm.get(name)
        if c is None:
            c = is_comm[name] = COMM_KERNEL.search(name) is not None
        (comm if c else compute).append((ts, end))
    win = span or ((lo, hi) if lo <= hi else (0.0, 0.0))
    cu, pu = clip(union(comm), *win), clip(union(compute), *win)
    return GpuSummary(rank=rank, window_us=win[1] - win[0], kernels=len(comm) + len(compute),
                      comm_kernels=len(comm), comm_us=length(cu), compute_us=length(pu),
                      overlap_us=overlap_length(cu, pu), busy_us=length(union([*cu, *pu])))


def flag(summaries: Iterable[GpuSummary], floor: float = FLAG_FLOOR) -> list[dict[str, Any]]:
    """Ranks whose communication, compute or exposed share stands out from the median of the
    ranks with GPU activity (``outliers``: 1.5 x and ``floor`` away, both directions)."""
    gpu = [s for s in summaries if s.gpu]
    found = []
    for key, label in FLAG_METRICS.items():
        values = {s.rank: s.frac(_metric_us(s, key)) for s in gpu}
        for o in outliers(values, floor=floor):
            found.append({
                "rank": o.rank, "metric": key, "value": round(o.value, 4),
                "median": round(o.median, 4), "direction": o.direction,
                "reason": f"{label} {o.value:.1%} of the window vs median {o.median:.1%} "
                          f"({'higher' if o.direction == 'high' else 'lower'} than the others)",
            })
    return sorted(found, key=lambda f: (f["rank"], f["metric"]))


def _metric_us(s: GpuSummary, key: str) -> float:
    return {"comm_frac": s.comm_us, "compute_frac": s.compute_us,
            "exposed_frac": s.exposed_us}[key]


# ---------------------------------------------------------------------------------------------
# Merge


def _key(v: Any) -> str | int | float:
    return v if isinstance(v, str | int | float) else json.dumps(v, default=str)


def _base_ns(trace: Mapping[str, Any]) -> int:
    v = trace.get("baseTimeNanoseconds")
    return int(v) if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0


def merge(traces: Mapping[int, Mapping[str, Any]],
          other: Mapping[str, Any] | None = None, *, in_place: bool = False) -> dict[str, Any]:
    """One Chrome/Perfetto trace of every rank in ``traces`` (rank -> parsed trace).

    Events are copied unless ``in_place`` (a caller that drops ``traces`` afterwards saves a
    dict per event); an event without a numeric ``ts`` is dropped (and counted in
    ``otherData.dropped_events``).
    """
    bases = {r: _base_ns(t) for r, t in traces.items()}
    base0 = min(bases.values(), default=0)
    out: list[dict[str, Any]] = []
    next_id = 0
    dropped = 0
    info: dict[str, Any] = {}
    for rank in sorted(traces):
        trace = traces[rank]
        shift = (bases[rank] - base0) / 1e3
        pnames: dict[Any, str] = {}
        tnames: dict[tuple[Any, Any], str] = {}
        threads: dict[tuple[Any, Any], int] = {}
        ids: dict[Any, int] = {}
        body: list[dict[str, Any]] = []
        for e in events_of(trace):
            if not isinstance(e, dict):
                dropped += 1
                continue
            ph = e.get("ph")
            pid, tid = e.get("pid"), e.get("tid")
            if type(pid) not in _PLAIN or type(tid) not in _PLAIN:  # dicts, lists: hashable keys
                pid, tid = _key(pid), _key(tid)
            if ph == "M":
                args = e.get("args") if isinstance(e.get("args"), dict) else {}
                name = e.get("name")
                if name == "process_labels" or (name == "process_name" and pid not in pnames):
                    pnames[pid] = str(args.get("labels" if name == "process_labels" else "name", ""))
                elif name == "thread_name":
                    tnames[(pid, tid)] = str(args.get("name", ""))
                continue  # re-emitted for the rank below
            ts = _num(e.get("ts"))
            if ts is None:
                dropped += 1
                continue
            key = (pid, tid)
            new_tid = threads.get(key)
            if new_tid is None:
                new_tid = threads[key] = len(threads) + 1
            ev = e if in_place else dict(e)
            ev["pid"], ev["tid"], ev["ts"] = rank, new_tid, ts + shift
            if "id" in ev and ph in _ID_PHASES:
                ident = _key(ev["id"])
                if ident not in ids:
                    ids[ident] = next_id
                    next_id += 1
                ev["id"] = ids[ident]
            body.append(ev)
        out += _rank_metadata(rank, trace, threads, pnames, tnames)
        out += body
        info[str(rank)] = {k: trace[k] for k in ("host_name", "distributedInfo", "deviceProperties")
                           if k in trace}
    return {
        "traceEvents": out,
        "displayTimeUnit": "ms",
        "baseTimeNanoseconds": base0,
        "otherData": {"source": "debug_server /profile", "ranks": sorted(traces),
                      "dropped_events": dropped, "rank_info": info, **(other or {})},
    }


def _rank_metadata(rank: int, trace: Mapping[str, Any], threads: Mapping[tuple[Any, Any], int],
                   pnames: Mapping[Any, str], tnames: Mapping[tuple[Any, Any], str]
                   ) -> list[dict[str, Any]]:
    def meta(name: str, args: dict[str, Any], tid: int = 0) -> dict[str, Any]:
        return {"ph": "M", "name": name, "pid": rank, "tid": tid, "ts": 0, "args": args}

    out = [meta("process_name", {"name": f"rank {rank}"}),
           meta("process_sort_index", {"sort_index": rank})]
    host = trace.get("host_name")
    if isinstance(host, str) and host:
        out.append(meta("process_labels", {"labels": f"host {host}"}))
    several = len({pid for pid, _ in threads}) > 1
    for (pid, tid), new_tid in threads.items():
        # Kineto's own tracks have string ids ("Spans"/"PyTorch Profiler") and no names.
        name = (tnames.get((pid, tid)) or (f"thread {tid}" if isinstance(tid, int) else str(tid))
                or "global")
        prefix = pnames.get(pid) or str(pid)
        if several and prefix:
            name = f"{prefix}: {name}"
        out.append(meta("thread_name", {"name": name}, new_tid))
        out.append(meta("thread_sort_index", {"sort_index": new_tid}, new_tid))
    return out


def to_json(trace: Mapping[str, Any]) -> bytes:
    """The merged trace as compact JSON bytes (the download)."""
    return json.dumps(trace, separators=(",", ":"), default=str).encode()
