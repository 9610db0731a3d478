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

The measurements are ``tools/preflight_net.py``, the tables ``tools/preflight_report.py``; this
module sets the job up, gathers every rank's identity and is the command.

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
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from debug_server.errors import first_line
from debug_server.tools.envinfo import collect_env, env_warnings
from debug_server.tools.preflight_net import (
    MIN_SIZE,
    bandwidth_sweep,
    busbw_factor,
    flag_stragglers,
    straggler_check,
    sweep_sizes,
)
from debug_server.tools.preflight_report import format_bytes, render_text, version_warnings

# The measurements live in preflight_net and the tables in preflight_report; their public
# functions stay importable from here, where the command is.
__all__ = [
    "bandwidth_sweep",
    "busbw_factor",
    "flag_stragglers",
    "main",
    "render_text",
    "sweep_sizes",
    "straggler_check",
]

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_UNUSABLE = 1
EXIT_FLAGGED = 2


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
# Output
# --------------------------------------------------------------------------------------------


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
        print(f"preflight: error: {first_line(e)}", file=sys.stderr)
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
            progress=(lambda s: logger.info("all_reduce %s done", format_bytes(s))) if rank == 0 else None,
        )
        per_rank_env = dict(enumerate(envs))
        warnings = env_warnings(per_rank_env, multi_host=len(hosts) > 1)
        warnings.extend(version_warnings(idents))
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
