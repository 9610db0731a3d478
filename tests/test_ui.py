"""The browser pages: verdict banner, rank grid, highlighted rows, grouped stacks, trace download."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from fakes import MAIN_STACK, closed_port_url

from debug_server.config import ServerConfig
from debug_server.fanout.reply import FrData
from debug_server.fanout.transport import RankResult
from debug_server.frontend.app import load_templates, make_frontend_app
from debug_server.frontend.dumps import analyze_fr
from debug_server.frontend.render import overview_model
from debug_server.readers.storeview import StaticRegistry
from debug_server.tools import synthetic

BROWSER = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"
IN_ALL_REDUCE = """Thread 0x00007f0000000002 (most recent call first):
  File "/site/debug_server/recording/comms.py", line 300 in all_reduce
  File "/job/train.py", line 95 in train_step
  File "/job/train.py", line 120 in <module>
"""


@pytest.fixture
async def client(aiohttp_client: Any, fake_job: Any) -> Any:
    """4 ranks: 0 and 2 wait in all_reduce #4, 1 never issued it, 3 is unreachable."""
    dumps = synthetic.hang_job(3, n_entries=5, missing_rank=1)
    urls = await fake_job(dumps, stacks={0: IN_ALL_REDUCE, 1: MAIN_STACK, 2: IN_ALL_REDUCE})
    urls.append(closed_port_url())
    config = ServerConfig(port=0, fetch_timeout=2.0)
    return await aiohttp_client(make_frontend_app(config, StaticRegistry(urls)))


async def _html(client: Any, path: str) -> str:
    resp = await client.get(path, headers={"Accept": BROWSER})
    assert resp.status == 200, await resp.text()
    return await resp.text()


def _cell(html: str, rank: int) -> str:
    m = re.search(rf'<a class="([^"]+)" href="/stacks#rank-{rank}" title="([^"]*)">{rank}</a>', html)
    assert m, f"no grid cell for rank {rank}"
    return m.group(1)


async def test_overview_banner_names_missing_rank_and_where_it_is(client: Any) -> None:
    html = await _html(client, "/")
    banner = html[html.index('<div class="banner'):html.index("</div>\n</div>") + 6]
    assert 'class="banner bad"' in banner
    text = re.sub(r"<[^>]+>", "", banner)
    assert "Rank 1 is missing from all_reduce #4 on main_comm" in text
    assert "Stuck: rank 1 at hang_phase at train.py:88 (not in a collective)" in text
    assert "Waiting in it: ranks {0, 2} at all_reduce at train.py:95" in text
    assert '<a href="/stacks#rank-1">1</a>' in banner


async def test_overview_grid_colours_ranks_by_state(client: Any) -> None:
    html = await _html(client, "/")
    assert [_cell(html, r) for r in range(4)] == ["s-ok", "s-behind", "s-ok", "s-unreachable"]
    assert "behind: 1</span>" in html and "unreachable: 1</span>" in html


async def test_overview_lists_progress_per_communicator(client: Any) -> None:
    html = await _html(client, "/")
    comms = html[html.index("<h2>Communicators</h2>"):]
    row = re.search(r'<tr class="fail"><td>main_comm</td><td>gloo</td><td>3</td><td>4</td>', comms)
    assert row, comms[:600]
    assert '<a href="/stacks#rank-1">1</a></td></tr>' in comms


async def test_overview_links_every_view_and_download(client: Any) -> None:
    html = await _html(client, "/")
    for href in ("/fr_trace", "/stacks", "/?format=json", "/fr_trace?format=json",
                 "/stacks?format=text", "/fr_trace/trace.json"):
        assert f'href="{href}"' in html, href
    assert 'id="autorefresh"' in html and "https://" not in html  # no external assets


async def test_unhealthy_and_not_registered_ranks_have_their_own_state(aiohttp_client: Any, fake_rank: Any) -> None:
    dumps = synthetic.hang_job(2, n_entries=3)
    url0 = await fake_rank(dumps[0], health={"healthy": False, "stalled_op": {
        "group": "main_comm", "seq": 2, "op": "all_reduce", "age_s": 30.0}})
    config = ServerConfig(port=0, fetch_timeout=2.0)
    client = await aiohttp_client(make_frontend_app(config, StaticRegistry([url0, None])))
    html = await _html(client, "/")
    assert [_cell(html, 0), _cell(html, 1)] == ["s-unhealthy", "s-not-registered"]
    assert "main_comm seq 2 all_reduce in flight for 30.0 s" in html


@pytest.mark.parametrize("query", ["refresh=10", "refresh=0"])
async def test_refresh_parameter_is_accepted_on_every_page(client: Any, query: str) -> None:
    for path in ("/", "/fr_trace", "/stacks"):
        await _html(client, f"{path}?{query}")


async def test_refresh_out_of_bounds_is_400(client: Any) -> None:
    assert (await client.get("/?refresh=99999")).status == 400


async def test_fr_trace_shows_findings_before_the_highlighted_failing_row(client: Any) -> None:
    html = await _html(client, "/fr_trace?onlyactive=false")
    assert html.index("<h2>Findings</h2>") < html.index("<h2>Collectives</h2>")
    table = html[html.index("<h2>Collectives</h2>"):html.index("NCCL Calls")]
    rows = re.findall(r'<tr class="fail">(.*?)</tr>', table)
    (row,) = [r for r in rows if "nccl:all_reduce" in r and "<td>4</td>" in r]
    assert '<a href="/stacks#rank-1">1</a>' in row
    assert html.count('<tr class="fail">') == 1 + 2  # the collective, and its two NCCL calls


async def test_stacks_groups_identical_ranks_odd_one_first(client: Any) -> None:
    html = await _html(client, "/stacks")
    heads = re.findall(r"<h2>(.*?)</h2>", html)
    assert heads[-3:] == ["rank 1: hang_phase at train.py:88 (not in a collective)",
                          "2 ranks: all_reduce at train.py:95", "rank 3: unreachable"]
    for r in range(4):
        assert f'id="rank-{r}"' in html
    assert "/job/train.py:88 in hang_phase" in html and "/job/train.py:120 in &lt;module&gt;" in html


def test_a_big_stacks_group_names_its_ranks_as_linked_ranges() -> None:
    """Above STACK_LINKS_MAX ranks a group's ranks are ranges, each linked by its first rank
    (131072 links are megabytes no one reads); the odd rank keeps its own link."""
    from debug_server.frontend.render import STACK_LINKS_MAX, stacks_model

    world = STACK_LINKS_MAX + 200
    odd = 700
    results = [RankResult(r, f"u{r}", "ok", MAIN_STACK if r == odd else IN_ALL_REDUCE)
               for r in range(world)]
    model = stacks_model(results)
    html = load_templates().get_template("stacks.html").render(title="Stacks", failures=[],
                                                               **model)
    heads = re.findall(r"<h2>(.*?)</h2>", html)
    assert heads == [f"rank {odd}: hang_phase at train.py:88 (not in a collective)",
                     f"{world - 1} ranks: all_reduce at train.py:95"]
    assert f'<a class="rk" id="rank-0" href="#rank-0">0-{odd - 1}</a>, ' \
           f'<a class="rk" id="rank-{odd + 1}" href="#rank-{odd + 1}">{odd + 1}-{world - 1}</a>' \
        in html
    assert f'id="rank-{odd}" href="#rank-{odd}">{odd}</a>' in html
    assert html.count('class="rk"') == 3


async def test_trace_download_is_an_attachment_with_the_stuck_op_in_flight(client: Any) -> None:
    resp = await client.get("/fr_trace/trace.json")
    assert resp.status == 200 and resp.content_type == "application/json"
    assert resp.headers["Content-Disposition"].startswith("attachment; filename=")
    trace = json.loads(await resp.text())
    stuck = {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X" and e["args"]["in_flight"]}
    assert stuck == {0, 2}


def test_overview_at_512_ranks_stays_under_2_mb() -> None:
    world = 512
    two = synthetic.hang_job(2, n_entries=2000, missing_rank=1)
    groups = {"main_comm": list(range(world))}
    full = synthetic.make_dump([e for e in two[0]["entries"] if e["state"] != "completed"], groups)
    late = synthetic.make_dump([], groups)
    dumps = {r: (late if r == world - 1 else full) for r in range(world)}
    recs = [RankResult(r, f"http://10.0.{r // 256}.{r % 256}:41234", "ok", body=MAIN_STACK)
            for r in range(world)]
    fr = FrData(recs, dumps)
    result = analyze_fr(fr, recs, world)
    model = overview_model(result, recs, dict.fromkeys(range(world), "healthy"), world)
    html = load_templates().get_template("index.html").render(title="Overview", failures=[], **model)
    assert len(html.encode()) <= 2 * 1024 * 1024
    assert html.count("/stacks#rank-") >= world and 'class="s-behind" href="/stacks#rank-511"' in html


async def test_mismatched_collective_row_is_marked_mismatch(aiohttp_client: Any, fake_job: Any) -> None:
    dumps = synthetic.hang_job(2, n_entries=3)
    odd = dumps[1]["entries"][-1]
    odd["input_sizes"] = odd["output_sizes"] = [[512]]
    urls = await fake_job(dumps)
    config = ServerConfig(port=0, fetch_timeout=2.0)
    client = await aiohttp_client(make_frontend_app(config, StaticRegistry(urls)))
    html = await _html(client, "/fr_trace?onlyactive=false")
    (row,) = re.findall(r'<tr class="mismatch">(.*?)</tr>', html)
    assert "<td>2</td>" in row and "nccl:all_reduce" in row
    assert 'class="banner bad"' in html


def test_overview_takes_progress_and_behind_ranks_from_the_analysis_result() -> None:
    dumps = synthetic.hang_job(3, n_entries=5, missing_rank=1)
    recs = [RankResult(r, f"http://127.0.0.1:{41000 + r}", "ok", body=MAIN_STACK) for r in range(3)]
    result = analyze_fr(FrData(recs, dumps), recs, 3)
    # The view renders what the analysis says; it reads no dump (there is none to read here).
    result["behind"] = [{"rank": 2, "groups": ["other_comm"]}]
    result["communicators"][0]["last_completed_min"] = 1
    model = overview_model(result, recs, dict.fromkeys(range(3), "healthy"), 3)
    assert [c["state"] for c in model["cells"]] == ["ok", "ok", "behind"]
    assert model["problems"][0]["detail"].startswith("behind on other_comm")
    assert "<td>main_comm</td><td>gloo</td><td>3</td><td>4</td><td>3</td><td>1</td>" in model["comms"]
