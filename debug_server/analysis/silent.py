"""Ranks that cannot answer, joined into the verdict as evidence like any other.

A rank whose worker does not answer gives no Flight Recorder data, but the frontend (or its
host's agent) may still have read it from outside: its stack (py-spy) and its process state
(``/proc``: stopped, blocked in the kernel, zombie, gone; whether it holds the GIL). When its
peers wait in op k of a group it belongs to and that evidence places it outside any collective,
or its process cannot run at all, it is the rank that never joined op k: a ``missing_ranks``
finding whose ``silent`` field carries the evidence. A silent rank whose stack shows it inside
a collective, with no state that stops it, is left as before ("may be the one missing").

Process records (``analyze(processes=...)``, the result's ``ranks[].process``) are dicts:
``state`` (``running | stopped | blocked | zombie | gone``), ``since`` (epoch seconds the state
was first seen, or None), ``holds_gil`` (bool or None), ``cpu_pct`` (CPU use over the last
seconds, or None), ``wchan`` (the kernel wait channel, or None), ``age_s`` (how old the read is).
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from typing import Any

from debug_server.analysis.merge import Merge
from debug_server.analysis.ranks import format_ranks
from debug_server.analysis.stackparse import Position

__all__ = ["PROCESS_STATES", "cannot_run", "next_step", "process_phrase", "silent_findings"]

PROCESS_STATES = ("running", "stopped", "blocked", "zombie", "gone")
"""What ``ranks[].process.state`` may say (from ``/proc/<pid>/stat``'s state letter)."""

_CANNOT_RUN = frozenset({"stopped", "zombie", "gone"})
_HOLDS_GIL = re.compile(r"^\s*Thread [^\n]*holds the GIL[^\n]*\(most recent call first\)", re.M)


def cannot_run(proc: Mapping[str, Any] | None) -> bool:
    """The process cannot make progress whatever its stack says (stopped, exited)."""
    return proc is not None and proc.get("state") in _CANNOT_RUN


def holds_gil(proc: Mapping[str, Any] | None, stack: str | None) -> bool:
    """The process record says so, or the outside read's stack (py-spy marks the thread)."""
    if proc is not None and proc.get("holds_gil") is not None:
        return bool(proc["holds_gil"])
    return bool(stack and _HOLDS_GIL.search(stack))


def _since(proc: Mapping[str, Any]) -> str:
    since = proc.get("since")
    if not isinstance(since, int | float) or since <= 0:
        return ""
    return " since " + time.strftime("%H:%M:%S", time.gmtime(since)) + " UTC"


def process_phrase(proc: Mapping[str, Any] | None, *, gil: bool = False, where: str = "") -> str:
    """``its process is stopped (SIGSTOP, ...) at train.py:47 since 03:12:09 UTC``, or ``""``
    (``where``: the stack's summary, when one was read)."""
    if proc is None and not gil:
        return ""
    state = (proc or {}).get("state")
    wchan = (proc or {}).get("wchan")
    if state == "stopped":
        text = "its process is stopped (SIGSTOP, a debugger or a frozen cgroup)"
    elif state == "blocked":
        text = "its process is blocked in the kernel" + (f" ({wchan})" if wchan else "")
    elif state == "zombie":
        text = "its process has exited and was not reaped (zombie)"
    elif state == "gone":
        text = "its process is gone"
    elif gil:
        text = "its main thread holds the GIL in a C call"
    elif state == "running" and wchan and wchan not in ("0", "-"):
        text = f"its process sleeps in the kernel ({wchan})"
    else:
        return ""
    if where:
        text += f" at {where}"
    if proc is not None:
        text += _since(proc)
        # Only "spinning": a CPU share changes from read to read, the verdict must not.
        cpu = proc.get("cpu_pct")
        if state in ("running", "blocked") and isinstance(cpu, int | float) and cpu >= 50:
            text += ", spinning on a CPU"
    return text


def next_step(ev: Mapping[str, Any], rank: int) -> str | None:
    """The next step for a silent rank whose state says more than its stack, else None."""
    proc = ev.get("process") or {}
    pid = proc.get("pid")
    state = proc.get("state")
    if state == "stopped":
        return (f"rank {rank}'s process is stopped: find what stopped it (a debugger, a "
                f"frozen cgroup, SIGSTOP) and resume it (kill -CONT {pid or '<pid>'}).")
    if state in ("zombie", "gone"):
        return (f"rank {rank}'s process has ended while its peers wait: read its log for the "
                "error it ended with.")
    if state == "blocked":
        return (f"rank {rank} is blocked in the kernel ({proc.get('wchan') or 'no wait channel'}): "
                "look for a hung file system, device or driver call on its host.")
    if ev.get("holds_gil"):
        where = f" at {ev['position']}" if ev.get("position") else ""
        return (f"find out why rank {rank}'s main thread holds the GIL in a C call{where}: it "
                "never reached the collective, and its debug worker cannot run.")
    return None


def silent_findings(m: Merge, positions: Mapping[int, Position]) -> None:
    """Add a ``missing_ranks`` finding per op that ranks with data wait in and that silent
    members of its group, read from outside, are not in (see the module's docstring)."""
    silent = [r for r in m.no_data() if r in positions or r in m.processes]
    if not silent or not m.waiting:
        return
    taken: set[int] = set()
    for w in m.waiting:
        g = next((g for g in m.groups.values() if g.id == w["group"]), None)
        if g is None:
            continue
        away = [r for r in silent if r in g.rank_set and r not in taken and _away(m, positions, r)]
        if not away:
            continue
        taken.update(away)
        waiting = sorted(set(w["ranks"]))
        evidence = {str(r): _evidence(m, positions, r) for r in away}
        m.finding(
            "missing_ranks", g, w["seq"], w["op"], away,
            f"{'Rank' if len(away) == 1 else 'Ranks'} {format_ranks(away)} gave no Flight "
            f"Recorder data and, read from outside, {'is' if len(away) == 1 else 'are'} not in "
            f"{w['op']} #{w['seq']} on {g.label}",
            waiting=waiting, silent=evidence,
        )  # fmt: skip


def _away(m: Merge, positions: Mapping[int, Position], r: int) -> bool:
    proc = m.processes.get(r)
    if cannot_run(proc):
        return True
    pos = positions.get(r)
    if proc is not None and proc.get("state") == "blocked":
        return pos is None or not pos.in_collective  # stuck in the kernel, not in a collective
    return pos is not None and not pos.in_collective


def _evidence(m: Merge, positions: Mapping[int, Position], r: int) -> dict[str, Any]:
    pos = positions.get(r)
    proc = m.processes.get(r)
    return {
        "position": pos.position.replace(" ", " in ", 1) if pos is not None else None,
        "in_collective": pos.in_collective if pos is not None else None,
        "holds_gil": holds_gil(proc, m.stacks.get(r)),
        "process": dict(proc) if proc is not None else None,
        "reason": m.unavailable.get(r, "no data"),
    }
