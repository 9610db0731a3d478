"""The live collector: lookup plus fan-out, with one session, one timeout, one bound on requests
in flight, and optionally a route that asks one agent per host instead of every rank.

:class:`LiveCollector` implements ``collector.Collector``. It owns the one asker of the ranks
(``asker.Asker``: client, slots, timeout, rank states) and hands it to its FR rounds
(``rounds.FrRounds``), its outside reads (``outside.OutsideReads``) and its route, none of
which knows the collector. Its page methods (``fetch``, ``fr``, ``stacks``, ``fr_stacks``) go
through its :class:`~collector.Route` where it has one (``agents.AgentRoute``): the route answers
what it can through the agents and returns what it left, which the ``direct_*`` methods here
ask; without one (fixed worker URLs, an agent's own collector) every rank is asked directly. The
agent asks its host's ranks with the two FR rounds apart (``first_round``, then ``complete`` or
``since_round``).
"""

from __future__ import annotations

import asyncio
import operator
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

import aiohttp

from debug_server.analysis.digest import DigestMemo
from debug_server.fanout.asker import Asker
from debug_server.fanout.collector import Plan, Route, Routed
from debug_server.fanout.leanhttp import LeanClient
from debug_server.fanout.outside import OutsideReads
from debug_server.fanout.reply import Each, FrData, Keep, cut_off_loop, parse_off_loop
from debug_server.fanout.rounds import FrRounds
from debug_server.fanout.transport import (
    OK,
    TIMED_OUT,
    UNREACHABLE,
    RankResult,
    RankStates,
    Registry,
)
from debug_server.protocol import frwindow
from debug_server.protocol.addrs import NOT_REGISTERED, WorkerAddr
from debug_server.protocol.names import (
    HEALTH_HANDLER,
    INCLUDE_STACKTRACES,
    ONLY_ACTIVE,
    STACKS_HANDLER,
    WINDOW,
)
from debug_server.readers import pyspy

_RANK = operator.attrgetter("rank")

RouteFor = Callable[[Asker, FrRounds], Route]
"""A route built on the collector's asker and FR rounds (``agents.agent_route``)."""


class LiveCollector:
    """Every rank's answers from the live workers (module doc)."""

    def __init__(
        self, session: aiohttp.ClientSession, registry: Registry, *, timeout: float,
        max_concurrency: int = 64, http: LeanClient | None = None,
        prime_ranks: int | None = None, route: RouteFor | None = None,
    ) -> None:
        self.registry = registry
        self.asker = Asker(session, timeout=timeout, max_concurrency=max_concurrency, http=http)
        """Asks the ranks for this collector, its rounds, outside reads and route (``asker``)."""
        self.rounds = FrRounds(self.asker, prime_ranks)
        self.outside = OutsideReads(self.asker)
        """Process states and py-spy, and the quiet ranks' kept reads (``outside``)."""
        self.route = route(self.asker, self.rounds) if route is not None else None
        """Through one agent per host (``agents.AgentRoute``); None: every rank directly."""
        self.digest_memo = DigestMemo() if route is not None else None
        """Digests of the last analysis of this collector's windows (``collector.Collector``).
        Only a route hands back the same dump objects (an agent's "unchanged" reply: its held
        dumps); without one every fetch parses new objects, and a memo would only keep the last
        dumps alive."""

    @property
    def states(self) -> RankStates:
        return self.asker.states

    @property
    def timeout(self) -> float:
        return self.asker.timeout

    @property
    def pyspy(self) -> pyspy.PySpyCapture:
        return self.outside.pyspy

    @property
    def world_size(self) -> int:
        return self.registry.world_size

    def data_time_ns(self) -> int:
        """When the data was taken (in-flight ops end here on a timeline): now, for a live job."""
        return time.time_ns()

    # -- the pages' methods (``collector.Collector``) -------------------------------------------

    async def fetch(self, handler: str, params: Mapping[str, str] | None = None,
                    addrs: Sequence[WorkerAddr] | None = None, each: Each | None = None,
                    ) -> list[RankResult]:
        if addrs is None:
            addrs = await self.registry.lookup()
        route = self.route
        if route is not None and not params and each is None and route.relays(handler):
            plan = await route.plan(addrs)
            if plan is not None:
                return await self._routed(route.fetch(handler, plan), plan,
                                          lambda rest: self.direct_fetch(handler, None, rest))
        return await self.direct_fetch(handler, params, addrs, each)

    async def fr(self, *, only_active: bool = False, whole: bool = False,
                 addrs: Sequence[WorkerAddr] | None = None) -> FrData:
        """Every rank's FR dump, parsed once.

        By default each communicator's entries from its frontier on (``frwindow``): every entry
        that can still disagree, at a cost that does not grow with the ring. ``whole=True``
        fetches whole rings; ``only_active=True`` only entries not yet completed (not enough to
        find a mismatch that completed on one side; kept for the timeline download).

        Usually one round trip: each worker cuts at its own frontier less a slack; a rank whose
        cut turns out above the job's frontier is asked again from ``since=`` on (``rounds``).
        """
        if addrs is None:
            addrs = await self.registry.lookup()
        plan = await self.route.plan(addrs) if self.route is not None else None
        if self.route is None or plan is None:
            return await self.direct_fr(addrs, only_active=only_active, whole=whole)
        if not (whole or only_active):
            return await self.route.fr(plan)
        routed = await self.route.fr_plain(plan, only_active=only_active, whole=whole)
        results, dumps = list(routed.got.results), dict(routed.got.dumps)
        rest = plan.direct + routed.left
        if rest:
            plain = await self.direct_fr(rest, only_active=only_active, whole=whole)
            results += plain.results
            dumps.update(plain.dumps)
        self.states.update(results)
        return FrData(sorted(results, key=lambda r: r.rank), dumps)

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
        plan = await self.route.plan(addrs) if self.route is not None else None
        if self.route is not None and plan is not None:
            return await self._routed(self.route.stacks(plan, native=native, every=every), plan,
                                      lambda rest: self.direct_stacks(rest, native=native,
                                                                      every=every))
        return await self.direct_stacks(addrs, native=native, every=every)

    async def fr_stacks(self, addrs: Sequence[WorkerAddr] | None = None,
                        ) -> tuple[FrData, list[RankResult]]:
        """``fr()`` and ``stacks()`` of the same ranks, for a page that shows both, in one
        request per rank where the worker is ours (``wire.WITH_STACKS``): half the requests of
        asking each. A rank whose worker timed out is read by py-spy as ``stacks`` reads it;
        one that answered without stacks (torch's C++ worker) is asked for them apart."""
        fr, stacks, _ = await self._fr_stacks(addrs, None)
        return fr, stacks

    async def fr_stacks_health(self, addrs: Sequence[WorkerAddr] | None = None,
                               ) -> tuple[FrData, list[RankResult], list[RankResult]]:
        """``fr_stacks()`` and every rank's health: through agents in the same request per host
        (``agentwire.WITH_HEALTH``: at 131072 ranks, 16384 host requests fewer than asking
        apart); ranks no agent served, and without a route every rank, are asked for their
        health alongside."""
        health: list[RankResult] = []
        return await self._fr_stacks(addrs, health)

    async def _fr_stacks(self, addrs: Sequence[WorkerAddr] | None,
                         health: list[RankResult] | None,
                         ) -> tuple[FrData, list[RankResult], list[RankResult]]:
        if addrs is None:
            addrs = await self.registry.lookup()
        texts: dict[int, str] = {}
        plan = await self.route.plan(addrs) if self.route is not None else None
        if self.route is not None and plan is not None:
            # Each agent asked once for all (``agent_fr?stacks=true&health=true``); ranks
            # asked directly get their stacks with their FR too (``stacks_after_fr``), and
            # their health apart: the ranks no agent serves meanwhile, those an agent left
            # (it failed, or refused health) after.
            routed, direct_health = await asyncio.gather(
                self.route.fr_stacks(plan, texts, health),
                self._health_of(plan.direct if health is not None else []))
            fr, got = routed.got
            rest: list[WorkerAddr] = []
            if health is not None:
                health += direct_health
                have = {r.rank for r in health}
                rest = [a for a in addrs if a.rank not in have]
            more, more_health = await asyncio.gather(
                self.stacks_after_fr(routed.left, fr.results, texts) if routed.left
                else asyncio.sleep(0, []), self._health_of(rest))
            healths = sorted(health + more_health, key=_RANK) if health is not None else []
            return fr, sorted(got + more, key=_RANK), healths
        first, got_health = await asyncio.gather(
            self.first_round(addrs, texts), self._health_of(addrs if health is not None else []))
        fr, stacks = await asyncio.gather(self.complete(addrs, first),
                                          self.stacks_after_fr(addrs, first, texts))
        return fr, stacks, got_health

    async def _health_of(self, addrs: Sequence[WorkerAddr]) -> list[RankResult]:
        """Every rank's health reply, asked directly (none asked for no rank)."""
        return await self.direct_fetch(HEALTH_HANDLER, None, addrs) if addrs else []

    async def fr_recent(self, ops: int, addrs: Sequence[WorkerAddr] | None = None,
                        keep: Keep | None = None) -> FrData:
        """Each rank's newest entries without their stacks: per communicator from its own
        frontier less ``ops`` on (``window=<ops>&includestacktraces=false``), in one request per
        rank straight to the workers; the straggler poll's fetch (``frontend.stragglers``). A
        worker that refuses these parameters gets whole rings, cut to the window as they arrive.
        ``keep``: what to keep of each reply as it arrives (``reply.kept_on_arrival``)."""
        if addrs is None:
            addrs = await self.registry.lookup()
        cut = frwindow.Window(slack=ops)
        results = await self.rounds.ask({WINDOW: str(ops), INCLUDE_STACKTRACES: "false"},
                                        addrs, cut, keep=keep)
        results = await self.rounds.whole_for_refusers(results, addrs, [], cut, keep)
        return FrData(results, await parse_off_loop(results))

    # -- every rank directly (the route's fall-back, and an agent's own collector) ------------

    async def direct_fetch(self, handler: str, params: Mapping[str, str] | None,
                           addrs: Sequence[WorkerAddr], each: Each | None = None,
                           ) -> list[RankResult]:
        return await self.asker.fetch(handler, params, addrs, each)

    async def direct_fr(self, addrs: Sequence[WorkerAddr], *, only_active: bool = False,
                        whole: bool = False) -> FrData:
        if whole or only_active:
            params = {ONLY_ACTIVE: "true" if only_active and not whole else "false"}
            results = await self.rounds.ask(params, addrs)
            return FrData(results, await parse_off_loop(results))
        return await self.complete(addrs, await self.first_round(addrs))

    async def direct_stacks(self, addrs: Sequence[WorkerAddr], *, native: bool = False,
                            every: bool = False) -> list[RankResult]:
        results = await self.direct_fetch(STACKS_HANDLER, None, addrs)
        return await self._stuck_stacks(results, addrs, native=native, every=every)

    # -- the default FR fetch in its two rounds (an agent asks them apart) ---------------------

    async def first_round(self, addrs: Sequence[WorkerAddr],
                          stacks: dict[int, str] | None = None) -> list[RankResult]:
        """The default ``fr``'s first round alone, replies not yet parsed (an agent compares
        them with its last ones before it parses them: ``agent.digest.fr_tag``). With
        ``stacks`` (a dict to fill) our workers are asked for their stacks in the same request
        (``wire.WITH_STACKS``): each rank's stacks text goes there, its FR JSON stays the body."""
        return await self.rounds.local(addrs, stacks)

    async def complete(self, addrs: Sequence[WorkerAddr], first: list[RankResult]) -> FrData:
        """The default ``fr`` from its first round's records on: the job's frontier from them,
        round 2 for the ranks whose cut lies above it, every dump cut to the window."""
        first_dumps = await parse_off_loop(first)
        since = frwindow.frontier(first_dumps)
        # Round 2, rarely: ranks whose own cut lies above the job's frontier (a rank that
        # timed out once is not asked again: that would cost a second timeout on one page).
        again = [a for a in addrs if a.rank in first_dumps
                 and not frwindow.covers(first_dumps[a.rank], since)]
        second = await self.rounds.since(since, again, first_dumps) if again else []
        by_rank = {r.rank: r for r in second}
        results = [by_rank.get(r.rank, r) for r in first]
        if second:
            redone = await parse_off_loop(second)
            first_dumps = {r: redone.get(r, d) for r, d in first_dumps.items()
                           if r not in by_rank or r in redone}
        dumps = await cut_off_loop(first_dumps, since)
        return FrData(results, dumps, since)

    async def since_round(self, since: Mapping[str, int], addrs: Sequence[WorkerAddr],
                          groups: Mapping[int, set[str]]) -> FrData:
        """Round 2 alone (a host's agent, asked ``since=`` by the frontend): each rank from
        ``since`` on, cut to it; ``groups``: each rank's groups (``since`` is cut to them)."""
        first = {a.rank: {"pg_status": dict.fromkeys(groups.get(a.rank, since), {})}
                 for a in addrs}
        results = await self.rounds.since(since, addrs, first)
        dumps = await cut_off_loop(await parse_off_loop(results), since)
        return FrData(results, dumps, dict(since))

    async def routed_since(self, since: Mapping[str, int],
                           addrs: Sequence[WorkerAddr]) -> FrData:
        """Round 2 alone through the route (an aggregator asked ``since=``), else directly."""
        plan = await self.route.plan(addrs) if self.route is not None else None
        if self.route is None or plan is None:
            return await self.since_round(since, addrs, {a.rank: set(since) for a in addrs})
        return await self.route.since(plan, since)

    async def stacks_after_fr(self, addrs: Sequence[WorkerAddr], first: Sequence[RankResult],
                              texts: Mapping[int, str]) -> list[RankResult]:
        """``stacks()`` of ``addrs`` from an FR round that asked for them (``first_round``):
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
            results += await self.direct_fetch(STACKS_HANDLER, None, ask)
        return await self._stuck_stacks(sorted(results, key=lambda r: r.rank), addrs)

    async def _stuck_stacks(self, results: list[RankResult], addrs: Sequence[WorkerAddr], *,
                            native: bool = False, every: bool = False) -> list[RankResult]:
        """``stacks``' records completed (``outside.OutsideReads.complete``): a rank whose worker
        timed out read by py-spy, else by signal where it opted in; processes read."""
        return await self.outside.complete(results, addrs, native=native, every=every)

    async def _routed(self, through: Awaitable[Routed[list[RankResult]]], plan: Plan,
                      directly: Callable[[list[WorkerAddr]], Awaitable[list[RankResult]]],
                      ) -> list[RankResult]:
        """A route's records for its ranks, ``plan.direct`` asked ``directly`` meanwhile, then
        the ranks it left asked ``directly`` too."""
        routed, first = await asyncio.gather(
            through, directly(plan.direct) if plan.direct else asyncio.sleep(0, []))
        results: list[RankResult] = [*first, *routed.got]
        if routed.left:
            results += await directly(routed.left)
        self.states.update(results)
        return sorted(results, key=lambda r: r.rank)

    def close(self) -> None:
        self.outside.close()
        if self.route is not None:
            self.route.close()


__all__ = ["LiveCollector"]
