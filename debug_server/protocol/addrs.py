"""Where the workers are, as every side names it: the store's keys, ``WorkerAddr``, ``Registry``.

A rank registers ``debug_server/rank{R}`` = ``http://<host>:<port>`` (the key torch's own debug
server uses, through the same ``PrefixStore``), then a sidecar ``debug_server/rank{R}_meta`` =
JSON ``{"restart", "run_id", "pid", "host", "start", "uid", ...}`` (``rank.discovery``); a host's
agent publishes ``debug_server/agent/<host id>`` and each of its ranks names it in its sidecar
(``"agent": <host id>``). Readers (``readers.storeview``, ``agent.registry``, ``fanout.agents``)
never block on a missing key: a rank that never registered is ``NOT_REGISTERED`` at once. A key
whose sidecar names another elastic restart is stale and not trusted (``stale_reason``); a key
without a sidecar (torch's C++ worker) is trusted. Pure: no torch, no store calls.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from debug_server.protocol import fastjson

PREFIX = "debug_server"
NOT_REGISTERED = "not registered"
AGENT_META_KEY = "agent"
"""Key of a rank's registration sidecar that names its host's agent."""
MAX_RANKS_PARAM = 64 * 1024


def url_key(rank: int) -> str:
    return f"rank{rank}"


def meta_key(rank: int) -> str:
    return f"rank{rank}_meta"


def agent_key(host_id: str) -> str:
    """The agent's store key under the ``debug_server`` prefix."""
    return f"agent/{host_id}"


def tree_hosts_key(restart: int) -> str:
    """A counter: how many hosts' agents joined the tree (``agent.tree``); each got the
    counter's value before its own add as its place."""
    return f"tree/{restart}/hosts"


def tree_size_key(restart: int) -> str:
    """The hosts per group of the tree (set by the first agent that joined)."""
    return f"tree/{restart}/size"


def tree_place_key(restart: int, place: int) -> str:
    """The host id of the agent at ``place`` in the tree."""
    return f"tree/{restart}/place/{place}"


def tree_group_key(restart: int, group: int) -> str:
    """Group ``group``'s aggregator: JSON ``url``, ``ranks``, ``hosts``, ``pid``."""
    return f"tree/{restart}/group/{group}"


@dataclass(slots=True, unsafe_hash=True)
class WorkerAddr:
    """Where rank ``rank``'s worker listens, or why it is not known (``url`` None).

    Read-only by convention: an address is shared by every list a registry read hands out
    (``storeview.same_as_before``) and never changed. Not a frozen dataclass: a read of 131072
    ranks made them in 0.24 s frozen (each field set through ``object.__setattr__``), 0.07 s
    plain; it hashes and compares as the frozen one did."""

    rank: int
    url: str | None
    error: str | None = None
    meta: dict[str, Any] | None = None
    """The registration sidecar (pid, host, signal-stacks info); None for torch's own worker."""


def meta_dict(raw: bytes | None) -> dict[str, Any] | None:
    """A rank's meta value as read from the store; None when absent or not a JSON object."""
    try:
        meta = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    return meta if isinstance(meta, dict) else None


def meta_dicts(raws: Mapping[int, bytes]) -> dict[int, dict[str, Any] | None]:
    """:func:`meta_dict` of many ranks' values, read as one JSON array where they make one of
    as many items (one parse, ``fastjson``'s: 131072 sidecars in 0.15 s by ``orjson``, 0.32 s
    by ``json``, 0.57 s one by one; their keys' texts shared); else, a value that is not one
    JSON item, each on its own. (Values made to read as two items where two others read as one
    would shift sidecars between ranks: only a writer of the store can make them, who can as
    well register any worker.)"""
    if raws:
        try:
            got = fastjson.loads(b"[" + b",".join(raws.values()) + b"]")
        except ValueError:
            got = None
        if isinstance(got, list) and len(got) == len(raws):
            return {r: m if isinstance(m, dict) else None for r, m in zip(raws, got, strict=True)}
    return {r: meta_dict(raw) for r, raw in raws.items()}


def stale_reason(meta_raw: bytes | None, restart_count: int) -> str | None:
    if meta_raw is None:
        return None  # no sidecar: torch's own worker, trusted
    try:
        meta: Any = json.loads(meta_raw)
        restart = int(meta["restart"])
    except (ValueError, KeyError, TypeError):
        return f"{NOT_REGISTERED} (unreadable registration metadata)"
    if restart != restart_count:
        return f"{NOT_REGISTERED} (stale key from restart {restart}, job is at restart {restart_count})"
    return None


class Registry(Protocol):
    """Where the workers are (``readers.storeview.StoreRegistry`` or ``StaticRegistry``)."""

    world_size: int

    async def lookup(self) -> list[WorkerAddr]: ...

    def close(self) -> None: ...


def rank_ranges(ranks: Iterable[int]) -> list[str]:
    """``[0, 1, 2, 5]`` -> ``["0-2", "5"]`` (sorted, ranges collapsed)."""
    return sorted_ranges(sorted(set(ranks)))


def sorted_ranges(rs: Sequence[int]) -> list[str]:
    """:func:`rank_ranges` of ranks already sorted and distinct, found in O(runs x log ranks)
    steps rather than one per rank (131072 ranks in two runs cost a few dozen steps)."""
    n = len(rs)
    parts: list[str] = []
    i = 0
    while i < n:
        first = rs[i]
        if i + 1 == n or rs[i + 1] != first + 1:
            parts.append(str(first))
            i += 1
            continue
        # rs[k] - k never decreases (sorted, distinct): a run is where it stays rs[i] - i.
        base = first - i
        lo, hi = i + 1, n - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if rs[mid] - mid == base:
                lo = mid
            else:
                hi = mid - 1
        parts.append(f"{first}-{rs[lo]}")
        i = lo + 1
    return parts


def parse_ranks(raw: str) -> list[int]:
    """``0-7,9`` -> [0, ..., 7, 9]; raises ValueError with one line."""
    if len(raw) > MAX_RANKS_PARAM:
        raise ValueError(f"longer than {MAX_RANKS_PARAM} characters")
    out: set[int] = set()
    for part in (p for p in raw.split(",") if p):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"{part[:20]!r} is not a rank or a range a-b")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a or b - a > 1 << 20:
            raise ValueError(f"bad range {part[:20]!r}")
        out.update(range(a, b + 1))
    return sorted(out)


def format_ranks(ranks: Sequence[int]) -> str:
    """The compact text of a rank list (``0-7,9``), what :func:`parse_ranks` reads back."""
    return ",".join(rank_ranges(ranks))
