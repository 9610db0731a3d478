"""What every collector answers: the one interface the pages, the dumper, the hang watch, the
straggler poll and the agent ask every rank through.

Three collectors implement :class:`Collector`: the live one (``live.LiveCollector``, which asks
the workers, directly or through one agent per host: ``agents.AgentRoute``, a :class:`Route`
it is given), ``departed.KeepLast`` around it (a gone rank's last data kept), and the post-mortem
viewer's ``tools.view_collector.DiskCollector`` (the answers from the dumper's files).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from debug_server.analysis.digest import DigestMemo
from debug_server.fanout.reply import FrData
from debug_server.fanout.transport import RankResult, RankStates, Registry
from debug_server.protocol.addrs import WorkerAddr
from debug_server.protocol.names import C10D_FR_HANDLER, FR_HANDLER, STACKS_HANDLER

if TYPE_CHECKING:
    from debug_server.fanout.live import LiveCollector

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


class Route(Protocol):
    """How the live collector reaches the ranks other than one request per rank (``agents``).

    Given to one ``LiveCollector``, which attaches itself. Each method answers exactly what the
    collector's own method of that name answers, asking the collector's ``direct_*`` methods
    for the ranks it does not serve; None: it serves none of ``addrs`` (the collector then asks
    them all directly).
    """

    def attach(self, c: LiveCollector) -> None: ...

    async def fetch(self, handler: str, addrs: Sequence[WorkerAddr]) -> list[RankResult] | None: ...

    async def fr(self, addrs: Sequence[WorkerAddr], *, only_active: bool, whole: bool,
                 ) -> FrData | None: ...

    async def stacks(self, addrs: Sequence[WorkerAddr], *, native: bool, every: bool,
                     ) -> list[RankResult] | None: ...

    async def fr_stacks(self, addrs: Sequence[WorkerAddr],
                        ) -> tuple[FrData, list[RankResult]] | None: ...

    def close(self) -> None: ...


__all__ = ["C10D_FR_HANDLER", "FR_HANDLER", "PRIME_RANKS", "PRIME_TIMEOUT_S", "STACKS_HANDLER",
           "Collector", "Route"]
