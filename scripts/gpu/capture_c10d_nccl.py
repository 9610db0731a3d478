"""Capture what torch's C++ worker on a CUDA build answers (issue 31: the fakes of
``bench_frontend.py --c10d-nccl`` must be byte-compatible with it).

    torchrun --nproc_per_node=2 scripts/gpu/capture_c10d_nccl.py OUTDIR

Each rank: ``init_process_group("nccl")`` (lazy), torch's ``_WorkerServer``; 2100 all_reduce
on the default group from a call site two frames deep (the ring wraps), one on a sub-group;
then rank 0 alone issues an async all_reduce (an active entry). Rank 0 saves its worker's
replies: ``dump_nccl_trace_json`` whole and ``onlyactive=true``, ``fr_trace_json``, and the
handler list. Both ranks then leave with ``os._exit`` (the open collective never completes).
"""

from __future__ import annotations

import datetime
import os
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def post(port: int, name: str, query: str = "") -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/handler/{name}{query}", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def layer(t: torch.Tensor, group: Any = None) -> None:
    dist.all_reduce(t, group=group)


def train(t: torch.Tensor, n: int) -> None:
    for _ in range(n):
        layer(t)


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    from torch._C._distributed_c10d import _WorkerServer
    rank = int(os.environ["RANK"])
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=600))
    server = _WorkerServer("127.0.0.1", 0)
    t = torch.ones(1024, device=dev)
    train(t, 2100)
    sub = dist.new_group([0, 1], group_desc="dp_shard")
    layer(t, sub)
    torch.cuda.synchronize()
    store = dist.distributed_c10d._get_default_store()
    time.sleep(2.0)  # c10d's watchdog retires them
    if rank == 0:
        dist.all_reduce(torch.ones(16, device=dev), group=sub, async_op=True)
        time.sleep(1.0)
        for fname, name, q in (("nccl_whole.json", "dump_nccl_trace_json", ""),
                               ("nccl_active.json", "dump_nccl_trace_json", "?onlyactive=true"),
                               ("nccl_nocoll.json", "dump_nccl_trace_json", "?includecollectives=false"),
                               ("cpu_fr.json", "fr_trace_json", "")):
            s0 = time.perf_counter()
            status, body = post(server.port, name, q)
            print(f"{name}{q}: {status} {len(body)} bytes {time.perf_counter() - s0:.3f} s", flush=True)
            (out / fname).write_bytes(body)
        req = urllib.request.Request(f"http://127.0.0.1:{server.port}/handler/", method="GET")
        with urllib.request.urlopen(req, timeout=30) as r:
            (out / "handlers.json").write_bytes(r.read())
        print("torch", torch.__version__, "nccl", torch.cuda.nccl.version(), flush=True)
        store.set("captured", "1")
    else:
        store.wait(["captured"])
    os._exit(0)


if __name__ == "__main__":
    main()
