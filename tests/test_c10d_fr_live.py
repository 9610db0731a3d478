"""Jobs that call torch.distributed directly: real gloo ranks, c10d's Flight Recorder, live pages.

The module's job: 2 ranks, a communicator ``main_comm`` with a hook (3 all_reduce), then a tiny
DDP model; in step 1 rank 1 skips ``backward()`` (it sleeps instead), so rank 0 waits alone in
DDP's gradient all_reduce on ``default_pg``. Nothing but ``start_debug_server`` is added for the
DDP part: what the pages say about it comes from c10d's own recorder, merged by the workers.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from httpget import get_json
from mpjob import finish, start_ranks

pytestmark = [pytest.mark.job, pytest.mark.timeout(240)]

DDP_JOB = """
import datetime, os, sys, time
from pathlib import Path
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from debug_server import start_debug_server
from debug_server.recording.comms import new_comm
from debug_server.recording.hooks import FlightRecorderHook

rank = int(os.environ["RANK"])
out = Path(os.environ["JOB_OUT"])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
server = start_debug_server(port=0, dump_dir=str(out / "dumps"), dump_interval=2, stall_timeout=3)
server.wait_registered(30)
(out / f"worker{rank}.part").write_text(server.worker_url)
(out / f"worker{rank}.part").rename(out / f"worker{rank}")
if rank == 0:
    (out / "frontend.part").write_text(server.frontend_url)
    (out / "frontend.part").rename(out / "frontend")
comm = new_comm("gloo", "cpu", "main_comm", timeout=120)
hook = FlightRecorderHook(max_entries=100).register_with_comm(comm)
for _ in range(3):
    comm.all_reduce(torch.ones(16))
torch.manual_seed(0)
model = DDP(torch.nn.Linear(8, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)


def skip_backward(seconds):
    time.sleep(seconds)  # SKIP LINE


for step in range(3):
    loss = model(torch.randn(4, 8)).sum()
    if rank == 1 and step == 1:
        from torch._C import _distributed_c10d as c10d
        import json
        st = json.loads(c10d._dump_fr_trace_json(False, False))["pg_status"]["0"]
        (out / "rank1_last_enqueued").write_text(str(st["last_enqueued_collective"]))
        skip_backward(float(os.environ["HANG_SECONDS"]))
        break
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


def _wait_file(path: Path, limit_s: float, procs: list[subprocess.Popen[str]]) -> str:
    """The file's text once a rank wrote it; a rank that exits first or the bound ends the wait
    with every rank's output (the ranks are killed by pid to read it)."""
    deadline = time.monotonic() + limit_s
    while not path.exists():
        died = [p.returncode for p in procs if p.poll() is not None]
        if died or time.monotonic() >= deadline:
            results = finish(procs, 1)
            pytest.fail(f"{path.name} not written within {limit_s} s (exit codes {died}):\n"
                        + "\n".join(f"rank {r.rank} exited {r.returncode}\nstdout: "
                                    f"{r.stdout[-2000:]}\nstderr: {r.stderr[-4000:]}"
                                    for r in results))
        time.sleep(0.2)
    return path.read_text()


@pytest.fixture(scope="module")
def ddp_job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    work = tmp_path_factory.mktemp("ddp")
    procs = start_ranks(DDP_JOB, 2, work, {"JOB_OUT": str(work), "HANG_SECONDS": "100"})
    try:
        job = {
            "dir": work,
            "frontend": _wait_file(work / "frontend", 90, procs),
            "workers": [_wait_file(work / f"worker{r}", 60, procs) for r in range(2)],
            "stuck_seq": int(_wait_file(work / "rank1_last_enqueued", 60, procs)) + 1,
            "skip_line": next(i for i, ln in enumerate(
                (work / "rank_script.py").read_text().splitlines(), 1) if "SKIP LINE" in ln),
        }
        yield job
    finally:
        finish(procs, 1)  # the hang never ends by itself: kill by pid, close the pipes


def _live_verdict(job: dict[str, Any], limit_s: float = 60) -> dict[str, Any]:
    """The frontend's JSON once it names a missing rank (the hang takes a moment to show)."""
    deadline = time.monotonic() + limit_s
    while True:
        result = get_json(f"{job['frontend']}/fr_trace?format=json")
        if any(f["kind"] == "missing_ranks" for f in result["findings"]):
            return result
        assert time.monotonic() < deadline, f"no missing rank within {limit_s} s: {result['verdict']}"
        time.sleep(1)


def test_live_verdict_names_the_rank_that_skipped_backward_and_the_stuck_all_reduce(ddp_job):
    r = _live_verdict(ddp_job)
    seq = ddp_job["stuck_seq"]
    missing = [(f["group"], f["seq"], f["op"], f["ranks"]) for f in r["findings"]
               if f["kind"] == "missing_ranks"]
    assert missing == [("0", seq, "all_reduce", [1])]
    assert f"Rank 1 never joined all_reduce #{seq} on pg 0 (default_pg)" in r["verdict"]
    assert f"rank_script.py:{ddp_job['skip_line']} in skip_backward" in r["verdict"]


def test_op_through_new_comm_appears_once_though_c10d_recorded_it_too(ddp_job):
    url = ddp_job["workers"][0]
    merged = get_json(f"{url}/handler/torchcomms_fr_trace_json", "POST")
    raw = get_json(f"{url}/handler/fr_trace_json", "POST")
    # c10d did record the communicator's ops, on the communicator's own c10d group...
    c10d_copies = [e for e in raw["entries"] if e["process_group"][1] == "main_comm"]
    assert [e["collective_seq_id"] for e in c10d_copies] == [1, 2, 3]
    # ...and the merged record has each of them once, under the communicator's name.
    comm_entries = [e for e in merged["entries"] if "main_comm" in e["process_group"]]
    assert [(e["process_group"], e["collective_seq_id"]) for e in comm_entries] == [
        (["main_comm", "gloo"], s) for s in (0, 1, 2)]
    assert [k for k, c in merged["pg_config"].items() if c["desc"] == "main_comm"] == []


def test_hang_report_names_rank_1_for_a_stall_seen_only_by_c10d(ddp_job):
    # On a loaded box an op of DDP's start can be in flight past stall_timeout (3 s) too and get
    # a report of its own (true when written): the one to check is the report of the real hang.
    dumps = Path(ddp_job["dir"]) / "dumps"
    seq = ddp_job["stuck_seq"]
    deadline = time.monotonic() + 90
    while True:
        reports = [json.loads(p.read_text()) for p in sorted(dumps.glob("hang_report_*.json"))]
        stalls = [{h["rank"]: (h["stalled_op"]["group"], h["stalled_op"]["seq"],
                               h["stalled_op"]["op"])
                   for h in r["health"] if h["stalled_op"]} for r in reports]  # written whole
        hang = [r for r, s in zip(reports, stalls, strict=True) if s.get(0, (None, -1))[1] == seq]
        if hang:
            break
        assert time.monotonic() < deadline, f"no hang report of seq {seq} within 90 s: {stalls}"
        time.sleep(0.5)
    report = hang[0]
    stalled = {h["rank"]: h["stalled_op"] for h in report["health"] if h["stalled_op"]}
    assert {r: (op["group"], op["seq"], op["op"]) for r, op in stalled.items()} == {
        0: ("0", seq, "all_reduce")}
    assert f"Rank 1 never joined all_reduce #{seq} on pg 0 (default_pg)" in report["verdict"]


def test_pytorch_fr_trace_reads_the_dumpers_merged_pickles(ddp_job):
    _live_verdict(ddp_job)
    per_rank = Path(ddp_job["dir"]) / "dumps" / "per_rank"
    deadline = time.monotonic() + 30
    seq = ddp_job["stuck_seq"]
    while True:  # the next dump cycle after the hang began
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
                               str(per_rank), "-p", "rank_"], capture_output=True, text=True,
                              timeout=120)
        text = proc.stdout + proc.stderr
        if f"Not all ranks joining collective, sequence number: {seq}" in text:
            break
        assert time.monotonic() < deadline, text[-3000:]
        time.sleep(2)
    assert "group info: 0:default_pg" in text and "missing ranks: {1}" in text
    assert "collective: nccl:all_reduce" in text


# -- turning c10d's recorder on -----------------------------------------------------------------

ENV_JOB = """
import os, json
import torch, torch.distributed as dist
from torch._C import _distributed_c10d as c10d
from debug_server import start_debug_server, stop_debug_server

names = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
if os.environ["ORDER"] == "server_first":
    start_debug_server(port=0)
    print("during", [os.environ.get(k) for k in names], flush=True)
    dist.init_process_group("gloo")
else:
    dist.init_process_group("gloo")
    start_debug_server(port=0)
for _ in range(3):
    dist.all_reduce(torch.ones(4))
print("entries", len(json.loads(c10d._dump_fr_trace_json(True, False)).get("entries", [])),
      flush=True)
stop_debug_server()
print("after", [os.environ.get(k) for k in names], flush=True)
dist.destroy_process_group()
"""


@pytest.fixture
def no_buffer_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        monkeypatch.delenv(k, raising=False)


def _one_rank(tmp_path: Path, **env: str) -> tuple[str, str]:
    procs = start_ranks(ENV_JOB, 1, tmp_path, env)
    [res] = finish(procs, 90)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout, res.stderr


def test_server_started_before_the_group_turns_c10d_recorder_on_and_stop_takes_it_back(
        tmp_path: Path, no_buffer_env: None):
    out, err = _one_rank(tmp_path, ORDER="server_first")
    # Only the name this torch reads: torch >= 2.8 warns on every rank when the old one is set.
    major, minor = (int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    assert ("during ['2000', None]" if (major, minor) >= (2, 8) else "during [None, '2000']") in out
    assert "is deprecated" not in err, err[-2000:]
    assert "entries 3" in out
    assert "after [None, None]" in out


def test_server_started_before_the_group_keeps_the_users_buffer_size(
        tmp_path: Path, no_buffer_env: None):
    out, _ = _one_rank(tmp_path, ORDER="server_first", TORCH_FR_BUFFER_SIZE="2")
    assert "during ['2', None]" in out
    assert "entries 2" in out  # the user's ring of 2, not ours
    assert "after ['2', None]" in out


def test_server_started_after_the_group_with_recorder_off_says_how_to_turn_it_on(
        tmp_path: Path, no_buffer_env: None):
    _, err = _one_rank(tmp_path, ORDER="group_first", TORCH_FR_BUFFER_SIZE="0")
    lines = [ln for ln in err.splitlines() if "Flight Recorder is off" in ln]
    assert len(lines) == 1, err[-3000:]
    assert "(TORCH_FR_BUFFER_SIZE=0)" in lines[0]
    assert "set TORCH_FR_BUFFER_SIZE=2000 before init_process_group" in lines[0]

