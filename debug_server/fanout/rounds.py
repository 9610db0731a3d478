"""The FR rounds of one fetch, and what the live collector learnt of each worker's FR handler.

An FR fetch is one or two rounds (``live.LiveCollector.fr``): round 1 asks each worker to cut
at its own frontier less a slack (:meth:`FrRounds.local`), round 2 asks the few ranks whose cut
lay above the job's frontier from ``since=`` on (:meth:`FrRounds.since`). Each round is
:meth:`FrRounds.ask`, which sends each worker the handler it answers: ours
(``torchcomms_fr_trace_json``, told the member lists this process holds: ``members``) or, for
torch's C++ worker (404 on ours), c10d's two recorders (``c10d_round``). A worker that refuses
a parameter (400 naming it: an older one of ours) is asked without it from then on; one that
refuses the window gets whole rings, cut here to the same window as they arrive.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlencode

from debug_server.fanout.asker import Asker
from debug_server.fanout.c10d_round import C10dRound
from debug_server.fanout.collector import PRIME_RANKS, PRIME_TIMEOUT_S
from debug_server.fanout.reply import (
    Cut,
    Each,
    Keep,
    cut_on_arrival,
    kept_on_arrival,
    param_cut,
    parse_dumps,
    stacks_apart,
)
from debug_server.fanout.transport import RankResult, fetch_one
from debug_server.protocol import frwindow, members
from debug_server.protocol.addrs import WorkerAddr
from debug_server.protocol.names import (
    C10D_FR_HANDLER,
    FR_HANDLER,
    ONLY_ACTIVE,
    SINCE,
    WINDOW,
    WITH_STACKS,
)


class FrRounds:
    """The FR rounds of one live collector, asked through its asker (module doc)."""

    def __init__(self, asker: Asker, prime_ranks: int | None = None) -> None:
        self.asker = asker
        self.prime_ranks = PRIME_RANKS if prime_ranks is None else prime_ranks
        """From this many ranks on, an FR fan-out while no member list is held asks one rank
        first (``_ours``); once one such rank has answered, never again (a job whose lists
        are all short teaches nothing, and would pay the extra round trip on every page)."""
        self._primed = False
        self.c10d = C10dRound(asker.fetch)
        # Per worker URL: which FR handler answers (torch's C++ worker has only c10d's), and
        # which parameters it refused (older ours).
        self._fr_handler: dict[str, str] = {}
        self._no_since: set[str] = set()  # refused the window: whole rings, cut here
        self._no_members: set[str] = set()  # refused ``pgknown``
        self._no_fr_stacks: set[str] = set()  # refused ``stacks``

    async def ask(self, params: Mapping[str, str], addrs: Sequence[WorkerAddr],
                  cut: Cut | None = None, stacks: dict[int, str] | None = None,
                  keep: Keep | None = None) -> list[RankResult]:
        """One FR fan-out; a 404 from our handler retries c10d's, and the winner is remembered.

        ``cut``: the window these replies are for (default: the one ``params`` ask for); a big
        reply is cut to it as it arrives (``reply.cutter``). ``stacks``: where ``params`` ask
        for them (``wire.WITH_STACKS``), each reply's stacks text goes there as it arrives.
        ``keep``: what to keep of each of our workers' replies as it arrives (``reply.Keep``).
        """
        cut = cut or param_cut(params)
        each = cut_on_arrival(cut)
        if keep is not None:
            each = kept_on_arrival(keep, each)
        if stacks is not None:
            each = stacks_apart(stacks, each)
        handlers = {a.rank: self._fr_handler.get(a.url or "", FR_HANDLER) for a in addrs}
        ours = [a for a in addrs if handlers[a.rank] == FR_HANDLER]
        theirs = [a for a in addrs if handlers[a.rank] != FR_HANDLER]
        results = await self._ours(params, ours, each) if ours else []
        retry = [a for a, r in zip(ours, results, strict=True) if r.http_status == 404]
        for a in retry:
            self._fr_handler[a.url or ""] = C10D_FR_HANDLER
        retry += theirs
        if retry:
            plain = {k: v for k, v in params.items() if k != WITH_STACKS}
            done = {r.rank: r for r in await self.c10d.ask(plain, retry, cut)}
            for a in theirs:  # a restarted worker on the same URL may be ours again
                if done[a.rank].http_status == 404:
                    self._fr_handler.pop(a.url or "", None)
                    self.asker.absent.forget(a.url or "")
            results = [done.pop(r.rank, r) for r in results] + list(done.values())
        return sorted(results, key=lambda r: r.rank)

    async def _ours(self, params: Mapping[str, str], addrs: Sequence[WorkerAddr],
                    each: Each | None = None) -> list[RankResult]:
        """Our handler, told which member lists this process holds (``members``); a worker
        that does not know that parameter (400 naming it) is asked without it, from then on.

        While this process holds no list yet (its first page), one rank is asked first and
        its lists learnt, so the other ranks' replies do not each carry the world's members.
        """
        c = self.asker
        # aiohttp refuses request lines over 8190 bytes, and ``since`` may take most of them.
        budget = min(members.MAX_PARAM_CHARS, 7000 - len(urlencode(params)))
        known = members.known_param(budget)
        by_rank: dict[int, RankResult] = {}
        if known is None and budget > 0 and len(addrs) >= self.prime_ranks and not self._primed:
            for a in [a for a in addrs if a.url][:1]:
                # Briefly: a stuck first rank must not delay the page by a whole timeout.
                async with c.semaphore:
                    r = await fetch_one(c.session, a, FR_HANDLER, params,
                                        min(c.timeout, PRIME_TIMEOUT_S), c.http)
                    if each is not None:  # as every reply of the fan-out (stacks apart, cut)
                        await each(r)
                if r.ok:  # else it is asked again with the others
                    self._primed = True
                    c.states.update([r])
                    by_rank[r.rank] = r
                    parse_dumps([RankResult(r.rank, r.url, r.status, r.body, dump=r.dump)])
            known = members.known_param(budget)
        told = [a for a in addrs if known and a.rank not in by_rank
                and (a.url or "") not in self._no_members]
        if not told and not by_rank:
            return await c.fetch(FR_HANDLER, params, addrs, each)
        told_ranks = {a.rank for a in told}
        untold = [a for a in addrs if a.rank not in by_rank and a.rank not in told_ranks]
        results = await c.fetch(FR_HANDLER, {**params, members.PARAM: known or ""}, told,
                                       each) if told else []
        refused = {r.rank for r in results
                   # "unknown parameter 'pgknown'": not any 400 whose list of allowed names
                   # has it (an older worker refusing ``stacks`` lists pgknown as allowed).
                   if r.http_status == 400 and f"parameter {members.PARAM!r}" in (r.error or "")}
        again = untold + [a for a in told if a.rank in refused]
        self._no_members.update(a.url or "" for a in told if a.rank in refused)
        by_rank.update((r.rank, r) for r in results)
        if again:
            by_rank.update((r.rank, r) for r in await c.fetch(FR_HANDLER, params, again,
                                                                     each))
        return [by_rank[a.rank] for a in addrs]  # in ``addrs`` order, as a fetch would be

    async def local(self, addrs: Sequence[WorkerAddr], stacks: dict[int, str] | None = None,
                    ) -> list[RankResult]:
        """Round 1: each rank cut at its own frontier less ``frwindow.LOCAL_SLACK``. With
        ``stacks`` (a dict to fill) our workers send their stacks in the same reply; one that
        refuses the parameter (an older worker: 400 naming it) is asked again without it, and
        from then on."""
        knows = [a for a in addrs if (a.url or "") not in self._no_since]
        whole = [a for a in addrs if (a.url or "") in self._no_since]
        window = {WINDOW: str(frwindow.LOCAL_SLACK)}
        asks = [a for a in knows if stacks is not None and (a.url or "") not in self._no_fr_stacks]
        rest = [a for a in knows if stacks is None or (a.url or "") in self._no_fr_stacks]
        results = await self.ask({**window, WITH_STACKS: "true"}, asks, stacks=stacks) \
            if asks else []
        refused = {r.rank for r in results if r.http_status == 400
                   and f"parameter {WITH_STACKS!r}" in (r.error or "")}
        self._no_fr_stacks.update(a.url or "" for a in asks if a.rank in refused)
        rest += [a for a in asks if a.rank in refused]
        if rest:
            again = {r.rank: r for r in await self.ask(window, rest)}
            results = [again.pop(r.rank, r) for r in results] + list(again.values())
        return await self.whole_for_refusers(sorted(results, key=lambda r: r.rank), knows,
                                             whole, frwindow.Window(slack=frwindow.LOCAL_SLACK))

    async def since(self, since: Mapping[str, int], addrs: Sequence[WorkerAddr],
                    first: Mapping[int, Mapping[str, Any]]) -> list[RankResult]:
        """Round 2: each rank from ``since`` on. Each is sent only its own groups' cut (``first``:
        its round-1 dump; a URL must stay under 8 KB however many groups the job has); ranks
        with the same groups share one fan-out."""
        by_param: dict[str, list[WorkerAddr]] = {}
        whole = []
        for a in addrs:
            text = frwindow.since_for(since, frwindow.rank_groups(first[a.rank]))
            if text is None or (a.url or "") in self._no_since:
                whole.append(a)
            else:
                by_param.setdefault(text, []).append(a)
        rounds = await asyncio.gather(*(self.ask({SINCE: text}, group)
                                        for text, group in by_param.items()))
        results = [r for rs in rounds for r in rs]
        knows = [a for group in by_param.values() for a in group]
        return await self.whole_for_refusers(results, knows, whole,
                                             lambda d: frwindow.window(d, since))

    async def whole_for_refusers(self, results: list[RankResult], asked: Sequence[WorkerAddr],
                                 whole: list[WorkerAddr], cut: Cut, keep: Keep | None = None,
                                 ) -> list[RankResult]:
        """Workers that refused our window parameters (400) get whole rings, now and later
        (``cut`` to the window as they arrive; ``keep`` as ``ask``'s)."""
        refused = {r.rank for r in results if r.http_status == 400}
        for a in asked:
            if a.rank in refused:
                self._no_since.add(a.url or "")
        whole = whole + [a for a in asked if a.rank in refused]
        if whole:
            more = {r.rank: r for r in await self.ask({ONLY_ACTIVE: "false"}, whole, cut,
                                                      keep=keep)}
            results = [more.pop(r.rank, r) for r in results] + list(more.values())
        return sorted(results, key=lambda r: r.rank)
