"""Reading and writing per-rank Flight Recorder dumps (torch FR schema).

Shared by the recording side (writes) and the analyzer (reads). Pure: no torch, no server code.
Pickles are written atomically (temp name in the same directory, then rename) and read back
with a restricted unpickler that only builds plain containers and scalars, so a hostile file
cannot run code.
"""

from __future__ import annotations

import functools
import io
import json
import logging
import os
import pickle
import re
import tempfile
from typing import Any

from debug_server.errors import first_line

logger = logging.getLogger(__name__)

FR_VERSION = "2.10"

# Only these globals may appear in a dump pickle. Protocol-level containers (dict, list, tuple,
# str, int, float, bool, None, bytes) need no global at all; sets and frozensets do.
_ALLOWED_GLOBALS = {
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class DumpError(ValueError):
    """A dump file that cannot be used; the message is one line naming the file and why."""


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused global {module}.{name}")


def safe_loads(data: bytes) -> Any:
    """Unpickle ``data`` allowing only plain containers and scalars (never runs code)."""
    return _RestrictedUnpickler(io.BytesIO(data)).load()


def write_dump_atomic(path: str, dump: dict[str, Any]) -> str:
    """Pickle ``dump`` to ``path`` atomically and return the path.

    The temp file is created in the target directory without the target's name prefix, so a
    reader globbing ``rank_*`` never sees a half-written file.
    """
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    write_atomic(path, pickle.dumps(dump, protocol=4))
    return path


def write_atomic(path: str, data: str | bytes) -> None:
    """Write to a hidden temp file in the same directory, then rename over ``path``.

    The temp name (``.tmp_*.part``) never matches a dump prefix, so readers never see a
    half-written file; on any failure the temp file is removed and the error propagates.
    """
    directory = os.path.dirname(os.path.abspath(path)) or "."
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp_", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# A plain literal list of ints, e.g. "[0, 1, 2]" or "[]". PyTorch's analyzer eval()s this field;
# we accept only what this pattern admits and parse it with json, so a hostile string is refused.
_RANKS_RE = re.compile(r"^\s*\[\s*(?:-?\d+\s*(?:,\s*-?\d+\s*)*)?\]\s*$")
_REQUIRED_KEYS = ("version", "entries")
_MAX_RANKS_TEXT = 10_000_000


def parse_ranks(value: Any) -> list[int]:
    """Parse ``pg_config[*]["ranks"]`` ("[0, 1]" or a list of ints) without eval.

    Raises :class:`DumpError` for anything else (a string that is not a plain literal list of
    ints, floats, nested lists, booleans).
    """
    if isinstance(value, (list, tuple)):
        if all(type(r) is int for r in value):
            return list(value)
        raise DumpError(f"ranks is not a list of ints: {value!r:.80}")
    if isinstance(value, str) and len(value) < _MAX_RANKS_TEXT and _RANKS_RE.match(value):
        return json.loads(value)
    raise DumpError(f"refused pg_config ranks {value!r:.80} (not a plain list of ints)")


class Members(tuple):  # the cached hash lives in __dict__: tuple subclasses take no slots
    """A group's sorted member ranks whose hash is computed once.

    Every rank's digest holds its groups' member tuples, and the analyzer hashes them per rank
    (sets, dict keys): for a 16384-member group that is 16384 ints each time, 0.16 ms, and
    2.6 s over 16384 ranks. Shared by all ranks (:func:`group_members`) and hashed once, it is
    O(1) after the first.
    """

    def __hash__(self) -> int:
        h = self.__dict__.get("_hash")
        if h is None:
            h = self.__dict__["_hash"] = tuple.__hash__(self)
        return h


@functools.lru_cache(maxsize=4096)
def _members_text(value: str) -> tuple[int, ...]:
    return Members(sorted(set(parse_ranks(value))))


def group_members(value: Any) -> tuple[int, ...]:
    """:func:`parse_ranks`, sorted and without duplicates, parsed once per distinct text.

    Every member of a group carries the same member list, so over N ranks the text of the
    world group is parsed once, not N times (at 16384 ranks that is O(N) against O(N^2)).
    Raises :class:`DumpError` as :func:`parse_ranks` does.
    """
    if isinstance(value, str):
        return _members_text(value)
    return tuple(sorted(set(parse_ranks(value))))


def _version_tuple(version: Any) -> tuple[int, int] | None:
    if not isinstance(version, str):
        return None
    m = re.fullmatch(r"(\d+)\.(\d+)", version.strip())
    return (int(m.group(1)), int(m.group(2))) if m else None


def validate_dump(dump: Any, source: str = "dump") -> dict[str, Any]:
    """Check the top-level shape of one rank's dump; return it or raise :class:`DumpError`.

    Entries themselves are not checked one by one here (the analyzer skips a bad entry with a
    note); what is refused is what would make the whole file meaningless or unsafe: not a dict,
    missing ``version``/``entries``, a version other than 2.x, ``pg_config`` ranks that are not a
    plain literal list of ints.
    """
    if not isinstance(dump, dict):
        raise DumpError(f"{source}: not an FR dump (top level is {type(dump).__name__}, not dict)")
    missing = [k for k in _REQUIRED_KEYS if k not in dump]
    if missing:
        raise DumpError(f"{source}: not an FR dump (missing {', '.join(missing)})")
    vt = _version_tuple(dump["version"])
    if vt is None or vt[0] != 2:
        raise DumpError(f"{source}: unsupported FR version {dump['version']!r:.40} (need 2.x)")
    if not isinstance(dump["entries"], list):
        raise DumpError(f"{source}: entries is {type(dump['entries']).__name__}, not a list")
    pg_config = dump.get("pg_config", {})
    if not isinstance(pg_config, dict):
        raise DumpError(f"{source}: pg_config is {type(pg_config).__name__}, not a dict")
    for name, cfg in pg_config.items():
        if not isinstance(cfg, dict):
            raise DumpError(f"{source}: pg_config[{name!r:.40}] is not a dict")
        if "ranks" in cfg:
            try:
                parse_ranks(cfg["ranks"])
            except DumpError as e:
                raise DumpError(f"{source}: pg_config[{name!r:.40}]: {e}") from None
    return dump


def loads_dump(data: bytes, source: str = "dump") -> dict[str, Any]:
    """Decode one dump from bytes (pickle via :func:`safe_loads`, or JSON) and validate it."""
    head = data[:64].lstrip()
    if not head:
        raise DumpError(f"{source}: empty file")
    if head[:1] in (b"{", b"["):
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise DumpError(f"{source}: invalid JSON ({first_line(e, 80)})") from None
    elif data[:1] == b"\x80":
        try:
            obj = safe_loads(data)
        except pickle.UnpicklingError as e:
            msg = first_line(e, empty="invalid pickle")
            if msg.startswith("refused global"):
                raise DumpError(f"{source}: {msg} (not a plain FR dump)") from None
            if "truncated" in msg or "ran out" in msg.lower():
                raise DumpError(f"{source}: truncated pickle") from None
            raise DumpError(f"{source}: invalid pickle ({msg:.80})") from None
        except (EOFError, IndexError):
            raise DumpError(f"{source}: truncated pickle") from None
        except Exception as e:  # noqa: BLE001 - any decoder failure means "unusable file"
            raise DumpError(f"{source}: invalid pickle ({type(e).__name__})") from None
    else:
        raise DumpError(f"{source}: not a pickle or JSON FR dump")
    return validate_dump(obj, source)


def load_dump(path: str) -> dict[str, Any]:
    """Read and validate one per-rank dump file (pickle or JSON); raise :class:`DumpError`."""
    source = os.path.basename(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise DumpError(f"{source}: cannot read ({e.strerror or e})") from None
    return loads_dump(data, source)


# ``<prefix><rank>`` (what torch's dumper writes) or ``<prefix><rank>.json``. ASCII digits only:
# str.isdigit() also admits "²" and other digits that int() then rejects or reads differently.
_RANK_SUFFIX_RE = re.compile(r"^(.*?)([0-9]+)(\.json)?$", re.ASCII)
_RANK_REST_RE = re.compile(r"^([0-9]+)(\.json)?$", re.ASCII)
MAX_RANK = 1 << 20
"""Rank numbers in file names above this are refused (a typo must not make a 10^12-rank job)."""


def infer_prefix(names: list[str]) -> str | None:
    """The common prefix of ``<prefix><rank>[.json]`` file names, or None when not unique.

    Like PyTorch's loader: every name ending in a rank number (before an optional ``.json``)
    proposes its head; exactly one proposal means that is the prefix.
    """
    prefixes = {m.group(1) for n in names if (m := _RANK_SUFFIX_RE.match(n))}
    return next(iter(prefixes)) if len(prefixes) == 1 else None


STALLED_STACKS_PREFIX = "stalled_stacks_r"
"""Name prefix of the stall watchdog's stacks file in the per-rank dump directory."""


def rank_files(directory: str, prefix: str | None = None) -> tuple[dict[int, str], list[str]]:
    """Map rank -> path for the dump files in ``directory`` named ``<prefix><rank>[.json]``.

    Either name may hold a pickle or JSON (:func:`loads_dump` looks at the bytes, not the
    name). When a rank has both forms, the one without ``.json`` (what torch's dumper writes)
    is used and the other skipped with a note. Returns ``(files, notes)``; notes name the files
    that were skipped and why. Hidden files (``.tmp_*`` being written) are ignored. Raises
    :class:`DumpError` if the directory is unreadable or the prefix cannot be inferred.
    """
    try:
        names = sorted(n for n in os.listdir(directory) if not n.startswith("."))
    except OSError as e:
        raise DumpError(f"{directory}: cannot list ({e.strerror or e})") from None
    names = [n for n in names if os.path.isfile(os.path.join(directory, n))]
    if prefix is None:
        prefix = infer_prefix(names)
        if prefix is None:
            if not any(_RANK_SUFFIX_RE.match(n) for n in names):
                return {}, [f"skipped {n}: no rank number in the name" for n in names]
            raise DumpError(
                f"{directory}: cannot infer a common file prefix from "
                f"{', '.join(names[:4])}{'...' if len(names) > 4 else ''}"
            )
    files: dict[int, str] = {}
    is_json: dict[int, bool] = {}
    notes: list[str] = []
    for n in names:
        m = _RANK_REST_RE.match(n[len(prefix) :]) if n.startswith(prefix) else None
        if m is None:
            # The stall watchdog writes its stacks beside the pickles: ours, never a dump.
            if not n.startswith(STALLED_STACKS_PREFIX):
                notes.append(f"skipped {n}: not named {prefix}<rank>[.json]")
            continue
        rank, js = int(m.group(1)), m.group(2) is not None
        if rank > MAX_RANK:
            notes.append(f"skipped {n}: rank {rank} is above {MAX_RANK}")
            continue
        if rank in files:
            # Sorted names put "rank_3" before "rank_3.json"; keep the pickle torch writes.
            keep, drop = (files[rank], n) if not is_json[rank] or js else (n, files[rank])
            notes.append(f"skipped {os.path.basename(drop)}: rank {rank} already has "
                         f"{os.path.basename(keep)}")
            if keep == n:
                files[rank], is_json[rank] = os.path.join(directory, n), js
            continue
        files[rank], is_json[rank] = os.path.join(directory, n), js
    return files, notes
