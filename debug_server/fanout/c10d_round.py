"""One FR round over torch's own C++ workers: its two recorders asked and merged per rank.

torch's C++ worker has no ``torchcomms_fr_trace_json``: it answers c10d's CPU recorder
(``fr_trace_json``) and, on a CUDA build, its NCCL recorder (``dump_nccl_trace_json``), each
whole whatever it is asked (the NCCL one honours ``onlyactive``). :class:`C10dRound` asks both,
cuts each ring to the window as it arrives and merges them into one dump per rank
(``c10d_workers``), keeping per worker what it learnt: which have no NCCL handler, which CPU
groups the merge renamed, and which CPU recorders were empty a moment ago.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

from debug_server.fanout import c10d_workers
from debug_server.fanout.reply import (
    INLINE_BYTES,
    Cut,
    Each,
    cut_on_arrival,
    cutter,
    keep_parsed,
    lists_referred,
    marked_active,
    merge_c10d,
)
from debug_server.fanout.transport import OK, RankResult
from debug_server.protocol import frwindow
from debug_server.protocol.addrs import WorkerAddr
from debug_server.protocol.names import C10D_FR_HANDLER, ONLY_ACTIVE

CPU_EMPTY_TTL_S = 30.0
"""How long an empty CPU recorder of torch's C++ worker (no group, no entry: an NCCL-only job)
stands for asking it again. A gloo group made since shows within this long; NCCL's recorder,
where the hang is, is asked on every page."""

Fetch = Callable[[str, Mapping[str, str] | None, Sequence[WorkerAddr], Each | None],
                 Awaitable[list[RankResult]]]


class C10dRound:
    """torch's C++ workers' FR round, and what this frontend learnt of each worker."""

    def __init__(self, fetch: Fetch) -> None:
        self._fetch = fetch
        # Those without c10d's NCCL handler (CPU builds), and the CPU recorder's groups
        # renamed "<name>:gloo" in a worker's last merged dump.
        self._no_nccl: set[str] = set()
        self._gloo_renamed: dict[str, frozenset[str]] = {}
        # Those whose CPU recorder was empty when last asked, and until when that answer
        # stands in for asking again (CPU_EMPTY_TTL_S).
        self._cpu_empty_until: dict[str, float] = {}

    def _cpu_cut(self, cut: Cut | None) -> Callable[[RankResult], Cut | None]:
        def cpu_cut(r: RankResult) -> Cut | None:
            # The CPU ring arrives under c10d's names; the merge renames them afterwards.
            names = self._gloo_renamed.get(r.url or "")
            if cut is None or not names:
                return cut
            if isinstance(cut, frwindow.Window):
                if cut.since is None:  # the ring's own frontier: its own names
                    return cut
                return frwindow.Window(since=c10d_workers.cpu_since(cut.since, names))
            return None  # whole: cut after the merge (cut_off_loop)

        return cpu_cut

    async def ask(self, params: Mapping[str, str], addrs: Sequence[WorkerAddr],
                  cut: Cut | None) -> list[RankResult]:
        """One merged dump per rank; each ring cut to ``cut`` as it arrives. A worker without
        the NCCL handler (404: a CPU build) is not asked for it again; one whose NCCL recorder
        does not answer reads as failed, so its NCCL collectives are never silently missing.

        In a first round (``cut`` is each rank's own frontier: ``Window(slack=...)``) the NCCL
        recorder is asked only its active entries, read as a cut (``protocol.activecover``);
        round 2 asks the ranks that completed what another has not for their whole rings."""
        active = isinstance(cut, frwindow.Window) and cut.slack is not None
        nccl_params = {ONLY_ACTIVE: "true"} if active else c10d_workers.nccl_params(params)
        nccl_addrs = [a for a in addrs if (a.url or "") not in self._no_nccl]
        now = time.monotonic()
        held = [a for a in nccl_addrs if self._cpu_empty_until.get(a.url or "", 0.0) > now]
        held_ranks = {a.rank for a in held}
        cpu, nccl = await asyncio.gather(
            self._fetch(C10D_FR_HANDLER, params, [a for a in addrs if a.rank not in held_ranks],
                        lists_referred(cutter(self._cpu_cut(cut)))),
            self._fetch(c10d_workers.NCCL_HANDLER, nccl_params, nccl_addrs,
                        lists_referred(None if active else cut_on_arrival(cut)))
            if nccl_addrs else _no_results())
        for r in cpu:
            self._note_cpu_empty(r, now)
        cpu = sorted(cpu + [RankResult(a.rank, a.url, OK, c10d_workers.EMPTY_CPU_BODY,
                                       http_status=200) for a in held], key=lambda r: r.rank)
        merging = self._pair(cpu, {r.rank: r for r in nccl}, active)
        if merging:
            size = sum(len(r.body or "") + len(n.body or "") for r, n in merging)
            merged = (merge_c10d(merging, active) if size < INLINE_BYTES else await asyncio.
                      get_running_loop().run_in_executor(None, merge_c10d, merging, active))
            for (r, _), (dump, renamed) in zip(merging, merged, strict=True):
                if dump is not None:
                    keep_parsed(r, dump)
                if renamed:
                    self._gloo_renamed[r.url or ""] = renamed
                else:
                    self._gloo_renamed.pop(r.url or "", None)
        return cpu

    def _pair(self, cpu: list[RankResult], nccl: Mapping[int, RankResult],
              active: bool) -> list[tuple[RankResult, RankResult]]:
        """Each rank's CPU record with its NCCL one, where both answered (to merge); a CPU
        record takes the NCCL one's place or failure where only one of them answered."""
        merging = []
        for r in cpu:
            n = nccl.get(r.rank)
            if n is None:
                continue
            if n.http_status == 404:
                self._no_nccl.add(r.url or "")
            elif not r.ok:
                if r.http_status == 404 and n.ok:  # a torch whose worker has the NCCL one only
                    r.status, r.http_status, r.error = OK, 200, None
                    r.body, r.dump = n.body, n.dump
                    dump = marked_active(n) if active else None
                    if dump is not None:
                        keep_parsed(r, dump)
            elif not n.ok:
                r.status, r.http_status = n.status, n.http_status
                r.error = f"NCCL recorder ({c10d_workers.NCCL_HANDLER}): {n.error}"
                r.body, r.dump = None, None
            else:
                merging.append((r, n))
        return merging

    def _note_cpu_empty(self, r: RankResult, now: float) -> None:
        """Remember a torch C++ worker whose CPU recorder is empty (an NCCL-only job's): for
        ``CPU_EMPTY_TTL_S`` it is not asked again, a third of the requests of each page over
        such workers (4096 per page at 4096 ranks, issue 31)."""
        url = r.url or ""
        if r.ok and r.body is not None and len(r.body) < 1024 and c10d_workers.is_empty_body(r.body):
            self._cpu_empty_until[url] = now + CPU_EMPTY_TTL_S
        else:
            self._cpu_empty_until.pop(url, None)


async def _no_results() -> list[RankResult]:
    return []
