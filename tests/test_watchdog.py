"""The hang watchdog: a verdict on disk before the communicator times out, and no false alarm.

Real jobs: the reference demo (the session's one run, conftest's ``demo_done``: the report
lands before rank 0's timeout fires), a 2-rank gloo
job whose ranks run at different speeds (no report) and then stalls (a report, with the hook's
stall timeout coming from ``start_debug_server`` alone), and a job that aborts on timeout (the
pickle is on disk first). In-process: the health poll's transition logic over fake ranks.
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path
from typing import Any

import pytest
from fakes import MAIN_STACK
from jobscripts import ABORT_JOB
from mpjob import DEMO, REFERENCE_ENV, assert_ok, demo_hang_line, free_port, run_job

from debug_server.config import ServerConfig
from debug_server.dumpio import load_dump
from debug_server.fanout.reply import FrData
from debug_server.fanout.transport import OK, TIMED_OUT, RankResult
from debug_server.frontend.app import HANG_WATCH, make_frontend_app
from debug_server.frontend.hangreport import MAX_POLL_INTERVAL, HangWatch
from debug_server.rank.worker import StaticProvider
from debug_server.readers.storeview import StaticRegistry
from debug_server.tools import synthetic

WALL = re.compile(r"\[wall (\d+\.\d+)\]")


# ---------------------------------------------------------------------------------------------
# The reference demo


COMM_TIMEOUT = float(REFERENCE_ENV["COMM_TIMEOUT"])
STALL_TIMEOUT = float(REFERENCE_ENV["FR_STALL_TIMEOUT"])
DUMP_INTERVAL = float(REFERENCE_ENV["FR_DUMP_INTERVAL"])
Demo = tuple[Path, str]


def _wall_after(out: str, marker: str) -> float:
    line = next(ln for ln in out.splitlines() if marker in ln and WALL.search(ln))
    return float(WALL.search(line).group(1))  # type: ignore[union-attr]


@pytest.mark.job
@pytest.mark.timeout(200)
def test_demo_hang_report_is_written_before_the_communicator_times_out(demo_done: Demo) -> None:
    dump_dir, out = demo_done
    reports = sorted(dump_dir.glob("hang_report_*.txt"))
    assert len(reports) == 1, f"expected one hang report, got {reports}\n{out[-3000:]}"
    meta = json.loads(reports[0].with_suffix(".json").read_text())
    hang_start = _wall_after(out, "[rank 0] phase 2: all_reduce #4")
    caught = _wall_after(out, "[rank 0] (after ")
    assert "[rank 0] Caught timeout: RuntimeError: all_reduce #4" in out
    written = max(meta["time_unix"], reports[0].stat().st_mtime)
    took = written - hang_start
    print(f"\nhang start -> hang report: {took:.2f} s (stall_timeout {STALL_TIMEOUT:g} s, comm "
          f"timeout {COMM_TIMEOUT:g} s, caught at +{caught - hang_start:.2f} s)")
    assert written < caught and took < COMM_TIMEOUT, (took, caught - hang_start)
    # The stall timeout, then a health poll (<= the dump interval) and the report; the 10 s
    # slack is for a loaded machine, and COMM_TIMEOUT above is the bound that matters.
    assert STALL_TIMEOUT <= took < STALL_TIMEOUT + DUMP_INTERVAL + 10.0


@pytest.mark.job
def test_demo_hang_report_names_rank_1_seq_4_all_reduce_and_the_sleep_line(demo_done: Demo) -> None:
    dump_dir, _ = demo_done
    (report,) = sorted(dump_dir.glob("hang_report_*.txt"))
    text = report.read_text()
    assert "Trigger: rank 0: UNHEALTHY: main_comm seq 4 all_reduce in flight for" in text
    assert "Rank 1 never joined all_reduce #4 on main_comm" in text
    line = demo_hang_line()
    culprit = next(ln for ln in text.splitlines() if ln.startswith("rank 1: missing_ranks"))
    assert "main_comm seq 4 all_reduce" in culprit
    assert f"{DEMO.name}:{line} in hang_phase" in culprit
    assert f'{DEMO.name}", line {line} in hang_phase' in text  # rank 1's stacks


@pytest.mark.job
def test_demo_hang_report_json_has_culprit_and_finding(demo_done: Demo) -> None:
    dump_dir, _ = demo_done
    (path,) = sorted(dump_dir.glob("hang_report_*.json"))
    meta = json.loads(path.read_text())
    assert [(t["rank"], t["stalled_op"]["seq"], t["stalled_op"]["op"]) for t in meta["trigger"]] \
        == [(0, 4, "all_reduce")]
    (c,) = meta["culprits"]
    assert (c["rank"], c["kind"], c["group"], c["seq"], c["op"]) == \
        (1, "missing_ranks", "main_comm", 4, "all_reduce")
    assert c["where"]["file"].endswith(DEMO.name)
    assert (c["where"]["line"], c["where"]["function"]) == (demo_hang_line(), "hang_phase")
    assert any(line.startswith("Rank 1: OK") for line in meta["dump_files"])


@pytest.mark.job
def test_demo_stall_watchdog_wrote_rank_0_stacks_at_once(demo_done: Demo) -> None:
    dump_dir, _ = demo_done
    stacks = (dump_dir / "per_rank" / "stalled_stacks_r0.txt").read_text()
    assert "in all_reduce" in stacks


# ---------------------------------------------------------------------------------------------
# A real job: uneven but progressing ranks raise no alarm; a real stall does.

UNEVEN_JOB = r'''
import datetime, os, time, urllib.request
from pathlib import Path
import torch
import torch.distributed as dist
from debug_server import start_debug_server, stop_debug_server
from debug_server.rank import worker
from debug_server.recording.comms import new_comm
from debug_server.recording.hooks import FlightRecorderHook, health

rank = int(os.environ["RANK"])
port = int(os.environ["FE_PORT"])
dump_dir = Path(os.environ["DUMP_DIR"])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
# No stall_timeout on the hook: start_debug_server's value reaches it.
start_debug_server(port=port, dump_dir=str(dump_dir), dump_interval=0.5, fetch_timeout=3,
                   stall_timeout=1.5)
comm = new_comm("gloo", torch.device("cpu"), "main_comm", timeout=datetime.timedelta(seconds=30))
hook = FlightRecorderHook(max_entries=100).register_with_comm(comm)
store = dist.distributed_c10d._get_default_store()
t = torch.ones(1024)

def metrics():
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()

def until(what, probe, limit_s=60):
    deadline = time.monotonic() + limit_s
    while not (got := probe()):
        if time.monotonic() > deadline:
            raise SystemExit(f"rank {rank}: {what}: not within {limit_s} s")
        time.sleep(0.05)
    return got

# The frontend's hang watch asks every rank's worker for its health: count the asks, so a
# check that no alarm came waits until the watch has looked.
health_asks = [0]
_health = worker.HooksProvider.health
def _counted_health(self):
    health_asks[0] += 1
    return _health(self)
worker.HooksProvider.health = _counted_health

# Phase A: rank 1 computes twice as long as rank 0; rank 0 waits ~0.2 s in every all_reduce.
compute = 0.2 if rank == 0 else 0.4
for _ in range(12):
    time.sleep(compute)
    comm.all_reduce(t)
asked = health_asks[0]
until("two more health polls", lambda: health_asks[0] >= asked + 2)
print("A_HEALTH", health()["healthy"], health()["stalled_op"], flush=True)
store.add("a_done", 1)
while int(store.add("a_done", 0)) < 2:
    time.sleep(0.05)
if rank == 0:
    print("A_METRICS", [ln for ln in metrics().splitlines() if ln.startswith("debug_server_healthy")], flush=True)
    print("A_FILES", sorted(p.name for p in dump_dir.glob("hang_report_*")),
          sorted(p.name for p in (dump_dir / "per_rank").glob("stalled_*")), flush=True)
store.add("a_checked", 1)
while int(store.add("a_checked", 0)) < 2:
    time.sleep(0.05)

# Phase B: rank 1 stalls until rank 0, in all_reduce #12 past the stall timeout, is reported.
if rank == 1:
    wanted = ('debug_server_healthy{rank="0"} 0.0', 'debug_server_stuck_seq{group="main_comm"',
              'debug_server_missing_ranks{group="main_comm",rank="1"')
    def stalled():
        text = metrics()
        return text if all(w in text for w in wanted) else None
    text = until("rank 0 stalled on /metrics", stalled)
    print("B_METRICS", [ln for ln in text.splitlines() if ln.startswith(("debug_server_healthy", "debug_server_stuck_seq", "debug_server_missing_ranks{"))], flush=True)
    until("the hang report and rank 0's stall dump", lambda: len(list(dump_dir.glob("hang_report_*"))) >= 2
          and (dump_dir / "per_rank" / "stalled_stacks_r0.txt").exists())
comm.all_reduce(t)
store.add("b_done", 1)
while int(store.add("b_done", 0)) < 2:
    time.sleep(0.05)
if rank == 0:
    print("B_FILES", sorted(p.name for p in dump_dir.glob("hang_report_*")),
          sorted(p.name for p in (dump_dir / "per_rank").glob("stalled_*")), flush=True)
store.add("exit", 1)
while int(store.add("exit", 0)) < 2:
    time.sleep(0.05)
stop_debug_server()
hook.unregister()
comm.finalize()
dist.destroy_process_group()
'''


@pytest.mark.job
@pytest.mark.timeout(120)
def test_uneven_progress_raises_no_alarm_and_a_real_stall_does(tmp_path: Path) -> None:
    dump_dir = tmp_path / "dumps"
    # The pickle prefix is set explicitly: an in-process start_debug_server elsewhere in the
    # session may have left its own in os.environ, which the ranks would inherit.
    results = run_job(UNEVEN_JOB, 2, tmp_path, timeout=100,
                      extra_env={"FE_PORT": str(free_port()), "DUMP_DIR": str(dump_dir),
                                 "TORCHCOMM_FR_DUMP_TEMP_FILE": str(dump_dir / "per_rank" / "rank_")})
    assert_ok(results)
    out0, out1 = results[0].stdout, results[1].stdout
    # Phase A: both ranks healthy, no report, no stall dump, /metrics says healthy.
    assert "A_HEALTH True None" in out0 and "A_HEALTH True None" in out1
    assert "A_FILES [] []" in out0
    assert ("A_METRICS ['debug_server_healthy{rank=\"0\"} 1.0', "
            "'debug_server_healthy{rank=\"1\"} 1.0']") in out0
    # Phase B: rank 0 unhealthy on /metrics, stuck at seq 12 with rank 1 missing; one report.
    b_metrics = next(ln for ln in out1.splitlines() if ln.startswith("B_METRICS"))
    assert 'debug_server_healthy{rank="0"} 0.0' in b_metrics
    assert 'debug_server_stuck_seq{group="main_comm",op="all_reduce"} 12.0' in b_metrics
    assert 'debug_server_missing_ranks{group="main_comm",rank="1",seq="12"} 1.0' in b_metrics
    b_files = next(ln for ln in out0.splitlines() if ln.startswith("B_FILES"))
    assert re.fullmatch(r"B_FILES \['hang_report_\d{8}_\d{6}(_\d+)?\.json', "
                        r"'hang_report_\d{8}_\d{6}(_\d+)?\.txt'\] \['stalled_stacks_r0\.txt'\]",
                        b_files), (b_files, results[0].stderr[-3000:])
    (report,) = dump_dir.glob("hang_report_*.txt")
    assert "Rank 1 never joined all_reduce #12 on main_comm" in report.read_text()


# ---------------------------------------------------------------------------------------------
# abort_process_on_timeout_or_error=True: the pickle is on disk, then the process aborts.



@pytest.mark.job
@pytest.mark.timeout(90)
def test_abort_on_timeout_writes_the_pickle_before_the_process_aborts(tmp_path: Path) -> None:
    prefix = tmp_path / "per_rank" / "rank_"
    results = run_job(ABORT_JOB, 2, tmp_path, timeout=60,
                      extra_env={"TORCHCOMM_FR_DUMP_TEMP_FILE": str(prefix)})
    r0 = results[0]
    assert r0.returncode == -signal.SIGABRT, (r0.returncode, r0.stderr[-3000:])
    assert "NOT_REACHED" not in r0.stdout
    assert "aborting the process" in r0.stderr
    dump = load_dump(f"{prefix}0")
    last = dump["entries"][-1]
    assert (last["collective_seq_id"], last["profiling_name"], last["state"]) == \
        (1, "nccl:all_reduce", "started")


# ---------------------------------------------------------------------------------------------
# The health poll over fake ranks


class _Flip(StaticProvider):
    """A fake rank whose health the test flips."""

    healthy = True

    def health(self) -> dict[str, Any]:
        if self.healthy:
            return {"healthy": True, "stalled_op": None, "in_flight": 0, "oldest_in_flight_s": None}
        return {"healthy": False, "in_flight": 1, "oldest_in_flight_s": 9.0,
                "stalled_op": {"group": "main_comm", "seq": 4, "op": "all_reduce", "age_s": 9.0}}


async def _watch_app(aiohttp_client: Any, fake_rank: Any, tmp_path: Path, **config: Any) -> Any:
    dumps = synthetic.hang_job(2, n_entries=5, missing_rank=1)
    providers = [_Flip(dumps[r], stacks=MAIN_STACK, dump_path=str(tmp_path / f"rank_{r}"))
                 for r in (0, 1)]
    urls = [await fake_rank(dumps[r], provider=providers[r]) for r in (0, 1)]
    cfg = ServerConfig(port=0, fetch_timeout=2.0, dump_dir=str(tmp_path / "dumps"),
                       **{"dump_interval": 3600.0, **config})
    client = await aiohttp_client(make_frontend_app(cfg, StaticRegistry(urls)))
    return client.app[HANG_WATCH], providers


async def test_health_is_polled_every_2_s_even_with_a_long_dump_interval(
        aiohttp_client: Any, fake_rank: Any, tmp_path: Path) -> None:
    watch, _ = await _watch_app(aiohttp_client, fake_rank, tmp_path)
    assert watch.interval == MAX_POLL_INTERVAL == 2.0
    watch2, _ = await _watch_app(aiohttp_client, fake_rank, tmp_path, dump_interval=0.5)
    assert watch2.interval == 0.5


async def test_report_only_on_the_transition_to_unhealthy_then_rearmed(
        aiohttp_client: Any, fake_rank: Any, tmp_path: Path) -> None:
    watch, providers = await _watch_app(aiohttp_client, fake_rank, tmp_path)
    assert await watch.poll() is None
    providers[0].healthy = False
    rep = await watch.poll()
    assert rep is not None and [h.rank for h in rep.trigger] == [0]
    assert await watch.poll() is None  # still unhealthy: no second report
    assert len(list((tmp_path / "dumps").glob("hang_report_*.txt"))) == 1
    assert [p.dump_calls for p in providers] == [1, 1]  # every rank wrote its pickle once
    providers[0].healthy = True
    assert await watch.poll() is None
    providers[0].healthy = False
    assert await watch.poll() is not None  # a new stall, a new report
    names = sorted(p.name for p in (tmp_path / "dumps").glob("hang_report_*"))
    assert len(names) == 4 and len({n.rsplit(".", 1)[0] for n in names}) == 2  # unique stamps


async def test_report_text_has_verdict_culprit_line_and_tables(
        aiohttp_client: Any, fake_rank: Any, tmp_path: Path) -> None:
    watch, providers = await _watch_app(aiohttp_client, fake_rank, tmp_path)
    providers[0].healthy = False
    await watch.poll()
    (path,) = (tmp_path / "dumps").glob("hang_report_*.txt")
    text = path.read_text()
    assert "Trigger: rank 0: UNHEALTHY: main_comm seq 4 all_reduce in flight for 9.0 s" in text
    assert "Rank 1 never joined all_reduce #4 on main_comm" in text
    assert "rank 1: missing_ranks main_comm seq 4 all_reduce; now at /job/train.py:88 in hang_phase" in text
    assert "=== Rank 1 stacks ===" in text and "--- Dump File ---" in text


class _StubCollector:
    """Health answers scripted per poll; FR and stacks empty (no HTTP at all)."""

    world_size = 2
    digest_memo = None

    def __init__(self, statuses: list[list[str]]) -> None:
        self.statuses = statuses
        self.registry = self

    async def lookup(self) -> list[Any]:
        return []

    async def fetch(self, handler: str, params: Any = None, addrs: Any = None) -> list[RankResult]:
        if handler != "torchcomms_health_check":
            return []
        body = json.dumps({"healthy": True, "stalled_op": None})
        return [RankResult(r, "http://x", st, body=body if st == OK else None,
                           error=None if st == OK else "timed out after 2.0 s")
                for r, st in enumerate(self.statuses.pop(0))]

    async def fr(self, *, only_active: bool = False, whole: bool = False,
                 addrs: Any = None) -> FrData:
        return FrData([], {})

    async def stacks(self, addrs: Any = None) -> list[RankResult]:
        return []

    async def fr_stacks(self, addrs: Any = None) -> tuple[FrData, list[RankResult]]:
        return FrData([], {}), []


async def test_rank_whose_health_check_keeps_timing_out_counts_as_unhealthy() -> None:
    polls = [[OK, TIMED_OUT], [OK, TIMED_OUT], [OK, OK], [OK, TIMED_OUT], [OK, TIMED_OUT],
             [OK, TIMED_OUT]]
    watch = HangWatch(_StubCollector(polls), None, interval=1.0)  # type: ignore[arg-type]
    got = [await watch.poll() for _ in list(polls)]
    assert [rep is not None for rep in got] == [False, False, False, False, False, True]
    (trigger,) = got[-1].trigger  # type: ignore[union-attr]
    assert trigger.line() == "rank 1: UNHEALTHY: health check timed out 3 times in a row"
