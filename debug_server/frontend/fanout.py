"""Asking every rank's worker the same question at once.

``fan_out`` never raises: it returns one ``RankResult`` per rank, in rank order. A rank is
``ok``, ``not registered`` (no usable key in the store), ``unreachable`` (nothing listening, or
the connection broke), ``timed out`` (no full answer within the per-rank timeout) or ``failed``
(the worker answered with an HTTP error). Every renderer consumes these records, and a failed
rank reads as one line: ``rank 3: unreachable after 2.0 s``.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlencode

import aiohttp

from debug_server.analysis.digest import DigestMemo
from debug_server.errors import first_line
from debug_server.frontend import c10d_workers, fastjson
from debug_server.frontend.absent import KnownAbsent
from debug_server.frontend.leanhttp import BodyTooLarge, LeanClient, ProtocolError
from debug_server.frontend.pagefirst import PageFirstSemaphore
from debug_server.protocol import activecover, frtext, frwindow, members
from debug_server.protocol.frwindow import WINDOW_KEY
from debug_server.protocol.wire import WITH_STACKS, split_stacks
from debug_server.rank import pyspy
from debug_server.rank.discovery import NOT_REGISTERED, WorkerAddr
from debug_server.rank.sigstack import SignalCapture

logger = logging.getLogger(__name__)

OK = "ok"
UNREACHABLE = "unreachable"
TIMED_OUT = "timed out"
FAILED = "failed"
GONE = "gone"
"""A rank that disappeared; its record holds its last data, its note says how and how old
(``departed.KeepLast``)."""

MAX_BODY_BYTES = 256 * 1024 * 1024
"""A worker reply larger than this is refused (a 2000-entry ring is ~1.5 MB)."""


@dataclass(slots=True)
class RankResult:
    """One rank's answer to one fan-out."""

    rank: int
    url: str | None
    status: str
    body: str | None = None
    error: str | None = None
    elapsed_s: float = 0.0
    http_status: int | None = None
    note: str | None = None
    """How an OK body came other than from the worker itself (``stacks read by py-spy ...``)."""
    done_ns: int = 0
    """The frontend's wall clock when the answer arrived (0: not a request of ``fetch_one``);
    with ``elapsed_s`` it brackets when the worker read its clock (``frontend.stragglers``)."""

    @property
    def ok(self) -> bool:
        """The record holds data: the rank answered, or (``GONE``) its last answer was kept."""
        return self.status == OK or self.status == GONE

    def line(self) -> str:
        """One line for people: ``rank 3: OK`` or ``rank 3: unreachable after 2.0 s (...)``."""
        if self.status == GONE:
            return f"rank {self.rank}: {self.note}"
        if self.ok:
            return f"rank {self.rank}: OK ({self.elapsed_s:.2f} s{'; ' + self.note if self.note else ''})"
        return f"rank {self.rank}: {self.error or self.status}"

    def json(self) -> Any:
        """The body parsed as JSON; raises ``ValueError`` when it is not."""
        if self.body is None:
            raise ValueError(f"rank {self.rank} has no body ({self.status})")
        return fastjson.loads(self.body)

    def summary(self) -> dict[str, Any]:
        """The record without its body (for JSON status lists)."""
        return {
            "rank": self.rank, "url": self.url, "status": self.status, "error": self.error,
            "elapsed_s": round(self.elapsed_s, 4), "http_status": self.http_status,
            **({"note": self.note} if self.note else {}),
        }


def handler_url(base: str, handler: str, params: Mapping[str, str] | str | None = None) -> str:
    """``params``: a mapping, or its query string already encoded (``fan_out`` encodes once for
    every rank: ``pgknown`` is long)."""
    if not params:
        return f"{base}/handler/{handler}"
    query = params if isinstance(params, str) else urlencode(params)
    return f"{base}/handler/{handler}?{query}"


async def fetch_one(
    session: aiohttp.ClientSession,
    addr: WorkerAddr,
    handler: str,
    params: Mapping[str, str] | str | None,
    timeout: float,
    http: LeanClient | None = None,
) -> RankResult:
    """POST one handler to one worker; every failure becomes a record, never an exception.

    ``http``: the lean client for plain-HTTP workers (``leanhttp``; a third of aiohttp's CPU per
    request), else ``session``.
    """
    if addr.url is None:
        return RankResult(addr.rank, None, NOT_REGISTERED, error=addr.error or NOT_REGISTERED)
    url = handler_url(addr.url, handler, params)
    start = time.monotonic()

    def done(status: str, error: str | None = None, body: str | None = None,
             code: int | None = None) -> RankResult:
        return RankResult(addr.rank, addr.url, status, body, error, time.monotonic() - start, code,
                          done_ns=time.time_ns())

    try:
        if http is not None and http.handles(url):
            code, raw = await http.post(url, timeout)
            text = raw.decode("utf-8", errors="replace")
        else:
            code, text = await asyncio.wait_for(_post(session, url), timeout)
    except asyncio.TimeoutError:  # builtin TimeoutError only from 3.11 on
        return done(TIMED_OUT, f"timed out after {timeout:.1f} s")
    except (aiohttp.ClientConnectionError, OSError) as e:
        elapsed = time.monotonic() - start
        detail = first_line(e, 200, empty='')
        return done(UNREACHABLE, f"unreachable after {elapsed:.1f} s"
                    + (f" ({detail})" if detail else ""))
    except (aiohttp.ClientError, ProtocolError) as e:
        return done(FAILED, f"request failed: {type(e).__name__}: {first_line(e, 200, empty='')}")
    except (_TooBig, BodyTooLarge) as e:
        return done(FAILED, str(e))
    if code != 200:
        reason = (text.strip().splitlines() or [""])[0][:300]
        return done(FAILED, f"HTTP {code}: {reason}".rstrip(": "), code=code)
    return done(OK, body=text, code=200)


class _TooBig(Exception):
    pass


async def _post(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with session.post(url) as resp:
        if resp.content_length is not None and resp.content_length > MAX_BODY_BYTES:
            raise _TooBig(f"reply of {resp.content_length} bytes exceeds {MAX_BODY_BYTES}")
        raw = await resp.read()
        return resp.status, raw.decode("utf-8", errors="replace")


async def fan_out(
    session: aiohttp.ClientSession,
    addrs: Sequence[WorkerAddr],
    handler: str,
    params: Mapping[str, str] | None = None,
    *,
    timeout: float,
    semaphore: asyncio.Semaphore | PageFirstSemaphore | None = None,
    http: LeanClient | None = None,
    each: Callable[[RankResult], Awaitable[None]] | None = None,
) -> list[RankResult]:
    """Ask every worker at once; one record per rank, in rank order.

    ``timeout`` is per rank and starts when that rank's request starts, so waiting for the
    ``semaphore`` (the bound on requests in flight) does not eat into it. ``http``: see
    ``fetch_one``. ``each``: awaited on every record as it arrives, still inside the
    ``semaphore`` (so at most that many replies are held before it shrinks them).
    """

    query = urlencode(params) if params else None  # the same for every rank: encoded once
    results: list[RankResult | None] = [None] * len(addrs)
    todo = deque(range(len(addrs)))

    # A few workers that each take the next rank, not a task per rank: a task, its wrapper
    # coroutines and their scheduling were a third of the frontend's CPU per request (issue 31:
    # 8192 requests per page at 4096 ranks). Between two ranks a worker renews its slot of
    # ``semaphore`` as a request queued from the start would take it (``pagefirst``: pages
    # first), so pages and background polls share the slots as before.
    async def worker() -> None:
        held = False
        try:
            while todo:
                i = todo.popleft()
                addr = addrs[i]
                if not held and semaphore is not None and addr.url is not None:
                    await semaphore.acquire()
                    held = True
                r = await fetch_one(session, addr, handler, query, timeout, http)
                if each is not None:
                    await each(r)
                results[i] = r
                if held and todo:
                    held = False  # renew hands the slot on or keeps it; it holds one on return
                    await _renew(semaphore)  # type: ignore[arg-type]
                    held = True
        finally:
            if held:
                semaphore.release()  # type: ignore[union-attr]

    slots = getattr(semaphore, "size", None) if semaphore is not None else None
    workers = min(len(addrs), slots or len(addrs))
    if workers == 1:
        await worker()
    elif workers:
        await asyncio.gather(*(worker() for _ in range(workers)))
    return sorted(results, key=lambda r: r.rank)  # type: ignore[arg-type,union-attr]


async def _renew(semaphore: asyncio.Semaphore | PageFirstSemaphore) -> None:
    """Between two requests of one worker: ``PageFirstSemaphore.renew``, else release and
    acquire (a plain semaphore serves its waiters in order)."""
    if isinstance(semaphore, PageFirstSemaphore):
        await semaphore.renew()
        return
    semaphore.release()
    await semaphore.acquire()


class Registry(Protocol):
    """Where the workers are (``discovery.StoreRegistry`` or ``StaticRegistry``)."""

    world_size: int

    async def lookup(self) -> list[WorkerAddr]: ...

    def close(self) -> None: ...


@dataclass(slots=True)
class FrData:
    """Every rank's FR fetch: the records, and the parsed dumps of the ranks that answered."""

    results: list[RankResult]
    dumps: dict[int, dict[str, Any]]
    window: dict[str, int] | None = None
    """Per group, the first seq fetched (``frwindow``); None for whole rings or active only."""
    scope: str | None = None
    """What the data is, where it is not a live fetch (the post-mortem viewer: "as the dumper
    wrote it"); the page shows it instead of the fetch window."""
    digest_memo: DigestMemo | None = None
    """The collector's digests of its last analysis (``analysis.digest.DigestMemo``), where its
    dumps may be the same objects again (``agent_fanout``)."""

    def unavailable(self) -> dict[int, str]:
        return {r.rank: r.line() for r in self.results if r.rank not in self.dumps}


GC_THRESHOLDS = (50_000, 1000, 20)
"""The garbage-collector thresholds of a process that fans out (``settle_gc``)."""


def settle_gc() -> None:
    """The cyclic collector of a process of its own that fans out (the frontend's, an agent's).

    A fan-out allocates a few dozen short-lived objects per request, and a page holds every
    rank's parsed reply (acyclic JSON, freed by reference counting when the page is done). With
    the default thresholds (700, 10, 10) full collections ran every few hundred requests: fr +
    stacks over 4096 ranks took 1.7x as long (``benchmarks/bench_frontend_gc.py``). A young
    generation of 50 000 objects and a middle one collected after 1000 young passes (about 50
    million allocations, dozens of 16384-rank pages) keep the collector from re-scanning a
    page's replies while the page holds them: the first FR page at 16384 ranks through agents
    spent 0.6 s of its 2.5 CPU-s there (``benchmarks/bench_agents.py``). What the process has
    built by now (modules, torch's among them) is frozen out of every later collection.
    """
    gc.set_threshold(*GC_THRESHOLDS)
    gc.freeze()


PRIME_RANKS = 64
"""From this many ranks on, a frontend's first FR fan-out asks one rank first (``members``); a
host's agent does from 2 (``Collector(prime_ranks=)``): its 8 ranks would otherwise each send
the world's list on its first ask (8 x 108 KB at 16384 ranks, on every host at once)."""
PRIME_TIMEOUT_S = 1.0
FR_HANDLER = "torchcomms_fr_trace_json"
C10D_FR_HANDLER = "fr_trace_json"
STACKS_HANDLER = "dump_traceback"


class RankStates:
    """The last reachability state of every rank; logs one line per change, not per fetch.

    A rank that answers at all (even an HTTP error) is ``ok`` here; otherwise its state is the
    fan-out status (``unreachable``, ``timed out``, ``not registered``). A dead rank thus costs
    one log line ("rank 3: ok -> unreachable"), not one per page and per dump cycle.
    """

    def __init__(self) -> None:
        self.last: dict[int, str] = {}

    @staticmethod
    def state(r: RankResult) -> str:
        return OK if r.status == OK or r.http_status is not None else r.status

    def update(self, results: Sequence[RankResult]) -> None:
        for r in results:
            new = self.state(r)
            old = self.last.get(r.rank)
            if old == new:
                continue
            self.last[r.rank] = new
            if old is None and new == OK:
                continue  # first sight of a healthy rank: nothing to report
            level = logging.INFO if new == OK else logging.WARNING
            detail = "" if new == OK else f" ({r.error})" if r.error and r.error != new else ""
            logger.log(level, "debug_server: rank %d: %s%s%s", r.rank,
                       f"{old} -> " if old is not None else "", new, detail)


class Collector:
    """Lookup plus fan-out with one session, one timeout, one bound on requests in flight."""

    def __init__(
        self, session: aiohttp.ClientSession, registry: Registry, *, timeout: float,
        max_concurrency: int = 64, http: LeanClient | None = None,
        prime_ranks: int | None = None,
    ) -> None:
        self.session = session
        self.prime_ranks = PRIME_RANKS if prime_ranks is None else prime_ranks
        """From this many ranks on, an FR fan-out while no member list is held asks one rank
        first (``_fr_ours``); once one such rank has answered, never again (a job whose lists
        are all short teaches nothing, and would pay the extra round trip on every page)."""
        self._primed = False
        self.http = http
        """The lean client for the fan-outs (``leanhttp``), else ``session``; its owner closes it."""
        self.registry = registry
        self.timeout = timeout
        # Shared by pages and the background polls; a page's requests get freed slots first.
        self.semaphore = PageFirstSemaphore(max_concurrency)
        self.states = RankStates()
        self.signal_capture = SignalCapture()
        self.pyspy = pyspy.PySpyCapture()
        # Per worker URL: which FR handler answers (torch's C++ worker has only c10d's), and
        # whether it refused ``since`` (then it gets whole rings, cut here).
        self._fr_handler: dict[str, str] = {}
        self._no_since: set[str] = set()
        self._no_members: set[str] = set()  # workers that refused ``pgknown`` (older ours)
        self._no_fr_stacks: set[str] = set()  # workers that refused ``stacks`` (older ours)
        # torch's C++ workers (c10d_workers): those without c10d's NCCL handler (CPU builds),
        # and the CPU recorder's groups renamed "<name>:gloo" in a worker's last merged dump.
        self._no_nccl: set[str] = set()
        self._gloo_renamed: dict[str, frozenset[str]] = {}
        # torch's C++ workers whose CPU recorder was empty when last asked, and until when that
        # answer stands in for asking again (CPU_EMPTY_TTL_S).
        self._cpu_empty_until: dict[str, float] = {}
        self._absent = KnownAbsent()  # handlers a worker answered 404 to (absent.py)

    @property
    def world_size(self) -> int:
        return self.registry.world_size

    def data_time_ns(self) -> int:
        """When the data was taken (in-flight ops end here on a timeline): now, for a live job."""
        return time.time_ns()

    async def fetch(
        self, handler: str, params: Mapping[str, str] | None = None,
        addrs: Sequence[WorkerAddr] | None = None,
        each: Callable[[RankResult], Awaitable[None]] | None = None,
    ) -> list[RankResult]:
        if addrs is None:
            addrs = await self.registry.lookup()
        ask, held = self._absent.split(handler, addrs)  # a 404 stands for a while (absent)
        results = await fan_out(self.session, ask, handler, params, timeout=self.timeout,
                                semaphore=self.semaphore, http=self.http, each=each)
        self._absent.note(handler, results)
        if held:
            results = sorted(results + held, key=lambda r: r.rank)
        self.states.update(results)
        return results

    async def fr(self, *, only_active: bool = False, whole: bool = False,
                 addrs: Sequence[WorkerAddr] | None = None) -> FrData:
        """Every rank's FR dump as JSON, parsed off the event loop.

        By default each communicator's entries from its frontier on (``frwindow``): every entry
        that can still disagree, at a cost that does not grow with the ring. ``whole=True``
        fetches whole rings; ``only_active=True`` only entries not yet completed (not enough to
        find a mismatch that completed on one side; kept for the timeline download).

        Usually one round trip: each worker cuts at its own frontier less a slack
        (``window=4``); a rank whose cut turns out above the job's frontier is asked again
        (``since=``). A rank that does not know ``torchcomms_fr_trace_json`` (torch's own C++
        worker answers 404) is asked for c10d's built-in ``fr_trace_json`` instead, and for its
        NCCL recorder's ``dump_nccl_trace_json`` where it has one (``c10d_workers``: in round 1
        only its active entries, and in round 2 the whole ring of a rank that completed what
        another has not, ``analysis.activecover``); one that refuses these parameters (400) is
        sent whole rings, cut here to the same window.
        """
        if addrs is None:
            addrs = await self.registry.lookup()
        if whole or only_active:
            params = {"onlyactive": "true" if only_active and not whole else "false"}
            results = await self._fr_round(params, addrs)
            dumps = await parse_off_loop(results)
            return FrData(results, dumps)
        # Round 1: each worker cuts at its own frontier less a slack; the replies' pg_status
        # and active entries fix each communicator's frontier over all ranks.
        return await self.fr_after_first(addrs, await self.fr_first_round(addrs))

    async def fr_recent(self, ops: int, addrs: Sequence[WorkerAddr] | None = None) -> FrData:
        """Each rank's newest entries without their stacks: per communicator from its own
        frontier less ``ops`` on (``window=<ops>&includestacktraces=false``), in one request per
        rank straight to the workers; the straggler poll's fetch (``frontend.stragglers``). A
        worker that refuses these parameters gets whole rings, cut to the window as they arrive."""
        if addrs is None:
            addrs = await self.registry.lookup()
        cut = frwindow.Window(slack=ops)
        results = await self._fr_round({"window": str(ops), "includestacktraces": "false"},
                                       addrs, cut)
        results = await self._whole_for_refusers(results, addrs, [], cut)
        return FrData(results, await parse_off_loop(results))

    async def fr_first_round(self, addrs: Sequence[WorkerAddr],
                             stacks: dict[int, str] | None = None) -> list[RankResult]:
        """The default ``fr``'s first round alone, bodies unparsed (an agent compares them with
        its last ones before it parses them: ``agent.fr_tag``). With ``stacks`` (a dict to
        fill) our workers are asked for their stacks in the same request (``wire.WITH_STACKS``):
        each rank's stacks text goes there, its FR JSON stays the body."""
        return await self._fr_local_round(addrs, stacks)

    async def fr_stacks(self, addrs: Sequence[WorkerAddr] | None = None,
                        ) -> tuple[FrData, list[RankResult]]:
        """``fr()`` and ``stacks()`` of the same ranks, for a page that shows both, in one
        request per rank where the worker is ours (``wire.WITH_STACKS``): half the requests of
        asking each. A rank whose worker timed out is read by py-spy as ``stacks`` reads it;
        one that answered without stacks (torch's C++ worker) is asked for them apart."""
        if addrs is None:
            addrs = await self.registry.lookup()
        texts: dict[int, str] = {}
        first = await self.fr_first_round(addrs, texts)
        fr, stacks = await asyncio.gather(self.fr_after_first(addrs, first),
                                          self.stacks_after_fr(addrs, first, texts))
        return fr, stacks

    async def stacks_after_fr(self, addrs: Sequence[WorkerAddr], first: Sequence[RankResult],
                              texts: Mapping[int, str]) -> list[RankResult]:
        """``stacks()`` of ``addrs`` from an FR round that asked for them (``fr_first_round``):
        the texts it brought; a rank whose worker timed out or is unreachable keeps that record
        (then py-spy, as in ``stacks``); any other rank without a text is asked for it now."""
        by_rank = {r.rank: r for r in first}
        results: list[RankResult] = []
        ask: list[WorkerAddr] = []
        for a in addrs:
            r = by_rank.get(a.rank)
            text = texts.get(a.rank)
            if r is not None and text is not None:
                results.append(RankResult(a.rank, a.url, OK, text, None, r.elapsed_s, 200))
            elif r is not None and r.status in (TIMED_OUT, UNREACHABLE, NOT_REGISTERED):
                results.append(RankResult(a.rank, a.url, r.status, None, r.error, r.elapsed_s,
                                          r.http_status))
            else:
                ask.append(a)
        if ask:
            results += await self.fetch(STACKS_HANDLER, None, ask)
        return await self._stuck_stacks(sorted(results, key=lambda r: r.rank), addrs)

    async def fr_after_first(self, addrs: Sequence[WorkerAddr],
                             first: list[RankResult]) -> FrData:
        """The default ``fr`` from its first round's records on."""
        first_dumps = await parse_off_loop(first)
        since = frwindow.frontier(first_dumps)
        # Round 2, rarely: ranks whose own cut lies above the job's frontier (a rank that
        # timed out once is not asked again: that would cost a second timeout on one page).
        again = [a for a in addrs if a.rank in first_dumps
                 and not frwindow.covers(first_dumps[a.rank], since)]
        second = await self._fr_window_round(since, again, first_dumps) if again else []
        by_rank = {r.rank: r for r in second}
        results = [by_rank.get(r.rank, r) for r in first]
        if second:
            redone = await parse_off_loop(second)
            first_dumps = {r: redone.get(r, d) for r, d in first_dumps.items()
                           if r not in by_rank or r in redone}
        dumps = await cut_off_loop(first_dumps, since)
        return FrData(results, dumps, since)

    async def fr_since(self, since: Mapping[str, int], addrs: Sequence[WorkerAddr],
                       groups: Mapping[int, set[str]]) -> FrData:
        """The re-ask round alone (a host's agent, asked ``since=`` by the frontend): each rank
        from ``since`` on, cut to it; ``groups``: each rank's groups (``since`` is cut to them)."""
        first = {a.rank: {"pg_status": dict.fromkeys(groups.get(a.rank, since), {})}
                 for a in addrs}
        results = await self._fr_window_round(since, addrs, first)
        dumps = await parse_off_loop(results)
        dumps = await cut_off_loop(dumps, since)
        return FrData(results, dumps, dict(since))

    async def _fr_round(self, params: Mapping[str, str], addrs: Sequence[WorkerAddr],
                        cut: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
                        stacks: dict[int, str] | None = None) -> list[RankResult]:
        """One FR fan-out; a 404 from our handler retries c10d's, and the winner is remembered.

        ``cut``: the window these replies are for (default: the one ``params`` ask for). A reply
        over ``CUT_ON_ARRIVAL_BYTES`` (a worker that ignores the window: torch's C++ worker sends
        its whole ring, ~0.9 MB) is cut to it as it arrives, so a fan-out over thousands of such
        workers never holds all their rings at once. ``stacks``: where ``params`` ask for them
        (``wire.WITH_STACKS``), each reply's stacks text goes there as it arrives (before the cut).
        """
        each = _cutter_on_arrival(cut or _param_cut(params))
        if stacks is not None:
            each = _stacks_apart(stacks, each)
        handlers = {a.rank: self._fr_handler.get(a.url or "", FR_HANDLER) for a in addrs}
        ours = [a for a in addrs if handlers[a.rank] == FR_HANDLER]
        theirs = [a for a in addrs if handlers[a.rank] != FR_HANDLER]
        results = await self._fr_ours(params, ours, each) if ours else []
        retry = [a for a, r in zip(ours, results, strict=True) if r.http_status == 404]
        for a in retry:
            self._fr_handler[a.url or ""] = C10D_FR_HANDLER
        retry += theirs
        if retry:
            plain = {k: v for k, v in params.items() if k != WITH_STACKS}
            done = {r.rank: r for r in await self._c10d_round(plain, retry,
                                                              cut or _param_cut(params))}
            for a in theirs:  # a restarted worker on the same URL may be ours again
                if done[a.rank].http_status == 404:
                    self._fr_handler.pop(a.url or "", None)
                    self._absent.forget(a.url or "")
            results = [done.pop(r.rank, r) for r in results] + list(done.values())
        return sorted(results, key=lambda r: r.rank)

    async def _c10d_round(self, params: Mapping[str, str], addrs: Sequence[WorkerAddr],
                          cut: Callable[[dict[str, Any]], dict[str, Any]] | None,
                          ) -> list[RankResult]:
        """torch's C++ workers: c10d's CPU recorder (``fr_trace_json``) and, where the worker
        has one, its NCCL recorder (``dump_nccl_trace_json``), one merged dump per rank
        (``c10d_workers``); each ring cut to ``cut`` as it arrives. A worker without the NCCL
        handler (404: a CPU build) is not asked for it again; one whose NCCL recorder does not
        answer reads as failed, so its NCCL collectives are never silently missing.

        In a first round (``cut`` is each rank's own frontier: ``Window(slack=...)``) the NCCL
        recorder is asked only its active entries, read as a cut (``analysis.activecover``);
        round 2 asks the ranks that completed what another has not for their whole rings."""

        def cpu_cut(r: RankResult) -> Callable[[dict[str, Any]], dict[str, Any]] | None:
            # The CPU ring arrives under c10d's names; the merge renames them afterwards.
            names = self._gloo_renamed.get(r.url or "")
            if cut is None or not names:
                return cut
            if isinstance(cut, frwindow.Window):
                if cut.since is None:  # the ring's own frontier: its own names
                    return cut
                return frwindow.Window(since=c10d_workers.cpu_since(cut.since, names))
            return None  # whole: cut after the merge (cut_off_loop)

        active = isinstance(cut, frwindow.Window) and cut.slack is not None
        nccl_params = {"onlyactive": "true"} if active else c10d_workers.nccl_params(params)
        nccl_addrs = [a for a in addrs if (a.url or "") not in self._no_nccl]
        now = time.monotonic()
        held = [a for a in nccl_addrs if self._cpu_empty_until.get(a.url or "", 0.0) > now]
        held_ranks = {a.rank for a in held}
        cpu, nccl = await asyncio.gather(
            self.fetch(C10D_FR_HANDLER, params, [a for a in addrs if a.rank not in held_ranks],
                       _lists_referred(_cutter_by_record(cpu_cut))),
            self.fetch(c10d_workers.NCCL_HANDLER, nccl_params, nccl_addrs,
                       _lists_referred(None if active else _cutter_on_arrival(cut)))
            if nccl_addrs else _no_results())
        for r in cpu:
            self._note_cpu_empty(r, now)
        cpu = sorted(cpu + [RankResult(a.rank, a.url, OK, c10d_workers.EMPTY_CPU_BODY, http_status=200)
                            for a in held], key=lambda r: r.rank)
        by_rank = {r.rank: r for r in nccl}
        merging = []
        for r in cpu:
            n = by_rank.get(r.rank)
            if n is None:
                continue
            if n.http_status == 404:
                self._no_nccl.add(r.url or "")
            elif not r.ok:
                if r.http_status == 404 and n.ok:  # a torch whose worker has the NCCL one only
                    r.status, r.http_status, r.error = OK, 200, None
                    r.body = _marked_active(n.body) if active else n.body
            elif not n.ok:
                r.status, r.http_status = n.status, n.http_status
                r.error, r.body = f"NCCL recorder ({c10d_workers.NCCL_HANDLER}): {n.error}", None
            else:
                merging.append((r, n))
        if merging:
            size = sum(len(r.body or "") + len(n.body or "") for r, n in merging)
            merged = (_merge_bodies(merging, active) if size < INLINE_BYTES else await asyncio.
                      get_running_loop().run_in_executor(None, _merge_bodies, merging, active))
            for (r, _), (body, renamed) in zip(merging, merged, strict=True):
                r.body = body
                if renamed:
                    self._gloo_renamed[r.url or ""] = renamed
                else:
                    self._gloo_renamed.pop(r.url or "", None)
        return cpu

    def _note_cpu_empty(self, r: RankResult, now: float) -> None:
        """Remember a torch C++ worker whose CPU recorder is empty (an NCCL-only job's): for
        ``CPU_EMPTY_TTL_S`` it is not asked again, a third of the requests of each page over
        such workers (4096 per page at 4096 ranks, issue 31)."""
        url = r.url or ""
        if r.ok and r.body is not None and len(r.body) < 1024 and c10d_workers.is_empty_body(r.body):
            self._cpu_empty_until[url] = now + CPU_EMPTY_TTL_S
        else:
            self._cpu_empty_until.pop(url, None)

    async def _fr_ours(self, params: Mapping[str, str], addrs: Sequence[WorkerAddr],
                       each: Callable[[RankResult], Awaitable[None]] | None = None,
                       ) -> list[RankResult]:
        """Our handler, told which member lists this frontend holds (``members``); a worker
        that does not know that parameter (400 naming it) is asked without it, from then on.

        While this frontend holds no list yet (its first page), one rank is asked first and
        its lists learnt, so the other ranks' replies do not each carry the world's members.
        """
        # aiohttp refuses request lines over 8190 bytes, and ``since`` may take most of them.
        budget = min(members.MAX_PARAM_CHARS, 7000 - len(urlencode(params)))
        known = members.known_param(budget)
        by_rank: dict[int, RankResult] = {}
        if known is None and budget > 0 and len(addrs) >= self.prime_ranks and not self._primed:
            for a in [a for a in addrs if a.url][:1]:
                # Briefly: a stuck first rank must not delay the page by a whole timeout.
                async with self.semaphore:
                    r = await fetch_one(self.session, a, FR_HANDLER, params,
                                        min(self.timeout, PRIME_TIMEOUT_S), self.http)
                    if each is not None:  # as every reply of the fan-out (stacks apart, cut)
                        await each(r)
                if r.ok:  # else it is asked again with the others
                    self._primed = True
                    self.states.update([r])
                    by_rank[r.rank] = r
                    parse_dumps([RankResult(r.rank, r.url, r.status, r.body)])  # learns its lists
            known = members.known_param(budget)
        told = [a for a in addrs if known and a.rank not in by_rank
                and (a.url or "") not in self._no_members]
        if not told and not by_rank:
            return await self.fetch(FR_HANDLER, params, addrs, each)
        told_ranks = {a.rank for a in told}
        untold = [a for a in addrs if a.rank not in by_rank and a.rank not in told_ranks]
        results = await self.fetch(FR_HANDLER, {**params, members.PARAM: known or ""}, told,
                                   each) if told else []
        refused = {r.rank for r in results
                   # "unknown parameter 'pgknown'": not any 400 whose list of allowed names
                   # has it (an older worker refusing ``stacks`` lists pgknown as allowed).
                   if r.http_status == 400 and f"parameter {members.PARAM!r}" in (r.error or "")}
        again = untold + [a for a in told if a.rank in refused]
        self._no_members.update(a.url or "" for a in told if a.rank in refused)
        by_rank.update((r.rank, r) for r in results)
        if again:
            by_rank.update((r.rank, r) for r in await self.fetch(FR_HANDLER, params, again, each))
        return [by_rank[a.rank] for a in addrs]  # in ``addrs`` order, as fetch would be

    async def _fr_local_round(self, addrs: Sequence[WorkerAddr],
                              stacks: dict[int, str] | None = None) -> list[RankResult]:
        knows = [a for a in addrs if (a.url or "") not in self._no_since]
        whole = [a for a in addrs if (a.url or "") in self._no_since]
        window = {"window": str(frwindow.LOCAL_SLACK)}
        if stacks is None:
            results = await self._fr_round(window, knows)
        else:
            results = await self._fr_round_with_stacks(window, knows, stacks)
        return await self._whole_for_refusers(results, knows, whole,
                                              frwindow.Window(slack=frwindow.LOCAL_SLACK))

    async def _fr_round_with_stacks(self, params: Mapping[str, str], addrs: Sequence[WorkerAddr],
                                    stacks: dict[int, str]) -> list[RankResult]:
        """``_fr_round`` asking our workers for their stacks too; one that refuses the parameter
        (an older worker: 400 naming it) is asked again without it, and from then on."""
        asks = [a for a in addrs if (a.url or "") not in self._no_fr_stacks]
        rest = [a for a in addrs if (a.url or "") in self._no_fr_stacks]
        results = await self._fr_round({**params, WITH_STACKS: "true"}, asks, stacks=stacks)
        refused = {r.rank for r in results if r.http_status == 400
                   and f"parameter {WITH_STACKS!r}" in (r.error or "")}
        for a in asks:
            if a.rank in refused:
                self._no_fr_stacks.add(a.url or "")
        rest += [a for a in asks if a.rank in refused]
        if not rest:
            return results
        again = {r.rank: r for r in await self._fr_round(params, rest)}
        return sorted([again.pop(r.rank, r) for r in results] + list(again.values()),
                      key=lambda r: r.rank)

    async def _whole_for_refusers(self, results: list[RankResult], asked: Sequence[WorkerAddr],
                                  whole: list[WorkerAddr],
                                  cut: Callable[[dict[str, Any]], dict[str, Any]],
                                  ) -> list[RankResult]:
        """Workers that refused our window parameters (400) get whole rings, now and later
        (``cut`` to the window as they arrive, see ``_fr_round``)."""
        refused = {r.rank for r in results if r.http_status == 400}
        for a in asked:
            if a.rank in refused:
                self._no_since.add(a.url or "")
        whole = whole + [a for a in asked if a.rank in refused]
        if whole:
            more = {r.rank: r for r in await self._fr_round({"onlyactive": "false"}, whole, cut)}
            results = [more.pop(r.rank, r) for r in results] + list(more.values())
        return sorted(results, key=lambda r: r.rank)

    async def _fr_window_round(self, since: Mapping[str, int], addrs: Sequence[WorkerAddr],
                               first: Mapping[int, Mapping[str, Any]]) -> list[RankResult]:
        # Each rank is sent only its own groups' cut (a URL must stay under 8 KB however many
        # groups the job has); ranks with the same groups share one fan-out.
        by_param: dict[str, list[WorkerAddr]] = {}
        whole = []
        for a in addrs:
            text = frwindow.since_for(since, frwindow.rank_groups(first[a.rank]))
            if text is None or (a.url or "") in self._no_since:
                whole.append(a)
            else:
                by_param.setdefault(text, []).append(a)
        rounds = await asyncio.gather(*(self._fr_round({"since": text}, group)
                                        for text, group in by_param.items()))
        results = [r for rs in rounds for r in rs]
        knows = [a for group in by_param.values() for a in group]
        return await self._whole_for_refusers(results, knows, whole,
                                              lambda d: frwindow.window(d, since))

    async def stacks(self, addrs: Sequence[WorkerAddr] | None = None, *, native: bool = False,
                     every: bool = False) -> list[RankResult]:
        """Every rank's stacks, never disturbing a rank that did not opt in.

        First each worker's own answer (faulthandler). A rank whose worker timed out (its main
        thread holding the GIL) is read by py-spy from outside (``pyspy``: the frontend for its
        own host, an answering worker on that rank's host otherwise), within about 1 s more.
        Only where py-spy is unavailable or not permitted, and only for a rank that opted in
        (``signal_stacks``), is the rank asked by signal (``sigstack``). ``native``: every rank
        through py-spy ``--native`` (Python and native frames; pauses each rank for the read);
        ``every``: every rank through py-spy, not only the stuck ones.
        """
        if addrs is None:
            addrs = await self.registry.lookup()
        results = await self.fetch(STACKS_HANDLER, None, addrs)
        return await self._stuck_stacks(results, addrs, native=native, every=every)

    async def _stuck_stacks(self, results: list[RankResult], addrs: Sequence[WorkerAddr], *,
                            native: bool = False, every: bool = False) -> list[RankResult]:
        """``stacks``' records completed: a rank whose worker timed out (a thread holding the
        GIL) read by py-spy, else by signal where it opted in; ``native``/``every`` as there."""

        async def ask(helper: WorkerAddr, params: Mapping[str, str], timeout: float) -> RankResult:
            return await fetch_one(self.session, helper, pyspy.HANDLER, params, timeout)

        failed = await self.pyspy.fill(results, addrs, ask=ask, native=native,
                                       every=every or native, ok=OK, timed_out=TIMED_OUT)
        no_pyspy = [r for r in results if r.status == TIMED_OUT and r.rank in failed
                    and failed[r.rank].kind in (pyspy.UNAVAILABLE, pyspy.NOT_PERMITTED)]
        await self.signal_capture.fill(no_pyspy, {a.rank: a.meta for a in addrs}, TIMED_OUT)
        return results


def parse_dumps(results: Sequence[RankResult]) -> dict[int, dict[str, Any]]:
    """Parse the OK bodies; a body that is not a JSON object turns its record into a failure."""
    dumps: dict[int, dict[str, Any]] = {}
    for r in results:
        if not r.ok:
            continue
        try:
            dump = r.json()
        except ValueError as e:
            r.status, r.error = FAILED, f"reply is not JSON ({first_line(e, 200, empty='')})"
            continue
        if not isinstance(dump, dict):
            r.status, r.error = FAILED, "reply is not a JSON object"
            continue
        members.inline(dump)  # lists sent as references (pgknown), one shared copy
        members.learn(dump)
        dumps[r.rank] = dump
    return dumps


CPU_EMPTY_TTL_S = 30.0
"""How long an empty CPU recorder of torch's C++ worker (no group, no entry: an NCCL-only job)
stands for asking it again. A gloo group made since shows within this long; NCCL's recorder,
where the hang is, is asked on every page."""

INLINE_BYTES = 256 * 1024
"""Replies smaller than this in all are parsed on the event loop, not on a thread: the hop and
the GIL hand-over between threads cost more than parsing them (an agent's 8 ranks' windows are
about 20 KB; 1024 agents on one box spent 2x the CPU on their fr replies with the hops)."""
INLINE_DUMPS = 64
"""Up to this many dumps are cut to the window on the event loop (a few entries each)."""


async def parse_off_loop(results: Sequence[RankResult]) -> dict[int, dict[str, Any]]:
    """``parse_dumps`` on a thread where the bodies are big (``INLINE_BYTES``), else here."""
    if sum(len(r.body) for r in results if r.body) < INLINE_BYTES:
        return parse_dumps(results)
    return await asyncio.get_running_loop().run_in_executor(None, parse_dumps, results)


async def cut_off_loop(dumps: Mapping[int, dict[str, Any]],
                       since: Mapping[str, int]) -> dict[int, dict[str, Any]]:
    """``_cut_all`` on a thread for many dumps (``INLINE_DUMPS``), else here."""
    if len(dumps) <= INLINE_DUMPS:
        return _cut_all(dumps, since)
    return await asyncio.get_running_loop().run_in_executor(None, _cut_all, dumps, since)


CUT_ON_ARRIVAL_BYTES = 256 * 1024
"""A windowed FR reply larger than this is cut to the window as it arrives (``_fr_round``)."""


def _param_cut(params: Mapping[str, str]) -> Callable[[dict[str, Any]], dict[str, Any]] | None:
    """The window an FR request's parameters ask for (None: whole rings or active entries)."""
    if "since" in params:
        return frwindow.Window(since=frwindow.parse_since(params["since"]))
    if "window" in params:
        return frwindow.Window(slack=int(params["window"]))
    return None


def _cutter_on_arrival(cut: Callable[[dict[str, Any]], dict[str, Any]] | None
                       ) -> Callable[[RankResult], Awaitable[None]] | None:
    if cut is None:
        return None
    return _cutter_by_record(lambda r: cut)


def _cutter_by_record(cut_for: Callable[[RankResult], Callable[[dict[str, Any]], dict[str, Any]]
                                        | None]) -> Callable[[RankResult], Awaitable[None]]:
    """``_cutter_on_arrival`` with a cut chosen per record (``cut_for``; None: left whole)."""

    async def each(r: RankResult) -> None:
        if r.ok and r.body is not None and len(r.body) > CUT_ON_ARRIVAL_BYTES:
            cut = cut_for(r)
            if cut is not None:
                r.body = await asyncio.get_running_loop().run_in_executor(None, _cut_body,
                                                                          r.body, cut)

    return each


def _lists_referred(then: Callable[[RankResult], Awaitable[None]] | None,
                    ) -> Callable[[RankResult], Awaitable[None]]:
    """An ``each`` that runs ``then`` (a cut), then writes each long member list of the reply
    as a reference (``members.refer_text``; ``parse_dumps`` puts the shared copy back): torch's
    C++ workers send the world's list in every reply."""

    async def each(r: RankResult) -> None:
        if then is not None:
            await then(r)
        if r.ok and r.body is not None:
            r.body = members.refer_text(r.body)

    return each


def _stacks_apart(stacks: dict[int, str], then: Callable[[RankResult], Awaitable[None]] | None,
                  ) -> Callable[[RankResult], Awaitable[None]]:
    """An ``each`` that moves a ``stacks=true`` reply's stacks text into ``stacks`` (its FR JSON
    stays the body), then runs ``then``."""

    async def each(r: RankResult) -> None:
        if r.ok and r.body is not None:
            r.body, text = split_stacks(r.body)
            if text is not None:
                stacks[r.rank] = text
        if then is not None:
            await then(r)

    return each


async def _no_results() -> list[RankResult]:
    return []


def _merge_bodies(pairs: Sequence[tuple[RankResult, RankResult]], active: bool = False,
                  ) -> list[tuple[str | None, frozenset[str]]]:
    """Each rank's CPU and NCCL recorder replies as one body (``c10d_workers.merge``), and the
    CPU groups renamed. A reply that is not a JSON object, or an NCCL recorder that names no
    group, leaves the CPU body as it is (``parse_dumps`` reports a bad one). ``active``: the
    NCCL replies are ``onlyactive`` ones, marked as such a cut (``activecover.mark``)."""
    out: list[tuple[str | None, frozenset[str]]] = []
    for cpu, nccl in pairs:
        b = _json_object(nccl.body)
        # An empty CPU recorder (an NCCL-only job; held, CPU_EMPTY_TTL_S): the NCCL reply is
        # the merged one, as its own text (marked where active), parsed once here, not encoded.
        a = _EMPTY_CPU if cpu.body == c10d_workers.EMPTY_CPU_BODY else _json_object(cpu.body)
        if a is None or b is None or not c10d_workers.has_groups(b):
            out.append((cpu.body, frozenset()))
        elif c10d_workers.is_empty(a) and WINDOW_KEY not in b:
            out.append((activecover.mark_text(nccl.body or "", b) if active else nccl.body,
                        frozenset()))
        else:
            merged, renamed = c10d_workers.merge(a, activecover.mark(b) if active else b)
            out.append((_encoded(merged), renamed))
    return out


_EMPTY_CPU: dict[str, Any] = fastjson.loads(c10d_workers.EMPTY_CPU_BODY)


def _json_object(body: str | None) -> dict[str, Any] | None:
    """``body`` parsed, where it is a JSON object (else None: ``parse_dumps`` reports it)."""
    try:
        dump = fastjson.loads(body or "")
    except ValueError:
        return None
    return dump if isinstance(dump, dict) else None


def _encoded(dump: Mapping[str, Any]) -> str:
    return fastjson.dumps(dump, default=str)


def _rewritten(body: str | None, change: Callable[[dict[str, Any]], Mapping[str, Any]],
               ) -> str | None:
    """``body`` parsed, changed and encoded again; unchanged where it is not a JSON object."""
    dump = _json_object(body)
    return body if dump is None else _encoded(change(dump))


def _marked_active(body: str | None) -> str | None:
    """An ``onlyactive`` reply's body with its cut's facts (``activecover.mark``)."""
    return _rewritten(body, activecover.mark)


def _cut_body(body: str, cut: Callable[[dict[str, Any]], dict[str, Any]]) -> str:
    """``body`` cut to the window and encoded again; unchanged when it is not a JSON object
    (``parse_dumps`` reports that with its own line). A whole c10d ring is cut from its text,
    parsing only what the window keeps (``frtext``), where its text allows."""
    if isinstance(cut, frwindow.Window):
        fast = frtext.cut_text(body, cut)
        if fast is not None:
            return fast
    return _rewritten(body, cut) or body


def _cut_all(dumps: Mapping[int, dict[str, Any]],
             since: Mapping[str, int]) -> dict[int, dict[str, Any]]:
    """Every dump cut to the job's window (the workers' own cuts may keep a little more)."""
    return {r: frwindow.window(d, since) for r, d in dumps.items()}


def failure_lines(results: Sequence[RankResult]) -> list[str]:
    """One line per rank that did not answer OK."""
    return [r.line() for r in results if not r.ok]
