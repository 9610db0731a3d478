"""The reference scenario through plain torch.distributed (``DEMO_API=c10d``), end to end.

No communicator and no hook: the record is c10d's own Flight Recorder, merged by the workers.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from mpjob import DEMO, demo_hang_line, run_demo

pytestmark = [pytest.mark.job, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    dump_dir = tmp_path_factory.mktemp("demo_c10d") / "dumps"
    # The stall (3 s) must show well before gloo's timeout ends the hang on rank 0: 15 s leaves
    # the health poll room on a loaded box (with 8 s a loaded run once wrote no report).
    out = run_demo(dump_dir, DEMO_API="c10d", FR_DUMP_INTERVAL="1", COMM_TIMEOUT="15",
                   HANG_SECONDS="19", FR_STALL_TIMEOUT="3")
    return dump_dir, out


def test_c10d_demo_verdict_names_rank_1_the_all_reduce_its_seq_on_default_pg_and_the_sleep(demo):
    _, out = demo
    verdict = out.split("Verdict:")[1].splitlines()[0]
    assert verdict.startswith(" Rank 1 never joined all_reduce #5 on pg 0 (default_pg)")
    assert f"{DEMO.name}:{demo_hang_line()} in hang_phase (time.sleep)" in verdict


def test_c10d_demo_rank_0_times_out_in_the_default_groups_all_reduce(demo):
    _, out = demo
    assert "[rank 0] phase 2: all_reduce #5 on default_pg, waiting for rank 1" in out
    assert "[rank 0] Caught timeout: RuntimeError:" in out


def test_c10d_demo_hang_report_comes_from_c10d_health(demo):
    dump_dir, _ = demo
    [report] = sorted(dump_dir.glob("hang_report_*.txt"))
    text = report.read_text()
    assert "rank 0: UNHEALTHY: 0 seq 5 all_reduce" in text
    assert "Rank 1 never joined all_reduce #5 on pg 0 (default_pg)" in text


def test_pytorch_fr_trace_agrees_on_the_c10d_demo_pickles(demo):
    dump_dir, _ = demo
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
         str(dump_dir / "per_rank"), "-p", "rank_"],
        capture_output=True, text=True, timeout=120)
    text = proc.stdout + proc.stderr
    assert "Not all ranks joining collective, sequence number: 5" in text
    assert "group info: 0:default_pg" in text and "missing ranks: {1}" in text
