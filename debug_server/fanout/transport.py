"""The fan-out's transport: one POST per worker, every failure a record, never an exception.

``fan_out`` returns one ``RankResult`` per rank, in rank order. A rank is ``ok``, ``not
registered`` (no usable key in the store), ``unreachable`` (nothing listening, or the connection
broke), ``timed out`` (no full answer within the per-rank timeout) or ``failed`` (the worker
answered with an HTTP error). Every renderer consumes these records, and a failed rank reads as
one line: ``rank 3: unreachable after 2.0 s``.

**Two HTTP clients, each for what it alone does.** Plain ``http://`` workers (ours, agents,
torch's C++ worker) are asked through ``leanhttp.LeanClient``: a third of aiohttp's CPU per
request; ``benchmarks/bench_frontend.py --per-rank --memo --ranks 4096`` took 1.12 s for
``/fr_trace`` with it against 2.08 s through aiohttp's client (2-core box, ``leanhttp``'s
docstring). aiohttp's client stays for what the lean one does not speak: ``https://`` workers
(``--tls``) and the processes that hold no lean client (py-spy helper asks, tests).
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

from debug_server.errors import first_line
from debug_server.fanout.leanhttp import BodyTooLarge, LeanClient, ProtocolError
from debug_server.fanout.pagefirst import PageFirstSemaphore
from debug_server.protocol import fastjson
from debug_server.protocol.addrs import NOT_REGISTERED, WorkerAddr

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
    dump: dict[str, Any] | None = None
    """An FR reply already parsed as it arrived (``reply``: a big ring cut to its window, torch's
    C++ worker's two recorders merged); its ``body`` is then ``""`` (answered). Never encoded
    again: ``reply.parse_dumps`` takes it as it is."""
    process: dict[str, Any] | None = None
    """The rank's process as read from outside on its host (``readers.procstate``: state, since,
    CPU use, wait channel, whether it holds the GIL), where it was read."""

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
        """The body parsed as JSON (the ``dump`` where it was parsed on arrival); raises
        ``ValueError`` when it is not JSON."""
        if self.dump is not None:
            return self.dump
        if self.body is None:
            raise ValueError(f"rank {self.rank} has no body ({self.status})")
        return fastjson.loads(self.body)

    def summary(self) -> dict[str, Any]:
        """The record without its body (for JSON status lists)."""
        return {
            "rank": self.rank, "url": self.url, "status": self.status, "error": self.error,
            "elapsed_s": round(self.elapsed_s, 4), "http_status": self.http_status,
            **({"note": self.note} if self.note else {}),
            **({"process": self.process} if self.process is not None else {}),
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



class RankStates:
    """The last reachability state of every rank; logs one line per change, not per fetch.

    A rank that answers at all (even an HTTP error) is ``ok`` here; otherwise its state is the
    fan-out status (``unreachable``, ``timed out``, ``not registered``). A dead rank thus costs
    one log line ("rank 3: ok -> unreachable", at debug level: see ``update``), not one per page
    and per dump cycle.
    """

    def __init__(self) -> None:
        self.last: dict[int, str] = {}

    @staticmethod
    def state(r: RankResult) -> str:
        return OK if r.status == OK or r.http_status is not None else r.status

    def update(self, results: Sequence[RankResult]) -> None:
        last = self.last
        for r in results:  # ``state`` inlined: once per rank per page
            new = OK if r.status == OK or r.http_status is not None else r.status
            old = last.get(r.rank)
            if old == new:
                continue
            self.last[r.rank] = new
            if old is None and new == OK:
                continue  # first sight of a healthy rank: nothing to report
            # A rank that stops answering is the job's end far more often than a fault: the
            # frontend's watch says which it was, once per batch of ranks (departed), so here
            # it is only debug. A rank that answers too slowly stays a warning.
            level = (logging.INFO if new == OK else logging.DEBUG if new == UNREACHABLE
                     else logging.WARNING)
            detail = "" if new == OK else f" ({r.error})" if r.error and r.error != new else ""
            logger.log(level, "debug_server: rank %d: %s%s%s", r.rank,
                       f"{old} -> " if old is not None else "", new, detail)



def failure_lines(results: Sequence[RankResult]) -> list[str]:
    """One line per rank that did not answer OK."""
    return [r.line() for r in results if not r.ok]
