"""Cutting a whole c10d ring to a window from its JSON text, parsing only the entries it keeps.

torch's C++ worker answers ``fr_trace_json`` with its whole ring (about 0.9 MB for 2000 entries)
whatever it is asked, and the frontend cuts it to the window (``frwindow``) as it arrives.
Parsing the whole text was most of that cost (about 5 of 9 ms per ring on a 2-core box), and
a hung job's window is a handful of entries at the end of the ring. :func:`cut_text` gives
exactly what ``json.loads`` then the :class:`~frwindow.Window` would (same dump, same
``fr_window`` facts), reading the rest of the text with C-speed string searches only:

1. c10d writes compact JSON with sorted keys, so every entry is an object that begins with
   ``{"collective_seq_id":`` and the entries are the text between ``"entries":[`` and the
   ``]`` before the next top-level key. Inside JSON strings a ``"`` is always escaped, so that
   opening, and each ``"<key>":`` searched for below, can only be structure: splitting on the
   opening gives the entries' texts;
2. each entry's group, sequence number and creation time come from one regular-expression
   search each over the whole text (one match per entry, in ring order; checked by count);
3. the head (``pg_config``, ``pg_status``...) and every entry not yet retired
   (``"retired":false``) are parsed: enough for the window's frontier (``frwindow.frontier``
   reads only entries that are not done);
4. the entries the window keeps (a collective at or above its group's cut, or of a group the
   window keeps whole) are parsed, and the ``fr_window`` facts (ring size, oldest creation
   time) come from step 2.

Where any of this does not hold it returns None and the caller parses the whole text: a text
not in c10d's shape, P2P entries (a window keeps some completed ones: ``frwindow._pick``), or
anything that does not parse. Pure: no torch, no HTTP.
"""

from __future__ import annotations

import json
import re
from typing import Any

from debug_server.protocol.frwindow import WINDOW_KEY, Window, _facts

__all__ = ["cut_dump", "cut_text"]

_HEAD = '{"comm_lib_version":'
_ENTRIES = '"entries":['
_OPEN = '{"collective_seq_id":'
_SEP = "}," + _OPEN
_TAILS = ('],"nccl_comm_state":', '],"pg_config":')
_SEQ = re.compile(r'"collective_seq_id":(-?\d+)[,}]')
_GROUP = re.compile(r'"process_group":\["((?:[^"\\]|\\.)*)"')
_CREATED = re.compile(r'"time_created_ns":(-?\d+)[,}]')
# What frwindow._is_p2p reads as P2P: the op name after the first ":" is send or recv.
_P2P = re.compile(r'"profiling_name":"(?:[^":\\]*:)?(?:send|recv)[ "]')


def cut_text(body: str, win: Window) -> str | None:
    """``win`` applied to the c10d dump ``body`` (JSON text), as compact JSON text; None where
    the text is not what this reads (see the module doc): parse it whole instead."""
    cut = cut_dump(body, win)
    return None if cut is None else json.dumps(cut, separators=(",", ":"), default=str)


def cut_dump(body: str, win: Window) -> dict[str, Any] | None:
    """:func:`cut_text` as the dump itself, never encoded (the fan-out keeps replies parsed:
    ``fanout.reply``)."""
    return _cut(body, win)


def _cut(body: str, win: Window) -> dict[str, Any] | None:
    if not body.startswith(_HEAD):
        return None
    start = body.find(_ENTRIES)
    first = start + len(_ENTRIES)
    if start < 0 or not body.startswith(_OPEN, first):
        return None
    end = max(body.rfind(t) for t in _TAILS)
    if end < first:
        return None
    text = body[first:end]  # '{"collective_seq_id":...},...,{...}'
    if ("send" in text or "recv" in text) and _P2P.search(text):
        return None  # a window keeps some completed P2P ops: frwindow._pick decides those
    pieces = text.split(_SEP)
    n = len(pieces)
    # One of each per entry, in ring order (c10d's entries are flat objects of these keys).
    seqs, groups, created = _SEQ.findall(text), _GROUP.findall(text), _CREATED.findall(text)
    if not len(seqs) == len(groups) == len(created) == text.count('"retired":') == n:
        return None
    try:
        head_before = json.loads(body[:start].rstrip(",") + "}")
        head_after = json.loads("{" + body[end + 2:])
        if not isinstance(head_before, dict) or not isinstance(head_after, dict):
            return None
        # Every entry not retired: what the frontier reads (frwindow.frontier). Found from the
        # end of the ring, where a hung job's are.
        pending = []
        i, begin = n - 1, len(text) - len(pieces[-1])
        at = text.rfind('"retired":false')
        while at >= 0:
            while at < begin:
                i -= 1
                begin -= len(pieces[i]) + len(_SEP)
            pending.append(_entry(pieces, i))
            at = text.rfind('"retired":false', 0, begin)
        pending.reverse()
        head = {**head_before, **head_after}
        since = win.since_for({**head, "entries": pending})
        # Per group as written in the text: the first seq kept (-1: the group is kept whole).
        cuts = {g: since.get(json.loads(f'"{g}"'), -1) for g in set(groups)}
        if len(cuts) == 1:
            cut = next(iter(cuts.values()))
            picked = [i for i, seq in enumerate(map(int, seqs)) if seq >= cut]
        else:
            picked = [i for i, (g, seq) in enumerate(zip(groups, map(int, seqs), strict=True))
                      if seq >= cuts[g]]
        kept = [_entry(pieces, i) for i in picked]
    except (ValueError, TypeError):
        return None
    if any(type(e) is not dict for e in kept):
        return None
    oldest = _oldest(created)
    out: dict[str, Any] = {**head_before, "entries": kept, **head_after}
    out[WINDOW_KEY] = _facts(head.get(WINDOW_KEY), since, n, oldest)
    return out


def _oldest(created: list[str]) -> int:
    """The smallest non-zero creation time (``frwindow._pick``'s ``ring_oldest_ns``): compared
    as text where every one has the same number of digits (c10d's nanosecond clock), which
    orders them as numbers without converting 2000 of them."""
    if created and len(set(map(len, created))) == 1:
        low = min(created)  # of equal-length texts the least starts with the least digit
        if low[0] not in "-0":  # so none is negative or zero
            return int(low)
    return min((t for t in map(int, created) if t), default=0)


def _entry(pieces: list[str], i: int) -> Any:
    """Entry ``i`` parsed from its text (``pieces``: the entries' texts split on ``_SEP``)."""
    return json.loads((_OPEN if i else "") + pieces[i] + ("}" if i < len(pieces) - 1 else ""))
