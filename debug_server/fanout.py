"""Asking every rank's worker the same question at once.

``fan_out`` never raises: it returns one ``RankResult`` per rank, in rank order. A rank is
``ok``, ``not registered`` (no usable key in the store), ``unreachable`` (nothing listening, or
the connection broke), ``timed out`` (no full answer within the per-rank timeout) or ``failed``
(the worker answered with an HTTP error). Every renderer consumes these records, and a failed
rank reads as one line: ``rank 3: unreachable after 2.0 s``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlencode

import aiohttp

from debug_server.discovery import NOT_REGISTERED, WorkerAddr
from debug_server.sigstack import SignalCapture

logger = logging.getLogger(__name__)

OK = "ok"
UNREACHABLE = "unreachable"
TIMED_OUT = "timed out"
FAILED = "failed"

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

    @property
    def ok(self) -> bool:
        return self.status == OK

    def line(self) -> str:
        """One line for people: ``rank 3: OK`` or ``rank 3: unreachable after 2.0 s (...)``."""
        if self.ok:
            return f"rank {self.rank}: OK ({self.elapsed_s:.2f} s)"
        return f"rank {self.rank}: {self.error or self.status}"

    def json(self) -> Any:
        """The body parsed as JSON; raises ``ValueError`` when it is not."""
        if self.body is None:
            raise ValueError(f"rank {self.rank} has no body ({self.status})")
        return json.loads(self.body)

    def summary(self) -> dict[str, Any]:
        """The record without its body (for JSON status lists)."""
        return {
            "rank": self.rank, "url": self.url, "status": self.status, "error": self.error,
            "elapsed_s": round(self.elapsed_s, 4), "http_status": self.http_status,
        }


def handler_url(base: str, handler: str, params: Mapping[str, str] | None = None) -> str:
    query = f"?{urlencode(params)}" if params else ""
    return f"{base}/handler/{handler}{query}"


async def fetch_one(
    session: aiohttp.ClientSession,
    addr: WorkerAddr,
    handler: str,
    params: Mapping[str, str] | None,
    timeout: float,
) -> RankResult:
    """POST one handler to one worker; every failure becomes a record, never an exception."""
    if addr.url is None:
        return RankResult(addr.rank, None, NOT_REGISTERED, error=addr.error or NOT_REGISTERED)
    url = handler_url(addr.url, handler, params)
    start = time.monotonic()

    def done(status: str, error: str | None = None, body: str | None = None,
             code: int | None = None) -> RankResult:
        return RankResult(addr.rank, addr.url, status, body, error, time.monotonic() - start, code)

    try:
        code, text = await asyncio.wait_for(_post(session, url), timeout)
    except asyncio.TimeoutError:  # builtin TimeoutError only from 3.11 on
        return done(TIMED_OUT, f"timed out after {timeout:.1f} s")
    except (aiohttp.ClientConnectionError, OSError) as e:
        elapsed = time.monotonic() - start
        detail = _short(e)
        return done(UNREACHABLE, f"unreachable after {elapsed:.1f} s"
                    + (f" ({detail})" if detail else ""))
    except aiohttp.ClientError as e:
        return done(FAILED, f"request failed: {type(e).__name__}: {_short(e)}")
    except _TooBig as e:
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
    semaphore: asyncio.Semaphore | None = None,
) -> list[RankResult]:
    """Ask every worker at once; one record per rank, in rank order.

    ``timeout`` is per rank and starts when that rank's request starts, so waiting for the
    ``semaphore`` (the bound on requests in flight) does not eat into it.
    """

    async def one(addr: WorkerAddr) -> RankResult:
        if semaphore is None or addr.url is None:
            return await fetch_one(session, addr, handler, params, timeout)
        async with semaphore:
            return await fetch_one(session, addr, handler, params, timeout)

    results = await asyncio.gather(*(one(a) for a in addrs))
    return sorted(results, key=lambda r: r.rank)


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

    def unavailable(self) -> dict[int, str]:
        return {r.rank: r.line() for r in self.results if r.rank not in self.dumps}


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
        max_concurrency: int = 64,
    ) -> None:
        self.session = session
        self.registry = registry
        self.timeout = timeout
        self.semaphore = asyncio.Semaphore(max_concurrency)
        self.states = RankStates()
        self.signal_capture = SignalCapture()

    @property
    def world_size(self) -> int:
        return self.registry.world_size

    async def fetch(
        self, handler: str, params: Mapping[str, str] | None = None,
        addrs: Sequence[WorkerAddr] | None = None,
    ) -> list[RankResult]:
        if addrs is None:
            addrs = await self.registry.lookup()
        results = await fan_out(self.session, addrs, handler, params, timeout=self.timeout,
                                semaphore=self.semaphore)
        self.states.update(results)
        return results

    async def fr(self, *, only_active: bool, addrs: Sequence[WorkerAddr] | None = None) -> FrData:
        """Every rank's FR dump as JSON, parsed off the event loop.

        A rank that does not know ``torchcomms_fr_trace_json`` (torch's own C++ worker answers
        404) is asked for c10d's built-in ``fr_trace_json`` instead.
        """
        if addrs is None:
            addrs = await self.registry.lookup()
        params = {"onlyactive": "true" if only_active else "false"}
        results = await self.fetch(FR_HANDLER, params, addrs)
        retry = [a for a, r in zip(addrs, results, strict=True) if r.http_status == 404]
        if retry:
            again = {r.rank: r for r in await self.fetch(C10D_FR_HANDLER, params, retry)}
            results = [again.get(r.rank, r) for r in results]
        dumps = await asyncio.get_running_loop().run_in_executor(None, parse_dumps, results)
        return FrData(results, dumps)

    async def stacks(self, addrs: Sequence[WorkerAddr] | None = None) -> list[RankResult]:
        """Every rank's stacks; a rank on this host whose worker timed out (its main thread
        holding the GIL) is asked by signal instead (``sigstack``), within about 1 s more."""
        if addrs is None:
            addrs = await self.registry.lookup()
        results = await self.fetch(STACKS_HANDLER, None, addrs)
        await self.signal_capture.fill(results, {a.rank: a.meta for a in addrs}, TIMED_OUT)
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
            r.status, r.error = FAILED, f"reply is not JSON ({_short(e)})"
            continue
        if not isinstance(dump, dict):
            r.status, r.error = FAILED, "reply is not a JSON object"
            continue
        dumps[r.rank] = dump
    return dumps


def failure_lines(results: Sequence[RankResult]) -> list[str]:
    """One line per rank that did not answer OK."""
    return [r.line() for r in results if not r.ok]


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else ""
