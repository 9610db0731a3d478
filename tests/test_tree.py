"""The tree's second level (``agent/tree.py``, ``fanout/agents.py``): a real gloo job of 8 ranks
"on four hosts" (torchrun's per-host variables, one agent id per pair of ranks) with two hosts
per group (``DEBUG_SERVER_TREE_HOSTS=2``), so the agents at places 0 and 2 of the tree lead a
group each and the frontend asks only those two aggregators. Rank 5 sleeps instead of joining
all_reduce #3. Then the aggregator of rank 5's group is killed: its ranks come through their
host agents in the same page, and the verdict stays the same.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
from agentjob import get, hang_line, job_script, running_hosts, wait_gone
from mpjob import free_port

pytestmark = [pytest.mark.job, pytest.mark.timeout(240)]

WORLD, PER_HOST, TREE_HOSTS, STUCK = 8, 2, 2, 5

JOB = job_script(STUCK, 200)
HANG_LINE = hang_line(JOB)
_get = get


def _store_json(store_port: int, keys: list[str]) -> dict[str, dict[str, Any]]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", store_port, is_master=False,
                          timeout=datetime.timedelta(seconds=10))
    return {k: json.loads(store.get(f"debug_server/{k}")) for k in keys
            if store.check([f"debug_server/{k}"])}


def _groups(store_port: int) -> dict[str, dict[str, Any]]:
    return _store_json(store_port, [f"tree/0/group/{g}" for g in range(WORLD // PER_HOST)])


def _fr_ready(fr: dict[str, Any]) -> bool:
    return fr.get("ranks_with_data") == list(range(WORLD)) and any(
        c["seq"] == 3 and c["missing_ranks"] == [STUCK] for c in fr.get("collectives", []))


def _notes(fr: dict[str, Any]) -> list[str]:
    return [r.get("note") or "" for r in fr.get("ranks", [])]


def _host(rank: int) -> str:
    return f"fakehost{rank // PER_HOST}"


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("treejob")
    store_port = free_port()
    with running_hosts(tmp, JOB, WORLD, PER_HOST, store_port, {
        "DEBUG_SERVER_TREE_HOSTS": str(TREE_HOSTS), "OMP_NUM_THREADS": "1"}) as (procs, logs):
        deadline = time.monotonic() + 120
        url = None
        fr: dict[str, Any] = {}
        while True:
            for p, log in zip(procs, logs, strict=True):
                if p.poll() is not None:
                    raise AssertionError(f"a rank exited:\n{log.read_text()[-3000:]}")
            text = logs[0].read_text()
            if url is None and "FRONTEND " in text:
                url = text.split("FRONTEND ", 1)[1].split()[0]
            if url is not None and len(_groups(store_port)) == WORLD // PER_HOST // TREE_HOSTS:
                status, body = _get(url, "/fr_trace?format=json")
                fr = json.loads(body) if status == 200 else {}
                # The frontend reads the tree every few seconds: until every rank came up it.
                if _fr_ready(fr) and all("via agent agg-" in n for n in _notes(fr)):
                    break
            assert time.monotonic() < deadline, (fr.get("ranks"), logs[0].read_text()[-3000:])
            time.sleep(0.5)
        yield {"url": url, "store_port": store_port, "fr": fr, "procs": procs, "logs": logs}


def test_two_hosts_per_group_make_two_aggregators_over_four_ranks_each(
        job: dict[str, Any]) -> None:
    """Places go by the order the agents joined: each group two hosts, every rank in one."""
    from debug_server.protocol.addrs import parse_ranks

    groups = _groups(job["store_port"])
    assert len(groups) == 2 and all(len(g["hosts"]) == TREE_HOSTS for g in groups.values())
    ranks = sorted(r for g in groups.values() for r in parse_ranks(g["ranks"]))
    assert ranks == list(range(WORLD)), groups
    for g in groups.values():
        assert sorted(parse_ranks(g["ranks"])) == sorted(
            r for r in range(WORLD) if _host(r) in g["hosts"]), g


def test_every_rank_comes_up_the_tree_and_the_verdict_names_rank_5(job: dict[str, Any]) -> None:
    fr = job["fr"]
    assert fr["verdict"].startswith(f"Rank {STUCK} never joined all_reduce #3"), fr["verdict"]
    for r, note in enumerate(_notes(fr)):
        # which way each rank came: its host's agent, then its group's aggregator
        assert note.startswith("via its host's agent; via agent agg-"), (r, note)


def test_stacks_come_up_the_tree_and_show_rank_5_asleep(job: dict[str, Any]) -> None:
    status, body = _get(job["url"], "/stacks?format=json")
    assert status == 200, body
    ranks = json.loads(body)["ranks"]
    assert all("via agent agg-" in (r.get("note") or "") for r in ranks), ranks
    assert f"line {HANG_LINE} in <module>" in ranks[STUCK]["stacks"], ranks[STUCK]["stacks"]


def test_a_host_agent_sends_stacks_by_class_where_its_aggregator_asks_so(
        job: dict[str, Any]) -> None:
    """Asked as an aggregator asks (``agentwire.CLASSES``), a host agent sends its two ranks
    waiting in all_reduce as one text (their thread ids differ); asked as a frontend asks, each
    rank's own text. Both ways, on both routes that carry stacks."""
    from httpget import post

    from debug_server.protocol import agentwire

    host = _store_json(job["store_port"], [f"agent/{_host(0)}"])[f"agent/{_host(0)}"]
    base = f"{host['url'].rstrip('/')}/handler"
    asks = {agentwire.STACKS: "", agentwire.FR: "&stacks=true"}
    for route, more in asks.items():
        texts = {}
        for classes in ("", f"&{agentwire.CLASSES}=true"):
            status, body = post(f"{base}/{route}?ranks=0-1{more}{classes}")
            assert status == 200, body
            obj = json.loads(body)
            texts[classes] = (obj["stacks"] if route == agentwire.FR else obj)["bodies"]
        own, folded = texts[""], texts[f"&{agentwire.CLASSES}=true"]
        assert len(own) == 2 and own[0] != own[1], (route, own)
        assert folded == own[:1], (route, folded)


def test_health_comes_up_the_tree_with_the_fr_in_one_request_per_host(
        job: dict[str, Any]) -> None:
    """The overview's ask (``agentwire.WITH_HEALTH``): an aggregator asked for its group's FR,
    stacks and health asks its host agents for all three at once (``test_fr_stacks`` counts
    the requests) and sends every rank's health reply up, rank 5 (asleep) with no stalled op;
    the overview shows every rank's health."""
    from httpget import post

    from debug_server.protocol import agentwire
    from debug_server.protocol.addrs import parse_ranks

    group = next(g for g in _groups(job["store_port"]).values()
                 if STUCK in parse_ranks(g["ranks"]))
    base = f"{group['url'].rstrip('/')}/handler"
    status, body = post(f"{base}/{agentwire.FR}?ranks={group['ranks']}&stacks=true&"
                        f"{agentwire.WITH_HEALTH}=true")
    assert status == 200, body
    part = json.loads(body)["health"]
    got: dict[int, dict[str, Any]] = {}
    for row in part["ranks"]:
        assert row["status"] == "ok" and row["note"].startswith("via its host's agent"), row
        for r in parse_ranks(str(row.get("ranks", row.get("rank")))):
            got[r] = json.loads(part["bodies"][row["body"]])
    assert sorted(got) == sorted(parse_ranks(group["ranks"])), got
    assert all(isinstance(h["healthy"], bool) for h in got.values()), got
    assert got[STUCK]["stalled_op"] is None, got[STUCK]
    status, page = _get(job["url"], "/?format=json")
    rows = json.loads(page)["ranks"]
    assert [r["rank"] for r in rows] == list(range(WORLD))
    assert not [r for r in rows if "unknown" in r["health"]], rows


def test_the_straggler_poll_asks_the_aggregators_and_they_their_host_agents(
        job: dict[str, Any]) -> None:
    """``/stragglers`` through the tree (``fanout.recent``): the page answers its three keys,
    each aggregator and each host agent answered ``agent_recent`` (its clock, then its ranks'
    times), and the page names nobody where rank 5 sleeps (too few complete collectives)."""
    from httpget import post

    from debug_server.protocol import agentwire

    status, body = _get(job["url"], "/stragglers?format=json")
    assert status == 200, body
    got = json.loads(body)
    assert sorted(got) == ["groups_checked", "stragglers", "window_ops"] and \
        got["stragglers"] == [], got
    hosts = _store_json(job["store_port"], [f"agent/{_host(r)}" for r in range(0, WORLD, PER_HOST)])
    for where in [*_groups(job["store_port"]).values(), *hosts.values()]:
        status, info = post(f"{where['url'].rstrip('/')}/handler/{agentwire.INFO}")
        assert status == 200, info
        assert json.loads(info)["requests"].get(agentwire.RECENT, 0) >= 2, (where["url"], info)


def test_a_dead_aggregator_is_bypassed_through_its_host_agents(job: dict[str, Any]) -> None:
    """Last in the module: the aggregator of rank 5's group (and its host's agent, the same
    process) killed; rank 5's host agent still answers for it, the others of that host
    directly."""
    from debug_server.protocol.addrs import parse_ranks

    group = next(g for g in _groups(job["store_port"]).values()
                 if STUCK in parse_ranks(g["ranks"]))
    os.kill(group["pid"], signal.SIGKILL)
    wait_gone(group["pid"])
    status, body = _get(job["url"], "/fr_trace?format=json")
    fr = json.loads(body)
    assert status == 200 and _fr_ready(fr), fr.get("ranks", fr)
    assert fr["verdict"].startswith(f"Rank {STUCK} never joined all_reduce #3"), fr["verdict"]
    notes = _notes(fr)
    lead_host = group["hosts"][0]  # the killed process was this host's agent too
    for r in range(WORLD):
        if _host(r) == lead_host:
            assert "via agent" not in notes[r], (r, notes[r])  # asked directly
        elif _host(r) in group["hosts"]:
            assert notes[r].startswith(f"via agent {_host(r)}") and "agg-" not in notes[r], \
                (r, notes[r])
        else:
            assert "via agent agg-" in notes[r], (r, notes[r])
