"""What every collector answers: the one interface the pages, the dumper, the hang watch, the
straggler poll and the agent ask every rank through.

Three collectors implement :class:`Collector`: the live one (``live``, which asks the workers,
directly or through one agent per host: a :class:`Route` it is given), ``departed.KeepLast``
around it (a gone rank's last data kept), and the post-mortem viewer's ``view_collector`` (the
answers from the dumper's files). The interfaces here name none of them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

from debug_server.analysis.digest import DigestMemo
from debug_server.fanout.reply import FrData
from debug_server.fanout.transport import RankResult, RankStates, Registry
from debug_server.protocol.addrs import WorkerAddr
from debug_server.protocol.names import C10D_FR_HANDLER, FR_HANDLER, STACKS_HANDLER

T = TypeVar("T")

PRIME_RANKS = 64
"""From this many ranks on, a frontend's first FR fan-out asks one rank first (``members``); a
host's agent does from 2 (``LiveCollector(prime_ranks=)``): its 8 ranks would otherwise each send
the world's list on its first ask (8 x 108 KB at 16384 ranks, on every host at once)."""
PRIME_TIMEOUT_S = 1.0


@runtime_checkable
class Collector(Protocol):
    """Every rank's answers, one record per rank in rank order, never raising."""

    registry: Registry
    states: RankStates
    digest_memo: DigestMemo | None
    """The collector's own digests of its last analysis (``analysis.digest.DigestMemo``), which
    the analysis call site passes to ``analyze`` with this collector's FR windows: a dump it
    hands back as the very same objects is not digested again. None where it never does."""

    @property
    def world_size(self) -> int: ...

    def data_time_ns(self) -> int:
        """When the data was taken (in-flight ops end here on a timeline)."""
        ...

    async def fetch(self, handler: str, params: Mapping[str, str] | None = None,
                    addrs: Sequence[WorkerAddr] | None = None,
                    each: Callable[[RankResult], Awaitable[None]] | None = None,
                    ) -> list[RankResult]:
        """One worker handler on every rank (health, ping, pickle dump, profiles...)."""
        ...

    async def fr(self, *, only_active: bool = False, whole: bool = False,
                 addrs: Sequence[WorkerAddr] | None = None) -> FrData:
        """Every rank's FR: by default the job's window, else whole rings or active entries."""
        ...

    async def stacks(self, addrs: Sequence[WorkerAddr] | None = None, *, native: bool = False,
                     every: bool = False) -> list[RankResult]:
        """Every rank's stacks (py-spy for a stuck rank)."""
        ...

    async def fr_stacks(self, addrs: Sequence[WorkerAddr] | None = None,
                        ) -> tuple[FrData, list[RankResult]]:
        """``fr()`` and ``stacks()`` of the same ranks, for a page that shows both."""
        ...

    async def fr_stacks_health(self, addrs: Sequence[WorkerAddr] | None = None,
                               ) -> tuple[FrData, list[RankResult], list[RankResult]]:
        """``fr_stacks()`` and every rank's health (``fetch`` of ``HEALTH_HANDLER``), for the
        overview: through agents, one request per host for all three."""
        ...


@dataclass(slots=True)
class Plan:
    """Which ranks of one fan-out a route serves, and which it leaves to be asked directly."""

    addrs: Sequence[WorkerAddr]
    """Every rank of the fan-out, in the order asked."""
    groups: list[tuple[Any, list[WorkerAddr]]]
    """The ranks it serves, grouped as the route asks them (one agent per group)."""
    direct: list[WorkerAddr]
    """The ranks it does not serve: asked directly, at the same time as the route's."""


@dataclass(slots=True)
class Routed(Generic[T]):
    """What a route fetched, and the ranks of its groups it could not serve (an agent that
    failed, a rank its agent does not know): the collector asks those directly."""

    got: T
    left: list[WorkerAddr]


class Route(Protocol):
    """How the live collector reaches the ranks other than one request per rank (``agents``).

    A route never calls back into the collector: it asks the ranks of its ``Plan`` it serves and
    returns what it got and what it left (``Routed``); the collector asks ``plan.direct`` and
    what was left itself, as it would without a route. Only the default FR window (``fr``), whose
    frontier is the whole job's, takes ``plan.direct`` through the rounds it was given too.
    """

    def relays(self, handler: str) -> bool:
        """Whether ``fetch`` of ``handler`` (without parameters) goes through the route."""
        ...

    async def plan(self, addrs: Sequence[WorkerAddr], tree: bool = True) -> Plan | None:
        """Who serves which of ``addrs``; None: the route serves none of them. ``tree``: the
        second level (aggregators) may serve them too."""
        ...

    async def since(self, plan: Plan, since: Mapping[str, int]) -> FrData:
        """The FR window's round 2 alone (``since=``) for ``plan``'s ranks, ``plan.direct``
        included."""
        ...

    def last_key(self) -> Any:
        """What the last ``fr`` window stands for, where the route can tell (else None)."""
        ...

    async def fetch(self, handler: str, plan: Plan) -> Routed[list[RankResult]]: ...

    async def stacks(self, plan: Plan, *, native: bool, every: bool,
                     ) -> Routed[list[RankResult]]: ...

    async def fr_plain(self, plan: Plan, *, only_active: bool, whole: bool) -> Routed[FrData]:
        """``fr(only_active=, whole=)``: the records and dumps of the ranks it served."""
        ...

    async def fr(self, plan: Plan) -> FrData:
        """The default FR window of every rank of ``plan``, ``plan.direct`` included."""
        ...

    async def fr_stacks(self, plan: Plan, texts: dict[int, str],
                        health: list[RankResult] | None = None,
                        ) -> Routed[tuple[FrData, list[RankResult]]]:
        """The default FR window of every rank of ``plan`` and the stacks of those it served;
        ``left``: the ranks still without stacks, whose texts (where an FR reply brought them)
        it put in ``texts``. With ``health`` (a list to fill): the health records of the ranks
        it served, asked in the same requests (the collector asks the others')."""
        ...

    def close(self) -> None: ...


__all__ = ["C10D_FR_HANDLER", "FR_HANDLER", "PRIME_RANKS", "PRIME_TIMEOUT_S", "STACKS_HANDLER",
           "Collector", "Plan", "Route", "Routed"]
