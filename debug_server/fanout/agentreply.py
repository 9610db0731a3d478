"""Reading an agent's reply: one record per rank it served, and for ``agent_fr`` their dumps.

An agent (``agent``) answers for its host's ranks in one reply (``protocol.agentwire``): the
ranks' records (status, error, timing), each distinct body once (``agent_stacks``,
``agent_fetch``), and for ``agent_fr`` each rank's dump with its call-site stacks and long member
lists shared (``"frames"``, ``"lists"``), or ``"unchanged": true`` with only the read times. These
functions turn a reply into the records and parsed dumps the live collector's direct fetch
would have given; anything malformed raises ``ValueError`` (the agent is then skipped a while and
its ranks asked directly: ``agents.AgentRoute``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

from debug_server.analysis.digest import SNAPSHOT_TIME_KEY
from debug_server.fanout.transport import FAILED, GONE, OK, RankResult
from debug_server.protocol import addrs, agentwire, fastjson, members
from debug_server.protocol.addrs import NOT_REGISTERED, WorkerAddr


@dataclass(slots=True, frozen=True)
class AgentAddr:
    """One registered agent: its host id, URL and the ranks it serves."""

    id: str
    url: str
    ranks: frozenset[int]


def keep_parts(into: Mapping[str, list[RankResult]] | None,
               got: Mapping[str, list[RankResult]]) -> None:
    """An agent's records of the parts read with its FR (``agentwire.READ_PARTS``: stacks,
    health), each where it was asked for (ranks it does not serve left out: they are asked
    directly)."""
    for name, into_part in (into or {}).items():
        part = got.get(name)
        if part is None:
            continue
        if NOT_REGISTERED in map(_STATUS, part):
            into_part.extend(r for r in part if r.status != NOT_REGISTERED)
        else:  # the usual case, read in C (1024 records a reply from an aggregator)
            into_part.extend(part)


_STATUS = attrgetter("status")
_RANK = attrgetter("rank")


class _PerList:
    """A value made from a ranks list, held by the list's identity: a route's plan hands the
    same lists page after page (``agents.AgentRoute.plan``), each read several times a page.
    A host's few ranks too: an aggregator asks its 128 hosts each page, and the ``ranks`` text
    of 8 ranks costs ~2 us to make again, its URL map ~1 us, against ~0.3 us to look up.

    Held least recently used first out, within ``max_ranks`` ranks in all: a held value holds
    its list alive, so lists that are no longer handed out (a new read of the registry, a new
    split) go as new ones come, never piling up (they had: 3075 lists of 1024 ranks, one set
    per read of the registry, at 131072 ranks)."""

    def __init__(self, make: Any, max_ranks: int = 1 << 18) -> None:
        self._make = make
        self._held: OrderedDict[int, tuple[Sequence[WorkerAddr], Any]] = OrderedDict()
        self._ranks = 0
        self._max = max_ranks

    def __call__(self, rs: Sequence[WorkerAddr]) -> Any:
        held = self._held.get(id(rs))  # a held list is alive: its id is no other list's
        if held is not None:
            self._held.move_to_end(id(rs))
            return held[1]
        value = self._make(rs)
        self._held[id(rs)] = (rs, value)
        self._ranks += len(rs)
        while self._ranks > self._max and len(self._held) > 1:
            self._ranks -= len(self._held.popitem(last=False)[1][0])
        return value


ranks_param = _PerList(lambda rs: addrs.format_ranks([a.rank for a in rs]))
"""The ``ranks`` parameter naming ``rs`` (``0-1023``)."""
_urls = _PerList(lambda rs: {a.rank: a.url for a in rs})
"""rank -> its worker's URL, of ``rs``."""


def _records(row: Any, ag: AgentAddr, urls: Mapping[int, str | None],
             body: str | None) -> list[RankResult]:
    """One row's records: one rank's (``"rank"``), or every rank of ``"ranks"`` (their range
    text: ranks that answered alike, ``hostreply.records``)."""
    if not isinstance(row, dict) or not isinstance(row.get("status"), str):
        raise ValueError("a rank record is malformed")
    if type(row.get("rank")) is int:
        ranks = [row["rank"]]
    elif isinstance(row.get("ranks"), str):
        ranks = addrs.parse_ranks(row["ranks"])
    else:
        raise ValueError("a rank record names no rank")
    if not urls.keys() >= set(ranks):
        raise ValueError("a rank record names a rank not asked for")
    note = row.get("note") if isinstance(row.get("note"), str) else None
    via = f"via agent {ag.id}"
    note = f"{note}; {via}" if note else via
    elapsed = _elapsed(row)
    code = row.get("http_status")
    code = code if type(code) is int else None
    error = row.get("error") if isinstance(row.get("error"), str) else None
    status = row["status"]
    proc = row.get("process")  # read by the agent on the rank's host (readers.procstate)
    proc = proc if isinstance(proc, dict) else None
    return [RankResult(r, urls[r], status, body, error, elapsed, code, note, 0, None, proc)
            for r in ranks]


_HELD: dict[tuple[str, str], tuple[Mapping[int, str | None],
                                   dict[tuple[Any, ...], list[RankResult]]]] = {}
"""(agent id, part) -> (the URL map its records were made with, each OK row's records of its
last reply): ``_held_rows``."""
_HELD_MAX = 65536


def _row_key(row: Any) -> tuple[Any, ...] | None:
    """What makes an answered row's records, but for its reply time and body; None for any
    other row (a failed rank's record is made anew: its error may be relabelled on the way)."""
    if not isinstance(row, dict) or row.get("status") != OK or "process" in row:
        return None
    return (row.get("rank"), row.get("ranks"), row.get("note"), row.get("error"),
            row.get("http_status"))


def _held_rows(rows: Sequence[Any], ag: AgentAddr, urls: Mapping[int, str | None], part: str,
               body_of: Any) -> list[RankResult]:
    """Every row's records, where a row reads as it did in the agent's last reply of this
    ``part`` the same record objects again, with this reply's time and body: the hung case's
    unchanged replies rebuild no record (131072 records a page at the frontend, each made
    and freed), nor do the health replies, whose texts change with every page (the ages in
    them). The records of answered ranks are not changed on the way (only a failed rank's
    are: ``KeepLast._relabel``; those are made anew)."""
    held = _HELD.get((ag.id, part))
    # The same URLs (an aggregator's lists of its hosts' ranks are made per ask: compared)
    old = held[1] if held is not None and (held[0] is urls or held[0] == urls) else {}
    new: dict[tuple[Any, ...], list[RankResult]] = {}
    out: list[RankResult] = []
    for row in rows:
        body = body_of(row)
        key = _row_key(row)
        recs = old.get(key) if key is not None else None
        if recs is None:
            recs = _records(row, ag, urls, body)
        else:
            elapsed = _elapsed(row)
            if recs[0].elapsed_s != elapsed:
                for r in recs:
                    r.elapsed_s = elapsed
            # A text that reads as before keeps its object (ranks alike keep sharing one); an
            # aggregator's folded stacks (``hostreply.fold_stacks``) read otherwise and are set
            # to the row's text again, then folded again.
            if recs[0].body != body:
                for r in recs:
                    r.body = body
        if key is not None:
            new[key] = recs
        out += recs
    _put_held((ag.id, part), urls, new)
    return out


def _put_held(key: tuple[str, str], urls: Mapping[int, str | None],
              rows: dict[tuple[Any, ...], list[RankResult]]) -> None:
    if len(_HELD) >= _HELD_MAX:
        _HELD.clear()
    _HELD[key] = (urls, rows)


def _elapsed(row: Mapping[str, Any]) -> float:
    elapsed = row.get("elapsed_s")
    return float(elapsed) if isinstance(elapsed, int | float) else 0.0


def _load(body: str) -> dict[str, Any]:
    obj = fastjson.loads(body)
    if not isinstance(obj, dict) or not isinstance(obj.get("ranks"), list):
        raise ValueError("not an agent reply (no ranks list)")
    return obj


def parse_grouped(body: str, ag: AgentAddr,
                   rs: Sequence[WorkerAddr]) -> list[RankResult]:
    """``agent_stacks``/``agent_fetch``: records whose bodies are shared by index."""
    return _grouped_records(_load(body), ag, rs)


def _grouped_records(obj: dict[str, Any], ag: AgentAddr, rs: Sequence[WorkerAddr],
                     part: str | None = None) -> list[RankResult]:
    """Records whose bodies are shared by index; with ``part``, answered rows that read as in
    the agent's last reply of that part give the same records again (``_held_rows``)."""
    if not isinstance(obj.get("ranks"), list):
        raise ValueError("not an agent reply (no ranks list)")
    texts = obj.get("bodies")
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise ValueError("bodies is not a list of texts")

    def body_of(row: Any) -> str | None:
        i = row.get("body") if isinstance(row, dict) else None
        if i is not None and (type(i) is not int or not 0 <= i < len(texts)):
            raise ValueError("a body index is out of range")
        return texts[i] if i is not None else None

    urls = _urls(rs)
    if part is not None:
        return _held_rows(obj["ranks"], ag, urls, part, body_of)
    out = []
    for row in obj["ranks"]:
        out += _records(row, ag, urls, body_of(row))
    return out


def with_snap(dump: Mapping[str, Any], snap: Any) -> dict[str, Any]:
    out = dict(dump)
    if type(snap) is int:
        out[SNAPSHOT_TIME_KEY] = snap
    else:
        out.pop(SNAPSHOT_TIME_KEY, None)
    return out


_FrReply = tuple[list[RankResult], dict[int, dict[str, Any]], str, dict[int, int | None] | None,
                 dict[str, list[RankResult]]]


def parse_fr(body: str, ag: AgentAddr, rs: Sequence[WorkerAddr]) -> _FrReply:
    """``agent_fr``: records, each rank's dump with its member lists put back, the reply's tag,
    for an "unchanged" reply (no dumps) each rank's read time (else None), and the ranks'
    records of each part read with the FR (``agentwire.READ_PARTS``) that it carries, by name:
    the stacks where it was asked ``stacks=true``, the health where ``health=true``."""
    obj = _load(body)
    got_tag = obj.get(agentwire.TAG)
    tag = got_tag if isinstance(got_tag, str) else ""
    parts: dict[str, list[RankResult]] = {}
    for name in agentwire.READ_PARTS:
        part = obj.get(name)
        if part is not None:
            if not isinstance(part, dict):
                raise ValueError(f"{name} is not an object")
            parts[name] = _grouped_records(part, ag, rs, name)
    if obj.get("unchanged") is True:
        snap = obj.get(agentwire.SNAP)
        if snap is None or not tag:
            raise ValueError("an unchanged reply without its tag or read times")
        # An answered rank's body is "" (its dump is the held one), as in a full reply.
        recs = _held_rows(obj["ranks"], ag, _urls(rs), "fr", lambda row: "" if isinstance(
            row, dict) and row.get("status") == OK else None)
        return recs, {}, tag, agentwire.read_times_obj(snap), parts
    lists, raw = obj.get("lists", {}), obj.get("dumps", {})
    if not isinstance(lists, dict) or not isinstance(raw, dict):
        raise ValueError("lists or dumps is not an object")
    for text in lists.values():
        if isinstance(text, str):
            members.learn({"pg_config": {"_": {"ranks": text}}})
    frame_sets = obj.get("frames", [])
    if not isinstance(frame_sets, list):
        raise ValueError("frames is not a list")
    # A full reply the agent made for an earlier ask (agent.LAST_FULL) carries this ask's
    # read times apart.
    fresh = obj.get(agentwire.SNAP)
    fresh_times = agentwire.read_times_obj(fresh) if fresh is not None else None
    classes = agentwire.read_classes_obj(obj.get(agentwire.SAME, []))
    urls = _urls(rs)
    # An answered rank's body is "" (its dump is parsed already; the snapshot keys on a body).
    rows = [(row, _records(row, ag, urls, "" if isinstance(row, dict) and row.get(
        "status") in (OK, GONE) else None)) for row in obj["ranks"]]
    recs = [r for _, row_recs in rows for r in row_recs]
    answered = {r.rank for r in recs if r.ok}
    dumps: dict[int, dict[str, Any]] = {}
    for key, d in raw.items():
        rank = int(key) if key.isascii() and key.isdigit() else -1
        if rank not in answered:
            continue
        if not isinstance(d, dict):
            continue  # no dump of this rank: failed below
        entries = d.get("entries")
        for e in entries if isinstance(entries, list) else ():
            i = e.get("frames") if isinstance(e, dict) else None
            if type(i) is int:  # one shared list per distinct stack (agent.share_frames)
                if not 0 <= i < len(frame_sets):
                    raise ValueError("a frames index is out of range")
                e["frames"] = frame_sets[i]
        members.inline(d)
        members.learn(d)
        dumps[rank] = d if fresh_times is None else with_snap(d, fresh_times.get(rank))
    for rep, times in classes:
        # Ranks whose dumps read the same as another's (``hostreply.share_same``): each its own
        # top level (its read time) over the other's parts, shared by identity, which the
        # analysis and the window's cut read once for all of them.
        base = dumps.get(rep)
        if base is None:
            continue  # failed below
        if fresh_times is not None:
            times = {r: fresh_times.get(r) for r in times}
        dumps.update({r: with_snap(base, t) for r, t in times.items()
                      if r in answered and r not in dumps})
    if len(dumps) < len(answered):
        for r in recs:
            if r.ok and r.rank not in dumps:
                r.status, r.error, r.body = FAILED, f"rank {r.rank}: the agent sent no dump", None
    _hold(rows, ag, urls, "fr")
    return recs, dumps, tag, None, parts


def _hold(rows: Sequence[tuple[Any, list[RankResult]]], ag: AgentAddr,
          urls: Mapping[int, str | None], part: str) -> None:
    """A whole reply's rows whose ranks all answered, held as ``_held_rows`` holds an
    unchanged reply's: the next (unchanged) reply's rows give these records again, not 131072
    new ones on a new frontend's second page."""
    _put_held((ag.id, part), urls, {key: recs for row, recs in rows
                                    if (key := _row_key(row)) is not None
                                    and all(r.status == OK and r.body == "" for r in recs)})


Held = tuple[Any, str, dict[int, dict[str, Any]], str | None]
"""An agent's last full ``agent_fr`` reply: (the question, its tag, its parsed dumps, the
``pgknown`` it was asked with: None where it was asked without)."""


def held_again(held: Held | None, tag: str, recs: list[RankResult], snap: Mapping[int, Any],
               snaps: dict[int, Any] | None) -> dict[int, dict[str, Any]] | None:
    """An "unchanged" reply's dumps: the held ones (``agents.AgentRoute._agent_fr``), each
    with its new read time (shallow copies; with ``snaps``, the held dumps themselves and the
    times put there); None where the held reply is not the one the tag names, or lacks a
    rank."""
    if held is None or tag != held[1]:
        return None
    kept = held[2]
    dumps: dict[int, dict[str, Any]] = {}
    times: dict[int, Any] = {}
    try:
        for r in recs:
            if r.status == OK:  # its body is "" already (agentreply.parse_fr)
                dumps[r.rank] = kept[r.rank]
                times[r.rank] = snap.get(r.rank)
    except KeyError:
        return None
    if snaps is not None:
        snaps.update(times)
        return dumps
    return {r: with_snap(d, times[r]) for r, d in dumps.items()}


def registered(recs: list[RankResult], dumps: dict[int, dict[str, Any]],
               ) -> tuple[list[RankResult], dict[int, dict[str, Any]]]:
    """An agent's records and dumps less the ranks it says are not registered (it asked the
    store before they came: they are asked directly)."""
    if NOT_REGISTERED not in map(_STATUS, recs):
        return recs, dumps
    recs = [r for r in recs if r.status != NOT_REGISTERED]
    return recs, {r.rank: dumps[r.rank] for r in recs if r.rank in dumps}


def take_replies(groups: Sequence[tuple[AgentAddr, list[WorkerAddr]]], replies: Sequence[Any],
                 results: list[RankResult], dumps: dict[int, dict[str, Any]],
                 via: dict[int, AgentAddr]) -> list[WorkerAddr]:
    """The agents' FR replies (``agents.AgentRoute._agent_fr``: records and dumps, None for a
    failed agent) put into ``results``, ``dumps`` and ``via``; the ranks none of them served."""
    rest: list[WorkerAddr] = []
    for (ag, rs), reply in zip(groups, replies, strict=True):
        if reply is None:
            rest += rs
            continue
        recs, ds = reply
        served = set(map(_RANK, recs))
        results += recs
        dumps.update(ds)
        via.update(dict.fromkeys(served, ag))
        if len(served) < len(rs):  # records name only ranks asked (``_records``)
            rest += [a for a in rs if a.rank not in served]
    return rest
