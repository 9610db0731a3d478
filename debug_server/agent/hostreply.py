"""An agent's ``agent_fr``/``agent_stacks`` reply body, made from its host's ranks' records.

What makes an agent's reply small and cheap to compare (``protocol.agentwire``, read back by
``fanout.agentreply``): each distinct body once (:func:`records`), long member lists and
call-site stacks once per reply (:func:`share_lists`, :func:`share_frames`), the host's mismatch
signatures (:func:`signatures`), and the reply's :func:`fr_tag`, computed before any dump is
parsed, with an "unchanged" reply carrying only records and read times (:func:`unchanged_reply`).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from debug_server.analysis.digest import SNAPSHOT_TIME_KEY
from debug_server.fanout.reply import FrData
from debug_server.fanout.transport import RankResult
from debug_server.protocol import addrs, fastjson, members
from debug_server.protocol.agentwire import (
    NOT_ASKED_DATA,
    SAME,
    SNAP,
    TAG,
    StackClasses,
    classes_obj,
    times_obj,
)


def records(results: Sequence[RankResult], with_body: bool) -> tuple[list[dict[str, Any]],
                                                                      list[str]]:
    """Rank records, and with ``with_body`` each distinct body once (``"body"``: index). Ranks
    whose records agree but for their reply time share one row (``"ranks"``: their range
    text, ``"elapsed_s"``: the longest): a thousand ranks that answered alike are one row."""
    texts: list[str] = []
    index: dict[str, int] = {}
    rows: list[dict[str, Any]] = []
    # What a row says but for its rank and reply time -> (the row, its ranks): an aggregator
    # writes 1024 records a reply, each but the first of a kind a lookup and an append.
    alike: dict[tuple[Any, ...], tuple[dict[str, Any], list[int]]] = {}
    for r in results:
        i = None
        if with_body and r.body is not None:
            i = index.get(r.body)
            if i is None:
                i = index[r.body] = len(texts)
                texts.append(r.body)
        if r.process is not None:  # read per rank on its host: its own row
            rows.append(_row(r, i))
            continue
        key = (r.status, r.error, r.http_status, r.note or None, i)
        held = alike.get(key)
        if held is None:
            row = _row(r, i)
            del row["rank"]
            held = alike[key] = (row, [])
            rows.append(row)
        elif r.elapsed_s > held[0]["elapsed_s"]:
            held[0]["elapsed_s"] = round(r.elapsed_s, 4)
        held[1].append(r.rank)
    for row, ranks in alike.values():
        if len(ranks) == 1:
            row["rank"] = ranks[0]
        else:
            row["ranks"] = addrs.format_ranks(ranks)
    return rows, texts


def _row(r: RankResult, body: int | None) -> dict[str, Any]:
    """A record's row: its summary less its URL (the asker knows its ranks' addresses)."""
    row = r.summary()
    del row["url"]
    if body is not None:
        row["body"] = body
    return row


def signatures(dumps: Mapping[int, Mapping[str, Any]]) -> dict[str, dict[str, dict[str, str]]]:
    """Per group and collective seq, each distinct ``op sizes dtypes`` with the ranks that issued
    it (their range text, ``0-1023``): the host's part of the mismatch check, in a few bytes per
    op whatever the ranks (an aggregator's thousand ranks that agree are one short text)."""
    out: dict[str, dict[str, dict[str, list[int]]]] = {}
    texts: dict[str, str] = {}  # repr of the fields -> their JSON (one encode per distinct op)
    for rank, d in sorted(dumps.items()):
        entries = d.get("entries")
        for e in entries if isinstance(entries, list) else ():
            try:
                g = str(e["process_group"][0])
                seq = int(e["collective_seq_id"])
                name = str(e["profiling_name"]).partition(":")[2] or str(e["profiling_name"])
            except (KeyError, TypeError, ValueError, IndexError):
                continue
            if name.partition(" ")[0] in ("send", "recv"):
                continue
            fields = [name, e.get("input_sizes"), e.get("input_dtypes"), e.get("output_sizes")]
            key = repr(fields)
            sig = texts.get(key)
            if sig is None:
                sig = texts[key] = json.dumps(fields, separators=(",", ":"))
            out.setdefault(g, {}).setdefault(str(seq), {}).setdefault(sig, []).append(rank)
    return {g: {seq: {sig: addrs.format_ranks(rs) for sig, rs in sigs.items()}
                for seq, sigs in by_seq.items()} for g, by_seq in out.items()}


def share_lists(dumps: Mapping[int, Mapping[str, Any]],
                 known: frozenset[str]) -> tuple[dict[str, Mapping[str, Any]], dict[str, str]]:
    """Dumps with each long member list as a reference, and the lists the frontend lacks."""
    lists: dict[str, str] = {}

    def ref(text: str) -> str:
        d = members.digest(text)
        if d not in known:
            lists[d] = text
        return d

    return {str(r): members.map_lists(d, ref) for r, d in dumps.items()}, lists


def share_frames(dumps: Mapping[str, Mapping[str, Any]]) -> tuple[dict[str, Any], list[Any]]:
    """Dumps whose entries name their call-site stack by index into one list of the distinct
    stacks: the ranks of a host issue the same ops from the same lines, and a real stack is
    most of an entry's bytes."""
    frame_sets: list[Any] = []
    index: dict[str, int] = {}
    out: dict[str, Any] = {}
    for r, d in dumps.items():
        entries = d.get("entries")
        if not isinstance(entries, list):
            out[r] = d
            continue
        shared = []
        for e in entries:
            frames = e.get("frames") if isinstance(e, dict) else None
            if not isinstance(frames, list):
                shared.append(e)
                continue
            key = repr(frames)  # equal stacks read from JSON print alike
            i = index.get(key)
            if i is None:
                i = index[key] = len(frame_sets)
                frame_sets.append(frames)
            shared.append({**e, "frames": i})
        out[r] = {**d, "entries": shared}
    return out, frame_sets


_SNAP_RE = re.compile(r'"' + SNAPSHOT_TIME_KEY + r'"\s*:\s*-?\d+')


def fr_tag(q: Mapping[str, str], results: Sequence[RankResult]) -> str:
    """What one ``agent_fr`` reply for query ``q`` holds, as a short hash: the question, this
    agent's member lists, and each rank's status and reply text less its read time
    (``dump_time_ns`` changes on every ask of a live rank; a hung one's ring does not). For the
    default ask, ``results`` are the first round's (the rest follows from them)."""
    h = hashlib.blake2b(digest_size=12)
    h.update(json.dumps(sorted((k, v) for k, v in q.items() if k not in NOT_ASKED_DATA),
                        separators=(",", ":")).encode())
    h.update((members.known_param() or "").encode())
    for r in results:
        h.update(f"\0{r.rank}\0{r.status}\0".encode())
        h.update(_SNAP_RE.sub("", r.body or "").encode(errors="replace"))
    return h.hexdigest()


Parts = Mapping[str, Sequence[RankResult]]
"""What a reply carries next to the FR data (``agentwire.READ_PARTS``): each part's name
(``"stacks"``, ``"health"``) -> the ranks' records of it."""


def read_parts(parts: Parts | None) -> dict[str, Any]:
    """``stacks=true`` (and ``health=true``): each part's records as ``agent_stacks`` sends
    them (``"ranks"``, ``"bodies"``), under its name."""
    out: dict[str, Any] = {}
    for name, results in (parts or {}).items():
        rows, texts = records(results, with_body=True)
        out[name] = {"ranks": rows, "bodies": texts}
    return out


def read_times(results: Sequence[RankResult]) -> dict[str, Any]:
    """Each answering rank's read time (``dump_time_ns``), read off its reply text (no parse),
    as the wire sends them (``agentwire.times_obj``)."""
    snap: dict[int, int | None] = {}
    for r in results:
        if r.ok:
            m = _SNAP_RE.search(r.body or "")
            snap[r.rank] = int(m.group(0).rpartition(":")[2]) if m else None
    return times_obj(snap)


def unchanged_reply(host: str, results: Sequence[RankResult], tag: str,
                    parts: Parts | None = None,
                    snap: Mapping[str, Any] | None = None) -> str:
    """The records and each rank's read time, read off its reply text (no parse) unless
    given (``snap``: an aggregator's, from the dumps its hosts sent)."""
    rows, _ = records(results, with_body=False)
    return fastjson.dumps({"host": host, "ranks": rows, TAG: tag, "unchanged": True,
                           SNAP: read_times(results) if snap is None else snap,
                           **read_parts(parts)})


_HOST_NOTE = re.compile(r"via agent [^;]+$")
HOST_NOTE = "via its host's agent"


def fold_notes(results: Sequence[RankResult] | None) -> None:
    """An aggregator's records: "via agent <host>" becomes "via its host's agent", so the ranks
    of all its hosts that answered alike share one row (``records``); a rank it asked directly
    (its host's agent failed) keeps no such note."""
    for r in results or ():
        if r.note:
            r.note = _HOST_NOTE.sub(HOST_NOTE, r.note)


def fold_stacks(results: Sequence[RankResult] | None) -> None:
    """An aggregator's records of its ranks' stacks: their notes folded (``fold_notes``), and a
    text that reads as an earlier rank's but for thread ids (``agentwire.stack_class``) becomes
    that rank's text object, so its ~1024 ranks waiting at one line are one row and one text on
    the way up, not one each (each process prints its own thread ids). A rank's own ids are
    then its host agent's to show."""
    fold_notes(results)
    first: dict[str, str] = {}
    class_of = StackClasses()
    for r in results or ():
        if r.ok and r.body is not None:
            r.body = first.setdefault(class_of(r.body), r.body)


def dump_times(dumps: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """Each rank's read time from its parsed dump (an aggregator's ranks' bodies are parsed),
    as the wire sends them (``agentwire.times_obj``)."""
    return times_obj({r: t if type(t := d.get(SNAPSHOT_TIME_KEY)) is int else None
                      for r, d in dumps.items()})


def group_tag(q: Mapping[str, str], results: Sequence[RankResult], key: Any) -> str:
    """An aggregator's tag: the question, the asker's member lists, the ranks' statuses and its
    host agents' tags (``AgentRoute.last_key``: every rank came through a host agent that
    tagged its reply, and the cut was the last one's). "" where ``key`` is None: no conditional
    ask then."""
    if key is None:
        return ""
    h = hashlib.blake2b(digest_size=12)
    h.update(json.dumps(sorted((k, v) for k, v in q.items() if k not in NOT_ASKED_DATA),
                        separators=(",", ":")).encode())
    h.update((members.known_param() or "").encode())
    h.update(repr(key).encode())
    for r in results:
        h.update(f"\0{r.rank}\0{r.status}".encode())
    return "g" + h.hexdigest()


def share_same(dumps: Mapping[str, Mapping[str, Any]]) -> tuple[dict[str, Any], list[Any]]:
    """Ranks whose dumps read the same but for their read time, as one dump: ``"same"`` lists
    each dump sent with the other ranks that read as it and their own read times
    (``agentwire.classes_obj``). What goes up a level grows with the distinct behaviours, not
    with the ranks (an aggregator's thousand ranks in a few dumps)."""
    first: dict[str, str] = {}
    out: dict[str, Any] = {}
    same: dict[int, dict[int, int | None]] = {}
    for r, d in dumps.items():
        rest = {k: v for k, v in d.items() if k != SNAPSHOT_TIME_KEY}
        text = fastjson.dumps(rest, default=str)
        rep = first.get(text)
        if rep is None:
            first[text] = r
            out[r] = d
        else:
            t = d.get(SNAPSHOT_TIME_KEY)
            same.setdefault(int(rep), {})[int(r)] = t if type(t) is int else None
    return out, classes_obj(same)



def data_part(fr: FrData, known: frozenset[str]) -> str:
    """A full reply's data, as JSON text: what its tag stands for (the ranks' windows and the
    asker's lists), so the same text serves any asker of the same tag (``app.LAST_FULL``)."""
    dumps, lists = share_lists(fr.dumps, known)
    dumps, frame_sets = share_frames(dumps)
    dumps, same = share_same(dumps)
    return fastjson.dumps({"dumps": dumps, SAME: same, "lists": lists, "frames": frame_sets,
                           "window": fr.window, "signatures": signatures(fr.dumps)}, default=str)


def with_part(host: str, results: Sequence[RankResult], tag: str, part: str,
              parts: Parts | None, snap: Mapping[str, Any] | None,
              ) -> str:
    """A full reply: this ask's records (and its read parts, and read times where the data part was
    made for an earlier ask) around the data part's text (``data_part``: an object, whose
    members follow the head's)."""
    rows, _ = records(results, with_body=False)
    head = fastjson.dumps({"host": host, "ranks": rows, TAG: tag,
                           **({SNAP: snap} if snap is not None else {}),
                           **read_parts(parts)}, default=str)
    return head[:-1] + "," + part[1:]


__all__ = ["HOST_NOTE", "data_part", "dump_times", "fold_notes", "fold_stacks", "fr_tag", "group_tag", "read_times", "records",
           "Parts", "read_parts", "share_frames", "share_lists", "share_same", "signatures",
           "unchanged_reply", "with_part"]
