"""An ``onlyactive`` Flight Recorder reply read as a window: what it holds, and when it is enough.

torch's C++ worker on a CUDA build serves its NCCL recorder (``dump_nccl_trace_json``,
``fanout.c10d_workers``) either whole or ``onlyactive=true``: ``pg_config``, ``pg_status`` and
the entries whose completion was not discovered, nothing in between. Whole rings from 4096 ranks
are 3.7 GB per page; the active entries are a few per rank. So the frontend's first round asks
for those (``fanout.c10d_round``), and this module says what such a reply holds in the terms
``frwindow`` uses for every cut (``fr_window``: ``since``, ``covers``), so the rest of the
windowed fetch runs unchanged.

**The cut an active reply is** (:func:`facts`). For each group ``g`` of its ``pg_status`` no
collective above ``lc = last_completed_collective`` has completed, so the reply holds every
collective of ``g`` from ``lc + 1`` on: ``since[g] = lc + 1``. That holds only where the reply
does hold each of ``lc + 1 .. last_enqueued_collective`` (an op completed between the
watchdog's count and the read is in neither), so where it does not, where a group has entries
but no status row, or where the reply's ``pg_status`` and ``pg_config`` name different groups
(c10d keys status by id and config by name; they differ for hashed split-group names, and then
no row can be trusted to be its group's), ``since[g]`` is :data:`NOT_COVERED`. ``active`` lists
the groups; ``ring_entries`` is None and ``ring_oldest_ns`` 0: the reply does not say how long
the ring is or when its oldest op was made (its oldest *held* entry is among the newest).

**The job's window over such groups** (``frwindow.frontier``). For a group that some dump holds
only the active entries of, the cut is the first seq some member has not completed,
``min over members of min(lc, first active - 1) + 1``: no margin below it, and 0 counts (the
whole group). Below it every member completed every op and an active reply holds none of
them; with the usual margin every rank would have to send its whole ring for the margin band.

**When a reply is enough** (``frwindow.covers``, unchanged). Where ``since[g] <= frontier(g)``
for all its groups, i.e. ``lc(g) <= min over members of min(lc, first active - 1)``: the rank
completed nothing that some member has not completed. Otherwise it COMPLETED, in some group, a
seq that another member has not (under NCCL the rank with the smaller count of a size mismatch
completes while its peer hangs: its completed entries are the evidence) and it is asked again,
for its whole ring cut to the window as it arrives: the windowed fetch's ordinary round 2.
In a job still running, watchdogs a poll apart put ranks "ahead" of each other and those are
read whole, as every rank was before; in a hang the counters have long caught up.

**P2P.** An active reply holds every pending send and recv, which is all the analyzer compares;
it lacks the newest completed P2P op that a window keeps for a group seen only through
completed ones (such a group is still named by ``pg_config`` and ``pg_status``).

**What this costs in answers.** A mismatch that every member *completed* (NCCL let it through:
equal byte counts) shows in an ordinary window only inside its 2-seq margin; in a group read
active-only it does not show. It is not why anything hangs; ``?onlyactive=false`` and the
post-mortem CLI see it.

**The analyzer on such a dump.** A rank with no entry for ``#N`` of a group is missing where its
``pg_status`` says ``last_enqueued < N`` and history lost where ``>= N``; ``ring_oldest_ns`` 0
keeps the time test (ring newer than the op: evicted) off, which the held entries would fake.
Pure: no torch, no HTTP.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

try:
    import orjson
except ImportError:  # a source tree without it: json writes the same text, slower
    orjson = None  # type: ignore[assignment]

from debug_server.protocol.frwindow import ACTIVE_KEY, MAX_SEQ, WINDOW_KEY, _group, _is_p2p

__all__ = ["NOT_COVERED", "facts", "mark"]

NOT_COVERED = MAX_SEQ
"""``since`` of a group an active reply cannot vouch for: no window starts that high."""


def _count(v: Any) -> int | None:
    # torch's c10d writes pg_status counters as strings ("4"); ours are ints.
    if isinstance(v, bool) or v is None:
        return None
    try:
        n = int(v)
    except (TypeError, ValueError):
        return None
    return n if -1 <= n <= MAX_SEQ else None


def facts(dump: Mapping[str, Any]) -> dict[str, Any]:
    """The ``fr_window`` facts of ``dump``, an ``onlyactive`` reply (see the module doc)."""
    # isinstance(x, dict) first: parsed JSON, and abc's Mapping check costs (issue 31's
    # profile at 4096 ranks).
    status = dump.get("pg_status")
    status = status if isinstance(status, dict) or isinstance(status, Mapping) else {}
    config = dump.get("pg_config")
    config = config if isinstance(config, dict) or isinstance(config, Mapping) else {}
    entries = dump.get("entries")
    held: dict[str, set[int]] = {}
    for e in entries if isinstance(entries, list) else ():
        g = _group(e) if isinstance(e, dict) or isinstance(e, Mapping) else None
        if g is None:
            continue
        seqs = held.setdefault(g, set())
        seq = e.get("collective_seq_id")
        if not _is_p2p(e) and type(seq) is int:
            seqs.add(seq)
    trusted = {str(k) for k in status} == {str(k) for k in config}
    since: dict[str, int] = {}
    for g, row in status.items():
        g = str(g)
        row = row if isinstance(row, dict) or isinstance(row, Mapping) else {}
        lc = _count(row.get("last_completed_collective"))
        le = _count(row.get("last_enqueued_collective"))
        seqs = held.get(g, set())
        whole = (trusted and lc is not None and le is not None and le - lc <= len(seqs)
                 and all(s in seqs for s in range(lc + 1, le + 1)))
        since[g] = lc + 1 if whole and lc is not None else NOT_COVERED
    for g in held:
        since.setdefault(g, NOT_COVERED)
    return {"since": since, "ring_entries": None, "ring_oldest_ns": 0,
            ACTIVE_KEY: sorted(since)}


def mark(dump: Mapping[str, Any]) -> dict[str, Any]:
    """``dump`` (an ``onlyactive`` reply) with its :func:`facts` under ``fr_window``."""
    return {**dump, WINDOW_KEY: facts(dump)}
