"""``/metrics``: the job's hang state for Prometheus, built at scrape time.

One scrape is one fan-out (every rank's health check and its FR window: each communicator's
entries from its frontier on, ``frwindow``) and one analyzer run over it; a custom collector turns that into metric families in a private
``CollectorRegistry`` (never the process-global one, so nothing leaks between apps or tests).
Exposition is the Prometheus text format 0.0.4.

Metrics (labels in braces; ``rank`` is the global rank, ``group`` the communicator):

- ``debug_server_world_size``: ranks in the job.
- ``debug_server_up{rank}``: 1 when the rank's worker answered this scrape, else 0.
- ``debug_server_healthy{rank}``: 1 healthy, 0 a stalled op (only ranks that answered health).
- ``debug_server_in_flight_ops{rank}``: ops issued and not completed.
- ``debug_server_oldest_in_flight_seconds{rank}``: age of the oldest in-flight op (0: none).
- ``debug_server_stalled_op_seq{rank,group,op}``: seq of the op this rank reports stalled.
- ``debug_server_last_enqueued_seq{rank,group}``, ``debug_server_last_started_seq{rank,group}``,
  ``debug_server_last_completed_seq{rank,group}``: from each rank's ``pg_status``.
- ``debug_server_missing_ranks{group,seq,rank}``: 1 for each rank missing from a collective
  that others issued; ``debug_server_missing_ranks_count{group,seq}``: how many.
- ``debug_server_stuck_seq{group,op}``: the lowest sequence number of ``group`` with an error
  finding (missing ranks, mismatch, stuck everywhere): where the job stopped.
- ``debug_server_findings{kind}``: the analyzer's error findings by kind.
- ``debug_server_hang_reports_total``: hang reports written by this frontend.
- ``debug_server_scrape_duration_seconds``: how long the fan-out and analysis took.
- ``debug_server_rank_arrival_lag_seconds{rank,group}``: the rank's median arrival lag at the
  group's collectives over the straggler window (``frontend.stragglers``' last poll; absent
  before it), and ``debug_server_rank_last_share{rank,group}``: the share of them it was last at.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector as PromCollector

from debug_server.fanout.collector import Collector
from debug_server.fanout.reply import FrData
from debug_server.frontend.dumps import analyze_fr
from debug_server.frontend.hangreport import RankHealth, parse_health
from debug_server.protocol.names import HEALTH_HANDLER

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "debug_server"


@dataclass(slots=True)
class Scrape:
    """What one scrape saw: health, the FR window and the analyzer's result."""

    world_size: int
    health: list[RankHealth]
    fr: FrData
    result: dict[str, Any]
    hang_reports: int
    duration_s: float
    slow: dict[str, Any] | None = None
    """The straggler watch's last result (``analysis.stragglers.analyze``), None before it polled."""


async def scrape(collector: Collector, hang_reports: int = 0,
                 slow: dict[str, Any] | None = None) -> Scrape:
    """One fan-out of health and the FR window, and the analysis of it."""
    started = time.monotonic()
    addrs = await collector.registry.lookup()
    health_res, fr = await asyncio.gather(collector.fetch(HEALTH_HANDLER, None, addrs),
                                          collector.fr(addrs=addrs))
    result = await asyncio.get_running_loop().run_in_executor(
        None, analyze_fr, fr, None, collector.world_size, collector.digest_memo)
    return Scrape(collector.world_size, parse_health(health_res), fr, result, hang_reports,
                  time.monotonic() - started, slow)


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=labels)


class JobCollector(PromCollector):
    """Builds the metric families of one ``Scrape`` (a prometheus-client custom collector)."""

    def __init__(self, s: Scrape) -> None:
        self.s = s

    def collect(self) -> Iterator[Metric]:
        s = self.s
        world = _gauge("world_size", "Ranks in the job.", [])
        world.add_metric([], s.world_size)
        yield world

        answered = {r.rank for r in s.fr.results if r.http_status is not None}
        answered |= {h.rank for h in s.health if h.answered}
        up = _gauge("up", "1 when the rank's worker answered this scrape, else 0.", ["rank"])
        healthy = _gauge("healthy", "1 healthy, 0 an op in flight longer than the stall "
                         "timeout (ranks that answered health only).", ["rank"])
        in_flight = _gauge("in_flight_ops", "Ops issued and not completed.", ["rank"])
        oldest = _gauge("oldest_in_flight_seconds",
                        "Age of the rank's oldest in-flight op (0: none).", ["rank"])
        stalled = _gauge("stalled_op_seq", "Sequence number of the op the rank reports stalled.",
                         ["rank", "group", "op"])
        for h in s.health:
            rank = str(h.rank)
            up.add_metric([rank], 1 if h.rank in answered else 0)
            if h.healthy is not None:
                healthy.add_metric([rank], 1 if h.healthy else 0)
            if h.answered:
                in_flight.add_metric([rank], _num(h.info.get("in_flight")))
                oldest.add_metric([rank], _num(h.info.get("oldest_in_flight_s")))
            op = h.stalled_op
            if op and isinstance(op.get("seq"), int):
                stalled.add_metric([rank, str(op.get("group")), str(op.get("op"))], op["seq"])
        yield from (up, healthy, in_flight, oldest, stalled)

        seq_docs = {
            "last_enqueued_collective": ("last_enqueued_seq", "Last collective seq issued."),
            "last_started_collective": ("last_started_seq", "Last collective seq started."),
            "last_completed_collective": ("last_completed_seq", "Last collective seq completed."),
        }
        seq_families = {k: _gauge(n, d, ["rank", "group"]) for k, (n, d) in seq_docs.items()}
        for rank, dump in sorted(s.fr.dumps.items()):
            status = dump.get("pg_status")
            if not isinstance(status, dict):
                continue
            for group, st in sorted(status.items()):
                if not isinstance(st, dict):
                    continue
                for key, fam in seq_families.items():
                    if isinstance(st.get(key), int):
                        fam.add_metric([str(rank), str(group)], st[key])
        yield from seq_families.values()

        findings = [f for f in s.result.get("findings", []) if f.get("severity", "error") == "error"]
        missing = _gauge("missing_ranks", "1 for each rank missing from a collective that other "
                         "ranks issued.", ["group", "seq", "rank"])
        missing_n = _gauge("missing_ranks_count", "Ranks missing from the collective.",
                           ["group", "seq"])
        stuck = _gauge("stuck_seq", "Lowest collective seq of the communicator with an error "
                       "finding: where the job stopped.", ["group", "op"])
        by_kind: dict[str, int] = {}
        lowest: dict[str, tuple[int, str]] = {}
        for f in findings:
            kind, group, seq = str(f.get("kind")), str(f.get("group")), f.get("seq")
            by_kind[kind] = by_kind.get(kind, 0) + 1
            if kind == "missing_ranks":
                for r in f.get("ranks", []):
                    missing.add_metric([group, str(seq), str(r)], 1)
                missing_n.add_metric([group, str(seq)], len(f.get("ranks", [])))
            if isinstance(seq, int) and (group not in lowest or seq < lowest[group][0]):
                lowest[group] = (seq, str(f.get("op")))
        for group, (seq, op) in sorted(lowest.items()):
            stuck.add_metric([group, op], seq)
        kinds = _gauge("findings", "The analyzer's error findings by kind.", ["kind"])
        for kind, n in sorted(by_kind.items()):
            kinds.add_metric([kind], n)
        yield from (missing, missing_n, stuck, kinds)

        reports = CounterMetricFamily(f"{PREFIX}_hang_reports", "Hang reports this frontend "
                                      "wrote.", labels=[])
        reports.add_metric([], s.hang_reports)
        yield reports
        took = _gauge("scrape_duration_seconds", "Fan-out and analysis time of this scrape.", [])
        took.add_metric([], round(s.duration_s, 6))
        yield took
        yield from _straggler_families(s.slow)


def _straggler_families(result: dict[str, Any] | None) -> Iterator[Metric]:
    lag = _gauge("rank_arrival_lag_seconds", "Median time the rank issued the group's "
                 "collectives after its first member did, over the straggler window.",
                 ["rank", "group"])
    share = _gauge("rank_last_share", "Share of the group's collectives in the straggler "
                   "window the rank arrived last at.", ["rank", "group"])
    for g in (result or {}).get("groups", []):
        for row in g["rows"]:
            labels = [str(row["rank"]), str(g["group"])]
            lag.add_metric(labels, row["median_lag_ms"] / 1e3)
            share.add_metric(labels, row["last_share"])
    yield from (lag, share)


def _num(v: Any) -> float:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else 0.0


def render(s: Scrape) -> bytes:
    """The text exposition of one scrape, from a registry of its own."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(JobCollector(s))
    return generate_latest(registry)


async def metrics_response(collector: Collector, hang_reports: int = 0,
                           slow: dict[str, Any] | None = None) -> web.Response:
    """The ``/metrics`` reply: one scrape, rendered off the event loop; ``slow``: the
    straggler watch's last result."""
    s = await scrape(collector, hang_reports, slow)
    body = await asyncio.get_running_loop().run_in_executor(None, render, s)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})
