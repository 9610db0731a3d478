"""The post-mortem viewer's reading side: what a dump directory holds, and one cycle's data.

:func:`scan_dir` lists the dump cycles of a directory (the files that share a dumper stamp, and
the per-rank dumps as one more cycle) and its hang reports; :func:`load_cycle` reads one cycle
into :class:`CycleData`. Files are read the analyzer's way (JSON, or pickles of plain containers
only), and whatever cannot be used is a one-line problem, never an exception. The pages that
show it are ``tools/view.py``'s.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from debug_server.analysis import stackparse
from debug_server.analysis.ranks import format_ranks
from debug_server.dumpio import (
    MAX_RANK,
    DumpError,
    load_dump,
    parse_ranks,
    rank_files,
    validate_dump,
)
from debug_server.errors import first_line
from debug_server.frontend import snapshot
from debug_server.frontend.dumps import (
    FR_TRACE_PREFIX,
    HANG_REPORT_PREFIX,
    SNAPSHOT_PREFIX,
    STACKS_PREFIX,
    STAMP_FORMAT,
)

logger = logging.getLogger(__name__)

PER_RANK = "per_rank"
"""The cycle id of the per-rank dumps (``<dir>/per_rank/`` or ``<dir>`` itself)."""
MAX_FILE_BYTES = 4 << 30
"""A dump file larger than this is refused rather than read into memory."""

_STAMP = r"\d{8}_\d{6}(?:_\d+)?"
CYCLE_FILE_RE = re.compile(
    rf"^({FR_TRACE_PREFIX}|{STACKS_PREFIX}|{SNAPSHOT_PREFIX}|{HANG_REPORT_PREFIX})_({_STAMP})"
    r"\.(txt|json)$", re.ASCII)
"""A file the dumper writes once per cycle: kind, stamp, extension."""
STAMP_RE = re.compile(rf"^{_STAMP}$", re.ASCII)
_FAILED_SECTION = re.compile(r"^rank \d+: .+$")


@dataclass(slots=True)
class Cycle:
    """One dump cycle: the files that share a stamp (or the per-rank dumps)."""

    stamp: str
    snapshot: str | None = None
    stacks: str | None = None
    fr_text: str | None = None
    rank_files: dict[int, str] | None = None
    mtime: float = 0.0
    """The newest file's modification time (what "data from" means for per-rank dumps)."""

    def files(self) -> list[str]:
        named = [self.snapshot, self.stacks, self.fr_text]
        return [p for p in named if p] + sorted((self.rank_files or {}).values())

    def when(self) -> str:
        """``2026-11-26 05:26:16`` from the stamp (local time, as the dumper wrote it)."""
        if self.stamp == PER_RANK:
            return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.mtime))
        t = time.strptime(self.stamp[:15], STAMP_FORMAT)
        n = self.stamp[16:]  # the dumper's _1, _2... for cycles in one second
        return time.strftime("%Y-%m-%d %H:%M:%S", t) + (f" #{n}" if n else "")

    def label(self) -> str:
        if self.stamp == PER_RANK:
            return f"{self.when()}: per-rank dumps ({len(self.rank_files or {})} files)"
        what = [k for k, p in (("FR", self.snapshot), ("stacks", self.stacks)) if p]
        return f"{self.when()}: {' + '.join(what) or 'text report only'}"


@dataclass(slots=True)
class HangReportInfo:
    stamp: str
    txt: str | None
    verdict: str


@dataclass(slots=True)
class Scan:
    """The directory's cycles (oldest first), hang reports, and why anything is unusable."""

    cycles: list[Cycle]
    hang_reports: list[HangReportInfo]
    problems: list[str]

    def find(self, stamp: str) -> Cycle | None:
        return next((c for c in self.cycles if c.stamp == stamp), None)

    def hang_cycle(self) -> Cycle | None:
        """The first dump cycle written at or after the newest hang report: the job as it was
        seen hung. Later cycles may show it after a timeout ended the hang (ranks moved on, or
        gone); None without a report or a cycle after it."""
        if not self.hang_reports:
            return None
        at = _stamp_key(self.hang_reports[-1].stamp)
        return next((c for c in self.cycles if c.stamp != PER_RANK and _stamp_key(c.stamp) >= at), None)


    def best_cycle(self) -> Cycle | None:
        """The default cycle: the hang report's; else the newest with FR data and stacks
        (``complete``); else the newest."""
        return self.hang_cycle() or next(
            (c for c in reversed(self.cycles) if complete(c, self)),
            self.cycles[-1] if self.cycles else None)


def _stamp_key(stamp: str) -> tuple[str, int]:
    base, n = stamp[:15], stamp[16:]
    return base, int(n) if n else 0


def read_bounded(path: str) -> bytes:
    """The file's bytes; one over ``MAX_FILE_BYTES`` is a ``DumpError``, not a read."""
    size = os.path.getsize(path)
    if size > MAX_FILE_BYTES:
        raise DumpError(f"{os.path.basename(path)}: {size} bytes is over the "
                        f"{MAX_FILE_BYTES >> 30} GiB limit")
    with open(path, "rb") as f:
        return f.read()


def scan_dir(path: str) -> Scan:
    """Every dump cycle in ``path``; never raises (an unusable dir is a problem line)."""
    problems: list[str] = []
    try:
        names = sorted(os.listdir(path))
    except OSError as e:
        return Scan([], [], [f"{path}: cannot list ({e.strerror or e})"])
    cycles: dict[str, Cycle] = {}
    reports: dict[str, dict[str, str]] = {}
    for name in names:
        m = CYCLE_FILE_RE.match(name)
        if m is None:
            continue
        kind, stamp, ext = m.groups()
        full = os.path.join(path, name)
        if kind == HANG_REPORT_PREFIX:
            reports.setdefault(stamp, {})[ext] = full
            continue
        c = cycles.setdefault(stamp, Cycle(stamp))
        if kind == SNAPSHOT_PREFIX and ext == "json":
            c.snapshot = full
        elif kind == STACKS_PREFIX and ext == "txt":
            c.stacks = full
        elif kind == FR_TRACE_PREFIX and ext == "txt":
            c.fr_text = full
        else:
            continue
        c.mtime = max(c.mtime, file_mtime(full))
    per_rank_dir = os.path.join(path, PER_RANK)
    if os.path.isdir(per_rank_dir):
        rank_dir: str | None = per_rank_dir
    elif not cycles and not reports:
        rank_dir = path  # a plain directory of per-rank dumps (ours or torch's)
    else:
        rank_dir = None
    ordered = sorted(cycles.values(), key=lambda c: _stamp_key(c.stamp))
    if rank_dir is not None:
        try:
            files, notes = rank_files(rank_dir)
        except DumpError as e:
            problems.append(str(e))
            files, notes = {}, []
        for n in notes:
            logger.debug("debug_server view: %s", n)
        if files:
            mtime = max(file_mtime(p) for p in files.values())
            # Ranks rewrite these every cycle and once more on their way out: place them by
            # their time among the dated cycles (usually last).
            at = sum(1 for c in ordered if c.mtime <= mtime)
            ordered.insert(at, Cycle(PER_RANK, rank_files=files, mtime=mtime))
    hang = [_hang_report(stamp, reports[stamp]) for stamp in sorted(reports, key=_stamp_key)]
    if not ordered:
        problems.append(f"{path}: no dump cycles (no fr_snapshot_<ts>.json, stacks_<ts>.txt, "
                        f"per_rank/ or <prefix><rank> dump files)")
    return Scan(ordered, hang, problems)


def file_mtime(path: str) -> float:
    """The file's modification time; 0.0 for one gone since the listing."""
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


def _hang_report(stamp: str, files: Mapping[str, str]) -> HangReportInfo:
    txt = os.path.basename(files["txt"]) if "txt" in files else None
    verdict = "(no .json report)"
    if "json" in files:
        try:
            obj = json.loads(read_bounded(files["json"]))
            verdict = str(obj.get("verdict") or "(no verdict)") if isinstance(obj, dict) else (
                "(not a hang report)")
        except (OSError, ValueError, DumpError) as e:
            verdict = f"(unreadable: {first_line(e)})"
    return HangReportInfo(stamp, txt, verdict[:500])


@dataclass(slots=True)
class CycleData:
    """What one cycle says about every rank, and every file-level problem in one line each."""

    cycle: Cycle | None
    dumps: dict[int, dict[str, Any]] = field(default_factory=dict)
    fr_errors: dict[int, str] = field(default_factory=dict)
    stacks: dict[int, str] = field(default_factory=dict)
    stack_errors: dict[int, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    stacks_from: str | None = None
    """The stacks file used, when it is not the cycle's own (per-rank dumps)."""
    filled: list[int] = field(default_factory=list)
    """Ranks whose FR data came from the per-rank dumps, not this cycle's snapshot."""
    world_size: int = 0

    def sources(self) -> tuple[str, str]:
        c = self.cycle
        fr = (os.path.basename(c.snapshot) if c and c.snapshot
              else "per-rank dumps" if c and c.rank_files else "")
        if self.filled:
            per_rank = f"per-rank dumps (rank {format_ranks(self.filled)})"
            fr = f"{fr} + {per_rank}" if fr else per_rank
        st = os.path.basename(self.stacks_from or (c.stacks if c and c.stacks else "") or "")
        return fr, st


def _rank_key(key: str, source: str) -> int:
    if not (key.isascii() and key.isdigit()) or int(key) > MAX_RANK:
        raise DumpError(f"{source}: {key[:40]!r} is not a rank number")
    return int(key)


def _load_snapshot(path: str, data: CycleData) -> None:
    name = os.path.basename(path)
    try:
        obj = snapshot.expand(json.loads(read_bounded(path)))  # shared member lists inline
    except (OSError, ValueError, DumpError) as e:
        data.problems.append(f"{name}: unusable ({first_line(e)})")
        return
    if not isinstance(obj, dict):
        data.problems.append(f"{name}: not a snapshot (top level is {type(obj).__name__})")
        return
    # Ranks of one class are shallow copies of one dump (snapshot.expand): checked once.
    checked: dict[tuple[int, ...], tuple[dict[str, Any], str | None, int]] = {}
    for key, value in obj.items():
        try:
            rank = _rank_key(str(key), name)
        except DumpError as e:
            data.problems.append(str(e))
            continue
        if isinstance(value, dict) and set(value) == {"error"}:
            data.fr_errors[rank] = str(value["error"]).splitlines()[0][:300] if value["error"] else (
                "no data")
            continue
        parts = ((id(value.get("entries")), id(value.get("pg_config")), id(value.get("version")))
                 if isinstance(value, dict) else None)
        seen = checked.get(parts) if parts is not None else None
        if seen is not None:
            err = seen[1]
            if err is not None:  # the class's reason, named by this rank
                err = err.replace(f"{name} rank {seen[2]}:", f"{name} rank {rank}:", 1)
        else:
            try:
                validate_dump(value, f"{name} rank {rank}")
                err = None
            except DumpError as e:
                err = str(e)
            if parts is not None:
                checked[parts] = (value, err, rank)  # value keeps the ids alive
        if err is None:
            data.dumps[rank] = value
        else:
            data.fr_errors[rank] = err


def _load_rank_files(files: Mapping[int, str], data: CycleData) -> None:
    for rank, path in sorted(files.items()):
        try:
            data.dumps[rank] = load_dump(path)
        except DumpError as e:
            data.fr_errors[rank] = str(e)
        except MemoryError:
            data.fr_errors[rank] = f"{os.path.basename(path)}: too large to load"


def _load_stacks(path: str, data: CycleData) -> None:
    name = os.path.basename(path)
    try:
        text = read_bounded(path).decode("utf-8", errors="replace")
    except (OSError, DumpError) as e:
        data.problems.append(f"{name}: unusable ({first_line(e)})")
        return
    sections = stackparse.split_stacks_file(text)
    if not sections:
        data.problems.append(f"{name}: no '=== Rank N ===' sections")
    for rank, body in sections.items():
        if rank > MAX_RANK:
            data.problems.append(f"{name}: rank {rank} is above {MAX_RANK}")
            continue
        stripped = body.strip()
        # The dumper writes a rank that did not answer as its one failure line.
        if "\n" not in stripped and _FAILED_SECTION.match(stripped) and not (
                stackparse.parse_threads(body)):
            data.stack_errors[rank] = stripped
        else:
            data.stacks[rank] = body


def _fill_from_rank_files(cycle: Cycle, per_rank: Cycle, data: CycleData) -> None:
    """A cycle without a (usable) snapshot, or with ranks it could not fetch, takes those ranks'
    FR data from the per-rank dumps (written by each rank on a dump cycle or on its way out:
    often the most authoritative post-mortem data), and says so."""
    assert per_rank.rank_files is not None
    wanted = {r: p for r, p in per_rank.rank_files.items() if r not in data.dumps}
    if not wanted:
        return
    errors = {r: data.fr_errors.pop(r) for r in wanted if r in data.fr_errors}
    _load_rank_files(wanted, data)
    data.filled = sorted(r for r in wanted if r in data.dumps)
    for r, err in errors.items():  # the snapshot's reason stays where the file did not help
        if r not in data.dumps:
            data.fr_errors[r] = err
    if not data.filled:
        return
    where = os.path.dirname(next(iter(wanted.values())))
    why = (f"no usable {SNAPSHOT_PREFIX}_{cycle.stamp}.json"
           if len(data.dumps) == len(data.filled) else "ranks its snapshot lacks")
    data.problems.append(
        f"cycle {cycle.stamp}: {why}; Flight Recorder data of rank {format_ranks(data.filled)} "
        f"taken from the per-rank dumps in {os.path.basename(where) or where} "
        f"(written {per_rank.when()})")


def complete(cycle: Cycle, scan: Scan) -> bool:
    """Whether a cycle has FR data (a whole snapshot, or per-rank dumps to take it from) and
    stacks: what the default cycle needs to say who hangs where."""
    if cycle.stamp == PER_RANK:
        return any(c.stacks for c in scan.cycles)
    has_fr = (cycle.snapshot is not None and looks_whole(cycle.snapshot)) or \
        scan.find(PER_RANK) is not None
    return has_fr and cycle.stacks is not None and looks_whole(cycle.stacks, b"")


def looks_whole(path: str, end: bytes = b"}") -> bool:
    """A cheap look at a file's tail: not empty, and a JSON object's last byte where one is
    expected (a frontend killed while writing leaves neither: files are renamed into place
    whole, but a copy, a full disk or a filesystem without atomic rename may cut one)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64))
            tail = f.read().rstrip()
    except OSError:
        return False
    return size > 0 and tail.endswith(end)


def load_cycle(scan: Scan, cycle: Cycle | None) -> CycleData:
    """Read one cycle's files (restricted loading only); never raises."""
    data = CycleData(cycle, problems=list(scan.problems))
    if cycle is not None:
        if cycle.snapshot:
            _load_snapshot(cycle.snapshot, data)
        elif cycle.rank_files:
            _load_rank_files(cycle.rank_files, data)
        per_rank = scan.find(PER_RANK)
        if cycle.rank_files is None and per_rank is not None and per_rank.rank_files:
            _fill_from_rank_files(cycle, per_rank, data)
        if not cycle.snapshot and not cycle.rank_files and not data.filled:
            extra = (f"; its text report is {os.path.basename(cycle.fr_text)}"
                     if cycle.fr_text else "")
            data.problems.append(f"cycle {cycle.stamp} has no {SNAPSHOT_PREFIX}_{cycle.stamp}.json"
                                 f" (Flight Recorder data not kept){extra}")
        stacks_path = cycle.stacks
        if stacks_path is None and cycle.stamp == PER_RANK:
            # Per-rank dumps come with no stacks of their own: use the last ones written.
            stacks_path = next((c.stacks for c in reversed(scan.cycles) if c.stacks), None)
            data.stacks_from = stacks_path
        if stacks_path:
            _load_stacks(stacks_path, data)
        else:
            data.problems.append(f"cycle {cycle.stamp} has no stacks file")
    ranks = set(data.dumps) | set(data.fr_errors) | set(data.stacks) | set(data.stack_errors)
    configs = {id(c): c for d in data.dumps.values() if isinstance(c := d.get("pg_config"), dict)}
    for pg_config in configs.values():  # ranks alike share one (snapshot.expand): read once
        for cfg in pg_config.values():
            ranks.update(r for r in _cfg_ranks(cfg) if 0 <= r <= MAX_RANK)
    data.world_size = max(ranks) + 1 if ranks else 0
    for p in data.problems[len(scan.problems):]:
        logger.warning("debug_server view: %s", p)
    for rank, err in sorted(data.fr_errors.items()):
        logger.warning("debug_server view: rank %d: %s", rank, err)
    return data


def _cfg_ranks(cfg: Any) -> list[int]:
    try:
        return parse_ranks(cfg.get("ranks", "[]")) if isinstance(cfg, dict) else []
    except DumpError:
        return []
