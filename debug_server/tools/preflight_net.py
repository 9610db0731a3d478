"""The network measurements of ``python -m debug_server.preflight``: stragglers and bandwidth.

Collective functions (every rank calls them, in the same order) that time barriers and an
``all_reduce`` sweep, and the pure evaluation of the barrier times; the methods are in
``tools/preflight.py``'s docstring. Setup, the report and the CLI are ``preflight``'s.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

MIN_SIZE = 1024
# The staggered rank sleeps this long so that the others are already waiting in the barrier.
_STAGGER_S = 0.002
# Bound on round-trip barriers overall, so a 1000-rank job's preflight stays in seconds.
_MAX_TURN_BARRIERS = 2000


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier(device: torch.device) -> None:
    dist.barrier()
    # NCCL's barrier is an all_reduce on the GPU; wait for it on the host so that the time of a
    # barrier is the time until every rank has arrived.
    _sync(device)


# --------------------------------------------------------------------------------------------
# Stragglers
# --------------------------------------------------------------------------------------------


def _timed_barrier(device: torch.device, delay_s: float) -> float:
    if delay_s > 0:
        time.sleep(delay_s)
    t0 = time.perf_counter()
    _barrier(device)
    return time.perf_counter() - t0


def straggler_check(
    device: torch.device,
    iters: int,
    *,
    delay_s: float = 0.0,
) -> dict[str, Any]:
    """Time barriers on every rank (collective); returns every rank's raw waits, in seconds.

    ``{"arrival": {rank: [wait per iteration]}, "turns": {rank: {"rank": r, "waits": {rank:
    [wait per iteration]}}}}``: ``arrival`` are plain back-to-back barriers; in turn ``r`` rank
    ``r`` arrives ``_STAGGER_S`` after the others. ``delay_s`` makes this rank sleep before each
    timed barrier (a simulated straggler). Evaluate with ``flag_stragglers``.
    """
    world = dist.get_world_size()
    _barrier(device)
    arrival = [_timed_barrier(device, delay_s) for _ in range(iters)]
    turn_iters = max(1, min(iters, _MAX_TURN_BARRIERS // max(world, 1)))
    turns: dict[int, list[float]] = {}
    me = dist.get_rank()
    for r in range(world):
        waits = []
        for _ in range(turn_iters):
            _barrier(device)
            waits.append(_timed_barrier(device, delay_s + (_STAGGER_S if r == me else 0.0)))
        turns[r] = waits
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"arrival": arrival, "turns": turns})
    return {
        "arrival": {rank: g["arrival"] for rank, g in enumerate(gathered)},
        "turns": {
            r: {rank: g["turns"][r] for rank, g in enumerate(gathered)} for r in range(world)
        },
    }


def flag_stragglers(
    raw: Mapping[str, Any],
    *,
    factor: float = 1.5,
    late_s: float = 0.010,
    rtt_floor_s: float = 0.001,
) -> dict[str, Any]:
    """Turn ``straggler_check``'s waits into per-rank medians and flags (pure).

    * ``arrival_lateness_s``: median over iterations of ``max(wait) - wait[rank]``; flagged
      ``late`` when above ``late_s``.
    * ``barrier_median_s``: median of the rank's own round trip, from the iterations of its turn
      where it really arrived last (its wait is the smallest); ``None`` when a late rank spoiled
      every one of them. Flagged ``slow_barrier`` when above ``factor`` x the median of medians
      and at least ``rtt_floor_s`` above it (microsecond noise is not a straggler).
    """
    arrival: Mapping[int, Sequence[float]] = raw["arrival"]
    turns: Mapping[int, Mapping[int, Sequence[float]]] = raw["turns"]
    ranks = sorted(arrival)
    lateness: dict[int, float] = {}
    n_iter = min((len(v) for v in arrival.values()), default=0)
    for r in ranks:
        per_iter = [max(arrival[q][i] for q in ranks) - arrival[r][i] for i in range(n_iter)]
        lateness[r] = statistics.median(per_iter) if per_iter else 0.0
    rtt: dict[int, float | None] = {}
    for r in ranks:
        waits = turns.get(r, {})
        own = waits.get(r, [])
        valid = [
            w for i, w in enumerate(own)
            if all(w <= waits[q][i] for q in waits if q != r and i < len(waits[q]))
        ]
        rtt[r] = statistics.median(valid) if valid else None
    medians = [v for v in rtt.values() if v is not None]
    mom = statistics.median(medians) if medians else None
    rows = []
    flagged = []
    for r in ranks:
        flags = []
        reasons = []
        if lateness[r] > late_s:
            flags.append("late")
            reasons.append(
                f"arrives {lateness[r] * 1e3:.1f} ms late at barriers (median of {n_iter})"
            )
        b = rtt[r]
        if b is not None and mom is not None and b > factor * mom and b - mom >= rtt_floor_s:
            flags.append("slow_barrier")
            reasons.append(
                f"barrier round trip {b * 1e6:.0f} us vs median of medians {mom * 1e6:.0f} us"
            )
        rows.append(
            {"rank": r, "barrier_median_s": b, "arrival_lateness_s": lateness[r], "flags": flags}
        )
        if flags:
            flagged.append({"rank": r, "flags": flags, "reason": "; ".join(reasons)})
    return {
        "iters": n_iter,
        "factor": factor,
        "late_threshold_s": late_s,
        "rtt_floor_s": rtt_floor_s,
        "median_of_medians_s": mom,
        "ranks": rows,
        "flagged": flagged,
    }


# --------------------------------------------------------------------------------------------
# Bandwidth
# --------------------------------------------------------------------------------------------


def sweep_sizes(max_size: int, step: int = 2, min_size: int = MIN_SIZE) -> list[int]:
    """Message sizes in bytes: ``min_size``, x``step``, ... up to ``max_size`` inclusive."""
    sizes = []
    s = min_size
    while s <= max_size:
        sizes.append(s)
        s *= step
    return sizes


def busbw_factor(world_size: int) -> float:
    """all_reduce's bus-bandwidth factor ``2 (n - 1) / n`` (nccl-tests' definition)."""
    return 2.0 * (world_size - 1) / world_size if world_size > 0 else 0.0


def _time_all_reduce(t: torch.Tensor, device: torch.device) -> float:
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        dist.all_reduce(t)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    dist.all_reduce(t)
    return time.perf_counter() - t0


def bandwidth_sweep(
    device: torch.device,
    sizes: Sequence[int],
    iters: int,
    warmup: int,
    progress: Callable[[int], None] | None = None,
) -> list[dict[str, Any]]:
    """``all_reduce`` (float32, sum) bandwidth per size (collective; every rank gets the rows).

    Each rank takes the median of ``iters`` timed iterations after ``warmup`` untimed ones; a
    size's ``time_s`` is the slowest rank's median (the time the job would wait),
    ``algbw_gbps = bytes / time_s / 1e9`` and ``busbw_gbps = algbw_gbps * 2 (n - 1) / n``.
    """
    world = dist.get_world_size()
    # Zeros: sums stay finite however many iterations run.
    buf = torch.zeros(max(sizes) // 4, dtype=torch.float32, device=device)
    medians: list[float] = []
    for size in sizes:
        t = buf[: size // 4]
        _barrier(device)
        for _ in range(warmup):
            dist.all_reduce(t)
        _sync(device)
        times = [_time_all_reduce(t, device) for _ in range(iters)]
        medians.append(statistics.median(times))
        if progress is not None:
            progress(size)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, medians)
    rows = []
    for i, size in enumerate(sizes):
        per_rank = [g[i] for g in gathered]
        slowest = max(range(world), key=lambda r: per_rank[r])
        t_s = per_rank[slowest]
        algbw = size / t_s / 1e9 if t_s > 0 else 0.0
        rows.append(
            {
                "size_bytes": size,
                "count": size // 4,
                "dtype": "float32",
                "time_s": t_s,
                "slowest_rank": slowest,
                "algbw_gbps": algbw,
                "busbw_gbps": algbw * busbw_factor(world),
                "time_s_per_rank": per_rank,
            }
        )
    return rows
