"""A rank's process as read from outside, on its own host: ``/proc/<pid>/stat`` and ``wchan``.

A rank whose worker cannot answer (stopped, a C call holding the GIL, blocked in the kernel)
still has a process the kernel describes. The reader that reads its stacks with py-spy (the
frontend for its own host, a host's agent, or a worker asked ``process_state?pid=``) reads it
here too, and only a pid a rank of this job announced (``jobpids.check``):

- **state**: the state letter of ``/proc/<pid>/stat`` as the analysis names it
  (``analysis.silent.PROCESS_STATES``): ``R``/``S``/``I`` running (it can run), ``D`` blocked
  (uninterruptible, in the kernel: a hung NFS write, a driver call), ``T``/``t`` stopped
  (SIGSTOP, a tracer, a frozen cgroup), ``Z`` zombie, ``X`` or no such process (or another
  process under the same pid: its start time differs) gone; ``letter`` keeps the letter itself;
- **since**: the epoch second this reader first saw the current state (its own memory: a state
  that began before the reader first looked reads as "since" that first look);
- **cpu_pct**: CPU use (``utime + stime``) between this read and the reader's last one of the
  same process, or over ``SETTLE_S`` where it has none recent (a spinning rank reads ~100 %);
- **wchan**: the kernel function the main thread sleeps in (``/proc/<pid>/wchan``), None when
  it runs or the kernel hides it;
- **holds_gil**: not from ``/proc``: py-spy's stack says so (:func:`gil_from_stack`), None
  where no py-spy read was made.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from debug_server.protocol.names import PROCESS_HANDLER
from debug_server.readers import jobpids

__all__ = ["HANDLER", "STATE_OF", "ProcReader", "describe", "gil_from_stack"]

HANDLER = PROCESS_HANDLER
"""The worker handler (ours): ``pid=`` of a rank of this job on the worker's host, as JSON."""
SETTLE_S = 0.1
"""Two reads this far apart give the CPU use of a process read for the first time."""
CPU_WINDOW_S = 30.0
"""A last read older than this is not used for the CPU use (it would average over minutes)."""
STATE_OF = {"R": "running", "S": "running", "I": "running", "D": "blocked", "T": "stopped",
            "t": "stopped", "Z": "zombie", "X": "gone", "x": "gone"}
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_LETTER = {"R": "R running", "S": "S sleeping", "I": "I idle", "D": "D disk sleep",
           "T": "T stopped", "t": "t tracing stop", "Z": "Z zombie", "X": "X dead"}


@dataclass(slots=True, frozen=True)
class _Sample:
    letter: str
    ticks: int
    start: int
    at: float


def _sample(pid: int) -> _Sample | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
        fields = raw.rsplit(")", 1)[1].split()
        return _Sample(fields[0], int(fields[11]) + int(fields[12]), int(fields[19]),
                       time.monotonic())
    except (OSError, IndexError, ValueError):
        return None


def _wchan(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/wchan") as f:
            text = f.read().strip()
    except OSError:
        return None
    return text if text and text not in ("0", "-") else None


class ProcReader:
    """Reads processes of this host; remembers each one's last sample and state (``since``).

    Thread-safe: the frontend reads on executor threads. ``wall``: the clock ``since`` is in.
    """

    def __init__(self, wall: Callable[[], float] = time.time) -> None:
        self._wall = wall
        self._lock = threading.Lock()
        self._last: dict[tuple[int, int], _Sample] = {}
        self._since: dict[tuple[int, int], tuple[str, float]] = {}

    def read(self, targets: Sequence[tuple[int, Mapping[str, Any] | None]],
             settle_s: float = SETTLE_S) -> list[dict[str, Any]]:
        """One record per ``(pid, announced)`` (``announced``: the rank's registration sidecar,
        checked with ``jobpids.check``); blocks ``settle_s`` once where a process has no recent
        sample. A pid the check refuses while it exists reads ``state: None`` and ``error``."""
        first: list[_Sample | None | str] = []
        for pid, announced in targets:
            s = _sample(pid)
            start = announced.get("start") if isinstance(announced, Mapping) else None
            if s is None or (isinstance(start, int) and s.start != start):
                first.append(None)  # no such process, or another one under the same pid
                continue
            why = jobpids.check(pid, announced)
            first.append(s if why is None else why)  # a reason: not ours to read
        now = time.monotonic()
        with self._lock:
            fresh = all(not isinstance(s, _Sample) or (
                (last := self._last.get((pid, s.start))) is not None
                and 0 < now - last.at < CPU_WINDOW_S) for s, (pid, _) in zip(first, targets,
                                                                           strict=True))
        if not fresh and settle_s > 0:
            time.sleep(settle_s)
        return [self._record(pid, s, settle_s > 0 and not fresh)
                for s, (pid, _) in zip(first, targets, strict=True)]

    def _record(self, pid: int, s: _Sample | None | str, again: bool) -> dict[str, Any]:
        if isinstance(s, str):
            return {"pid": pid, "state": None, "error": s}
        if s is None:
            return {"pid": pid, "state": "gone", "letter": None, "since": self._seen(pid, 0, "gone"),
                    "holds_gil": None, "cpu_pct": None, "wchan": None, "age_s": 0.0}
        key = (pid, s.start)
        with self._lock:
            last = self._last.get(key)
        now = s
        if again:
            last, now = s, _sample(pid) or s  # the second of two reads SETTLE_S apart
        elif last is None or not 0 < s.at - last.at < CPU_WINDOW_S:
            last = s  # no recent read to measure from: no CPU use this time
        if now.start != s.start:  # ended between the two reads, its pid reused
            return self._record(pid, None, False)
        cpu = None
        if now is not last and now.at > last.at:
            cpu = round(100.0 * (now.ticks - last.ticks) / _TICKS / (now.at - last.at), 1)
        with self._lock:
            self._last[key] = now
        state = STATE_OF.get(now.letter, "running")
        return {"pid": pid, "state": state, "letter": now.letter,
                "since": self._seen(pid, s.start, state), "holds_gil": None,
                "cpu_pct": None if cpu is None else max(0.0, cpu), "wchan": _wchan(pid),
                "age_s": 0.0}

    def _seen(self, pid: int, start: int, state: str) -> float:
        key = (pid, start)
        with self._lock:
            old = self._since.get(key)
            if old is None or old[0] != state:
                old = self._since[key] = (state, self._wall())
            return old[1]


# ---------------------------------------------------------------------------------------------
# What py-spy's stack says, and the record as one line for people

_HEADER = re.compile(r"^\s*Thread [^\n]*\(most recent call first\):", re.M)


def gil_from_stack(text: str | None) -> bool | None:
    """Whether the main thread holds the GIL, as py-spy's stack text says (``holds the GIL`` in
    its header: ``pyspy._thread_header``); None when the text is not py-spy's."""
    if not text or "py-spy" not in text.split("\n", 1)[0]:
        return None
    headers = _HEADER.findall(text)
    main = next((h for h in headers if '"MainThread"' in h), headers[0] if headers else None)
    return main is not None and "holds the GIL" in main


def describe(proc: Mapping[str, Any] | None) -> str:
    """``stopped (T stopped) since 12:00:01 UTC, 0 % CPU, in do_signal_stop, holds the GIL;
    pid 4242, read 3 s ago``, or ``""`` without a record."""
    if not isinstance(proc, Mapping):
        return ""
    if proc.get("state") is None:
        return f"process not read: {proc.get('error') or 'unknown'}"
    parts = [str(proc["state"])]
    letter = proc.get("letter")
    if letter in _LETTER:
        parts[0] += f" ({_LETTER[letter]})"
    since = proc.get("since")
    if isinstance(since, int | float) and since > 0:
        parts[0] += " since " + time.strftime("%H:%M:%S", time.gmtime(since)) + " UTC"
    cpu = proc.get("cpu_pct")
    if isinstance(cpu, int | float):
        parts.append(f"{cpu:.0f} % CPU")
    if proc.get("wchan"):
        parts.append(f"in {proc['wchan']}")
    if proc.get("holds_gil") is True:
        parts.append("holds the GIL")
    tail = f"pid {proc.get('pid')}"
    age = proc.get("age_s")
    if isinstance(age, int | float) and age >= 1:
        tail += f", read {age:.0f} s ago"
    return ", ".join(parts) + "; " + tail
