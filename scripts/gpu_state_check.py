"""GPU check (2 ranks, nccl): the stuck all_reduce on the waiting rank shows `started` once its
kernel runs, and `completed` after the late rank joins. Run under torchrun on a 2-GPU machine:

    torchrun --nproc_per_node=2 scripts/gpu_state_check.py
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from debug_server.comms import new_comm  # noqa: E402
from debug_server.hooks import FlightRecorderHook  # noqa: E402


def main() -> int:
    rank = int(os.environ["RANK"])
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=120), device_id=dev)
    comm = new_comm("nccl", dev, "main_comm", timeout=datetime.timedelta(seconds=60))
    hook = FlightRecorderHook(max_entries=100).register_with_comm(comm)
    t = torch.ones(1024, device=dev)
    comm.all_reduce(t)  # warm-up: communicator init
    if rank == 1:
        time.sleep(6)
        comm.all_reduce(t)
        print(f"[rank 1] joined late; states {[e['state'] for e in hook.dump_json()['entries']]}", flush=True)
    else:
        work = comm.all_reduce(t, async_op=True)
        seen = []
        for _ in range(8):
            time.sleep(0.5)
            seen.append(hook.dump_json()["entries"][-1]["state"])
        print(f"[rank 0] seq 1 state while rank 1 sleeps: {seen}", flush=True)
        work.wait()
        torch.cuda.synchronize()
        last = hook.dump_json()["entries"][-1]
        print(f"[rank 0] after rank 1 joined: state {last['state']}, duration_ms {last['duration_ms']}", flush=True)
        ok = "started" in seen and last["state"] == "completed"
        print(f"[rank 0] GPU STATE CHECK {'PASSED' if ok else 'FAILED'}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
