"""The report of ``python -m debug_server.preflight``: its result as plain-text tables."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tabulate import tabulate

from debug_server.analysis.ranks import format_ranks


def format_bytes(n: int | None) -> str:
    """``1536`` -> ``1.5 KiB``; ``None`` -> ``?``."""
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
    return f"{format_bytes(free)} / {format_bytes(total)}"


def version_warnings(idents: Sequence[Mapping[str, Any]]) -> list[str]:
    """One warning per version (torch, NCCL) that differs between ranks."""
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
    out.append(_identity_table(result["identity"]))
    out.append("")
    out += _straggler_section(result["stragglers"])
    out.append("")
    out.append(f"== all_reduce bandwidth (float32 sum, {result['world_size']} ranks) ==")
    out.append(
        tabulate(
            [
                [format_bytes(r["size_bytes"]), r["count"], f"{r['time_s'] * 1e6:.1f}",
                 f"{r['algbw_gbps']:.3f}", f"{r['busbw_gbps']:.3f}", r["slowest_rank"]]
                for r in result["bandwidth"]
            ],
            headers=["size", "count", "time (us)", "algbw (GB/s)", "busbw (GB/s)", "slowest rank"],
        )
    )
    out.append("")
    out.append("== Environment ==")
    out.append(_env_table(result["env"]))
    out.append("")
    out.append(f"== Warnings ({len(result['warnings'])}) ==")
    out.extend(f"  WARNING: {w}" for w in result["warnings"])
    if not result["warnings"]:
        out.append("  none")
    return "\n".join(out)


def _identity_table(idents: Sequence[Mapping[str, Any]]) -> str:
    return tabulate(
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
            for r in idents
        ],
        headers=["rank", "local", "host", "pid", "device", "dev mem free/total",
                 "host mem avail/total", "torch"],
    )


def _straggler_section(st: Mapping[str, Any]) -> list[str]:
    mom = st["median_of_medians_s"]
    out = [
        f"== Stragglers ({st['iters']} barriers; late > {st['late_threshold_s'] * 1e3:.1f} ms, "
        f"slow barrier > {st['factor']}x median of medians"
        + (f" = {mom * 1e6:.0f} us" if mom is not None else "")
        + ") =="
    ]
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
    out += [f"  STRAGGLER rank {f['rank']}: {f['reason']}" for f in st["flagged"]]
    return out


def _env_table(result_env: Mapping[str, Mapping[str, str]]) -> str:
    """One row per variable: its value where all ranks agree, and the ranks that set it."""
    env: Mapping[int, Mapping[str, str]] = {int(k): v for k, v in result_env.items()}
    names = sorted({k for e in env.values() for k in e})
    rows = []
    for name in names:
        values = {e.get(name) for e in env.values()}
        have = [r for r, e in env.items() if name in e]
        value = next(iter(values)) if len(values) == 1 else "(differs, see warnings)"
        rows.append([name, value, "all" if len(have) == len(env) else format_ranks(have)])
    return tabulate(rows, headers=["variable", "value", "ranks"]) if rows else "(none set)"
