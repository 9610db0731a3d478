"""An order inversion on a real 4-rank gloo job (plain torch.distributed, issue 37).

Two groups over all ranks, ``grad_sync`` then ``metrics`` at every step; at step 3 rank 2
reduces ``metrics`` first (a dict iterated in another order on one rank). On gloo each op blocks
its rank, so ranks 0, 1, 3 wait in grad_sync #4 and rank 2 in metrics #4. The verdict must name
rank 2 and the order, every time it is read, live and from the CLI on the per-rank pickles.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from httpget import get_json
from mpjob import REPO
from rankprocs import DumpDirJob

pytestmark = pytest.mark.job  # starts real processes (tests/tiers.py)

RANK = """
import os, time
import torch
import torch.distributed as dist
from debug_server import start_debug_server

rank = int(os.environ["RANK"])
h = start_debug_server(port=0, fetch_timeout=2, dump_dir=os.environ["DUMP_DIR"],
                       dump_interval=2)
dist.init_process_group("gloo")
grad = dist.new_group(list(range(4)), group_desc="grad_sync")
metrics = dist.new_group(list(range(4)), group_desc="metrics")
assert h.wait_registered(30)
t = torch.ones(16)
for step in range(4):
    order = {"grad_sync": grad, "metrics": metrics}
    if step == 3:
        print("READY", h.frontend_url, flush=True)
        if rank == 2:
            order = {"metrics": metrics, "grad_sync": grad}
    for name, g in order.items():
        dist.all_reduce(t, group=g)  # REDUCE_LINE
time.sleep(120)
"""


def _inversion(result: dict[str, Any]) -> dict[str, Any] | None:
    order = result.get("finding_order") or []
    first = result["findings"][order[0]] if order else None
    return first if first is not None and first["kind"] == "order_inversion" else None


@pytest.mark.timeout(180)
def test_gloo_order_inversion_is_named_live_and_by_the_cli(tmp_path: Path) -> None:
    with DumpDirJob(tmp_path, RANK, 4) as job:
        base = job.wait_for(0, r"^READY (\S+)", timeout=120).group(1)
        deadline = time.monotonic() + 60
        before = None
        while True:
            # Until the inversion is named and the verdict reads the same twice: while a rank
            # on a loaded box is still on its way into its first all_reduce, the verdict names
            # the inversion without what it caused ("Because of it: ranks 0-1, 3 never joined").
            result = get_json(f"{base}/fr_trace?format=json")
            f = _inversion(result)
            if (f is not None and result["verdict"] == before) or time.monotonic() > deadline:
                break
            before = result["verdict"] if f is not None else None
            time.sleep(1.0)
        assert f is not None, result.get("verdict")
        assert (f["ranks"], f["others"]) == ([2], [0, 1, 3]), result["verdict"]
        assert result["category"] == "cpu_divergence"
        line = f"rank_script.py:{job.line_of('REDUCE_LINE')}"
        assert "different orders" in result["verdict"] and line in result["verdict"]
        assert [o["group_label"] for o in f["ops"]] == ["pg 2 (metrics)", "pg 1 (grad_sync)"]
        for _ in range(3):  # the same verdict on every read
            assert get_json(f"{base}/fr_trace?format=json")["verdict"] == result["verdict"]
        # The CLI on the per-rank pickles the periodic dumper has every rank write.
        per_rank = job.dump_dir / "per_rank"
        deadline = time.monotonic() + 60
        while len(list(per_rank.glob("rank_*"))) < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        out = subprocess.run([sys.executable, "-m", "debug_server.fr_trace", str(per_rank),
                              "-p", "rank_", "--json"], capture_output=True, text=True,
                             timeout=60, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
        assert out.returncode == 2, out.stderr[-2000:]
        cli = json.loads(out.stdout)
        g = _inversion(cli)
        assert g is not None and (g["ranks"], g["others"]) == ([2], [0, 1, 3]), cli["verdict"]
        # The same finding and headline; the live page adds what the stacks say.
        assert cli["category"] == result["category"]
        assert cli["verdict"].split(". ")[0] == result["verdict"].split(". ")[0]
