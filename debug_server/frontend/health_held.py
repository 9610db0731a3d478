"""The overview's health column from the hang watch's last poll, where a fresh one costs seconds.

The overview shows every rank's health next to its reachability and the verdict. Asking every
rank for its health on each overview is one more fan-out over the whole job: at 16384 ranks,
through agents, that fan-out was most of what the overview cost over ``/fr_trace`` (the ranks
and agents serving 16384 health requests). The hang watch (``hangreport.HangWatch``) already
polls every rank's health, and above ``MAX_POLLS_PER_S x interval`` ranks it rations those polls
for exactly that reason (every 32 s at 16384 ranks).

So where the watch rations its polls, the overview takes the health column from the watch's
last poll while that poll is younger than :data:`MAX_AGE_POLLS` poll intervals, and says so on
the page with its age (``note``, JSON ``health_age_s``). Everything else on the page (the
reachability of every rank, the FR data, the stacks, the verdict) is fetched fresh as before, and
**a rank that does not answer now reads as not answering in the health column too**, whatever
the held poll said. Below that size, or with no poll young enough, the overview asks every rank
as before and its page is unchanged. That read no longer costs a fan-out of its own through
agents (``Collector.fr_stacks_health``: each host's agent brings its ranks' health with their FR
and stacks, in one request), but it still asks every rank and parses every reply (at 131072
ranks about 0.3 s of the frontend's CPU), which a held read saves.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from debug_server.fanout.transport import GONE, OK, RankResult
from debug_server.frontend.hangreport import POLLED, HangWatch, RankHealth, class_texts
from debug_server.frontend.render import CELLS_MAX

__all__ = ["MAX_AGE_POLLS", "HeldHealth", "column_texts", "held_health"]

MAX_AGE_POLLS = 2.0
"""A held poll is used while it is younger than this many of the watch's poll intervals (the
watch's next poll is due within one; the other covers the poll's own duration, which includes
the pages served meanwhile, since the poll's requests wait behind theirs (``pagefirst``): at
16384 ranks with pages back to back, polls of 13-17 s every 32 s, so 45-48 s apart)."""


@dataclass(frozen=True, slots=True)
class HeldHealth:
    """The hang watch's last poll, as the overview uses it."""

    health: Sequence[RankHealth]
    age_s: float
    """Seconds since that poll's replies came in."""
    interval_s: float
    """The watch's poll interval at this job size."""
    by: str = POLLED
    """Who read it: the watch's poll or an overview (``HangWatch.hold``)."""

    def texts(self, reach: Sequence[RankResult], world_size: int) -> dict[int, str]:
        """Each rank's health line: the held one, unless the rank does not answer now.

        ``reach``: this page's fresh records of every rank (its stacks fetch). A rank whose
        worker gave no answer at all now (unreachable, timed out, not registered) gets the
        line a fresh health fetch would give it, from that record, so a rank that died after
        the poll never reads as healthy.
        """
        held = _held_texts(self.health, world_size)
        ranks = {r.rank for r in reach}
        # Every rank of the poll and no other (the usual case): the poll's texts as they are,
        # less the ranks that do not answer now; else rank by rank.
        out = dict(held) if ranks == held.keys() else {
            r: held.get(r, "health unknown (not in the hang watch's last poll)") for r in ranks}
        for r in reach:
            if r.status != OK and r.status != GONE and r.http_status is None:
                out[r.rank] = f"health unknown ({r.error or r.status})"
        return out

    def note(self) -> str:
        """What the page says about the health column."""
        return (f"Health column: {self.by} of {self.age_s:.0f} s ago (at this job size the hang "
                f"watch polls every {self.interval_s:.0f} s, and pages do not ask every rank each "
                "time); reachability, the verdict and everything else on this page are fresh.")


def column_texts(health: Sequence[RankHealth], world_size: int) -> dict[int, str]:
    """The overview's health column: each rank's health line; above ``render.CELLS_MAX`` ranks
    (where the overview shows runs of ranks alike, not ranks) the line of its class of ranks
    alike (``hangreport.class_texts``: ages as the class's range), so ranks stalled in one op
    polled a few ms apart read alike and form one run, not one row each."""
    if world_size > CELLS_MAX:
        return class_texts(health)
    return {h.rank: h.text() for h in health}


_TEXTS: list[tuple[Sequence[RankHealth], int, dict[int, str]]] = []
"""The last poll's texts, made once per poll (not per overview: 131072 texts a page)."""


def _held_texts(health: Sequence[RankHealth], world_size: int) -> dict[int, str]:
    if _TEXTS and _TEXTS[0][0] is health and _TEXTS[0][1] == world_size:
        return _TEXTS[0][2]
    texts = column_texts(health, world_size)
    _TEXTS[:] = [(health, world_size, texts)]
    return texts


def held_health(watch: HangWatch | None, now: float | None = None) -> HeldHealth | None:
    """The watch's last poll where the overview should use it instead of asking every rank:
    the watch rations its polls at this job size and its last poll is young enough."""
    if watch is None or not watch.last or watch.last_at is None:
        return None
    interval = watch.poll_interval()
    if interval <= watch.interval:  # not rationed: a health fan-out is cheap at this size
        return None
    age = (time.monotonic() if now is None else now) - watch.last_at
    if not 0 <= age <= MAX_AGE_POLLS * interval:
        return None
    return HeldHealth(watch.last, age, interval, watch.last_by)
