"""The reference hang: two ranks, one of them never joins the fifth collective.

    torchrun --nproc_per_node=2 examples/hang_demo.py

Each rank creates the communicator ``main_comm``, starts the debug server (rank 0 serves
http://127.0.0.1:25999 and writes periodic dumps), records with a 100-entry Flight Recorder, and
runs phase 1 (three all_reduce and one broadcast of 1024 floats, all ranks). In phase 2 the
hanging rank sleeps instead of joining; the others issue one more all_reduce, which times out
after COMM_TIMEOUT seconds; they catch the error and write their pickle. While it hangs, open the
pages or read the dumps: they name the collective (seq 4, all_reduce), the missing rank, and the
line where it is stuck. The script ends by itself and prints what to run next.

On several hosts (``torchrun --nnodes=N --node_rank=K --master_addr=<rank 0's host>``) rank 0
prints the link with its reachable address and the access token, and when FR_DUMP_DIR is not
shared, the summary says which ranks' pickles are on other hosts and suggests
``--allow-incomplete-ranks`` (tests/test_twohosts.py runs it on two network namespaces).

With ``DEMO_API=c10d`` the same scenario runs through plain torch.distributed, as DDP, FSDP and
most training code do: no communicator and no hook, ``dist.all_reduce`` and ``dist.broadcast``
on the default group, whose timeout is COMM_TIMEOUT. The record then comes from c10d's own
Flight Recorder, merged by the debug server: the stuck op is all_reduce seq 5 on ``default_pg``
(c10d counts from 1).

Environment (all optional):
    FR_DUMP_DIR        where dumps go (default: a folder in the temp dir named after the run)
    FR_DUMP_INTERVAL   seconds between periodic dumps (default 2)
    FR_STALL_TIMEOUT   seconds an op may be in flight before the rank reports unhealthy (default 10)
    COMM_TIMEOUT       the communicator's timeout in seconds (default 20)
    HANGING_RANK       the rank that hangs (default: the last rank)
    HANG_SECONDS       how long it sleeps (default COMM_TIMEOUT + 10)
    DEBUG_SERVER_PORT  the rank-0 frontend's port (default 25999)
    TEST_BACKEND       gloo (default) or nccl
    TEST_DEVICE        cpu (default) or cuda (one GPU per rank, LOCAL_RANK)
    DEMO_API           comm (default: new_comm + FlightRecorderHook) or c10d (gloo only)
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from debug_server import start_debug_server, stop_debug_server
from debug_server.recording import hooks
from debug_server.recording.comms import new_comm
from debug_server.recording.hooks import FlightRecorderHook


def env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        sys.exit(f"error: {name}={raw!r} is not a number of seconds")


def say(rank: int, msg: str) -> None:
    # One write per line: print() writes text and newline separately, so two ranks sharing
    # torchrun's stdout would interleave mid-line.
    sys.stdout.write(f"[rank {rank}] {msg}\n")
    sys.stdout.flush()


def hang_phase(seconds: float) -> None:
    """The hanging rank's "bug": it never reaches the collective."""
    time.sleep(seconds)  # <- the line the dumps point at (HANG LINE)


def wait_for_all(store: dist.Store, key: str, world: int, limit_s: float) -> None:
    """A barrier through the TCPStore: the communicator may be unusable after its timeout."""
    store.add(key, 1)
    deadline = time.monotonic() + limit_s
    while int(store.add(key, 0)) < world and time.monotonic() < deadline:
        time.sleep(0.2)


def main() -> int:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    backend = os.environ.get("TEST_BACKEND", "gloo")
    device_kind = os.environ.get("TEST_DEVICE", "cpu")
    comm_timeout = env_float("COMM_TIMEOUT", 20.0)
    dump_interval = env_float("FR_DUMP_INTERVAL", 2.0)
    stall_timeout = env_float("FR_STALL_TIMEOUT", 10.0)
    hang_seconds = env_float("HANG_SECONDS", comm_timeout + 10.0)
    hanging_rank = int(os.environ.get("HANGING_RANK", str(world - 1)))
    port = int(os.environ.get("DEBUG_SERVER_PORT", "25999"))
    run_id = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("MASTER_PORT", "demo")
    dump_dir = os.environ.get("FR_DUMP_DIR") or os.path.join(
        tempfile.gettempdir(), f"debug_server_demo_{run_id}"
    )
    # The per-rank pickles go next to the text dumps, where PyTorch's fr_trace reads them.
    os.environ.setdefault("TORCHCOMM_FR_DUMP_TEMP_FILE", os.path.join(dump_dir, "per_rank", "rank_"))

    if device_kind == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    api = os.environ.get("DEMO_API", "comm")
    if api not in ("comm", "c10d") or (api == "c10d" and backend != "gloo"):
        # On NCCL a timed-out default group is torn down by c10d's watchdog, process and all.
        sys.exit(f"error: DEMO_API={api!r}: use comm, or c10d with TEST_BACKEND=gloo")
    say(rank, f"rank {rank}/{world}, device {device}, backend {backend}, hanging rank {hanging_rank}, "
        f"timeout {comm_timeout:g} s, api {api}")
    # The default group's timeout is longer than the communicator's, so the communicator's own
    # timeout is what fires in phase 2 (and NCCL's watchdog does not kill the process first).
    # With DEMO_API=c10d the default group is the one that times out.
    pg_timeout = comm_timeout if api == "c10d" else comm_timeout + 120
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=pg_timeout))
    server = start_debug_server(
        port=port, dump_dir=dump_dir, dump_interval=dump_interval, stall_timeout=stall_timeout
    )
    if rank == 0:
        # On several hosts the link carries rank 0's reachable address and the access token.
        say(rank, f"debug server: {server.browser_url}  (pages: /fr_trace /stacks)")
        say(rank, f"dumps every {dump_interval:g} s into {dump_dir}  (per-rank pickles in {dump_dir}/per_rank)")

    ops = C10dOps(rank) if api == "c10d" else CommOps(backend, device, comm_timeout, stall_timeout, rank)
    t = torch.ones(1024, device=device)

    say(rank, "phase 1: 3 x all_reduce + 1 x broadcast on all ranks")
    for _ in range(3):
        ops.all_reduce(t)
    ops.broadcast(t)
    say(rank, "phase 1 done")

    hang_start = time.time()
    if rank == hanging_rank:
        say(rank, f"phase 2: hanging (sleeping {hang_seconds:g} s instead of joining all_reduce {ops.label})")
        hang_phase(hang_seconds)
        path = ops.dump_file()
        say(rank, f"woke up; flight recorder pickle written to {path}")
    else:
        # Wall-clock stamps let a reader (and tests/test_watchdog.py) compare the hang report's
        # time with the hang's start and with the communicator's timeout.
        say(rank, f"phase 2: all_reduce {ops.label}, waiting for rank {hanging_rank} (times out after "
            f"{comm_timeout:g} s) [wall {time.time():.3f}]")
        t0 = time.monotonic()
        try:
            ops.all_reduce(t)
            say(rank, f"all_reduce {ops.label} completed (the hanging rank joined?)")
        except RuntimeError as e:
            say(rank, f"Caught timeout: {type(e).__name__}: {e}")
            say(rank, f"(after {time.monotonic() - t0:.1f} s) [wall {time.time():.3f}]")
            path = ops.dump_file()
            say(rank, f"flight recorder pickle written to {path}")

    # Keep the server up until every rank is done, so the dumps cover the whole hang.
    store = dist.distributed_c10d._get_default_store()
    wait_for_all(store, "demo_done", world, hang_seconds + comm_timeout + 60)
    if rank == 0:
        # One more dump cycle after everyone wrote their final pickle.
        time.sleep(min(dump_interval, 5.0))
        report(dump_dir, hang_start + comm_timeout, world)
    wait_for_all(store, "demo_exit", world, 60)
    stop_debug_server()
    ops.unregister()
    if backend == "nccl":
        # After the timeout c10d marks the NCCL group failed on the waiting ranks (its watchdog
        # takes those processes down) and the hanging rank's peers are gone: tearing the group
        # down cleanly would block on every rank. Leave at once instead.
        sys.stdout.flush()
        os._exit(0)
    ops.finalize()
    dist.destroy_process_group()
    return 0


class CommOps:
    """Phase ops through our communicator ``main_comm``, recorded by a 100-entry hook."""

    label = "#4"

    def __init__(self, backend: str, device: torch.device, timeout: float, stall_timeout: float,
                 rank: int) -> None:
        self.rank = rank
        self.timeout = timeout
        self.comm = new_comm(backend, device, "main_comm", timeout=datetime.timedelta(seconds=timeout))
        self.hook = FlightRecorderHook(max_entries=100, stall_timeout=stall_timeout).register_with_comm(self.comm)

    def all_reduce(self, t: torch.Tensor) -> None:
        if t.is_cuda:
            # On CUDA the op returns once enqueued (stream-ordered, like torch); the host waits
            # only when asked. The demo asks, as a step reading a result would: in a hang the
            # communicator's watchdog ends the wait at its timeout with the error it names.
            self.comm.all_reduce(t, async_op=True).wait(timeout=self.timeout + 60)
        else:
            self.comm.all_reduce(t)

    def broadcast(self, t: torch.Tensor) -> None:
        self.comm.broadcast(t, root=0)

    def dump_file(self) -> str:
        return self.hook.dump_file(self.rank)

    def unregister(self) -> None:
        self.hook.unregister()

    def finalize(self) -> None:
        self.comm.finalize()


class C10dOps:
    """Phase ops through plain torch.distributed on the default group (DEMO_API=c10d)."""

    label = "#5 on default_pg"

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def all_reduce(self, t: torch.Tensor) -> None:
        dist.all_reduce(t)

    def broadcast(self, t: torch.Tensor) -> None:
        dist.broadcast(t, src=0)

    def dump_file(self) -> str:
        # What the worker's torchcomms_fr_dump_file writes: c10d's record merged with ours.
        return hooks.dump_file(self.rank)

    def unregister(self) -> None:
        pass

    def finalize(self) -> None:
        pass


def report(dump_dir: str, timeout_at: float, world: int) -> None:
    """Print the analyzer's verdict on the per-rank pickles and the follow-up commands.

    The verdict joins the stacks dumped during the hang (the last before the communicator's
    timeout fired): afterwards every rank has moved on to the demo's final wait. On several
    hosts without a shared FR_DUMP_DIR, the other hosts' pickles are on those hosts: the
    verdict then covers the ranks here (``--allow-incomplete-ranks``) and says so.
    """
    per_rank = os.path.join(dump_dir, "per_rank")
    elsewhere = [r for r in range(world) if not os.path.exists(os.path.join(per_rank, f"rank_{r}"))]
    incomplete = " --allow-incomplete-ranks" if elsewhere else ""
    all_stacks = sorted(Path(dump_dir).glob("stacks_*.txt"))
    during = [p for p in all_stacks if p.stat().st_mtime < timeout_at]
    stacks = during or all_stacks
    cmd = [sys.executable, "-m", "debug_server.tools.fr_trace", per_rank, "-p", "rank_", "--json",
           *incomplete.split()]
    if stacks:
        cmd += ["--stacks", str(stacks[-1])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    hang_reports = sorted(Path(dump_dir).glob("hang_report_*.txt"))
    print("", flush=True)
    print("=" * 78)
    if elsewhere and hang_reports:
        # The pickles here cover only this host's ranks; the hang report saw every rank.
        try:
            hang = json.loads(hang_reports[0].with_suffix(".json").read_text())
            print(f"Verdict (every rank, from the hang report): {hang['verdict']}")
        except (OSError, ValueError, KeyError):
            pass
    label = "Verdict on the pickles here" if elsewhere else "Verdict"
    try:
        verdict = json.loads(proc.stdout)["verdict"]
        print(f"{label}: {verdict}")
    except (ValueError, KeyError):
        print(f"analyzer failed (exit {proc.returncode}): {proc.stderr.strip()[:500]}")
    if elsewhere:
        print(f"No pickle here for rank{'s' if len(elsewhere) > 1 else ''} "
              f"{', '.join(map(str, elsewhere))}: they are on the other hosts (FR_DUMP_DIR is not "
              f"shared). Copy them into {per_rank} for a verdict over every rank, or analyze "
              f"these with --allow-incomplete-ranks (below).")
    texts = sorted(Path(dump_dir).glob("torchcomms_fr_trace_*.txt"))
    print(f"Dumps: {dump_dir}")
    if texts:
        print(f"  latest FR trace: {texts[-1]}")
    if stacks:
        print(f"  stacks during the hang: {stacks[-1]}")
    print(f"  per-rank pickles: {per_rank}/rank_*")
    if hang_reports:
        print(f"  hang report:     {hang_reports[0]}  (written by the stall watchdog)")
    print("Next:")
    stacks_arg = f" --stacks {stacks[-1]}" if stacks else ""
    print(f"  python -m debug_server.fr_trace {per_rank} -p rank_{stacks_arg}{incomplete}")
    print(f"  python -m torch.distributed.flight_recorder.fr_trace {per_rank} -p rank_{incomplete}")
    print(f"  python -m torch.distributed.flight_recorder.fr_trace {per_rank} -p rank_ -j --print_stack_trace"
          f"{incomplete}")
    print(f"  python -m debug_server.view {dump_dir}   # the same pages, after the job, in a browser")
    store = f"{os.environ.get('MASTER_ADDR', '<MASTER_ADDR>')}:{os.environ.get('MASTER_PORT', '<MASTER_PORT>')}"
    print("While a job hangs and rank 0's host is gone (its frontend with it), attach the pages from "
          "any host that reaches the job's store:")
    print(f"  python -m debug_server.frontend --store {store} --world-size {world}")
    print("=" * 78, flush=True)


if __name__ == "__main__":
    sys.exit(main())
