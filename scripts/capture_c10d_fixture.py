"""Capture tests/data/c10d_merge_gloo.json: what c10d_fr.merge_c10d is given in a real job.

    python scripts/capture_c10d_fixture.py tests/data/c10d_merge_gloo.json

Two gloo ranks (spawned here): a communicator ``main_comm`` with a Flight Recorder hook (2
all_reduce), then plain torch.distributed on the default group (2 all_reduce, 1 broadcast), one
all_reduce on ``new_group([0, 1], group_desc="dp_shard")``, and rank 0 alone issues an async
all_reduce on the default group (seq 4) before both ranks record: our hooks' snapshot, c10d's
CPU recorder through its JSON dump (what torch's own ``fr_trace_json`` handler serves, with its
quirks: string ``pg_status`` values, 0 for unknown times), ``process_groups()`` and the c10d names
of the recorded communicators. Rank 1 then joins, so the job ends cleanly.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.elastic.utils.distributed import get_free_port


def _rank(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2")
    from debug_server.recording import c10d_fr, hooks
    from debug_server.recording.comms import new_comm

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    comm = new_comm("gloo", "cpu", "main_comm", timeout=30)
    hook = hooks.FlightRecorderHook(max_entries=100).register_with_comm(comm)
    t = torch.ones(8)
    for _ in range(2):
        comm.all_reduce(t)
    for _ in range(2):
        dist.all_reduce(t)
    dist.broadcast(t, src=0)
    sub = dist.new_group([0, 1], group_desc="dp_shard")
    dist.all_reduce(t, group=sub)
    work = dist.all_reduce(t, async_op=True) if rank == 0 else None
    store = dist.distributed_c10d._get_default_store()
    store.set(f"issued{rank}", "1")
    store.wait(["issued0", "issued1"])
    from torch._C import _distributed_c10d as c10d

    record = {
        "ours": hooks.lazy_snapshot().finish(),
        "recorders": [("cpu", json.loads(c10d._dump_fr_trace_json(True, False)))],
        "groups": {k: g._asdict() for k, g in c10d_fr.process_groups().items()},
        "owned": sorted(hooks.owned_groups()),
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record, default=list))
    store.set(f"recorded{rank}", "1")
    store.wait(["recorded0", "recorded1"])
    if rank == 1:
        dist.all_reduce(t)
    else:
        work.wait()
    hook.unregister()
    comm.finalize()
    dist.destroy_process_group()


def main() -> None:
    out = Path(sys.argv[1])
    tmp = out.parent / ".capture_tmp"
    tmp.mkdir(exist_ok=True)
    mp.spawn(_rank, args=(get_free_port(), str(tmp)), nprocs=2)
    ranks = {r: json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)}
    for r in range(2):
        (tmp / f"rank{r}.json").unlink()
    tmp.rmdir()
    out.write_text(json.dumps({
        "_comment": f"Captured by scripts/capture_c10d_fixture.py on torch {torch.__version__}: "
                    "per rank, our hooks' snapshot, c10d's recorders (JSON dumps), the process "
                    "groups and the c10d names of the recorded communicators.",
        "ranks": ranks,
    }, indent=1, default=list) + "\n")


if __name__ == "__main__":
    main()
