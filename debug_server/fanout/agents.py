"""The live collector's way through the per-host agents (``agent``), and back to the ranks without them.

:class:`AgentRoute` is the route (``collector.Route``) a ``live.LiveCollector`` is given where
the workers are found in a store, built on the collector's asker and FR rounds (``asker``,
``rounds``; it never calls the collector): its ``fr``, ``stacks``, ``fr_stacks`` and ``fetch``
(for the handlers an agent relays: health, ping, pickle dump) ask one agent per host instead of
every rank and return what they got, one ``RankResult`` per rank with the parsed dumps, and the
ranks they left (the collector asks those directly), so every page, dump and verdict is computed
as before. The agents' replies are read by ``agentreply``.

Which rank goes where: a rank whose registration sidecar names an agent (``"agent": <host id>``)
that is registered in the store (``debug_server/agent/<id>``) for this restart and lists the rank
goes through that agent; every other rank (torch's C++ workers, a host without an agent) is asked
directly. **A dead agent never hides a rank**: an agent that is not registered, refuses the
connection, answers badly or not within ``2 x fetch_timeout + 2 s`` has its ranks asked directly
in the same page, and is skipped (its ranks asked directly at once) for
:data:`AGENT_RETRY_S` before it is tried again. A rank its agent reports as not registered
(the agent's view of the store lags) is asked directly too.

The FR window keeps its protocol across agents: round 1 asks each agent for its host's ranks cut
at the host's frontier (and the direct ranks for their own cut), the job's frontier comes from
all replies, and only the ranks whose cut lies above it are asked again with ``since=``, through
their agent. Long member lists come once per agent reply, and not at all when this frontend
already holds them (``pgknown``). FR asks are conditional (``agentwire.TAG``): a host whose ranks'
windows did not change since this frontend's last ask (the hung case) answers with its rank
records and read times only, and the dumps held from its last reply are used again. Where every
agent's reply carries the same tag as for the last page, the job's window and the dumps cut to
it are used again too (with the new read times): no frontier and no cut over 16384 dumps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import operator
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import aiohttp

from debug_server.analysis.digest import SNAPSHOT_TIME_KEY
from debug_server.fanout.agentdir import (
    AGENT_RETRY_S,
    AGENT_SLACK_S,
    GROUP_ID_PREFIX,
    AgentDirectory,
)
from debug_server.fanout.agentreply import (
    AgentAddr,
    Held,
    held_again,
    keep_parts,
    parse_fr,
    parse_grouped,
    ranks_param,
    registered,
    take_replies,
    with_snap,
)
from debug_server.fanout.asker import Asker
from debug_server.fanout.collector import Plan, Routed
from debug_server.fanout.leanhttp import LeanClient
from debug_server.fanout.live import LiveCollector
from debug_server.fanout.reply import INLINE_BYTES, FrData, cut_off_loop, parse_off_loop
from debug_server.fanout.rounds import FrRounds
from debug_server.fanout.transport import RankResult, Registry
from debug_server.protocol import agentwire, frwindow, members
from debug_server.protocol.addrs import (
    AGENT_META_KEY,
    NOT_REGISTERED,
    WorkerAddr,
)
from debug_server.protocol.names import NATIVE, ONLY_ACTIVE, SINCE, WINDOW, WITH_STACKS

logger = logging.getLogger(__name__)
_RANK = operator.attrgetter("rank")

class AgentFailed(Exception):
    """An agent that did not give a usable reply; the text is one line."""


class _NoHealth(Exception):
    """An agent that refused ``health=true`` (an older one, asked by a newer frontend)."""


class AgentRoute:
    """The live collector's way through one agent per host (module doc): a ``collector.Route``
    on the collector's asker and FR rounds; every answer is what the collector's direct methods
    give for the same ranks, less the ranks it left."""

    def __init__(self, agents: AgentDirectory, asker: Asker, rounds: FrRounds,
                 classes: bool = False) -> None:
        self.agents = agents
        self.classes = {agentwire.CLASSES: "true"} if classes else {}
        """An aggregator's route (``agent_route(classes=True)``): its host agents send their
        ranks' stacks by class (``agentwire.CLASSES``), as it passes them up anyway."""
        self.asker = asker
        self.rounds = rounds
        self._down: dict[str, float] = {}
        self.agent_requests = 0
        """Agent requests that gave a usable reply (tests and benchmarks read it)."""
        self._no_health: set[str] = set()
        """Agents that refused ``health=true``: asked without it from then on; the collector
        asks their ranks' health directly, as it does for ranks no agent serves."""
        self.agent_unchanged = 0
        """``agent_fr`` replies that said "unchanged since your tag" (``_agent_fr``)."""
        self._held: dict[tuple[str, str], Held] = {}
        """(agent id, kind of ask) -> its last full ``agent_fr`` reply (``Held``)."""
        self._last_cut: tuple[Any, dict[str, int], dict[int, dict[str, Any]]] | None = None
        """(every agent's id, ranks and reply tag; the job's window; the dumps cut to it) of the
        last ``fr`` whose ranks all came through agents in one round."""
        self.cuts_reused = 0
        """``fr`` calls that used the last window and cut again (every agent's tag the same)."""
        self._key: Any = None
        self._owner: tuple[tuple[int, ...], dict[int, str], tuple[AgentAddr, ...]] = \
            ((), {}, ())
        """(ids of the aggregators found, rank -> aggregator id, the aggregators): ``plan``."""
        self._split: tuple[Sequence[WorkerAddr], dict[str, list[WorkerAddr]],
                           list[WorkerAddr]] | None = None
        """(the addresses split, their ranks by aggregator id, the others): ``plan``."""
        self.planned: list[AgentAddr] = []
        """The agents of the last plan (``fanout.recent.sample_clocks`` asks their clocks)."""
        self._by_host: tuple[Sequence[WorkerAddr], set[str], dict[str, AgentAddr],
                             dict[str, list[WorkerAddr]], list[WorkerAddr]] | None = None
        """(ranks no aggregator took, their agents' ids, those found, ``_by_host``): ``plan``."""

    def last_key(self) -> Any:
        """What the last ``fr`` window stands for: every agent's id and reply tag, where every
        rank came through an agent that tagged its reply in one round; else None. An
        aggregator's own tag folds it (``hostreply.group_tag``)."""
        return self._key

    @property
    def agent_timeout(self) -> float:
        return 2 * self.asker.timeout + AGENT_SLACK_S

    def close(self) -> None:
        self.agents.close()

    # -- which rank goes where --------------------------------------------------------------

    async def plan(self, addrs: Sequence[WorkerAddr], tree: bool = True) -> Plan | None:
        """One group per agent that serves some of ``addrs``: the tree's aggregators where the
        job has them (``tree``) and they are up, then each host's agent; None where none does."""
        now = time.monotonic()
        by_agent: dict[str, list[WorkerAddr]] = {}
        found: dict[str, AgentAddr] = {}
        if tree:
            for ag in await self.agents.groups():
                if self._down.get(ag.id, 0.0) <= now:
                    found[ag.id] = ag
        if found:
            # Which aggregator has which rank, made again only when the aggregators found
            # change (131072 entries: not on every page); the memo holds the objects whose ids
            # it compares, so none can be reused meanwhile.
            objs = tuple(id(ag) for ag in found.values())
            if self._owner[0] != objs:
                self._owner = (objs, {r: ag.id for ag in found.values() for r in ag.ranks},
                               tuple(found.values()))
                self._split = None
            # The registry hands back the same list while the store's keys stay (``storeview``):
            # the split by aggregator is made again only when that list or the aggregators change.
            split = self._split
            if split is None or split[0] is not addrs:
                owner = self._owner[1]
                groups: dict[str, list[WorkerAddr]] = {}
                rest = []
                for a in addrs:
                    gid = owner.get(a.rank) if a.url is not None else None
                    if gid is None:
                        rest.append(a)
                    else:
                        groups.setdefault(gid, []).append(a)
                split = self._split = (addrs, groups, rest)
            by_agent.update(split[1])
            addrs_left: Sequence[WorkerAddr] = split[2]
        else:
            addrs_left = addrs
        # By host agent: the same lists again for the same list and agents (an aggregator's).
        held = self._by_host if self._by_host and self._by_host[0] is addrs_left else None
        ids = held[1] if held is not None else _host_ids(addrs_left)
        hosts = await self.agents.lookup(
            {i for i in ids if self._down.get(i, 0.0) <= now}) if ids else {}
        if held is not None and held[2] == hosts:
            by_host, direct = held[3], held[4]
        else:
            by_host, direct = _by_host(addrs_left, hosts)
            self._by_host = (addrs_left, ids, hosts, by_host, direct)
        found.update(hosts)
        by_agent.update(by_host)
        if not by_agent:
            return None
        plan = Plan(addrs, [(found[i], rs) for i, rs in by_agent.items()], direct)
        self.planned = [ag for ag, _ in plan.groups]
        return plan

    async def _below(self, rs: Sequence[WorkerAddr]) -> Plan:
        """Ranks an aggregator left (it failed, or did not know them): their host agents'
        plan, the rest direct."""
        plan = await self.plan(rs, tree=False) if rs else None
        return plan if plan is not None else Plan(rs, [], list(rs))

    async def _ask(self, ag: AgentAddr, handler: str, params: Mapping[str, str]) -> str:
        r = await self.asker.one(WorkerAddr(-1, ag.url), handler, params, self.agent_timeout)
        if r.http_status == 400 and agentwire.WITH_HEALTH in params and \
                f"parameter {agentwire.WITH_HEALTH!r}" in (r.error or ""):
            self._no_health.add(ag.id)
            raise _NoHealth
        if not r.ok or r.body is None:
            self._fail(ag, r.error or r.status)
        return r.body or ""

    async def _reply(self, ag: AgentAddr, rs: Sequence[WorkerAddr], handler: str,
                     params: Mapping[str, str], parse: Any) -> Any:
        """``parse(body, ag, rs)`` of one agent's reply for ranks ``rs``, parsed off the loop;
        None when the agent failed or its reply is unusable (then it is skipped a while)."""
        try:
            body = await self._ask(ag, handler, {**params, agentwire.RANKS: ranks_param(rs)})
            # A host's reply is small (~20 KB for 8 ranks): parsed here, a thread hop costs more.
            out = parse(body, ag, rs) if len(body) < INLINE_BYTES else \
                await asyncio.get_running_loop().run_in_executor(None, parse, body, ag, rs)
        except AgentFailed:
            return None
        except _NoHealth:  # an older agent: the rest of the ask, its ranks' health apart
            return await self._reply(ag, rs, handler, _less_health(params), parse)
        except ValueError as e:
            with contextlib.suppress(AgentFailed):
                self._fail(ag, f"unusable reply ({e})")
            return None
        self._ok(ag)
        return out

    async def ask_agent(self, ag: AgentAddr, rs: Sequence[WorkerAddr], handler: str,
                        params: Mapping[str, str], parse: Any) -> Any:
        """``parse(body, ag, rs)`` of agent ``ag``'s reply (``_reply``; ``fanout.recent``)."""
        return await self._reply(ag, rs, handler, params, parse)

    def _fail(self, ag: AgentAddr, why: str) -> None:
        if ag.id not in self._down:
            logger.warning("debug_server: agent %s (%s): %s; asking its ranks directly for "
                           "%.0f s", ag.id, ag.url, why, AGENT_RETRY_S)
        self._down[ag.id] = time.monotonic() + AGENT_RETRY_S
        self.agents.forget(ag.id)
        raise AgentFailed(why)

    def _ok(self, ag: AgentAddr) -> None:
        self.agent_requests += 1
        if self._down.pop(ag.id, None) is not None:
            logger.info("debug_server: agent %s answers again", ag.id)

    # -- the three fan-outs -------------------------------------------------------------------

    def relays(self, handler: str) -> bool:
        """A handler an agent relays (``agentwire.FETCHABLE``, no parameters)."""
        return handler in agentwire.FETCHABLE

    async def fetch(self, handler: str, plan: Plan) -> Routed[list[RankResult]]:
        return await self._grouped(agentwire.FETCH, {agentwire.HANDLER: handler}, plan)

    async def stacks(self, plan: Plan, *, native: bool, every: bool,
                     ) -> Routed[list[RankResult]]:
        params = {NATIVE: str(native).lower(),
                  agentwire.EVERY: str(every or native).lower(), **self.classes}
        return await self._grouped(agentwire.STACKS, params, plan)

    async def _grouped(self, handler: str, params: Mapping[str, str], plan: Plan,
                       ) -> Routed[list[RankResult]]:
        replies = await asyncio.gather(*(self._reply(ag, rs, handler, params, parse_grouped)
                                         for ag, rs in plan.groups))
        results: list[RankResult] = []
        rest: list[WorkerAddr] = []
        for (_, rs), got in zip(plan.groups, replies, strict=True):
            if got is None:
                rest += rs
                continue
            fine = {r.rank: r for r in got if r.status != NOT_REGISTERED}
            results += fine.values()
            rest += [a for a in rs if a.rank not in fine]
        if rest and any(_is_group(ag) for ag, _ in plan.groups):
            below = await self._below(rest)  # an aggregator's ranks: their host agents
            more = await self._grouped(handler, params, below) if below.groups else None
            rest = below.direct + (more.left if more is not None else [])
            results += more.got if more is not None else []
        return Routed(results, rest)

    async def fr_stacks(self, plan: Plan, texts: dict[int, str],
                        health: list[RankResult] | None = None,
                        ) -> Routed[tuple[FrData, list[RankResult]]]:
        """``fr_stacks`` through the agents: each agent is asked once for both
        (``agent_fr?stacks=true``) and asks each of its ranks once; ranks asked directly bring
        their stacks texts with their FR (left, with their texts in ``texts``). With ``health``
        (a list to fill), each agent sends its ranks' health in the same reply
        (``agentwire.WITH_HEALTH``): the records of the ranks it served go there."""
        got: list[RankResult] = []
        parts = {WITH_STACKS: got, **({agentwire.WITH_HEALTH: health}
                                      if health is not None else {})}
        fr = await self._fr_window(plan.groups, plan.direct, parts, texts)
        have = {r.rank for r in got}
        return Routed((fr, got), [a for a in plan.addrs if a.rank not in have])

    async def fr(self, plan: Plan) -> FrData:
        return await self._fr_window(plan.groups, plan.direct)

    async def _fr_window(self, plan: list[tuple[AgentAddr, list[WorkerAddr]]],
                         direct: list[WorkerAddr],
                         parts: dict[str, list[RankResult]] | None = None,
                         texts: dict[int, str] | None = None,
                         ) -> FrData:
        """The default ``fr`` through the agents; with ``parts`` (``agentwire.READ_PARTS``:
        stacks, and health, by name -> a list to fill) the agents send their ranks' records of
        them in the same replies, and direct ranks' stacks texts go to ``texts``."""
        addrs = [a for _, rs in plan for a in rs] + list(direct)
        # Round 1: agents cut at their host's frontier, direct ranks at their own.
        window = {WINDOW: str(frwindow.LOCAL_SLACK),
                  **({**dict.fromkeys(parts, "true"), **self.classes} if parts else {})}
        first: list[Any] = []
        tags: dict[str, str] = {}
        # Ranks of "unchanged" replies -> their new read times (their dumps are the held ones,
        # not yet copied: where the last cut is used again, that is what gets copied).
        snaps: dict[int, Any] = {}
        known = members.known_param()
        if known is None and len(plan) > 1:
            # This frontend holds no member list yet: one agent first, so the other agents'
            # replies do not each carry the world's list (2048 x 100 KB at 16384 ranks).
            first = [await self._agent_fr(*plan[0], window, tags, parts, snaps)]
            known = members.known_param()
        direct_round = self._direct_local(direct, texts)
        rest_got, (direct_results, dumps) = await asyncio.gather(asyncio.gather(
            *(self._agent_fr(ag, rs, {**window, members.PARAM: known or ""}, tags, parts,
                             snaps) for ag, rs in plan[len(first):])), direct_round)
        results = list(direct_results)
        via: dict[int, AgentAddr] = {}
        rest = take_replies(plan, first + rest_got, results, dumps, via)
        if rest:  # agents that failed: an aggregator's ranks through their host agents,
            # then what is left (and a host agent's ranks) directly, in this page
            below = await self._below(rest) if any(_is_group(ag) for ag, _ in plan) else \
                Plan(rest, [], rest)
            replies = await asyncio.gather(
                *(self._agent_fr(ag, rs, {**window, members.PARAM: members.known_param() or ""},
                                 tags, parts, snaps) for ag, rs in below.groups))
            rest = list(below.direct) + take_replies(below.groups, replies, results, dumps, via)
            more, more_dumps = await self._direct_local(rest, texts)
            results += more
            dumps.update(more_dumps)
        # Every rank through an agent whose reply carries the same tag as for the last window
        # cut here (a tag covers the question, ranks included): the same windows less their
        # read times, so the same frontier and cut.
        key = (tuple(sorted((ag.id, tags.get(ag.id, "")) for ag, _ in plan))
               if not direct and not rest and all(tags.get(ag.id) for ag, _ in plan) else None)
        last = self._last_cut
        self._key = key
        if key is not None and last is not None and last[0] == key and last[2].keys() == \
                dumps.keys():
            since = dict(last[1])
            cut = last[2]
            dumps = {r: with_snap(cut[r], snaps[r] if r in snaps else d.get(SNAPSHOT_TIME_KEY))
                     for r, d in dumps.items()}
            self.cuts_reused += 1
        else:
            for r, snap in snaps.items():
                if r in dumps:
                    dumps[r] = with_snap(dumps[r], snap)
            since = frwindow.frontier(dumps)
            again = frwindow.not_covered(dumps, since)
            if again:
                results, dumps = await self._again(since, again, via, addrs, results, dumps)
            dumps = await cut_off_loop(dumps, since)
            # Not after a round 2: its replies are not covered by the first round's tags.
            self._last_cut = (key, since, dumps) if key is not None and not again else None
            if again:
                self._key = None
        self.asker.states.update(results)
        return FrData(sorted(results, key=_RANK), dumps, since)

    async def _again(self, since: dict[str, int], again: list[int], via: Mapping[int, AgentAddr],
                     addrs: Sequence[WorkerAddr], results: list[RankResult],
                     dumps: dict[int, dict[str, Any]]) -> tuple[list[RankResult],
                                                                dict[int, dict[str, Any]]]:
        """Round 2: only the ranks whose cut lies above the job's frontier, through their agent
        where they came through one."""
        by_rank = {a.rank: a for a in addrs}
        agent_ranks: dict[str, list[WorkerAddr]] = {}
        agents = {}
        direct = []
        for r in again:
            ag = via.get(r)
            if ag is None:
                direct.append(by_rank[r])
            else:
                agent_ranks.setdefault(ag.id, []).append(by_rank[r])
                agents[ag.id] = ag
        known = members.known_param() or ""

        async def through(ag: AgentAddr, rs: list[WorkerAddr]) -> tuple[
                list[RankResult], dict[int, dict[str, Any]]]:
            groups: set[str] = set()
            for a in rs:
                groups |= frwindow.rank_groups(dumps[a.rank])
            text = frwindow.since_for(since, groups)
            reply = None if text is None else await self._agent_fr(
                ag, rs, {SINCE: text, members.PARAM: known})
            if reply is None:  # the agent failed now: the same ranks directly
                return await self._direct_since(since, rs, dumps)
            return reply

        parts = await asyncio.gather(*(through(agents[i], rs) for i, rs in agent_ranks.items()),
                                     self._direct_since(since, direct, dumps))
        redone: dict[int, RankResult] = {}
        for recs, ds in parts:
            redone.update((r.rank, r) for r in recs)
            dumps = {**dumps, **ds}
        # A rank that failed on the re-ask has no usable window: drop its round-1 dump.
        for r, rec in redone.items():
            if not rec.ok:
                dumps.pop(r, None)
        return [redone.get(r.rank, r) for r in results], dumps

    async def since(self, plan: Plan, since: Mapping[str, int]) -> FrData:
        """Round 2 alone through the agents (an aggregator asked ``since=``): each host
        agent's ranks from ``since`` on, the rest (and a failed agent's) directly."""
        known = members.known_param() or ""
        text = frwindow.format_since(since)
        parts = await asyncio.gather(*(self._agent_fr(ag, rs, {SINCE: text, members.PARAM: known})
                                       for ag, rs in plan.groups))
        results: list[RankResult] = []
        dumps: dict[int, dict[str, Any]] = {}
        rest = list(plan.direct) + take_replies(plan.groups, parts, results, dumps, {})
        first: dict[int, dict[str, Any]] = {
            a.rank: {"pg_status": dict.fromkeys(since, {})} for a in rest}
        more, more_dumps = await self._direct_since(since, rest, first)
        results += more
        dumps.update(more_dumps)
        self.asker.states.update(results)
        dumps = await cut_off_loop(dumps, since)
        return FrData(sorted(results, key=lambda r: r.rank), dumps, dict(since))

    async def _direct_local(self, addrs: Sequence[WorkerAddr],
                            texts: dict[int, str] | None = None) -> tuple[
            list[RankResult], dict[int, dict[str, Any]]]:
        if not addrs:
            return [], {}
        results = await self.rounds.local(addrs, texts)
        dumps = await parse_off_loop(results)
        return results, dumps

    async def _direct_since(self, since: Mapping[str, int], addrs: Sequence[WorkerAddr],
                            first: Mapping[int, Mapping[str, Any]]) -> tuple[
            list[RankResult], dict[int, dict[str, Any]]]:
        if not addrs:
            return [], {}
        results = await self.rounds.since(since, addrs, first)
        dumps = await parse_off_loop(results)
        return results, dumps

    async def _agent_fr(self, ag: AgentAddr, rs: Sequence[WorkerAddr],
                        params: Mapping[str, str], tags: dict[str, str] | None = None,
                        parts: dict[str, list[RankResult]] | None = None,
                        snaps: dict[int, Any] | None = None,
                        ) -> tuple[list[RankResult], dict[int, dict[str, Any]]] | None:
        """One agent's FR reply as records and parsed dumps; None when the agent failed (its
        ranks are then asked directly). Ranks it reports as not registered are left out.
        ``tags``: where given, the reply's tag is put there under the agent's id.

        The ask is conditional (``agentwire.TAG``): where this frontend holds the agent's last
        reply to the same question, it sends that reply's tag, and an agent whose ranks' windows
        did not change since (the hung case) answers with the records and read times only; the
        held dumps are used again (shallow copies with the new ``dump_time_ns``; with ``snaps``,
        the held dumps themselves, their new read times put in ``snaps``: the caller copies)."""
        # Not for whole rings (``_fr_plain``): holding every rank's ring would double the
        # frontend's memory for the pages that are asked least.
        conditional = agentwire.WHOLE not in params
        slot = (ag.id, SINCE if SINCE in params else "local")
        # The FR part does not depend on stacks=true: both asks share what is held.
        question = (ranks_param(rs), tuple(sorted((k, v) for k, v in params.items()
                                             if k not in (members.PARAM,
                                                          *agentwire.NOT_ASKED_DATA))))
        held = self._held.get(slot) if conditional else None
        if held is not None and held[0] != question:
            held = None
        if ag.id in self._no_health:
            params = _less_health(params)
        ask = params
        if held is not None:
            # The tag answers the question as it was asked, with the member lists this side
            # named then (``pgknown``: the agent's tag covers them): asked so again, an agent
            # whose ranks' windows did not change says so, whatever lists were learnt since
            # (the first page's lists made every agent's second reply a whole one).
            ask = {k: v for k, v in params.items() if k != members.PARAM}
            if held[3] is not None:
                ask[members.PARAM] = held[3]
            ask[agentwire.TAG] = held[1]
        reply = await self._reply(ag, rs, agentwire.FR, ask, parse_fr)
        if reply is None:
            return None
        recs, dumps, tag, snap, got = reply
        if snap is not None:  # "unchanged": the held dumps again
            again = held_again(held, tag, recs, snap, snaps)
            if again is None:
                # Another page replaced what this one held meanwhile: ask once more, plainly.
                reply = await self._reply(ag, rs, agentwire.FR, params, parse_fr)
                if reply is None or reply[3] is not None:
                    return None
                recs, dumps, tag, snap, got = reply
                keep_parts(parts, got)
                return self._held_reply(slot, (question, params), conditional, recs, dumps, tag,
                                        tags)
            keep_parts(parts, got)
            if tags is not None:
                tags[ag.id] = tag
            dumps = again
            self.agent_unchanged += 1
            return registered(recs, dumps)
        keep_parts(parts, got)
        return self._held_reply(slot, (question, ask), conditional, recs, dumps, tag, tags)

    def _held_reply(self, slot: tuple[str, str], asked: tuple[Any, Mapping[str, str]],
                    conditional: bool,
                    recs: list[RankResult], dumps: dict[int, dict[str, Any]], tag: str,
                    tags: dict[str, str] | None = None,
                    ) -> tuple[list[RankResult], dict[int, dict[str, Any]]]:
        """A full ``agent_fr`` reply, held for the next conditional ask; ``asked``: the question
        and the parameters it was asked with."""
        if tag and conditional:
            # The parsed dumps themselves (no dump is changed in place after its reply is
            # parsed: a page's read times and cuts are new dicts): 131072 copies are ~50 MB.
            self._held[slot] = (asked[0], tag, dict(dumps), asked[1].get(members.PARAM))
            if tags is not None:
                tags[slot[0]] = tag
        return registered(recs, dumps)

    async def fr_plain(self, plan: Plan, *, only_active: bool, whole: bool) -> Routed[FrData]:
        params = {agentwire.WHOLE: str(whole).lower(), ONLY_ACTIVE: str(only_active).lower(),
                  members.PARAM: members.known_param() or ""}
        replies = await asyncio.gather(*(self._agent_fr(ag, rs, params)
                                         for ag, rs in plan.groups))
        results: list[RankResult] = []
        dumps: dict[int, dict[str, Any]] = {}
        rest = take_replies(plan.groups, replies, results, dumps, {})
        return Routed(FrData(results, dumps), rest)


def _host_ids(addrs: Sequence[WorkerAddr]) -> set[str]:
    """The host agents ``addrs``' sidecars name."""
    return {m[AGENT_META_KEY] for a in addrs
            if (m := a.meta) and isinstance(m.get(AGENT_META_KEY), str)}


def _by_host(addrs: Sequence[WorkerAddr], hosts: Mapping[str, AgentAddr],
             ) -> tuple[dict[str, list[WorkerAddr]], list[WorkerAddr]]:
    """``addrs`` by the host agent that serves each (its sidecar names it), and the others."""
    by_host: dict[str, list[WorkerAddr]] = {}
    direct: list[WorkerAddr] = []
    for a in addrs:
        aid = a.meta.get(AGENT_META_KEY) if a.meta else None
        ag = hosts.get(aid) if isinstance(aid, str) else None
        if a.url is None or ag is None or a.rank not in ag.ranks:
            direct.append(a)
        else:
            by_host.setdefault(ag.id, []).append(a)
    return by_host, direct


def _less_health(params: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in params.items() if k != agentwire.WITH_HEALTH}


def _is_group(ag: AgentAddr) -> bool:
    return ag.id.startswith(GROUP_ID_PREFIX)


def agent_route(agents: AgentDirectory, classes: bool = False,
                ) -> Callable[[Asker, FrRounds], AgentRoute]:
    """The route through ``agents`` for a ``LiveCollector(route=)``: built on its asker and
    FR rounds; ``classes``: an aggregator's, asking its host agents for stacks by class."""
    return lambda asker, rounds: AgentRoute(agents, asker, rounds, classes)


def collector_for(session: aiohttp.ClientSession, registry: Registry, *, timeout: float,
                  max_concurrency: int, http: LeanClient | None = None) -> LiveCollector:
    """The frontend's collector: through the agents where the workers are found in a store
    (rank 0's frontend and an attached one), every rank directly for fixed URLs; ``http``: the
    lean client for the fan-outs (``transport.fetch_one``)."""
    store = getattr(registry, "store_address", None)
    route = None
    if isinstance(store, tuple):
        route = agent_route(AgentDirectory(store[0], store[1],
                                           getattr(registry, "restart_count", 0),
                                           timeout=getattr(registry, "store_timeout", 5.0)))
    return LiveCollector(session, registry, timeout=timeout, max_concurrency=max_concurrency,
                         http=http, route=route)


__all__ = ["AGENT_RETRY_S", "GROUP_ID_PREFIX", "AgentAddr", "AgentDirectory", "AgentRoute", "agent_route",
           "collector_for"]
