"""The agent's routes as the frontend asks them (``agent/app.py`` answers them).

An agent serves its host's ranks under the workers' own route shape (``POST /handler/<name>``);
these are the names and the one conditional parameter both sides spell.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from debug_server.protocol.addrs import format_ranks, parse_ranks
from debug_server.protocol.names import (
    DUMP_FILE_HANDLER,
    HEALTH_HANDLER,
    PING_HANDLER,
    WITH_STACKS,
)

FR = "agent_fr"
STACKS = "agent_stacks"
FETCH = "agent_fetch"
INFO = "agent_info"
RECENT = "agent_recent"
"""The straggler poll's read (``fanout.recent``): with :data:`CLOCK` the agent's clock, read at
once; with :data:`OPS` each asked rank's newest collectives' times and its clock against the
agent's."""
CLOCK = "clock"
"""``agent_recent?clock=true``: only the agent's own clock (``{"dump_time_ns": ...}``)."""
OPS = "ops"
"""``agent_recent``: collectives per group wanted of each rank (its newest)."""
MAX_OPS = 4096
TAG = "tag"
"""``agent_fr``'s conditional ask: the ``tag`` of the asker's last reply for the same question;
when nothing but the ranks' read times changed since, the reply is ``"unchanged": true`` with
the rank records and each rank's ``dump_time_ns`` (``"snap"``) instead of the dumps."""
RANKS = "ranks"
"""Every agent route: the ranks asked, as ``0-3,5`` (``agent_launch.format_ranks``)."""
WHOLE = "whole"
"""``agent_fr``: whole rings (with ``onlyactive``: torch's FR parameter)."""
HANDLER = "handler"
"""``agent_fetch``: which worker handler to relay (one of :data:`FETCHABLE`)."""
EVERY = "every"
"""``agent_stacks``: py-spy for every rank, not only the stuck ones (with ``native``:
``names.NATIVE``, py-spy ``--native`` for every rank)."""
CLASSES = "classes"
"""``agent_stacks`` and ``agent_fr?stacks=true`` (an aggregator's ask of its host agents): the
ranks' stacks by class, a text that reads as an earlier rank's but for thread ids going as that
rank's text (``hostreply.fold_stacks``), so a host's ranks at one line send one text, not one
each. The aggregator folds its ranks so anyway on the way up; a frontend that asks a host agent
itself does not send it, and sees each rank's own thread ids."""
WITH_HEALTH = "health"
"""``agent_fr?stacks=true`` only: the ranks' health replies (``names.HEALTH_HANDLER``) come too,
under ``"health"`` as the stacks come under ``"stacks"`` (records, each distinct body once), so
a page that shows all three (the overview) asks each host once, not twice. An aggregator asks
its host agents so where it is asked so. An older agent refuses it (400 naming it): it is asked
without it from then on, and its ranks' health directly (``agents.AgentRoute``)."""
READ_PARTS = (WITH_STACKS, WITH_HEALTH)
"""What an ``agent_fr`` reply may carry next to the FR data, each read fresh with every reply
("unchanged" ones too), each under its own name: ``"stacks"``, ``"health"``."""
NOT_ASKED_DATA = (TAG, CLASSES, *READ_PARTS)
"""Parameters that change no FR data of an ``agent_fr`` reply (its tag, and what an asker
holds of it, leave them out): the asker's tag, whether and how the ranks' stacks and health
come along."""
FETCHABLE = frozenset({PING_HANDLER, HEALTH_HANDLER, DUMP_FILE_HANDLER})
"""Worker handlers ``agent_fetch`` relays (no parameters; the frontend asks the rest directly)."""


SNAP = "snap"
"""``agent_fr``: each answering rank's read time (``dump_time_ns``) where it is not in the
reply's dumps: an "unchanged" reply's, or a full reply made for an earlier ask's. Written by
:func:`times_obj`, read by :func:`read_times_obj`."""
SAME = "same"
"""``agent_fr``: ranks whose dumps read the same as a dump sent, as classes
(:func:`classes_obj`)."""


def times_obj(times: Mapping[int, int | None]) -> dict[str, Any]:
    """Ranks' read times on the wire: ``{"ranks": "0-1023", "ns": [t0, ..., t1023]}``, the
    times in ascending rank order (None: a rank whose reply had none). The frontend reads 131072
    of them on every page of a hung job: a list of ints parses in a fraction of a map's time
    (no key text per rank), and a rank is found without ``str(rank)``."""
    ranks = sorted(times)
    return {"ranks": format_ranks(ranks), "ns": [times[r] for r in ranks]}


def _times(ranks_text: Any, ns: Any, what: str) -> dict[int, int | None]:
    if not isinstance(ranks_text, str) or not isinstance(ns, list):
        raise ValueError(f"{what} is not ranks text and a list of times")
    ranks = parse_ranks(ranks_text)
    if len(ranks) != len(ns) or not set(map(type, ns)) <= {int, type(None)}:
        raise ValueError(f"{what}: the times do not match the ranks")
    return dict(zip(ranks, ns, strict=True))


def read_times_obj(obj: Any) -> dict[int, int | None]:
    """rank -> read time of a :func:`times_obj` (or of the older map ``{"<rank>": time}``);
    ValueError of one line for anything else."""
    if isinstance(obj, dict) and obj.keys() == {"ranks", "ns"}:
        return _times(obj["ranks"], obj["ns"], SNAP)
    if not isinstance(obj, dict):
        raise ValueError("snap is not an object")
    try:
        return {int(r): t if type(t) is int else None for r, t in obj.items()}
    except ValueError:
        raise ValueError("snap names a rank that is not a number") from None


def classes_obj(classes: Mapping[int, Mapping[int, int | None]]) -> list[Any]:
    """Ranks that share a dump sent, on the wire: ``[[rank sent, "1-1023", [their read
    times]], ...]`` (the rank sent -> each other rank's own read time)."""
    out = []
    for rep, times in classes.items():
        t = times_obj(times)
        out.append([rep, t["ranks"], t["ns"]])
    return out


def read_classes_obj(obj: Any) -> list[tuple[int, dict[int, int | None]]]:
    """(rank sent, {other rank: its read time}) of a :func:`classes_obj` (or of the older map
    ``{"<rank>": [rank sent, read time]}``); ValueError of one line for anything else."""
    if isinstance(obj, list):
        out = []
        for row in obj:
            if not (isinstance(row, list) and len(row) == 3 and type(row[0]) is int):
                raise ValueError("a same row is not [rank, ranks, times]")
            out.append((row[0], _times(row[1], row[2], SAME)))
        return out
    if not isinstance(obj, dict):
        raise ValueError("same is not a list")
    by_rep: dict[int, dict[int, int | None]] = {}
    for r, pair in obj.items():
        if not (isinstance(pair, list) and len(pair) == 2 and type(pair[0]) is int) or \
                not r.isdigit():
            raise ValueError("a same entry is not [rank, read time]")
        by_rep.setdefault(pair[0], {})[int(r)] = pair[1] if type(pair[1]) is int else None
    return list(by_rep.items())


_ID = re.compile(r"(?:0x[0-9a-fA-F]+|\d+)\b")


class StackClasses:
    """``stack_class`` per text object, made once: ranks alike share one text object on the way
    up (``hostreply.fold_stacks``), so 131072 ranks' texts are a few classes to make. Each text
    seen is held, so its id stays its own while this lives."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[str, str]] = {}

    def __call__(self, text: str) -> str:
        got = self._by_id.get(id(text))
        if got is None:
            got = self._by_id[id(text)] = (text, stack_class(text))
        return got[1]


def stack_class(text: str) -> str:
    """What ranks whose stacks read alike share: the text with its thread ids out (each process
    has its own: ``Thread 0x00007f3c...`` of faulthandler, ``Thread 12345`` of py-spy), so a
    job's ranks waiting at one line are one class, not one text each.

    The same as ``re.sub(r"\\b([Tt]hread) (0x[0-9a-fA-F]+|\\d+)\\b", r"\\1 <id>", ...)``, but
    by ``str.find``: 3 µs, not 33, for a rank's 1.8 KB of three threads (an aggregator makes
    one per rank of its ~1024, on every page)."""
    text = text.rstrip("\n")
    out = []
    i = 0
    find = text.find
    while (j := find("hread ", i)) >= 0:
        k = j + 6
        before = text[j - 2] if j >= 2 else " "
        if j >= 1 and text[j - 1] in "Tt" and not (before.isalnum() or before == "_"):
            m = _ID.match(text, k)
            if m is not None:
                out += (text[i:k], "<id>")
                i = m.end()
                continue
        out.append(text[i:k])
        i = k
    out.append(text[i:])
    return "".join(out)
