"""A real 4-rank gloo job on a 2x2 mesh (issue 33): rank 2 skips one tensor-parallel all_reduce.

Plain ``torch.distributed`` with ``start_debug_server`` only: tp groups [0, 1], [2, 3] and dp
groups [0, 2], [1, 3] built by ``new_group(..., group_desc="mesh_tp" / "mesh_dp")``. After three
steps rank 2 skips tp all_reduce #13 (c10d counts from 1); rank 3 waits in it, rank 1 waits for rank 3 in its dp
all_reduce, ranks 0 and 2 reach the final barrier. The live page and the CLI on the ranks'
pickles must both lead with rank 2 / mesh_tp [2, 3] / #13, category cpu_divergence.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from httpget import get_json
from mpjob import REPO, free_port, rank_env
from rankprocs import RankProcs

pytestmark = [pytest.mark.job, pytest.mark.timeout(240)]

MESH_JOB = """
import datetime, os, time
import torch, torch.distributed as dist
from debug_server import start_debug_server

rank = int(os.environ["RANK"])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=180))
h = start_debug_server(port=0, fetch_timeout=3, dump_dir=os.environ["DUMP_DIR"], dump_interval=3600)
assert h.wait_registered(60)
tp = [dist.new_group([0, 1], group_desc="mesh_tp"), dist.new_group([2, 3], group_desc="mesh_tp")]
dp = [dist.new_group([0, 2], group_desc="mesh_dp"), dist.new_group([1, 3], group_desc="mesh_dp")]
my_tp, my_dp = tp[rank // 2], dp[rank % 2]
t = torch.ones(64)
for step in range(3):
    for _ in range(4):
        dist.all_reduce(t, group=my_tp)
    dist.all_reduce(t, group=my_dp)
print("READY", h.frontend_url, h.worker_url, flush=True)
if rank != 2:  # rank 2 skips tp all_reduce #13 (c10d counts from 1)
    print("TP", flush=True)
    dist.all_reduce(t, group=my_tp)  # TP_LINE
print("DP", flush=True)
dist.all_reduce(t, group=my_dp)
print("BARRIER", flush=True)
dist.barrier()  # BARRIER_LINE
time.sleep(300)
"""


class MeshJob(RankProcs):
    def __init__(self, tmp: Path) -> None:
        self.dump_dir = tmp / "dumps"
        port = free_port()

        def env(r: int) -> dict[str, str]:
            e = rank_env(r, 4, port, {"DUMP_DIR": str(self.dump_dir)})
            e.pop("TORCHCOMM_FR_DUMP_TEMP_FILE", None)
            return e

        super().__init__(tmp, MESH_JOB, 4, env)


def _settled(result: dict[str, Any]) -> bool:
    """Every rank is where the skip leaves it: the barrier finding is there."""
    return any(f["kind"] == "missing_ranks" and f["op"] == "barrier" and f["ranks"] == [1, 3]
               for f in result["findings"])


def _check(result: dict[str, Any]) -> None:
    f = result["findings"][result["finding_order"][0]]
    assert (f["kind"], f["ranks"], f["seq"]) == ("missing_ranks", [2], 13), result["verdict"]
    assert "mesh_tp [2, 3]" in f["group_label"], result["verdict"]
    assert result["category"] == "cpu_divergence", result["verdict"]
    assert result["verdict"].startswith(f"Rank 2 never joined all_reduce #13 on {f['group_label']}")


def test_mesh_tp_skip_live_page_and_cli_lead_with_rank_2_on_mesh_tp(tmp_path: Path) -> None:
    with MeshJob(tmp_path) as job:
        m = [job.wait_for(r, r"^READY (\S+) (\S+)", timeout=120) for r in range(4)]
        base = m[0].group(1)
        for r in (0, 2):
            job.wait_for(r, r"^BARRIER")
        job.wait_for(1, r"^DP")
        job.wait_for(3, r"^TP")
        deadline = time.monotonic() + 60
        while not _settled(result := get_json(f"{base}/fr_trace?format=json")):
            assert time.monotonic() < deadline, result["verdict"]
            time.sleep(0.5)
        _check(result)
        assert f"rank_script.py:{job.line_of('BARRIER_LINE')}" in result["next_step"]
        # The CLI on the pickles each rank writes now (as the dumper would).
        for r in range(4):
            get_json(f"{m[r].group(2)}/handler/torchcomms_fr_dump_file", "POST")
        out = subprocess.run([sys.executable, "-m", "debug_server.tools.fr_trace",
                              str(job.dump_dir / "per_rank"), "-p", "rank_", "--json"],
                             capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
        assert out.returncode == 2, out.stderr[-2000:]
        _check(json.loads(out.stdout))
