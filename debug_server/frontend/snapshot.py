"""``fr_snapshot_<ts>.json``: what one dump cycle analyzed, in bytes that do not grow with rings.

The snapshot is ``{"<rank>": dump | {"error": line}}`` as the analyzer saw it, with three bounds
that keep a cycle's size independent of ring length x ranks (whole rings stay in the per-rank
pickles each rank writes itself, ``per_rank/rank_<N>``):

- **ranks that read the same** (issue 41: 131072 ranks in a few classes): a dump is written once,
  under the first rank that has it (its own ``dump_time_ns`` included); the other ranks with the
  same dump are listed under :data:`SAME_KEY`::

      "same_as": {"0": {"ranks": "1-77776,77778-131071", "dump_time_ns": "1*77776,2,1*53293"}}

  ``ranks``: range text (``a-b`` and single ranks, comma-separated, ascending); ``dump_time_ns``
  (where the dumps have an int one): each listed rank's own time, as the differences from the
  previous one in that order (the first from the representative's), ``d*n`` for a difference
  repeated ``n`` times. Ranks share a class when their dumps share their parts by identity (the
  fan-out's shallow copies: one encoding per distinct dump) or encode to the same text. Ranks
  that failed alike (``rank N: <why>`` with the same ``<why>``) are one row of
  :data:`ERRORS_KEY`: ``[{"ranks": "100-199", "error": "unreachable after 2.0 s"}]``; a failure
  of one rank stays ``"<rank>": {"error": line}``.
- **entries**: each rank's dump is the live window (entries from each communicator's frontier on,
  ``frwindow``), and at most :data:`MAX_ENTRIES_PER_RANK` of them: every entry not yet completed,
  then the newest completed ones. What a cap dropped is counted in the dump's ``fr_window``
  (``snapshot_dropped``), so a reader knows the ring held more.
- **member lists**: every member of a group carries the group's full member list
  (``pg_config.*.ranks``), so N ranks x an N-member group is O(N^2) bytes (1.9 GB at 16384 ranks).
  A list longer than :data:`INLINE_RANKS_CHARS` is written once under :data:`MEMBERS_KEY`
  (``{"m0": "[0, 1, ...]"}``) and each rank's ``ranks`` names it (``"@m0"``); an ascending
  list that its range text spells back exactly is written as that (``{"m0": {"ranges":
  "0-131071"}}``: 12 bytes, not 900 KB).

:func:`expand` undoes the second and third (readers call it right after ``json.loads``), so what
comes back is ``{"<rank>": dump | {"error": line}}`` of plain torch-schema dumps again: the ranks
of a class as shallow copies of its dump (each its own dict and ``dump_time_ns``, the parts
shared), which the analysis digests once, as it does the live fan-out's. A snapshot written
before the classes (one dump per rank) loads as it always did; a class map that is not one
(unknown rank, bad range text, a rank twice, times that do not add up) is a ``ValueError`` of
one line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from debug_server.analysis.ranks import parse_rank_text, rank_ranges
from debug_server.dumpio import MAX_RANK, DumpError, group_members, validate_dump
from debug_server.protocol.members import MIN_CHARS, map_lists

__all__ = ["ERRORS_KEY", "INLINE_RANKS_CHARS", "MAX_ENTRIES_PER_RANK", "MEMBERS_KEY", "SAME_KEY",
           "cap_entries", "encode", "encode_per_rank", "expand", "load"]

MEMBERS_KEY = "pg_members"
"""Top-level key of the shared member lists (never a rank number, so readers can tell it apart)."""
SAME_KEY = "same_as"
"""Top-level key of the classes: representative rank -> the other ranks with its dump, and their
``dump_time_ns`` (the module doc)."""
ERRORS_KEY = "rank_errors"
"""Top-level key of the failures shared by several ranks: ``[{"ranks", "error"}]``."""
INLINE_RANKS_CHARS = MIN_CHARS
"""Member lists up to this many characters stay inline (small groups cost less than a reference)."""
MAX_ENTRIES_PER_RANK = 512
"""Most FR entries one rank contributes to a snapshot (the live window is usually far smaller)."""
_REF = "@"
_WINDOW_KEY = "fr_window"
_TIME_KEY = "dump_time_ns"


def _done(e: Any) -> bool:
    return isinstance(e, Mapping) and bool(
        e.get("state") == "completed" or e.get("retired") or e.get("time_discovered_completed_ns"))


def cap_entries(dump: Mapping[str, Any], cap: int = MAX_ENTRIES_PER_RANK) -> Mapping[str, Any]:
    """``dump`` with at most ``cap`` entries: all pending ones, then the newest completed ones
    (ring order kept). Unchanged (the same object) when it is within the cap."""
    entries = dump.get("entries")
    if not isinstance(entries, list) or len(entries) <= cap:
        return dump
    pending = [i for i, e in enumerate(entries) if not _done(e)]
    room = max(0, cap - len(pending))
    keep = set(pending[-cap:])
    for i in range(len(entries) - 1, -1, -1):
        if room <= 0:
            break
        if i not in keep:
            keep.add(i)
            room -= 1
    kept = [entries[i] for i in sorted(keep)]
    out = dict(dump)
    out["entries"] = kept
    prior = dump.get(_WINDOW_KEY)
    window = dict(prior) if isinstance(prior, Mapping) else {"ring_entries": len(entries)}
    window["snapshot_dropped"] = int(window.get("snapshot_dropped", 0) or 0) + len(entries) - len(kept)
    out[_WINDOW_KEY] = window
    return out


class _Members:
    """Shared member lists: one name per distinct text."""

    def __init__(self) -> None:
        self.names: dict[str, str] = {}

    def ref(self, text: str) -> str:
        name = self.names.get(text)
        if name is None:
            name = self.names[text] = f"m{len(self.names)}"
        return name


def _identity(dump: Mapping[str, Any]) -> tuple[Any, ...]:
    """What makes two dumps one class without encoding them: every part but ``dump_time_ns``,
    containers by identity (the fan-out's shallow copies share them), scalars by value."""
    key: list[Any] = []
    for k, v in dump.items():
        if k == _TIME_KEY and type(v) is int:
            key.append(k)
        elif v is None or type(v) in (str, int, float, bool):
            key.append((k, type(v).__name__, v))
        else:
            key.append((k, id(v)))
    return tuple(key)


def _times_text(first: int, times: Sequence[int]) -> str:
    """``1*77776,2,1*53293``: each time's difference from the previous one (the first from
    ``first``), runs of one difference as ``d*n``."""
    out: list[str] = []
    prev, run_d, run_n = first, 0, 0
    for t in times:
        d = t - prev
        prev = t
        if run_n and d == run_d:
            run_n += 1
            continue
        if run_n:
            out.append(str(run_d) if run_n == 1 else f"{run_d}*{run_n}")
        run_d, run_n = d, 1
    if run_n:
        out.append(str(run_d) if run_n == 1 else f"{run_d}*{run_n}")
    return ",".join(out)


class _Class:
    __slots__ = ("rank", "text", "time", "ranks", "times")

    def __init__(self, rank: int, text: str, time: int | None) -> None:
        self.rank, self.text, self.time = rank, text, time
        self.ranks: list[int] = []
        self.times: list[int] = []


def encode(items: Sequence[tuple[int, Mapping[str, Any] | None, str | None]],
           cap: int = MAX_ENTRIES_PER_RANK) -> str:
    """The snapshot text of ``(rank, dump or None, error line or None)`` items, in that order:
    one dump per class of ranks (the module doc)."""
    members = _Members()
    by_identity: dict[tuple[Any, ...], _Class] = {}
    by_text: dict[tuple[bool, str], _Class] = {}
    errors: dict[str, list[int]] = {}
    # (rank, its class | ("why", the failure shared by rank) | ("line", its own error JSON))
    order: list[tuple[int, _Class | tuple[str, str]]] = []
    for rank, dump, error in items:
        if dump is None:
            line = error or "no data"
            head = f"rank {rank}: "
            if line.startswith(head) and "\n" not in line:
                why = line[len(head):]
                if why not in errors:
                    errors[why] = []
                    order.append((rank, ("why", why)))
                errors[why].append(rank)
            else:
                order.append((rank, ("line", json.dumps({"error": line}))))
            continue
        ident = _identity(dump)
        cls = by_identity.get(ident)
        t = dump.get(_TIME_KEY)
        timed = type(t) is int
        if cls is None:
            body = dict(map_lists(cap_entries(dump, cap), members.ref))
            if timed:
                del body[_TIME_KEY]
            text = json.dumps(body, default=str)
            cls = by_text.get((timed, text))
            if cls is None:
                cls = by_text[(timed, text)] = _Class(rank, text, t if timed else None)
                order.append((rank, cls))
                by_identity[ident] = cls
                continue
            by_identity[ident] = cls
        cls.ranks.append(rank)
        if timed:
            cls.times.append(t)
    parts = []
    same: dict[str, dict[str, str]] = {}
    lines: list[dict[str, str]] = []
    for rank, what in order:
        if isinstance(what, _Class):
            text = what.text
            if what.time is not None:
                text = (text[:-1] + ", " if text != "{}" else "{") + \
                    f"{json.dumps(_TIME_KEY)}: {what.time}}}"
            parts.append(f"{json.dumps(str(rank))}: {text}")
            if what.ranks:
                pairs = sorted(zip(what.ranks, what.times, strict=True)) if what.time is not None \
                    else [(r, 0) for r in sorted(what.ranks)]
                row = {"ranks": _format(r for r, _ in pairs)}
                if what.time is not None:
                    row[_TIME_KEY] = _times_text(what.time, [t for _, t in pairs])
                same[str(rank)] = row
        elif what[0] == "why":  # failed alike: one row when more than one rank
            ranks = errors[what[1]]
            if len(ranks) == 1:
                parts.append(f"{json.dumps(str(rank))}: "
                             f"{json.dumps({'error': f'rank {rank}: {what[1]}'})}")
            else:
                lines.append({"ranks": _format(ranks), "error": what[1]})
        else:
            parts.append(f"{json.dumps(str(rank))}: {what[1]}")
    if same:
        parts.append(f"{json.dumps(SAME_KEY)}: {json.dumps(same)}")
    if lines:
        parts.append(f"{json.dumps(ERRORS_KEY)}: {json.dumps(lines)}")
    if members.names:
        table = {name: _members_value(text) for text, name in members.names.items()}
        parts.append(f"{json.dumps(MEMBERS_KEY)}: {json.dumps(table)}")
    return "{" + ",\n".join(parts) + "}\n"


def _members_value(text: str) -> str | dict[str, str]:
    """A member list as written in the table: ``{"ranges": "0-131071"}`` where that gives the
    very text back (ascending, the torch schema's ``[0, 1, 2]`` spelling), else the text."""
    try:
        ranks = json.loads(text)
    except ValueError:
        return text
    if not (isinstance(ranks, list) and ranks and all(type(r) is int and r >= 0 for r in ranks)
            and all(a < b for a, b in zip(ranks, ranks[1:], strict=False))):
        return text
    ranges = _format(ranks)
    return {"ranges": ranges} if len(ranges) < len(text) and json.dumps(ranks) == text else text


def _members_text(value: Any, name: str) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and set(value) == {"ranges"}:
        return json.dumps(parse_rank_text(value["ranges"], f"{MEMBERS_KEY}[{name[:20]!r}]",
                                          MAX_RANK))
    return None


def encode_per_rank(items: Sequence[tuple[int, Mapping[str, Any] | None, str | None]],
                    cap: int = MAX_ENTRIES_PER_RANK) -> str:
    """The snapshot as written before the classes (one dump per rank): what old readers read,
    and the benchmark's "before" (``benchmarks/bench_dumps_scale.py``)."""
    members = _Members()
    parts = []
    for rank, dump, error in items:
        if dump is None:
            value = json.dumps({"error": error or "no data"})
        else:
            value = json.dumps(map_lists(cap_entries(dump, cap), members.ref), default=str)
        parts.append(f"{json.dumps(str(rank))}: {value}")
    if members.names:
        table = {name: text for text, name in members.names.items()}
        parts.append(f"{json.dumps(MEMBERS_KEY)}: {json.dumps(table)}")
    return "{" + ",\n".join(parts) + "}\n"


def _format(ranks: Iterable[int]) -> str:
    return ",".join(rank_ranges(ranks))


def _parse_times(raw: Any, first: int, n: int, where: str) -> list[int]:
    if not isinstance(raw, str):
        raise ValueError(f"{where}: dump_time_ns is not text")
    out: list[int] = []
    t = first
    for tok in raw.split(",") if raw else ():
        d, star, count = tok.partition("*")
        try:
            step, k = int(d), int(count) if star else 1
        except ValueError:
            raise ValueError(f"{where}: {tok[:20]!r} is not a time difference") from None
        if k < 1 or len(out) + k > n:
            raise ValueError(f"{where}: more times than ranks")
        for _ in range(k):
            t += step
            out.append(t)
    if len(out) != n:
        raise ValueError(f"{where}: {len(out)} times for {n} ranks")
    return out


def _expand_classes(obj: dict[str, Any]) -> None:
    same = obj.pop(SAME_KEY, None)
    errors = obj.pop(ERRORS_KEY, None)
    added: dict[str, Any] = {}
    if same is not None:
        if not isinstance(same, dict):
            raise ValueError(f"{SAME_KEY} is not a map")
        for rep_key, row in same.items():
            where = f"{SAME_KEY}[{str(rep_key)[:20]!r}]"
            rep = obj.get(rep_key)
            if not isinstance(rep, dict) or set(rep) == {"error"}:
                raise ValueError(f"{where}: names no dump of the snapshot")
            if not isinstance(row, dict):
                raise ValueError(f"{where}: not a map")
            ranks = parse_rank_text(row.get("ranks"), where, MAX_RANK)
            first = rep.get(_TIME_KEY)
            times: list[int] | None = None
            if _TIME_KEY in row:
                if type(first) is not int:
                    raise ValueError(f"{where}: times for a dump without {_TIME_KEY}")
                times = _parse_times(row[_TIME_KEY], first, len(ranks), where)
            for i, r in enumerate(ranks):
                key = str(r)
                if key in obj or key in added:
                    raise ValueError(f"{where}: rank {r} twice")
                d = dict(rep)  # shares every part with the representative (the live sharing)
                if times is not None:
                    d[_TIME_KEY] = times[i]
                added[key] = d
    if errors is not None:
        if not isinstance(errors, list):
            raise ValueError(f"{ERRORS_KEY} is not a list")
        for i, row in enumerate(errors):
            where = f"{ERRORS_KEY}[{i}]"
            if not isinstance(row, dict) or not isinstance(row.get("error"), str):
                raise ValueError(f"{where}: not a map with an error line")
            why = row["error"]
            for r in parse_rank_text(row.get("ranks"), where, MAX_RANK):
                key = str(r)
                if key in obj or key in added:
                    raise ValueError(f"{where}: rank {r} twice")
                added[key] = {"error": f"rank {r}: {why}"}
    if len(obj) + len(added) > MAX_RANK + 1:
        raise ValueError(f"more than {MAX_RANK + 1} ranks")
    obj.update(added)


def expand(obj: Any) -> Any:
    """A loaded snapshot with shared member lists put back inline and every rank of a class
    given its own entry again (the torch schema, one key per rank).

    A member reference that names no list is left as it is, for the dump check to refuse with
    its own one-line reason; a class map that is not one raises ``ValueError`` (one line).
    Anything that is not a snapshot dict is returned unchanged.
    """
    if not isinstance(obj, dict):
        return obj
    table = obj.pop(MEMBERS_KEY, None)
    if isinstance(table, dict):
        table = {k: _members_text(v, str(k)) for k, v in table.items()}
        for dump in obj.values():
            cfg = dump.get("pg_config") if isinstance(dump, dict) else None
            if not isinstance(cfg, dict):
                continue
            for c in cfg.values():
                raw = c.get("ranks") if isinstance(c, dict) else None
                if isinstance(raw, str) and raw.startswith(_REF):
                    text = table.get(raw[len(_REF):])
                    if isinstance(text, str):
                        c["ranks"] = text
    if SAME_KEY in obj or ERRORS_KEY in obj:
        _expand_classes(obj)
    return obj


def load(path: str, max_bytes: int) -> tuple[dict[int, dict[str, Any]], dict[int, str], int]:
    """(rank -> dump, rank -> why it has none, world size) of an ``fr_snapshot_<ts>.json``, for
    the ``fr_trace`` CLI. The ranks of a class come back as shallow copies of its dump
    (:func:`expand`), checked once per class (``dumpio.validate_dump``; one that fails is a
    rank without data). Raises ``OSError``, or ``ValueError`` of one line for a file that is
    not a snapshot."""
    name = os.path.basename(path)
    size = os.path.getsize(path)
    if size > max_bytes:
        raise ValueError(f"{size} bytes is over the {max_bytes >> 30} GiB limit")
    with open(path, "rb") as f:
        obj = expand(json.loads(f.read()))
    if not isinstance(obj, dict):
        raise ValueError(f"top level is {type(obj).__name__}")
    dumps: dict[int, dict[str, Any]] = {}
    unavailable: dict[int, str] = {}
    checked: dict[tuple[int, ...], tuple[Any, str | None]] = {}
    for key, value in obj.items():
        key = str(key)
        if not (key.isascii() and key.isdigit()) or int(key) > MAX_RANK:
            raise ValueError(f"{key[:40]!r} is not a rank number")
        rank = int(key)
        if isinstance(value, dict) and set(value) == {"error"}:
            line = str(value["error"]).splitlines()[0][:300] if value["error"] else ""
            unavailable[rank] = line or f"rank {rank}: no data"
            continue
        parts = ((id(value.get("entries")), id(value.get("pg_config")), id(value.get("version")))
                 if isinstance(value, dict) else None)
        seen = checked.get(parts) if parts is not None else None
        if seen is None:
            try:
                validate_dump(value, f"{name} rank {rank}")
                seen = (value, None)
            except DumpError as e:
                seen = (value, str(e))
            if parts is not None:
                checked[parts] = seen
        if seen[1] is None:
            dumps[rank] = value
        else:
            unavailable[rank] = f"unusable dump: {seen[1].split(': ', 1)[-1]}"
    ranks = set(dumps) | set(unavailable)
    configs = {id(c): c for d in dumps.values() if isinstance(c := d.get("pg_config"), dict)}
    for cfg in configs.values():  # shared by the ranks of a class: read once
        for c in cfg.values():
            try:
                ranks.update(r for r in group_members(c.get("ranks", "[]")) if 0 <= r <= MAX_RANK)
            except (DumpError, AttributeError):
                continue
    return dumps, unavailable, max(ranks) + 1 if ranks else 0
