"""c10d keys ``pg_status`` by group id and names entries by group name: both are read by name.

A group made with ``use_local_synchronization`` (what ``Comm.split`` makes) has a hashed name, so
its status row ("2") and its entries ("e141ae...") disagree. Read by the raw key, the merged dump
gained a bogus group "2" and the watchdog found no status for a split communicator.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from mpjob import REPO, free_port

JOB = """
import json, sys, time, torch, torch.distributed as dist
from debug_server.recording import c10d_fr
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d", rank=0, world_size=1)
local = dist.new_group([0], use_local_synchronization=True, group_desc="local")
t = torch.ones(4)
dist.all_reduce(t)
for _ in range(3):
    dist.all_reduce(t, group=local)
name = dist.distributed_c10d._world.pg_names[local]
c10d = torch._C._distributed_c10d
# c10d marks a gloo op completed in its own thread just after wait() returns: read once the
# third has been (under load that can lag the call by a while).
deadline = time.monotonic() + 60
while time.monotonic() < deadline and max(
        int(r.get("last_completed_collective", 0)) for r in
        c10d_fr._read(c10d, "_dump_fr_trace", "_dump_fr_trace_json", False, False)["pg_status"].values()) < 3:
    time.sleep(0.02)
whole = c10d_fr._read(c10d, "_dump_fr_trace", "_dump_fr_trace_json", True, False)
head = c10d_fr._read(c10d, "_dump_fr_trace", "_dump_fr_trace_json", False, False)
merged = c10d_fr.merge_c10d({"pg_config": {}, "pg_status": {}, "entries": []}, [("cpu", whole)])
print(json.dumps({
    "name": name,
    "raw_keys": sorted(head["pg_status"]),
    # A status-only read (what the watchdog makes): the id is learned by one full read.
    "row": c10d_fr.status_row("cpu", head["pg_status"], name),
    "by_name": sorted(c10d_fr.status_by_name("cpu", whole)),
    "merged_status": sorted(merged["pg_status"]),
    "merged_config": sorted(merged["pg_config"]),
}))
dist.destroy_process_group()
"""


def _run() -> dict:
    env = dict(os.environ, TORCH_FR_BUFFER_SIZE="100", PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-c", JOB % free_port()], capture_output=True, text=True,
                       timeout=120, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.job
def test_status_of_a_hashed_name_group_is_found_by_its_name_and_no_bogus_group_appears() -> None:
    out = _run()
    name = out["name"]
    assert len(name) == 40 and name not in out["raw_keys"]  # c10d's own keys are ids
    # The watchdog's read: three all_reduces of that group, seen completed (c10d counts from 1).
    assert out["row"]["last_completed_collective"] in (3, "3")
    assert name in out["by_name"]
    assert out["merged_status"] == sorted(["0", name])
    assert out["merged_config"] == sorted(["0", name])


def test_a_group_named_like_another_groups_id_keeps_its_own_status_row() -> None:
    from debug_server.recording import c10d_fr

    # Group "1" has id 2 (ids and names drift apart once some group has a hashed name); id 1
    # belongs to a group with no entries in this ring.
    dump = {"pg_status": {"2": {"last_completed_collective": 3}, "1": {"last_completed_collective": 7}},
            "entries": [{"process_group": ["1", "sub"], "pg_id": 2, "collective_seq_id": 3}]}
    assert c10d_fr.status_by_name("test-drift", dump)["1"] == {"last_completed_collective": 3}
    # The watchdog's lookup by name goes through the id too.
    assert c10d_fr.status_row("test-drift", dump["pg_status"], "1") == {"last_completed_collective": 3}
