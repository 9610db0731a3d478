"""Cross-rank Flight Recorder analysis: which rank is missing from which collective, and where.

The entry points, :func:`analyze` (dump dicts) and :func:`analyze_digests` (what the CLI's worker
processes return). Pure functions (no torch, no HTTP, no process groups), shared by the CLI
(``python -m debug_server.fr_trace``), the rank-0 frontend and the periodic dumper. The steps
live in their own modules: :mod:`.digest` (one rank's dump), :mod:`.groups` (group resolution),
:mod:`.match` and :mod:`.p2p` (matching), :mod:`.verdict` (root cause, category, prose),
:mod:`.progress` (per-communicator progress and ranks behind).

How it differs from PyTorch's ``fr_trace`` (each is a bug there):

* Collectives are matched per group (name plus member ranks) and ``collective_seq_id``; P2P ops
  per directed peer pair in ``p2p_seq_id`` order, never mixed with collectives.
* Ranks are never aligned on ``record_id`` (a per-process counter across groups).
* A wrapped ring is ``history_lost``, not a missing rank; one mismatch does not fail every later
  collective; a bad entry is skipped with a note, never an exception.
* PyTorch's own gloo dumps (empty ``pg_config`` names, ``state`` stuck at ``scheduled``) are
  repaired instead of raising ``KeyError``.
* Ranks are never read at one instant (:mod:`.skew`): a collective issued just before a rank's
  read is "in flight" for that rank, not missing, unmatched or stuck.

Speed: ranks whose digests are identical form one class and are merged once, so a 4096-rank job
where 4095 ranks did the same thing costs little more than a 2-rank one. Ranks whose dumps share
their parts by identity (the fan-out's shallow copies) are digested once, and what stays per rank
is a few list appends and one small record (131072 ranks in two classes: about 0.35 s,
``benchmarks/bench_analyze_shared.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from debug_server.analysis.digest import (
    SNAPSHOT_TIME_KEY,
    STATES,
    DigestMemo,
    RankDigest,
    SharedDigests,
    SharedRank,
    digest_dump,
    rebind,
    share_key,
)
from debug_server.analysis.groups import Group, resolve_groups
from debug_server.analysis.match import match_collectives
from debug_server.analysis.merge import FINDING_KINDS, NCCL_CALLS_FULL_LIMIT, Merge
from debug_server.analysis.order import order_inversions
from debug_server.analysis.p2p import match_p2p
from debug_server.analysis.progress import communicators
from debug_server.analysis.ranks import rank_ranges
from debug_server.analysis.silent import silent_findings
from debug_server.analysis.stackgroups import group_stacks
from debug_server.analysis.streams import stream_lanes
from debug_server.analysis.verdict import headlines, verdict

logger = logging.getLogger(__name__)

__all__ = ["analyze", "analyze_digests"]


def analyze(
    dumps: Mapping[int, Mapping[str, Any]],
    *,
    world_size: int | None = None,
    stacks: Mapping[int, str] | None = None,
    unavailable: Mapping[int, str] | None = None,
    pg_filters: Sequence[str] | None = None,
    digest_memo: DigestMemo | None = None,
    processes: Mapping[int, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """Match every rank's Flight Recorder entries and say what hangs and why.

    Args:
        dumps: global rank -> that rank's dump dict (``version``, ``pg_config``, ``pg_status``,
            ``entries``) in the torch FR schema; ``process_group`` may be a list or a tuple.
        world_size: defaults to the largest rank seen (dumps, pg_config, unavailable, stacks) + 1.
        stacks: rank -> raw faulthandler text of that rank, joined into ``stack_groups`` and the
            verdict.
        unavailable: rank -> one-line reason for ranks that gave no data ("unreachable after
            2.0 s"); listed in ``ranks_without_data`` and named in the verdict.
        pg_filters: only analyze groups whose name or desc is in this list.
        digest_memo: digests of the caller's last analysis, for dumps built of the same
            objects (``digest.DigestMemo``); the result is the same as without it.
        processes: rank -> that rank's process as read from outside (state, since, holds_gil,
            cpu_pct, wchan: :mod:`.silent`); a silent rank that it (or its stack) places
            outside the collective its peers wait in is named as the missing one.

    Returns:
        The analysis result (docs/architecture.md, "Contracts"): ``world_size``,
        ``ranks_with_data``, ``ranks_without_data``, ``unavailable``, ``groups``,
        ``collectives``, ``nccl_calls``, ``findings``, ``verdict``, ``stack_groups``, ``notes``;
        ``category`` (one of ``verdict.CATEGORIES``) and its one-line ``next_step`` unless the
        trace is clean; ``finding_order``, the indices of ``findings`` in the order the verdict
        takes them (root cause first), and ``headline_findings``, the ones a banner names;
        ``communicators`` (per communicator: last issued and completed seq, ranks behind) and
        ``behind`` (per rank behind: its communicators), see :mod:`.progress`. Never raises on
        bad data: a malformed dump or entry becomes a note.
    """
    digests = SharedDigests()
    notes: list[str] = []
    # Ranks that did the same thing arrive sharing their dump's parts (the fan-out's shallow
    # copies): each distinct dump is digested once, the others share its digest (SharedRank).
    firsts: dict[tuple[Any, ...], RankDigest] = {}
    snap_key = SNAPSHOT_TIME_KEY
    shared_digests, shared_ranks, shared_snaps = digests.digests, digests.ranks, digests.snaps
    for rank in sorted(dumps):  # keys, not items: comparing 131072 (int, dict) pairs is slow
        dump = dumps[rank]
        r = rank if type(rank) is int else int(rank)
        if type(dump) is dict:  # share_key(dump), inlined: this loop runs once per rank
            get = dump.get
            v = get("version", "")
            key: tuple[Any, ...] | None = (
                id(get("entries")), id(get("pg_config")), id(get("pg_status")),
                id(get("fr_window")), v if type(v) is str else id(v))
        else:
            key = share_key(dump)
        if key is not None:
            base = firsts.get(key)
            if base is not None:
                snap = get(snap_key) if type(dump) is dict else dump.get(snap_key)
                snap = snap if type(snap) is int and snap > 0 else 0  # digest.snap_ns_of
                if not base.notes:
                    shared_digests.append(base)
                    shared_ranks.append(r)
                    shared_snaps.append(snap)
                    continue
                moved = rebind(base, r, snap)
                if moved is not None:
                    digests.add(moved)
                    continue
        try:
            d = (digest_memo.digest(r, dump) if digest_memo is not None
                 else digest_dump(r, dump))
        except Exception as e:  # noqa: BLE001 - one unusable dump must not stop the analysis
            notes.append(f"rank {rank}: dump unusable ({type(e).__name__}: {str(e)[:80]})")
            logger.warning("rank %s: dump unusable: %s", rank, e)
            continue
        digests.add(d)
        if key is not None:
            firsts.setdefault(key, d)
    if digest_memo is not None:
        digest_memo.done()
    return analyze_digests(
        digests,
        world_size=world_size,
        stacks=stacks,
        unavailable=unavailable,
        pg_filters=pg_filters,
        extra_notes=notes,
        processes=processes,
    )


def analyze_digests(
    digests: Iterable[RankDigest | SharedRank] | SharedDigests,
    *,
    world_size: int | None = None,
    stacks: Mapping[int, str] | None = None,
    unavailable: Mapping[int, str] | None = None,
    pg_filters: Sequence[str] | None = None,
    extra_notes: Sequence[str] = (),
    processes: Mapping[int, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """:func:`analyze` over pre-computed digests (what the CLI's worker processes return).

    A rank may come as a ``digest.SharedRank`` (another rank's digest, its own rank and read
    time), and all of them as a ``digest.SharedDigests`` (what :func:`analyze` builds): the same
    result as the digests of each rank's own dump, at a cost per rank of a few list appends."""
    m = Merge(digests, world_size, stacks, unavailable, extra_notes, processes)
    shown = _match_groups(m, set(pg_filters) if pg_filters else None)
    calls, elided = _nccl_calls(m)
    stack_groups, positions = group_stacks(m.stacks, m.notes)
    order_inversions(m, m.ops)
    silent_findings(m, positions)
    m.findings.sort(
        key=lambda f: FINDING_KINDS.index(f["kind"]) if f["kind"] != "history_lost" else 99
    )
    no_data = m.no_data()
    for r in m.unavailable:
        if r not in no_data and r not in m.digest_of:
            no_data.append(r)
    v = verdict(m, stack_groups, positions)
    comms, behind = communicators(m, shown)
    return {
        "world_size": m.world_size,
        "ranks_with_data": m.data_ranks,
        "ranks_without_data": sorted(no_data),
        "unavailable": [
            {"rank": r, "reason": m.unavailable.get(r, "no data")} for r in sorted(no_data)
        ],
        "groups": [
            {"id": g.id, "name": g.name, "desc": g.desc, "ranks": g.ranks, "inferred": g.inferred,
             "label": g.label}
            for g in shown
        ],
        "collectives": m.collectives,
        "nccl_calls": calls,
        "nccl_calls_elided": elided,
        "findings": m.findings,
        "verdict": v.text,
        **({"category": v.category, "next_step": v.next_step} if v.category else {}),
        "finding_order": v.order,
        "headline_findings": headlines(m.findings, v.order),
        "stack_groups": stack_groups,
        "communicators": comms,
        "behind": behind,
        "ranks": [{"rank": r, "process": dict(p)} for r, p in sorted(m.processes.items())],
        "streams": stream_lanes(m.class_list, m.groups, m.ops, m.sigs),
        "notes": m.notes,
    }


def _match_groups(m: Merge, pg_filters: set[str] | None) -> list[Group]:
    """Match every group the filters let through; one broken group must not lose the others."""
    shown = []
    m.groups = resolve_groups(m.class_list, m.world_size, m.notes)
    for gkey, g in m.groups.items():
        if pg_filters is not None and not pg_filters & {g.name, g.desc, g.id}:
            continue
        shown.append(g)
        try:
            match_collectives(m, g, gkey)
            match_p2p(m, g, gkey)
        except Exception as e:  # noqa: BLE001 - one broken group must not lose the others
            logger.exception("analysis of group %s failed", g.id)
            m.notes.append(f"group {g.id}: analysis failed ({type(e).__name__}: {str(e)[:80]})")
    return shown


def _nccl_calls(m: Merge) -> tuple[list[dict[str, Any]], int]:
    """The result's ``nccl_calls`` and ``nccl_calls_elided``.

    Up to :data:`~.merge.NCCL_CALLS_FULL_LIMIT` (rank, op) pairs among the ops the matchers kept,
    one row per (rank, op), in op then rank order. Above it (131072 ranks would make millions
    of rows), one row per (rank class, op) instead: the same keys, ``global_rank`` the class's
    lowest rank there, plus ``global_ranks``, the class's ranks as range text
    (``"0-77776,77778-131071"``, ``protocol.addrs.rank_ranges``), in op then lowest-rank order.
    ``nccl_calls_elided``: when the job holds more than the limit of entries, how many
    (rank, entry) pairs no row stands for.
    """
    pairs = sum(len(ranks) for _, per in m.calls_src for ranks, _ in per)
    calls: list[dict[str, Any]] = []
    if pairs <= NCCL_CALLS_FULL_LIMIT:
        for row, per in m.calls_src:
            for r, st in sorted((r, st) for ranks, st in per for r in ranks):
                calls.append(
                    {
                        "id": len(calls),
                        "collective_id": row["id"],
                        "group": row["group"],
                        "global_rank": r,
                        "collective_type": row["profiling_name"],
                        "sizes": row["input_sizes"],
                        "state": STATES[st],
                    }
                )
    else:
        texts: dict[int, tuple[int, str]] = {}  # id of a class's rank list -> (lowest, text)
        for row, per in m.calls_src:
            held = []
            for ranks, st in per:
                if not ranks:
                    continue
                t = texts.get(id(ranks))
                if t is None:
                    t = texts[id(ranks)] = (min(ranks), ",".join(rank_ranges(ranks)))
                held.append((t, st))
            held.sort(key=lambda x: x[0][0])
            for (low, text), st in held:
                calls.append(
                    {
                        "id": len(calls),
                        "collective_id": row["id"],
                        "group": row["group"],
                        "global_rank": low,
                        "global_ranks": text,
                        "collective_type": row["profiling_name"],
                        "sizes": row["input_sizes"],
                        "state": STATES[st],
                    }
                )
    elided = m.total_entries - pairs if m.total_entries > NCCL_CALLS_FULL_LIMIT else 0
    return calls, elided
