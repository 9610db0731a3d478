"""One agent per host (``agent/app.py``, ``fanout/agents.py``, ``rank/agent_launch.py``).

In process: real worker apps on port 0 behind real agent apps on port 0, read by the frontend's
``agents_mod.AgentRoute``. Then a real gloo job of 4 ranks "on two hosts": two groups of two processes
on 127.0.0.1 with torchrun's per-host variables (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE=2``) and one
agent id per group, so each group's local rank 0 starts one agent; rank 3 sleeps instead of
joining all_reduce #3. Every process is ended by its process group (each rank has its own
session; its agent is in it).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from agentjob import get, hang_line, job_script, running_hosts, wait_gone
from fakes import FLEET_MISSING, FLEET_PER_HOST, FLEET_WORLD
from httpget import get_json
from mpjob import free_port, kill_all

from debug_server.config import JobEnv, Settings
from debug_server.frontend.dumps import analyze_fr
from debug_server.protocol import addrs
from debug_server.rank import agent_launch
from debug_server.rank.worker import StaticProvider
from debug_server.tools import synthetic

STACK = ('Thread 0x00007f0000000001 (most recent call first):\n'
         '  File "/job/train.py", line 88 in step\n')
HANG_STACK = ('Thread 0x00007f0000000001 (most recent call first):\n'
              '  File "/job/train.py", line 99 in sleepy\n')


# ---------------------------------------------------------------------------------------------
# Parameters


def test_rank_list_text_round_trips_with_ranges() -> None:
    assert addrs.format_ranks([7, 0, 1, 2, 3, 9]) == "0-3,7,9"
    assert addrs.parse_ranks("0-3,7,9") == [0, 1, 2, 3, 7, 9]


def test_rank_list_text_refuses_a_backwards_range() -> None:
    with pytest.raises(ValueError, match="bad range '5-2'"):
        addrs.parse_ranks("5-2")


def test_torchrun_layout_gives_the_hosts_contiguous_ranks() -> None:
    job = JobEnv(rank=5, world_size=8, local_world_size=4, master_addr="10.0.0.1",
                              master_port=29500)
    env = {"LOCAL_RANK": "1"}
    assert agent_launch.host_ranks(job, env) == [4, 5, 6, 7]
    assert agent_launch.wanted(job, Settings.from_env(env)) is True
    assert agent_launch.rank_meta(job, Settings.from_env({"DEBUG_SERVER_AGENT_ID": "h1"})) == {"agent": "h1"}


def test_single_host_job_runs_no_agent_unless_asked() -> None:
    job = JobEnv(rank=0, world_size=2, local_world_size=2, master_addr="127.0.0.1",
                              master_port=29500)
    assert agent_launch.wanted(job, Settings()) is False
    assert agent_launch.wanted(job, Settings(agent=True)) is True


# ---------------------------------------------------------------------------------------------
# In process: 8 fake ranks on two fake hosts


WORLD, PER_HOST, MISSING = FLEET_WORLD, FLEET_PER_HOST, FLEET_MISSING


@pytest.fixture
def fleet_providers() -> list[StaticProvider]:
    """8 ranks (rank 6 never issued the newest all_reduce, and sleeps) for ``agent_fleet``."""
    dumps = synthetic.hang_job(WORLD, n_entries=200, missing_rank=MISSING)
    return [StaticProvider(dumps[r], stacks=HANG_STACK if r == MISSING else STACK)
            for r in range(WORLD)]


async def _agent_counts(url: str) -> dict[str, int]:
    async with aiohttp.ClientSession() as s, s.post(f"{url}/handler/agent_info") as resp:
        return (await resp.json())["requests"]


async def test_fr_through_agents_gives_the_same_verdict_as_asking_every_rank(
        agent_fleet: dict[str, Any]) -> None:
    via = await agent_fleet["through"].fr()
    direct = await agent_fleet["plain"].fr()
    a = analyze_fr(via, None, WORLD)
    b = analyze_fr(direct, None, WORLD)
    assert a["verdict"] == b["verdict"] and f"Rank {MISSING} never joined" in a["verdict"]
    assert a["findings"] == b["findings"]
    assert sorted(via.dumps) == list(range(WORLD))
    assert [r.note for r in via.results] == [f"via agent h{r // PER_HOST}" for r in range(WORLD)]
    for h, ag in agent_fleet["agents"].items():
        assert (await _agent_counts(ag.url)).get("agent_fr", 0) >= 1, h


async def test_fr_window_through_agents_matches_the_direct_window(agent_fleet: dict[str, Any]) -> None:
    via = await agent_fleet["through"].fr()
    direct = await agent_fleet["plain"].fr()
    assert via.window == direct.window
    for r in range(WORLD):
        assert [(e["record_id"], e["frames"]) for e in via.dumps[r]["entries"]] == \
            [(e["record_id"], e["frames"]) for e in direct.dumps[r]["entries"]], r


async def test_agent_fr_reply_sends_each_call_site_stack_once(agent_fleet: dict[str, Any]) -> None:
    url = agent_fleet["agents"]["h0"].url
    async with aiohttp.ClientSession() as s, s.post(f"{url}/handler/agent_fr?window=4") as resp:
        reply = await resp.json()
    used = [e["frames"] for d in reply["dumps"].values() for e in d["entries"]]
    texts = [json.dumps(f) for f in reply["frames"]]
    assert len(texts) == len(set(texts)) and len(used) >= 4 * len(texts)
    assert sorted(set(used)) == list(range(len(texts)))


async def test_stacks_through_agents_give_every_rank_its_own_stack(agent_fleet: dict[str, Any]) -> None:
    results = await agent_fleet["through"].stacks()
    assert [r.rank for r in results] == list(range(WORLD))
    assert [r.body for r in results] == [HANG_STACK if r == MISSING else STACK
                                         for r in range(WORLD)]


async def test_agent_stacks_reply_holds_each_distinct_stack_once(agent_fleet: dict[str, Any]) -> None:
    url = agent_fleet["agents"]["h1"].url
    async with aiohttp.ClientSession() as s, s.post(f"{url}/handler/agent_stacks") as resp:
        reply = await resp.json()
    assert sorted(reply["bodies"]) == sorted([STACK, HANG_STACK])
    # Ranks with the same stack share one row (their ranks as range text).
    by_rank = {rk: reply["bodies"][r["body"]] for r in reply["ranks"]
               for rk in ([r["rank"]] if "rank" in r else addrs.parse_ranks(r["ranks"]))}
    assert by_rank[MISSING] == HANG_STACK and sorted(by_rank) == list(range(4, 8))
    assert len(reply["ranks"]) == 2


async def test_agent_fr_reply_carries_the_hosts_mismatch_signatures(agent_fleet: dict[str, Any]) -> None:
    url = agent_fleet["agents"]["h1"].url
    async with aiohttp.ClientSession() as s, s.post(f"{url}/handler/agent_fr?window=4") as resp:
        reply = await resp.json()
    newest = max(int(seq) for seq in reply["signatures"]["main_comm"])
    (sig, ranks), = reply["signatures"]["main_comm"][str(newest)].items()
    assert json.loads(sig)[0] == "all_reduce" and ranks == "4-5,7"


async def test_health_poll_goes_through_agents(agent_fleet: dict[str, Any]) -> None:
    results = await agent_fleet["through"].fetch("torchcomms_health_check")
    assert [json.loads(r.body)["healthy"] for r in results] == [True] * WORLD
    assert all(r.note == f"via agent h{r.rank // PER_HOST}" for r in results)


async def test_a_dead_agent_leaves_its_ranks_to_the_direct_path(agent_fleet: dict[str, Any]) -> None:
    await agent_fleet["agent_runners"]["h1"].cleanup()  # nothing listens there any more
    fr = await agent_fleet["through"].fr()
    stacks = await agent_fleet["through"].stacks()
    assert sorted(fr.dumps) == list(range(WORLD))
    assert [r.note for r in fr.results[PER_HOST:]] == [None] * PER_HOST
    assert [r.note for r in fr.results[:PER_HOST]] == ["via agent h0"] * PER_HOST
    assert stacks[MISSING].body == HANG_STACK and stacks[MISSING].note is None
    assert f"Rank {MISSING} never joined" in analyze_fr(fr, stacks, WORLD)["verdict"]


async def test_agent_refuses_an_unknown_parameter_in_one_line(agent_fleet: dict[str, Any]) -> None:
    url = agent_fleet["agents"]["h0"].url
    async with aiohttp.ClientSession() as s, s.post(f"{url}/handler/agent_fr?rank=1") as resp:
        assert resp.status == 400
        assert (await resp.text()) == ("unknown parameter 'rank' (allowed: classes, health, "
                                       "onlyactive, pgknown, ranks, since, stacks, tag, whole, "
                                       "window)")


async def test_agent_relays_only_the_listed_handlers(agent_fleet: dict[str, Any]) -> None:
    url = agent_fleet["agents"]["h0"].url
    async with aiohttp.ClientSession() as s, s.post(
            f"{url}/handler/agent_fetch?handler=torch_profile") as resp:
        assert resp.status == 400
        assert "must be one of ping, torchcomms_fr_dump_file, torchcomms_health_check" in \
            await resp.text()


# ---------------------------------------------------------------------------------------------
# A real gloo job: 4 ranks, two fake hosts, one agent each

JOB = job_script(3, 100)
HANG_LINE = hang_line(JOB)
_get = get


def _agents(store_port: int) -> dict[str, dict[str, Any]]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", store_port, is_master=False,
                          timeout=datetime.timedelta(seconds=10))
    out = {}
    for h in ("fakehost0", "fakehost1"):
        key = f"debug_server/agent/{h}"
        if store.check([key]):
            out[h] = json.loads(store.get(key))
    return out


def _fr_ready(fr: dict[str, Any]) -> bool:
    return fr.get("ranks_with_data") == [0, 1, 2, 3] and any(
        c["seq"] == 3 and c["missing_ranks"] == [3] for c in fr.get("collectives", []))


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("agentjob")
    store_port = free_port()
    with running_hosts(tmp, JOB, 4, 2, store_port) as (procs, logs):
        deadline = time.monotonic() + 60
        url = None
        while url is None or len(_agents(store_port)) < 2:
            for p, log in zip(procs, logs, strict=True):
                if p.poll() is not None:
                    raise AssertionError(f"a rank exited:\n{log.read_text()[-3000:]}")
            text = logs[0].read_text()
            if "FRONTEND " in text:
                url = text.split("FRONTEND ", 1)[1].split()[0]
            if time.monotonic() > deadline:
                raise AssertionError(f"job not up in 60 s:\n{logs[0].read_text()[-3000:]}")
            time.sleep(0.3)
        fr: dict[str, Any] = {}
        while time.monotonic() < deadline + 30:
            status, body = _get(url, "/fr_trace?format=json")
            fr = json.loads(body) if status == 200 else {}
            # The frontend may have looked for the agents just before they registered.
            if _fr_ready(fr) and all(r.get("note", "").startswith("via agent")
                                     for r in fr["ranks"]):
                break
            time.sleep(0.5)
        yield {"url": url, "store_port": store_port, "fr": fr, "procs": procs, "logs": logs}


@pytest.mark.job
@pytest.mark.timeout(150)
def test_each_fake_host_registers_one_agent_for_its_two_ranks(job: dict[str, Any]) -> None:
    agents = _agents(job["store_port"])
    assert {h: a["ranks"] for h, a in agents.items()} == {"fakehost0": "0-1", "fakehost1": "2-3"}


@pytest.mark.job
@pytest.mark.timeout(150)
def test_fr_trace_goes_through_the_agents_and_names_rank_3(job: dict[str, Any]) -> None:
    fr = job["fr"]
    assert _fr_ready(fr), fr.get("collectives", fr)
    assert [r.get("note") for r in fr["ranks"]] == ["via agent fakehost0"] * 2 + \
        ["via agent fakehost1"] * 2
    assert fr["verdict"].startswith("Rank 3 never joined all_reduce #3"), fr["verdict"]
    for a in _agents(job["store_port"]).values():
        assert get_json(f"{a['url']}/handler/agent_info", "POST")["requests"]["agent_fr"] >= 1


@pytest.mark.job
@pytest.mark.timeout(150)
def test_stacks_go_through_the_agents_and_show_rank_3_asleep(job: dict[str, Any]) -> None:
    status, body = _get(job["url"], "/stacks?format=json")
    assert status == 200, body
    ranks = json.loads(body)["ranks"]
    assert [r["note"] for r in ranks] == ["via agent fakehost0"] * 2 + ["via agent fakehost1"] * 2
    assert f"line {HANG_LINE} in <module>" in ranks[3]["stacks"], ranks[3]["stacks"]
    for a in _agents(job["store_port"]).values():
        assert get_json(f"{a['url']}/handler/agent_info", "POST")["requests"]["agent_stacks"] >= 1


@pytest.mark.job
@pytest.mark.timeout(150)
def test_attached_frontend_finds_the_agents_through_the_store(job: dict[str, Any]) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "debug_server.frontend", "--store",
                             f"127.0.0.1:{job['store_port']}", "--world-size", "4", "--port", "0",
                             "--host", "127.0.0.1", "--fetch-timeout", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        url = line.split("http://", 1)[1].split("/", 1)[0]
        fr: dict[str, Any] = {}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status, body = _get(f"http://127.0.0.1:{url.rpartition(':')[2]}", "/fr_trace?format=json")
            fr = json.loads(body) if status == 200 else {}
            if _fr_ready(fr) and all((r.get("note") or "").startswith("via agent")
                                     for r in fr["ranks"]):
                break
            time.sleep(0.5)
        assert [r.get("note") for r in fr["ranks"]] == ["via agent fakehost0"] * 2 + \
            ["via agent fakehost1"] * 2, fr.get("ranks", fr)
    finally:
        kill_all([proc])
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.job
@pytest.mark.timeout(150)
def test_killed_agent_leaves_every_rank_on_the_pages(job: dict[str, Any]) -> None:
    victim = _agents(job["store_port"])["fakehost1"]
    os.kill(victim["pid"], signal.SIGKILL)
    wait_gone(victim["pid"])
    status, body = _get(job["url"], "/fr_trace?format=json")
    fr = json.loads(body)
    assert status == 200 and _fr_ready(fr), fr.get("ranks", fr)
    assert [r.get("note") for r in fr["ranks"]] == ["via agent fakehost0"] * 2 + [None, None]
    assert fr["verdict"].startswith("Rank 3 never joined all_reduce #3"), fr["verdict"]
    status, body = _get(job["url"], "/stacks?format=json")
    ranks = json.loads(body)["ranks"]
    assert [r["rank"] for r in ranks if r["status"] == "ok"] == [0, 1, 2, 3]
    assert f"line {HANG_LINE} in <module>" in ranks[3]["stacks"]

