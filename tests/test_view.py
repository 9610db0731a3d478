"""The post-mortem viewer: the frontend's pages served from a dump dir, with no job behind them.

The dump dirs here are written by the dumper's own writers (``snapshot_json``, ``stacks_report``,
``write_dump_atomic``) from the reference scenario (rank 1 missing from all_reduce #4); the
browser test in ``test_view_browser.py`` runs on a real demo's dumps.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _scenarios as S
import pytest
from fakes import NEW, OLD, RANK0_STACK, RANK1_STACK, write_cycle
from httpget import get_json, request
from mpjob import free_port

from debug_server.auth import TOKEN_ENV, TOKEN_HEADER
from debug_server.dumpio import write_dump_atomic
from debug_server.fanout.reply import FrData
from debug_server.fanout.transport import OK, UNREACHABLE, RankResult
from debug_server.frontend.dumps import snapshot_json
from debug_server.tools.view import DiskCollector, make_view_app, scan_dir
from debug_server.tools.view_collector import CURRENT
from debug_server.tools.view_disk import load_cycle

REPO = Path(__file__).resolve().parent.parent
BROWSER = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"

@pytest.fixture
def dump_dir(tmp_path: Path) -> Path:
    """Two cycles: a clean one (old), then rank 1 missing from all_reduce #4 (new)."""
    d = tmp_path / "dumps"
    d.mkdir()
    write_cycle(d, OLD, S.clean(2, 4), {0: RANK0_STACK, 1: RANK0_STACK})
    write_cycle(d, NEW, S.missing_rank(), {0: RANK0_STACK, 1: RANK1_STACK})
    (d / f"hang_report_{NEW}.json").write_text(json.dumps({"verdict": "Rank 1 never joined"}))
    (d / f"hang_report_{NEW}.txt").write_text("=== Hang report ===\nrank 1 <module>\n")
    old = time.time() - 100  # the cycles' files are older than the per-rank dumps below
    for p in d.iterdir():
        os.utime(p, (old, old))
    return d


async def _client(aiohttp_client: Any, d: Path, **kw: Any) -> Any:
    return await aiohttp_client(make_view_app(str(d), **kw))


async def test_newest_cycle_is_shown_by_default_with_the_missing_rank(aiohttp_client: Any,
                                                                      dump_dir: Path) -> None:
    client = await _client(aiohttp_client, dump_dir)
    body = await (await client.get("/fr_trace", params={"format": "json"})).json()
    assert body["postmortem"]["cycle"] == NEW
    assert [(f["kind"], f["seq"], f["ranks"]) for f in body["findings"]] == [
        ("missing_ranks", 4, [1])]


LATER = "20240101_100030"
RANK1_AFTER = """Thread 0x00007f0000000002 (most recent call first):
  File "/job/train.py", line 99 in wait_for_all
  File "/job/train.py", line 150 in <module>
"""


async def test_hang_reports_cycle_is_shown_by_default_over_newer_ones(aiohttp_client: Any,
                                                                       dump_dir: Path) -> None:
    # A timeout ended the hang after the report: the newest cycle has rank 1 past its hang line.
    write_cycle(dump_dir, LATER, S.missing_rank(), {0: RANK0_STACK, 1: RANK1_AFTER})
    client = await _client(aiohttp_client, dump_dir)
    body = await (await client.get("/stacks", params={"format": "json"})).json()
    assert body["postmortem"]["cycle"] == NEW
    assert "line 66 in hang_phase" in body["ranks"][1]["stacks"]
    assert body["postmortem"]["hang_note"].startswith(
        f"Showing the first dump cycle after the hang report of {NEW}: the job as it was seen hung.")
    html = await (await client.get("/", headers={"Accept": BROWSER})).text()
    assert f'<option value="{NEW}" selected>' in html and "as it was seen hung" in html
    later = await (await client.get("/stacks", params={"format": "json", "cycle": LATER})).json()
    assert later["postmortem"]["hang_note"] is None
    assert "wait_for_all" in later["ranks"][1]["stacks"]


async def test_cycle_query_picks_the_older_clean_cycle(aiohttp_client: Any, dump_dir: Path) -> None:
    client = await _client(aiohttp_client, dump_dir)
    body = await (await client.get("/fr_trace", params={"format": "json", "cycle": OLD})).json()
    assert body["postmortem"]["cycle"] == OLD and body["findings"] == []
    assert [c["seq"] for c in body["collectives"]] == [0, 1, 2, 3]


async def test_chosen_cycle_is_kept_by_cookie_across_pages(aiohttp_client: Any, dump_dir: Path) -> None:
    client = await _client(aiohttp_client, dump_dir)
    await client.get("/", params={"cycle": OLD})
    body = await (await client.get("/stacks", params={"format": "json"})).json()
    assert body["postmortem"]["cycle"] == OLD
    assert "hang_phase" not in (body["ranks"][1]["stacks"] or "")


async def test_overview_html_has_banner_picker_and_verdict(aiohttp_client: Any, dump_dir: Path) -> None:
    client = await _client(aiohttp_client, dump_dir)
    resp = await client.get("/", headers={"Accept": BROWSER})
    html = await resp.text()
    assert resp.status == 200 and resp.content_type == "text/html"
    assert "Post-mortem: job ended; data from 2024-01-01 10:00:05" in html
    assert f'<option value="{OLD}">2024-01-01 10:00:00: FR + stacks</option>' in html
    assert f'<option value="{NEW}" selected>' in html
    assert 'Rank <a href="/stacks#rank-1">1</a> is missing from all_reduce #4 on main_comm' in html
    # The banner sits between the frontend's nav and its page title.
    assert html.index("</nav>") < html.index('id="postmortem"') < html.index("<h1>Overview</h1>")


async def test_overview_text_starts_with_the_post_mortem_line(aiohttp_client: Any, dump_dir: Path) -> None:
    client = await _client(aiohttp_client, dump_dir)
    text = await (await client.get("/", headers={"Accept": "*/*"})).text()
    first, _, rest = text.partition("\n")
    assert first.startswith("POST-MORTEM: job ended; data from 2024-01-01 10:00:05 (cycle "
                            f"{NEW}, 2 in ")
    assert "debug_server: 2/2 ranks reachable" in rest and "Rank 1 never joined" in rest


async def test_fr_trace_html_highlights_seq_4(aiohttp_client: Any, dump_dir: Path) -> None:
    client = await _client(aiohttp_client, dump_dir)
    html = await (await client.get("/fr_trace", headers={"Accept": BROWSER})).text()
    row = next(r for r in html.split("<tr") if "nccl:all_reduce" in r and "<td>4</td>" in r)
    assert row.startswith(' class="fail"') and 'href="/stacks#rank-1"' in row


async def test_fr_trace_html_says_the_data_is_as_dumped_not_a_live_window(aiohttp_client: Any,
                                                                          dump_dir: Path) -> None:
    client = await _client(aiohttp_client, dump_dir)
    html = await (await client.get("/fr_trace", headers={"Accept": BROWSER})).text()
    assert "as the dumper wrote them to fr_snapshot_" in html
    assert "frontier" not in html and "show whole rings" not in html


async def test_stacks_text_is_the_recorded_sections(aiohttp_client: Any, dump_dir: Path) -> None:
    client = await _client(aiohttp_client, dump_dir)
    text = await (await client.get("/stacks", params={"format": "text"})).text()
    rank1 = text.split("=== Rank 1 ===", 1)[1]
    assert 'File "/job/train.py", line 66 in hang_phase' in rank1


async def test_stacks_html_escapes_module_frames(aiohttp_client: Any, dump_dir: Path) -> None:
    client = await _client(aiohttp_client, dump_dir)
    html = await (await client.get("/stacks", headers={"Accept": BROWSER})).text()
    assert "/job/train.py:66 in hang_phase" in html
    assert "in &lt;module&gt;" in html and "in <module>" not in html


async def test_trace_json_ends_in_flight_ops_at_the_cycle_time(aiohttp_client: Any,
                                                               dump_dir: Path) -> None:
    client = await _client(aiohttp_client, dump_dir)
    resp = await client.get("/fr_trace/trace.json")
    trace = json.loads(await resp.text())
    assert resp.headers["Content-Disposition"].startswith("attachment; ")
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    seq4 = [e for e in events if e.get("args", {}).get("collective_seq_id") == 4]
    assert seq4, events[:3]
    # The newest file is ~100 s old: an in-flight op ends then, not at "now".
    end_s = max((e["ts"] + e["dur"]) / 1e6 for e in seq4)
    assert end_s < time.time() - 50


async def test_per_rank_dumps_are_a_cycle_of_their_own(aiohttp_client: Any, dump_dir: Path) -> None:
    (dump_dir / "per_rank").mkdir()
    dumps = S.missing_rank()
    write_dump_atomic(str(dump_dir / "per_rank" / "rank_0"), dumps[0])
    (dump_dir / "per_rank" / "rank_1.json").write_text(json.dumps(dumps[1]))
    client = await _client(aiohttp_client, dump_dir)
    body = await (await client.get("/", params={"format": "json", "cycle": "per_rank"})).json()
    pm = body["postmortem"]
    assert pm["cycle"] == "per_rank" and [c["cycle"] for c in pm["cycles"]] == [OLD, NEW, "per_rank"]
    assert pm["sources"] == {"fr": "per-rank dumps", "stacks": f"stacks_{NEW}.txt"}
    assert body["findings"][0]["ranks"] == [1]


async def test_plain_dir_of_pytorch_json_dumps_is_viewable(aiohttp_client: Any, tmp_path: Path) -> None:
    d = tmp_path / "torch"
    d.mkdir()
    for r, dump in S.load_fixture("c10d_gloo_hang.json").items():
        (d / f"nccl_trace_rank_{r}.json").write_text(json.dumps(dump))
    client = await _client(aiohttp_client, d)
    body = await (await client.get("/fr_trace", params={"format": "json"})).json()
    f = body["findings"][0]
    assert (f["kind"], f["seq"], f["op"], f["ranks"]) == ("missing_ranks", 5, "all_reduce", [1])
    assert "cycle per_rank has no stacks file" in body["postmortem"]["problems"]


async def test_hang_report_is_listed_and_served_as_a_file(aiohttp_client: Any, dump_dir: Path) -> None:
    client = await _client(aiohttp_client, dump_dir)
    html = await (await client.get("/", headers={"Accept": BROWSER})).text()
    assert (f'Hang reports: <a href="/postmortem/files/hang_report_{NEW}.txt">{NEW}</a>: '
            "Rank 1 never joined") in html
    resp = await client.get(f"/postmortem/files/hang_report_{NEW}.txt")
    assert resp.content_type == "text/plain" and "rank 1 <module>" in await resp.text()


@pytest.mark.parametrize("name", ["..%2Fetc%2Fpasswd", "rank_0", "stacks_x.txt", ".hidden"])
async def test_files_route_serves_only_cycle_files(aiohttp_client: Any, dump_dir: Path, name: str) -> None:
    client = await _client(aiohttp_client, dump_dir)
    resp = await client.get(f"/postmortem/files/{name}")
    assert resp.status == 404 and "not a dump cycle file" in await resp.text()


async def test_unknown_cycle_is_404_with_one_line(aiohttp_client: Any, dump_dir: Path) -> None:
    client = await _client(aiohttp_client, dump_dir)
    resp = await client.get("/fr_trace", params={"cycle": "20990101_000000"})
    text = await resp.text()
    assert resp.status == 404 and text.count("\n") == 1
    assert text.startswith("no dump cycle '20990101_000000' in ") and NEW in text


async def test_other_bad_parameters_still_get_the_frontends_400(aiohttp_client: Any,
                                                                dump_dir: Path) -> None:
    client = await _client(aiohttp_client, dump_dir)
    resp = await client.get("/fr_trace", params={"cycle": NEW, "page": "0", "full": "1"})
    assert resp.status == 400 and (await resp.text()).startswith("bad parameter page='0'")


async def test_empty_dir_says_why_on_the_page(aiohttp_client: Any, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    client = await _client(aiohttp_client, tmp_path / "empty")
    resp = await client.get("/", headers={"Accept": BROWSER})
    html = await resp.text()
    assert resp.status == 200
    assert f"{tmp_path / 'empty'}: no dump cycles (no fr_snapshot_&lt;ts&gt;.json" in html


async def test_truncated_snapshot_is_one_line_and_stacks_still_show(aiohttp_client: Any,
                                                                    dump_dir: Path, caplog: Any) -> None:
    snap = dump_dir / f"fr_snapshot_{NEW}.json"
    snap.write_text(snap.read_text()[:300])
    client = await _client(aiohttp_client, dump_dir)
    body = await (await client.get("/fr_trace", params={"format": "json"})).json()
    problems = body["postmortem"]["problems"]
    assert len(problems) == 1 and problems[0].startswith(f"fr_snapshot_{NEW}.json: unusable (")
    assert body["ranks_without_data"] == [0, 1]
    assert any(problems[0] in r.getMessage() for r in caplog.records)
    stacks = await (await client.get("/stacks", params={"format": "json"})).json()
    assert "hang_phase" in stacks["ranks"][1]["stacks"]


async def test_rank_error_recorded_in_a_snapshot_is_that_ranks_line(aiohttp_client: Any,
                                                                   tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir()
    dumps = S.missing_rank()
    fr = FrData([RankResult(0, "u0", OK, json.dumps(dumps[0])),
                 RankResult(1, "u1", UNREACHABLE, error="unreachable after 2.0 s")], {0: dumps[0]})
    (d / f"fr_snapshot_{NEW}.json").write_text(snapshot_json(fr))
    client = await _client(aiohttp_client, d)
    body = await (await client.get("/fr_trace", params={"format": "json"})).json()
    assert {r["rank"]: r["error"] for r in body["ranks"]}[1] == "rank 1: unreachable after 2.0 s"


async def test_hostile_pickle_in_per_rank_is_refused_and_never_runs(aiohttp_client: Any,
                                                                   tmp_path: Path) -> None:
    target = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> Any:
            return (os.system, (f"touch {target}",))

    d = tmp_path / "d"
    d.mkdir()
    write_dump_atomic(str(d / "rank_0"), S.missing_rank()[0])
    (d / "rank_1").write_bytes(pickle.dumps({"version": "2.10", "entries": [Evil()]}))
    client = await _client(aiohttp_client, d)
    html = await (await client.get("/fr_trace", headers={"Accept": BROWSER})).text()
    assert "rank 1: rank_1: refused global posix.system (not a plain FR dump)" in html
    assert not target.exists()


async def test_hostile_ranks_string_in_a_snapshot_is_refused(aiohttp_client: Any, tmp_path: Path) -> None:
    target = tmp_path / "X"
    d = tmp_path / "d"
    d.mkdir()
    dumps = S.missing_rank()
    dumps[1]["pg_config"]["main_comm"]["ranks"] = f"__import__('os').system('touch {target}')"
    write_cycle(d, NEW, dumps, {0: RANK0_STACK, 1: RANK1_STACK})
    client = await _client(aiohttp_client, d)
    body = await (await client.get("/fr_trace", params={"format": "json"})).json()
    err = {r["rank"]: r["error"] for r in body["ranks"]}[1]
    assert err.startswith(f"rank 1: fr_snapshot_{NEW}.json rank 1: pg_config['main_comm']: refused")
    assert not target.exists()


async def test_disk_collector_ignores_extra_fetch_options(dump_dir: Path) -> None:
    """The live Collector may grow options (a seq frontier, native stacks); the twin takes them."""
    scan = scan_dir(str(dump_dir))
    token = CURRENT.set(load_cycle(scan, scan.cycles[-1]))
    try:
        c = DiskCollector()
        fr = await c.fr(only_active=True, frontier={"main_comm": 3})
        stacks = await c.stacks(None, native=True)
    finally:
        CURRENT.reset(token)
    assert [e["collective_seq_id"] for e in fr.dumps[0]["entries"]] == [4]
    assert [r.rank for r in stacks if r.ok] == [0, 1]


async def test_token_is_required_when_given(aiohttp_client: Any, dump_dir: Path) -> None:
    token = "t" * 32
    client = await _client(aiohttp_client, dump_dir, auth_token=token)
    assert (await client.get("/")).status == 401
    resp = await client.get("/", headers={TOKEN_HEADER: token, "Accept": "*/*"})
    assert resp.status == 200 and (await resp.text()).startswith("POST-MORTEM: ")


def test_scan_orders_cycles_by_stamp_with_same_second_suffixes(tmp_path: Path) -> None:
    for stamp in ("20240101_100000_10", "20240101_100000_2", "20240101_100000"):
        (tmp_path / f"stacks_{stamp}.txt").write_text("=== Rank 0 ===\nx\n")
    assert [c.stamp for c in scan_dir(str(tmp_path)).cycles] == [
        "20240101_100000", "20240101_100000_2", "20240101_100000_10"]


def _start_cli(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    full = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    # The log goes to stderr, unread while the server runs: DEVNULL so it never fills a pipe.
    return subprocess.Popen([sys.executable, "-m", "debug_server.tools.view", *args], env=full,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def _end(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.communicate(timeout=10)  # also closes the stdout pipe


@pytest.mark.job
def test_cli_serves_loopback_and_stops_on_sigterm(dump_dir: Path) -> None:
    port = free_port()
    proc = _start_cli([str(dump_dir), "--port", str(port)])
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == f"ready {port}"
        body = get_json(f"http://127.0.0.1:{port}/fr_trace?format=json", timeout=10)
        assert body["findings"][0]["ranks"] == [1]
        proc.terminate()
        assert proc.wait(timeout=10) == 0
    finally:
        _end(proc)


@pytest.mark.job
def test_cli_beyond_loopback_requires_the_token(dump_dir: Path) -> None:
    port = free_port()
    token = "s" * 32
    proc = _start_cli([str(dump_dir), "--port", str(port), "--host", "0.0.0.0"], {TOKEN_ENV: token})
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == f"ready {port}"
        assert request(f"http://127.0.0.1:{port}/", timeout=10)[0] == 401
        status, body = request(f"http://127.0.0.1:{port}/", headers={TOKEN_HEADER: token},
                               timeout=10)
        assert status == 200 and body.startswith("POST-MORTEM: "), body
    finally:
        _end(proc)


@pytest.mark.job
def test_cli_missing_dir_exits_1_with_one_line(tmp_path: Path) -> None:
    full = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "debug_server.tools.view", str(tmp_path / "nope")],
                          env=full, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stderr == f"error: no such directory: {tmp_path / 'nope'}\n"



async def test_metrics_of_the_viewer_are_the_chosen_cycle_read_from_its_files(
        aiohttp_client: Any, dump_dir: Path) -> None:
    # The viewer has no background cycles (frontend/lastcycle.py): its /metrics reads the
    # cycle's files on request, as its pages do.
    client = await _client(aiohttp_client, dump_dir)
    text = await (await client.get("/metrics")).text()
    assert 'debug_server_stuck_seq{group="main_comm",op="all_reduce"} 4.0' in text
    assert "debug_server_cycle_ready 1.0" in text
