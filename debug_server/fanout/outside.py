"""Ranks read from outside: py-spy stacks and process states, and the ranks that went quiet.

A rank whose worker does not answer is read from outside (``readers.pyspy``: its stacks; else by
signal where it opted in: ``rank.sigstack``), and its process is read on its host
(``readers.procstate``: stopped, blocked in the kernel, its CPU use and wait channel). The reader
is the frontend for its own host's ranks, an agent for its host's (the agent's own live
collector does this), and for a rank on another host without an agent an answering worker on
that host (``pyspy_dump?pid=``, ``process_state?pid=``). Ranks on the reader's own host get their
process read on every page (a few ``/proc`` reads each): a rank that answers but sits in a
system call shows its wait channel too.

**Quiet ranks** (the asker's: ``asker.Asker``): a rank that timed out is not waited on again on
every page. Until it answers again its worker is asked for :data:`~asker.QUIET_ASK_S` only, and
the page uses its last outside read here (stacks and process), marked with its age, while
background tasks read it again (:class:`OutsideReads`) and ask its worker with the whole timeout
(the asker; each at most every :data:`~asker.REREAD_S`): a rank that answers either ask leaves
the quiet set at once. A page while one rank is stopped thus answers in a fraction of a second,
not in ``fetch_timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from debug_server.errors import first_line
from debug_server.fanout.asker import QUIET_ASK_S, REREAD_S, Asker, Quiet
from debug_server.fanout.transport import OK, TIMED_OUT, UNREACHABLE, RankResult, fetch_one
from debug_server.protocol import fastjson
from debug_server.protocol.addrs import WorkerAddr
from debug_server.protocol.names import PID
from debug_server.readers import procstate, pyspy
from debug_server.readers.sigstack import SignalCapture

logger = logging.getLogger(__name__)

KEEP_S = 300.0
"""A kept read older than this is not shown: the page reads the rank itself."""
PROCESS_ASK_S = 1.0
"""Bound on asking another worker for a rank's process state."""


class OutsideReads:
    """One live collector's outside reads and its quiet ranks (module doc)."""

    def __init__(self, asker: Asker) -> None:
        self.asker = asker
        self.processes = procstate.ProcReader()
        self.pyspy = pyspy.PySpyCapture()
        self.signal_capture = SignalCapture()

    @property
    def quiet(self) -> dict[int, Quiet]:
        """The asker's quiet ranks, each with its kept outside read (``asker.Quiet``)."""
        return self.asker.quiet

    def close(self) -> None:
        self.asker.close()

    # -- stacks and processes ----------------------------------------------------------------

    async def complete(self, results: list[RankResult], addrs: Sequence[WorkerAddr], *,
                       native: bool = False, every: bool = False) -> list[RankResult]:
        """``stacks``' records completed: a rank whose worker timed out read from outside (a
        quiet rank's kept read used, and read again in the background), every rank of this
        host with its process state; ``native``/``every``: every rank read by py-spy now."""
        fresh = native or every
        now = time.monotonic()
        kept_used: set[int] = set()
        if not fresh:
            for i, r in enumerate(results):
                q = self.quiet.get(r.rank)
                if r.status != TIMED_OUT or q is None or q.kept is None or now - q.read_at > KEEP_S:
                    continue
                results[i] = self._from_kept(r, q, now - q.read_at)
                kept_used.add(r.rank)
                if now - q.read_at > REREAD_S and (q.task is None or q.task.done()):
                    q.task = asyncio.ensure_future(self._reread(r.rank, addrs, results))
        silent = {r.rank for r in results if r.status in (TIMED_OUT, UNREACHABLE)}
        await self._read(results, addrs, native=native, every=every, skip=kept_used)
        for r in results:
            q = self.quiet.get(r.rank)
            if r.rank in silent and r.rank not in kept_used and q is not None and not fresh:
                q.kept, q.read_at = replace(r), time.monotonic()
        return results

    def _from_kept(self, r: RankResult, q: Quiet, age: float) -> RankResult:
        k = q.kept
        assert k is not None
        how = f"read {age:.0f} s ago"  # and again in the background (complete)
        out = replace(k, elapsed_s=r.elapsed_s, error=k.error if not k.ok else None)
        if k.ok:
            out.note = f"{k.note}; {how}" if k.note else how
            head, _, rest = (k.body or "").partition("\n")
            out.body = f"{head.rstrip(')')}; {how})\n{rest}" if head.startswith("(") else k.body
        else:
            out.error = f"{r.error}; {k.error}"
        if k.process is not None:
            out.process = {**k.process, "age_s": round(age, 1)}
        return out

    async def _reread(self, rank: int, addrs: Sequence[WorkerAddr],
                      page: Sequence[RankResult]) -> None:
        """A quiet rank read again from outside (its worker is probed apart: ``_probe``)."""
        addr = next((a for a in addrs if a.rank == rank), None)
        if addr is None:
            return
        c = self.asker
        # Answering ranks only: the helpers on its host (pyspy.fill reads the others' status).
        others = [replace(r) for r in page if r.rank != rank and r.status == OK
                  and r.note is None]
        rec = RankResult(rank, addr.url, TIMED_OUT,
                         error=f"timed out after {c.timeout:.1f} s", elapsed_s=c.timeout)
        try:
            await self._read([rec, *others], addrs, only={rank})
        except Exception as e:  # a background task: its failure is a log line, not a page's
            logger.warning("debug_server: reading quiet rank %d again failed: %s", rank,
                           first_line(e))
            return
        q = self.quiet.get(rank)
        if q is not None and q.url == addr.url:
            q.kept, q.read_at = rec, time.monotonic()

    async def _read(self, results: list[RankResult], addrs: Sequence[WorkerAddr], *,
                    native: bool = False, every: bool = False,
                    skip: set[int] | frozenset[int] = frozenset(),
                    only: set[int] | None = None) -> None:
        """py-spy (else signals) for the ranks of ``results`` not in ``skip`` (``pyspy.fill``),
        then the processes of all of them (of ``only``, where given)."""
        c = self.asker
        silent = {r.rank for r in results if r.status in (TIMED_OUT, UNREACHABLE)}

        async def ask(helper: WorkerAddr, params: Mapping[str, str], timeout: float) -> RankResult:
            return await fetch_one(c.session, helper, pyspy.HANDLER, params, timeout)

        todo = [r for r in results if r.rank not in skip]
        failed = await self.pyspy.fill(todo, addrs, ask=ask, native=native,
                                    every=every or native, ok=OK, timed_out=TIMED_OUT)
        no_pyspy = [r for r in todo if r.status == TIMED_OUT and r.rank in failed
                    and failed[r.rank].kind in (pyspy.UNAVAILABLE, pyspy.NOT_PERMITTED)]
        await self.signal_capture.fill(no_pyspy, {a.rank: a.meta for a in addrs}, TIMED_OUT)
        await self.read_processes(results, addrs, silent, skip, only)

    async def read_processes(self, results: Sequence[RankResult], addrs: Sequence[WorkerAddr],
                             silent: set[int], skip: set[int] | frozenset[int] = frozenset(),
                             only: set[int] | None = None) -> None:
        """Each rank's process where it can be read: every rank of this host, and the
        ``silent`` ones (no answer from their worker) elsewhere through a worker on their host.
        A rank in ``skip`` (its kept record used) is read only where that is local."""
        by_rank = {a.rank: a for a in addrs}
        here = self.pyspy.host
        local: list[RankResult] = []
        remote: list[RankResult] = []
        for r in results:
            meta = by_rank[r.rank].meta if r.rank in by_rank else None
            if not isinstance(meta, Mapping) or not isinstance(meta.get("pid"), int) \
                    or (only is not None and r.rank not in only):
                continue
            if meta.get("host") == here:
                local.append(r)
            elif r.rank in silent and r.rank not in skip:
                remote.append(r)
        if local:
            targets = [(by_rank[r.rank].meta["pid"], by_rank[r.rank].meta) for r in local]
            recs = await asyncio.get_running_loop().run_in_executor(
                None, self.processes.read, targets)
            for r, rec in zip(local, recs, strict=True):
                self._attach(r, rec)
        if remote:
            await asyncio.gather(*(self._ask_process(r, by_rank, results, silent)
                                   for r in remote))

    async def _ask_process(self, r: RankResult, by_rank: Mapping[int, WorkerAddr],
                           results: Sequence[RankResult], silent: set[int]) -> None:
        meta = by_rank[r.rank].meta or {}
        helpers = [by_rank[o.rank] for o in results
                   if o.rank != r.rank and o.rank not in silent and o.rank in by_rank
                   and (by_rank[o.rank].meta or {}).get("host") == meta.get("host")]
        if not helpers:
            return
        helper = helpers[r.rank % len(helpers)]
        got = await fetch_one(self.asker.session, helper, procstate.HANDLER,
                              {PID: str(meta["pid"])}, PROCESS_ASK_S)
        if got.status != OK or got.body is None:
            return
        with contextlib.suppress(ValueError):
            rec = fastjson.loads(got.body)
            if isinstance(rec, dict):
                self._attach(r, {**rec, "read_by": f"rank {helper.rank}'s worker"})

    @staticmethod
    def _attach(r: RankResult, rec: dict[str, Any]) -> None:
        if rec.get("state") is None:
            return
        gil = procstate.gil_from_stack(r.body if r.ok else None)
        if gil is None and r.process is not None:
            gil = r.process.get("holds_gil")  # a kept read's: py-spy is not read every page
        r.process = {**rec, "holds_gil": gil}


__all__ = ["KEEP_S", "QUIET_ASK_S", "REREAD_S", "OutsideReads"]
