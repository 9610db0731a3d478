"""A misconfigured collective must be named live, during the hang, and post-mortem alike.

Two cases on 2 ranks, through the public API (``start_debug_server``, ``new_comm``,
``FlightRecorderHook``): three good all_reduces of 1024 floats (#0-#2), then #3 misconfigured:

* ``size``: rank 0 all_reduces 1024 elements, rank 1 2048 (NCCL completes rank 0's op, rank 1
  hangs in it);
* ``type``: rank 0 all_reduces, rank 1 broadcasts (both hang).

The driver reads the live ``/fr_trace?format=json`` ``READ_AT`` seconds into the hang (default
17), checks the hang report the frontend wrote meanwhile, lets the ranks time out
(``COMM_TIMEOUT``) and write their pickles, then runs ``python -m debug_server.fr_trace`` on them.
Each must name the mismatch at #3 (``size_mismatch`` / ``type_mismatch``) with the category
``misconfigured_collective`` and no GPU/network advice; both verdicts are printed.

    python scripts/gpu/check_mismatch.py                 # NCCL on 2 GPUs, both cases
    TEST_BACKEND=gloo READ_AT=4 COMM_TIMEOUT=10 python scripts/gpu/check_mismatch.py --cases type

gloo cannot run the size case (gloo aborts rank 0 with "Received data size doesn't match
expected size" instead of completing it), so on CPU only ``type`` is meaningful.
Environment: ``TEST_BACKEND`` (nccl), ``DEBUG_SERVER_PORT``, ``MASTER_PORT`` (unset: free ports),
``OUT`` (a temp dir). Exit status 0 when every case passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpucommon import REPO, env_port, get, wait_for_mark

EXPECT = {"size": "size_mismatch", "type": "type_mismatch"}


# ---------------------------------------------------------------------------------------------
# One rank (run by torchrun)


def rank_main(case: str, dump_dir: str, marker: str, release: str) -> int:
    import torch

    from debug_server import start_debug_server, stop_debug_server
    from debug_server.recording.comms import new_comm
    from debug_server.recording.hooks import FlightRecorderHook

    rank = int(os.environ["RANK"])
    backend = os.environ.get("TEST_BACKEND", "nccl")
    timeout = float(os.environ.get("COMM_TIMEOUT", "40"))
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    server = start_debug_server(port=int(os.environ["DEBUG_SERVER_PORT"]),
                                dump_dir=dump_dir, dump_interval=3.0, stall_timeout=3.0)
    comm = new_comm(backend, device, "main_comm", timeout=datetime.timedelta(seconds=timeout))
    hook = FlightRecorderHook(max_entries=2000).register_with_comm(comm)
    t = torch.ones(1024, device=device)
    for _ in range(3):
        comm.all_reduce(t)
    if device.type == "cuda":
        torch.cuda.synchronize()
    if rank == 0:
        Path(marker).write_text(str(time.time()))
    print(f"[rank {rank}] issuing the misconfigured #3 ({case})", flush=True)
    if case == "size":
        x = torch.ones(1024 if rank == 0 else 2048, device=device)
        work = comm.all_reduce(x, async_op=True)
    else:
        x = torch.ones(1024, device=device)
        work = comm.all_reduce(x, async_op=True) if rank == 0 else comm.broadcast(x, 0, async_op=True)
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout))
        print(f"[rank {rank}] #3 completed", flush=True)
    except RuntimeError as e:
        print(f"[rank {rank}] #3 failed: {str(e).splitlines()[0][:200]}", flush=True)
    # Stay up until the driver has read the live pages (rank 0 hosts the frontend).
    deadline = time.monotonic() + timeout + 30
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.2)
    path = hook.dump_file(rank)
    print(f"[rank {rank}] pickle written to {path}", flush=True)
    sys.stdout.flush()
    stop_debug_server()
    del server
    # A communicator that timed out cannot be torn down cleanly on NCCL; nothing is left to do.
    os._exit(0)


# ---------------------------------------------------------------------------------------------
# The driver


def _check_result(where: str, result: dict[str, Any], case: str) -> list[str]:
    """What is wrong with one verdict (empty when it names the mismatch at #3)."""
    problems = []
    kinds = [(f.get("kind"), f.get("seq")) for f in result.get("findings", [])
             if f.get("severity", "error") == "error"]
    if (EXPECT[case], 3) not in kinds:
        problems.append(f"{where}: no {EXPECT[case]} at seq 3 (findings: {kinds})")
    if result.get("category") != "misconfigured_collective":
        problems.append(f"{where}: category {result.get('category')!r}, "
                        "want 'misconfigured_collective'")
    verdict = result.get("verdict", "")
    if "suspect the GPU" in verdict or "network or the NCCL" in verdict:
        problems.append(f"{where}: verdict still blames the GPU/network")
    return problems


def _show(where: str, result: dict[str, Any]) -> None:
    print(f"--- {where} ---")
    print(f"verdict: {result.get('verdict', '')}")
    print(f"category: {result.get('category')}; next step: {result.get('next_step')}")
    for f in result.get("findings", []):
        print(f"  [{f.get('kind')}] {f.get('group')} #{f.get('seq')} {f.get('op')} "
              f"ranks {f.get('ranks')}: {f.get('detail')}")


def run_case(case: str, out: Path) -> list[str]:
    work = out / case
    work.mkdir(parents=True, exist_ok=True)
    dump_dir, marker, release = work / "dumps", work / "hang_started", work / "release"
    for p in (marker, release):
        p.unlink(missing_ok=True)
    port = env_port("DEBUG_SERVER_PORT")
    read_at = float(os.environ.get("READ_AT", "17"))
    comm_timeout = float(os.environ.get("COMM_TIMEOUT", "40"))
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1",
               DEBUG_SERVER_PORT=str(port), COMM_TIMEOUT=str(comm_timeout))
    env.pop("TORCHCOMM_FR_DUMP_TEMP_FILE", None)
    log = open(work / "job.log", "w")
    job = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         f"--master-port={env_port('MASTER_PORT')}", __file__, "--rank-main", case,
         str(dump_dir), str(marker), str(release)],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    problems: list[str] = []
    try:
        hang_t0 = wait_for_mark(job, marker, 120, read_at)
        if hang_t0 is None:
            return [f"{case}: the job never reached #3 (see {work / 'job.log'})"]
        into = time.time() - hang_t0
        code, body = get(f"http://127.0.0.1:{port}/fr_trace?format=json", timeout=30)
        (work / "live_fr_trace.json").write_text(body)
        if code != 200:
            problems.append(f"{case}: live /fr_trace answered {code}: {body[:200]}")
        else:
            live = json.loads(body)
            print(f"=== {case}: live /fr_trace {into:.1f} s into the hang "
                  f"(window {live.get('fr_window')}) ===")
            _show("live /fr_trace", live)
            problems += _check_result("live /fr_trace", live, case)
        # The hang watch polls every 2 s and reports a stall older than 3 s; a rank whose
        # worker is slow to answer may delay that up to the communicator's timeout.
        wait_until = time.monotonic() + max(15.0, comm_timeout)
        while not (reports := sorted(glob.glob(str(dump_dir / "hang_report_*.json")))):
            if time.monotonic() > wait_until:
                break
            time.sleep(0.5)
        if not reports:
            problems.append(f"{case}: no hang_report_*.json in {dump_dir} after {into:.0f} s")
        else:
            rep = json.loads(Path(reports[0]).read_text())
            _show(f"hang report {os.path.basename(reports[0])}", rep)
            problems += _check_result("hang report", {**rep, "findings": rep.get("findings", [])},
                                      case)
        release.write_text("read")
        try:
            job.wait(timeout=comm_timeout + 90)
        except subprocess.TimeoutExpired:
            problems.append(f"{case}: the job did not end within {comm_timeout + 90:.0f} s")
    finally:
        release.write_text("read")
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(10)
        log.close()
    cli = subprocess.run(
        [sys.executable, "-m", "debug_server.tools.fr_trace", str(dump_dir / "per_rank"), "-p", "rank_",
         "--json"], capture_output=True, text=True, cwd=REPO, timeout=120,
        env=dict(os.environ, PYTHONPATH=str(REPO)))
    (work / "cli.json").write_text(cli.stdout)
    if cli.returncode != 2:
        problems.append(f"{case}: CLI exit {cli.returncode} (want 2): {cli.stderr.strip()[:300]}")
    else:
        pm = json.loads(cli.stdout)
        print(f"=== {case}: python -m debug_server.fr_trace on the pickles ===")
        _show("post-mortem CLI", pm)
        problems += _check_result("post-mortem CLI", pm, case)
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", choices=sorted(EXPECT), default=["size", "type"])
    p.add_argument("--rank-main", nargs=4, metavar=("CASE", "DUMP_DIR", "MARKER", "RELEASE"),
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_main:
        return rank_main(*args.rank_main)
    out = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu_check_mismatch_"))
    problems = []
    for case in args.cases:
        problems += run_case(case, out)
    print(f"outputs in {out}")
    if problems:
        print("FAILED:\n  " + "\n  ".join(problems))
        return 1
    print(f"OK: {', '.join(args.cases)} named at #3 live and post-mortem")
    return 0


if __name__ == "__main__":
    sys.exit(main())
