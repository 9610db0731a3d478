"""Preflight checks for the network side of a hang: ``python -m debug_server.preflight``.

Run it under torchrun with the same launch (hosts, GPUs, environment) as the job that hangs::

    torchrun --nnodes=2 --nproc_per_node=8 ... -m debug_server.preflight --max-size 1073741824

Every rank takes part; rank 0 prints the tables and, with ``--json OUT``, writes everything as one
JSON object. Four checks:

1. **Identity**: rank, local rank, host, pid, device, device and host memory, torch version.
2. **Stragglers**: (a) *arrival lateness*: every rank times ``--iters`` barriers; a rank that
   arrives late waits least, so ``max(wait) - wait[rank]`` is how late it arrived, measured from
   durations only (no clock sync between hosts). A median above ``--late-ms`` flags the rank.
   (b) *barrier round trip*: each rank in turn arrives a little after the others (a staggered
   start) and times its barrier, which is then its own round trip; a median above
   ``--factor`` x the median of medians (and ``--rtt-floor-ms`` above it) flags the rank.
3. **Bandwidth**: an ``all_reduce`` sweep from 1 KiB to ``--max-size`` bytes (float32, x2 or
   ``--step 4`` steps), the median of ``--iters`` timed iterations after ``--warmup``; the time of
   a size is the slowest rank's median. ``algbw = bytes / time`` and
   ``busbw = algbw * 2 (n - 1) / n`` (GB/s, 1e9), as in nccl-tests.
4. **Environment**: the debug-relevant variables of every rank (``debug_server.tools.envinfo``) with
   warnings for known traps.

Backend: ``--backend auto`` (default) picks nccl on ``cuda:LOCAL_RANK`` when CUDA is available,
else gloo on CPU. Exit status: 0 (also when something was flagged, unless ``--strict``: then 2),
1 when the job cannot be set up (a one-line reason).
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import logging
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tabulate import tabulate

from debug_server.analysis.core import format_ranks
from debug_server.tools.envinfo import collect_env, env_warnings

__all__ = [
    "bandwidth_sweep",
    "busbw_factor",
    "flag_stragglers",
    "main",
    "sweep_sizes",
    "straggler_check",
]

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_UNUSABLE = 1
EXIT_FLAGGED = 2

MIN_SIZE = 1024
# The staggered rank sleeps this long so that the others are already waiting in the barrier.
_STAGGER_S = 0.002
# Bound on round-trip barriers overall, so a 1000-rank job's preflight stays in seconds.
_MAX_TURN_BARRIERS = 2000


class PreflightError(Exception):
    """The job cannot be checked; the message says why and what to do."""


# --------------------------------------------------------------------------------------------
# Setup
# --------------------------------------------------------------------------------------------


def _choose_backend(requested: str) -> str:
    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


def _init(backend: str, timeout_s: float) -> tuple[torch.device, bool]:
    """Initialise the default group from torchrun's env; returns (device, whether we created it)."""
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise PreflightError("--backend nccl needs CUDA, and torch sees no GPU; use --backend gloo")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if dist.is_initialized():
        return device, False
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise PreflightError(
            f"{', '.join(missing)} not set: run under torchrun, e.g. "
            f"torchrun --nproc_per_node=2 -m debug_server.preflight"
        )
    kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout_s)}
    # device_id binds the group to this rank's GPU and initialises NCCL eagerly, so a broken
    # fabric fails here rather than in the first timed op (torch >= 2.3).
    if backend == "nccl" and "device_id" in inspect.signature(dist.init_process_group).parameters:
        kwargs["device_id"] = device
    dist.init_process_group(backend, **kwargs)
    return device, True


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier(device: torch.device) -> None:
    dist.barrier()
    # NCCL's barrier is an all_reduce on the GPU; wait for it on the host so that the time of a
    # barrier is the time until every rank has arrived.
    _sync(device)


# --------------------------------------------------------------------------------------------
# Identity
# --------------------------------------------------------------------------------------------


def _host_memory() -> tuple[int | None, int | None]:
    """(available, total) bytes of host memory."""
    try:
        info: dict[str, int] = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    info[key] = int(parts[0]) * 1024
        return info.get("MemAvailable"), info.get("MemTotal")
    except (OSError, ValueError):
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            return None, total
        except (ValueError, OSError, AttributeError):
            return None, None


def _nccl_version() -> str | None:
    try:
        v = torch.cuda.nccl.version()
    except (RuntimeError, AttributeError):
        return None
    # A tuple (2, 21, 5) in current torch, an int (22105) in old releases.
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def identity(device: torch.device) -> dict[str, Any]:
    """This rank's identity: rank, local rank, host, pid, device, memory, versions."""
    avail, total = _host_memory()
    row: dict[str, Any] = {
        "rank": dist.get_rank(),
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "device": str(device),
        "device_name": None,
        "device_mem_free": None,
        "device_mem_total": None,
        "host_mem_available": avail,
        "host_mem_total": total,
        "torch": torch.__version__,
        "backend": dist.get_backend(),
        "nccl": None,
    }
    if device.type == "cuda":
        free, dev_total = torch.cuda.mem_get_info(device)
        row.update(
            device_name=torch.cuda.get_device_name(device),
            device_mem_free=int(free),
            device_mem_total=int(dev_total),
            nccl=_nccl_version(),
        )
    return row


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


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def _bytes(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n} B"


def _mem(free: int | None, total: int | None) -> str:
    if total is None:
        return "-"
    return f"{_bytes(free)} / {_bytes(total)}"


def _version_warnings(idents: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = []
    for key in ("torch", "nccl"):
        by_value: dict[Any, list[int]] = {}
        for row in idents:
            by_value.setdefault(row.get(key), []).append(row["rank"])
        if len(by_value) > 1:
            parts = "; ".join(f"{v} on ranks {format_ranks(rs)}" for v, rs in by_value.items())
            lines.append(f"{key} version differs between ranks ({parts}): install one build everywhere")
    return lines


def render_text(result: Mapping[str, Any]) -> str:
    """The report as plain-text tables (what rank 0 prints)."""
    out: list[str] = []
    out.append(f"== Identity ({result['world_size']} ranks, backend {result['backend']}) ==")
    out.append(
        tabulate(
            [
                [
                    r["rank"],
                    r["local_rank"],
                    r["host"],
                    r["pid"],
                    r["device"] + (f" ({r['device_name']})" if r["device_name"] else ""),
                    _mem(r["device_mem_free"], r["device_mem_total"]),
                    _mem(r["host_mem_available"], r["host_mem_total"]),
                    r["torch"],
                ]
                for r in result["identity"]
            ],
            headers=["rank", "local", "host", "pid", "device", "dev mem free/total",
                     "host mem avail/total", "torch"],
        )
    )
    st = result["stragglers"]
    mom = st["median_of_medians_s"]
    out.append("")
    out.append(
        f"== Stragglers ({st['iters']} barriers; late > {st['late_threshold_s'] * 1e3:.1f} ms, "
        f"slow barrier > {st['factor']}x median of medians"
        + (f" = {mom * 1e6:.0f} us" if mom is not None else "")
        + ") =="
    )
    out.append(
        tabulate(
            [
                [
                    r["rank"],
                    "-" if r["barrier_median_s"] is None else f"{r['barrier_median_s'] * 1e6:.0f}",
                    f"{r['arrival_lateness_s'] * 1e3:.2f}",
                    ", ".join(r["flags"]) or "ok",
                ]
                for r in st["ranks"]
            ],
            headers=["rank", "barrier rtt (us)", "arrival lateness (ms)", "flags"],
        )
    )
    for f in st["flagged"]:
        out.append(f"  STRAGGLER rank {f['rank']}: {f['reason']}")
    out.append("")
    out.append(f"== all_reduce bandwidth (float32 sum, {result['world_size']} ranks) ==")
    out.append(
        tabulate(
            [
                [_bytes(r["size_bytes"]), r["count"], f"{r['time_s'] * 1e6:.1f}",
                 f"{r['algbw_gbps']:.3f}", f"{r['busbw_gbps']:.3f}", r["slowest_rank"]]
                for r in result["bandwidth"]
            ],
            headers=["size", "count", "time (us)", "algbw (GB/s)", "busbw (GB/s)", "slowest rank"],
        )
    )
    out.append("")
    out.append("== Environment ==")
    env: Mapping[int, Mapping[str, str]] = {int(k): v for k, v in result["env"].items()}
    names = sorted({k for e in env.values() for k in e})
    rows = []
    for name in names:
        values = {e.get(name) for e in env.values()}
        have = [r for r, e in env.items() if name in e]
        value = next(iter(values)) if len(values) == 1 else "(differs, see warnings)"
        rows.append([name, value, "all" if len(have) == len(env) else format_ranks(have)])
    out.append(tabulate(rows, headers=["variable", "value", "ranks"]) if rows else "(none set)")
    out.append("")
    out.append(f"== Warnings ({len(result['warnings'])}) ==")
    out.extend(f"  WARNING: {w}" for w in result["warnings"])
    if not result["warnings"]:
        out.append("  none")
    return "\n".join(out)


def _write_json(path: Path, obj: Mapping[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False))
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _delay_spec(text: str) -> tuple[int, float]:
    rank, sep, secs = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(rank), float(secs)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected RANK:SECONDS, got {text!r}") from None


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser."""
    p = argparse.ArgumentParser(
        prog="python -m debug_server.preflight",
        description="Preflight checks under torchrun: identity, stragglers, all_reduce bandwidth, "
        "debug environment and its traps.",
    )
    p.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto",
                   help="auto: nccl when CUDA is available, else gloo (default auto)")
    p.add_argument("--max-size", type=_positive_int, default=64 << 20, metavar="BYTES",
                   help="largest all_reduce message in bytes (default 64 MiB)")
    p.add_argument("--step", type=int, choices=[2, 4], default=2,
                   help="size multiplier between sweep points (default 2)")
    p.add_argument("--iters", type=_positive_int, default=20,
                   help="timed iterations per size and barriers per straggler check (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations per size (default 5)")
    p.add_argument("--json", metavar="OUT", type=Path, help="write the whole report as JSON (rank 0)")
    p.add_argument("--factor", type=float, default=1.5,
                   help="flag a barrier round trip above this x the median of medians (default 1.5)")
    p.add_argument("--late-ms", type=float, default=10.0,
                   help="flag a rank whose median arrival lateness exceeds this (default 10 ms)")
    p.add_argument("--rtt-floor-ms", type=float, default=1.0,
                   help="a slow barrier must also be this much above the median (default 1 ms)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="process-group timeout in seconds (default 300)")
    p.add_argument("--simulate-delay", type=_delay_spec, metavar="RANK:SECONDS",
                   help="testing aid: RANK sleeps SECONDS before each straggler barrier, so you can "
                   "see what a flagged rank looks like")
    p.add_argument("--strict", action="store_true",
                   help="exit 2 when a straggler or an environment trap was found")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the preflight on this rank (every rank of the job must run it); returns the exit code.

    Rank 0 prints the identity, straggler, bandwidth and environment tables and the warnings,
    and writes ``--json OUT``: ``{"world_size", "backend", "identity": [...], "stragglers":
    {..., "ranks": [...], "flagged": [...]}, "bandwidth": [{"size_bytes", "count", "time_s",
    "algbw_gbps", "busbw_gbps", ...}], "env": {rank: {var: value}}, "warnings": [...]}``.
    """
    args = build_parser().parse_args(argv)
    if args.max_size < MIN_SIZE:
        print(f"preflight: error: --max-size must be at least {MIN_SIZE}", file=sys.stderr)
        return EXIT_UNUSABLE
    backend = _choose_backend(args.backend)
    try:
        device, created = _init(backend, args.timeout)
    except (PreflightError, ValueError, RuntimeError) as e:
        print(f"preflight: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
              file=sys.stderr)
        return EXIT_UNUSABLE
    try:
        rank = dist.get_rank()
        world = dist.get_world_size()
        idents: list[Any] = [None] * world
        dist.all_gather_object(idents, identity(device))
        envs: list[Any] = [None] * world
        dist.all_gather_object(envs, collect_env())

        delay = 0.0
        if args.simulate_delay is not None and args.simulate_delay[0] == rank:
            delay = args.simulate_delay[1]
        raw = straggler_check(device, args.iters, delay_s=delay)
        stragglers = flag_stragglers(
            raw, factor=args.factor, late_s=args.late_ms / 1e3, rtt_floor_s=args.rtt_floor_ms / 1e3
        )
        hosts = {row["host"]: None for row in idents}
        for row in stragglers["ranks"]:
            row["host"] = idents[row["rank"]]["host"]

        sizes = sweep_sizes(args.max_size, args.step)
        bandwidth = bandwidth_sweep(
            device, sizes, args.iters, args.warmup,
            progress=(lambda s: logger.info("all_reduce %s done", _bytes(s))) if rank == 0 else None,
        )
        per_rank_env = dict(enumerate(envs))
        warnings = env_warnings(per_rank_env, multi_host=len(hosts) > 1)
        warnings.extend(_version_warnings(idents))
        result = {
            "world_size": world,
            "backend": dist.get_backend(),
            "hosts": list(hosts),
            "identity": idents,
            "stragglers": stragglers,
            "bandwidth": bandwidth,
            "env": {str(r): e for r, e in per_rank_env.items()},
            "warnings": warnings,
        }
        if rank == 0:
            print(render_text(result), flush=True)
            if args.json is not None:
                _write_json(args.json, result)
                print(f"\nJSON report: {args.json}", flush=True)
        found = bool(stragglers["flagged"] or warnings)
        return EXIT_FLAGGED if (args.strict and found) else EXIT_OK
    finally:
        if created:
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
