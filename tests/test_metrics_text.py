"""``/metrics``' cycle families written directly (``frontend.promtext``) against
``prometheus_client`` writing the same families sample by sample, one rank's record at a time:
over random cycles (health runs and ranks alike, failed and 404 ranks, stalled ops, shared and
own ``pg_status``, missing-rank findings, straggler rows, odd label texts) the two texts hold
the same families in the same order, with the same HELP and TYPE lines, and the same sample
lines (byte for byte; a family's samples may come in another order, which Prometheus ignores).
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from debug_server.fanout.reply import FrData
from debug_server.fanout.transport import FAILED, OK, RankResult
from debug_server.frontend import metrics, promtext
from debug_server.frontend.health import parse_health
from debug_server.frontend.lastcycle import FrPart, HealthPart


def _num(v: Any) -> float:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else 0.0


class _Reference:
    """The cycle's families as ``prometheus_client`` writes them, a sample per rank's record
    (what ``metrics`` did before ``promtext``)."""

    def __init__(self, c: metrics.Cycle) -> None:
        self.c = c

    def collect(self) -> Iterator[Metric]:
        fr, hp = self.c.fr, self.c.health

        def gauge(name: str, labels: list[str]) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"debug_server_{name}", _docs[name], labels=labels)

        up, healthy = gauge("up", ["rank"]), gauge("healthy", ["rank"])
        in_flight, oldest = gauge("in_flight_ops", ["rank"]), gauge("oldest_in_flight_seconds",
                                                                      ["rank"])
        stalled = gauge("stalled_op_seq", ["rank", "group", "op"])
        if hp is None and fr is not None:
            for r in fr.ranks:
                up.add_metric([str(r)], 1 if r in fr.answered else 0)
        for h in hp.health if hp is not None else ():
            rank = str(h.rank)
            up.add_metric([rank], 1 if h.rank in hp.replied else 0)
            if h.healthy is not None:
                healthy.add_metric([rank], 1 if h.healthy else 0)
            if h.answered:
                in_flight.add_metric([rank], _num(h.info.get("in_flight")))
                oldest.add_metric([rank], _num(h.oldest_s))
            op = h.stalled_op
            if op and isinstance(op.get("seq"), int):
                stalled.add_metric([rank, str(op.get("group")), str(op.get("op"))], op["seq"])
        yield from (up, healthy, in_flight, oldest, stalled)
        for key, name in (("last_enqueued_collective", "last_enqueued_seq"),
                          ("last_started_collective", "last_started_seq"),
                          ("last_completed_collective", "last_completed_seq")):
            fam = gauge(name, ["rank", "group"])
            for group, seq, ranks in fr.seqs.get(key, ()) if fr is not None else ():
                for r in ranks:
                    fam.add_metric([str(r), group], seq)
            yield fam
        missing, missing_n = gauge("missing_ranks", ["group", "seq", "rank"]), \
            gauge("missing_ranks_count", ["group", "seq"])
        stuck, kinds = gauge("stuck_seq", ["group", "op"]), gauge("findings", ["kind"])
        found = list(fr.findings) if fr is not None else []
        for f in (f for f in found if f.get("kind") == "missing_ranks"):
            where = [str(f.get("group")), str(f.get("seq"))]
            for r in f.get("ranks", []):
                missing.add_metric([*where, str(r)], 1)
            missing_n.add_metric(where, len(f.get("ranks", [])))
        # Per group, its first finding of the lowest seq (the one metrics names it by).
        for group in sorted({str(f.get("group")) for f in found}):
            at = [(f["seq"], str(f.get("op"))) for f in found
                  if str(f.get("group")) == group and isinstance(f.get("seq"), int)]
            if at:
                seq, op = min(at, key=lambda t: t[0])
                stuck.add_metric([group, op], seq)
        for kind, n in sorted(Counter(str(f.get("kind")) for f in found).items()):
            kinds.add_metric([kind], n)
        yield from (missing, missing_n, stuck, kinds)
        if fr is not None:
            took = gauge("scrape_duration_seconds", [])
            took.add_metric([], round(fr.took_s, 6))
            yield took
        lag, share = gauge("rank_arrival_lag_seconds", ["rank", "group"]), \
            gauge("rank_last_share", ["rank", "group"])
        for g in (self.c.slow or {}).get("groups", []):
            for row in g["rows"]:
                labels = [str(row["rank"]), str(g["group"])]
                lag.add_metric(labels, row["median_lag_ms"] / 1e3)
                share.add_metric(labels, row["last_share"])
        yield from (lag, share)


_docs: dict[str, str] = {}
"""Each family's HELP text, as ``metrics`` words it (read from its own families)."""


def _learn_docs() -> None:
    if not _docs:
        fr = FrPart.of(FrData([], {}), {}, 0.0, "test")
        for f in metrics.cycle_families(metrics.Cycle(fr, None, None)):
            head = b"".join(f.parts()).decode().splitlines()[0]
            name, _, doc = head.removeprefix("# HELP debug_server_").partition(" ")
            _docs[name] = doc.replace(r"\n", "\n").replace("\\\\", "\\")


def _reference_text(c: metrics.Cycle) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Reference(c))  # type: ignore[arg-type]
    return generate_latest(registry).decode()


ODD = ['main', 'pp "stage" 1', "back\\slash", "new\nline", "ü"]


def _cycle(rnd: random.Random) -> metrics.Cycle:
    world = rnd.choice([1, 2, 5, 16, 64])
    statuses = [{rnd.choice(ODD): {"last_enqueued_collective": rnd.randrange(5),
                                   "last_started_collective": rnd.choice([3, True, "x"]),
                                   "last_completed_collective": rnd.randrange(4)}
                 for _ in range(rnd.randrange(1, 3))} for _ in range(3)]
    results, dumps = [], {}
    for r in range(world):
        code = rnd.choice([200, 200, None])
        results.append(RankResult(r, f"http://h:{r}", OK if code else FAILED, http_status=code))
        if code and rnd.random() < 0.9:
            # Ranks alike share one pg_status (the fan-out's copies); some have their own.
            st = rnd.choice(statuses)
            dumps[r] = {"pg_status": st if rnd.random() < 0.7 else json.loads(json.dumps(st))}
    findings = [{"kind": "missing_ranks", "group": rnd.choice(ODD), "seq": rnd.randrange(9),
                 "op": "all_reduce", "ranks": sorted(rnd.sample(range(world), min(world, 2)))}
                for _ in range(rnd.randrange(3))] + [
        {"kind": rnd.choice(["mismatch", "stuck_everywhere"]), "group": rnd.choice(ODD),
         "seq": rnd.choice([2, None]), "op": rnd.choice(ODD)} for _ in range(rnd.randrange(2))]
    fr = FrPart.of(FrData(results, dumps), {"findings": findings}, 0.0, "test") \
        if rnd.random() < 0.85 else None
    hp = None
    if rnd.random() < 0.85:
        texts = [json.dumps({"healthy": True, "in_flight": 0}),
                 json.dumps({"healthy": False, "in_flight": 2, "oldest_in_flight_s": 5.5,
                             "stalled_op": {"group": rnd.choice(ODD), "seq": 7,
                                            "op": rnd.choice(ODD), "age_s": 5.5}}),
                 "not json"]
        polled = []
        for r in range(world):
            how = rnd.random()
            if how < 0.1:
                polled.append(RankResult(r, None, FAILED, error="unreachable"))
            elif how < 0.15:
                polled.append(RankResult(r, "u", FAILED, body="", http_status=404))
            else:
                # Runs of ranks alike, and ranks whose ages differ (polled ms apart).
                body = rnd.choice(texts) if rnd.random() < 0.8 else json.dumps(
                    {"healthy": False, "in_flight": 1, "oldest_in_flight_s": r + 0.25,
                     "stalled_op": {"group": "main", "seq": 3, "op": "all_reduce",
                                    "age_s": r / 3}})
                polled.append(RankResult(r, "u", OK, body=body, http_status=200))
        hp = HealthPart.of(polled, parse_health(polled))
    slow = None
    if rnd.random() < 0.7:
        slow = {"groups": [{"group": rnd.choice(ODD), "rows": [
            {"rank": r, "median_lag_ms": rnd.choice([0.0, 0.5, 12.345, 40.0, 1e-4]),
             "last_share": rnd.choice([0.0, 0.25, 1.0])} for r in range(world)]}
            for _ in range(rnd.randrange(1, 3))]}
    return metrics.Cycle(fr, hp, slow)


def _families(text: str) -> list[tuple[str, str, str]]:
    return [(f.name, f.documentation, f.type) for f in text_string_to_metric_families(text)]


@pytest.mark.parametrize("seed", range(6))
def test_the_direct_text_reads_as_prometheus_client_writes_it(seed: int) -> None:
    _learn_docs()
    rnd = random.Random(seed)
    for _ in range(50):
        c = _cycle(rnd)
        ours = promtext.write(metrics.cycle_families(c)).decode()
        ref = _reference_text(c)
        assert _families(ours) == _families(ref)
        assert sorted(ours.splitlines()) == sorted(ref.splitlines())
        # Each family's lines stay together, its HELP and TYPE first.
        heads = [i for i, line in enumerate(ours.splitlines()) if line.startswith("# HELP")]
        assert [ours.splitlines()[i + 1].startswith("# TYPE") for i in heads] == \
            [True] * len(heads)


def _lines(fam: promtext.Family) -> list[str]:
    return b"".join(fam.parts()).decode().splitlines()[2:]


def test_ranks_alike_are_one_join() -> None:
    fam = promtext.Family("up", "doc", ["rank"])
    fam.add_ranks(range(3), 1)
    fam.add_ranks([7], 0)
    fam.add_ranks([], 0)
    assert _lines(fam) == ['debug_server_up{rank="0"} 1.0', 'debug_server_up{rank="1"} 1.0',
                           'debug_server_up{rank="2"} 1.0', 'debug_server_up{rank="7"} 0.0']
    lag = promtext.Family("lag", "doc", ["rank", "group", "op"])
    lag.add_ranks([4], 2, {"group": 'a"b', "op": "x\ny"})
    lag.add_values([(-0.0, [5]), (1e21, [6]), (0.0, [8]), (1e21, [9, 10])],
                   {"group": "g", "op": "o"})
    assert _lines(lag) == ['debug_server_lag{group="a\\"b",op="x\\ny",rank="4"} 2.0',
                           'debug_server_lag{group="g",op="o",rank="5"} -0.0',
                           'debug_server_lag{group="g",op="o",rank="6"} 1e+21',
                           'debug_server_lag{group="g",op="o",rank="9"} 1e+21',
                           'debug_server_lag{group="g",op="o",rank="10"} 1e+21',
                           'debug_server_lag{group="g",op="o",rank="8"} 0.0']


@pytest.mark.parametrize("v", [0.0, -0.0, 1.0, -1.5, 0.1, 1e-7, 123456.5, 1234567.5, 1e16, 1e21,
                               -1e21, 2.5e-300, float("inf"), float("-inf"), float("nan"),
                               123456789012.0, 9999999.0])
def test_value_text_is_float_to_go_string(v: float) -> None:
    from prometheus_client.utils import floatToGoString

    assert promtext.value_text(v) == floatToGoString(v)
