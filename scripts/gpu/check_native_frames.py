"""GPU check: native frames (py-spy --native) of a rank spinning in a CUDA kernel, and the verdict.

Two ranks under torchrun on NCCL, through the public API (``start_debug_server``, ``new_comm``,
``FlightRecorderHook``): three good all_reduces (#0-#2), then rank 1 launches
``torch.cuda._sleep`` (a kernel spinning ``SPIN`` seconds) and rank 0 issues all_reduce #3 and
waits for it (``torch.cuda.synchronize``). Two cases:

* ``sync``: rank 1 waits for its kernel (``torch.cuda.synchronize``) before it issues #3: its
  host sits in the CUDA runtime and never reached #3.
* ``queued``: rank 1 issues #3 at once (queued on the GPU behind the kernel) and then waits:
  both ranks issued #3 and neither completes it while the kernel spins.

``READ_AT`` seconds into the spin the driver reads ``/stacks?native=1`` and
``/fr_trace?format=json``, prints rank 1's native stack and the verdict with its category, and
checks: every rank's stacks came from py-spy with native frames; rank 1's main thread shows a
frame of the CUDA libraries (``libcuda``/``libcudart``/``cu*``) under its Python line; the
verdict names a category (``gpu_or_network`` or ``cpu_divergence``, as the evidence says).
Exit status 0 when every check passed, 1 otherwise.

The machine has no pip on PATH for this: py-spy travels as its wheel in ``<repo>/.whl/``; the
driver installs it into ``/tmp/site`` (``pip --target`` where pip works, else by unzipping the
wheel, whose binary is ``py_spy-<v>.data/scripts/py-spy``) and puts ``/tmp/site/bin`` on PATH.

    python scripts/gpu/check_native_frames.py --out DIR                 # NCCL on 2 GPUs, both cases
    python scripts/gpu/check_native_frames.py --cpu --cases sync --out DIR
        # gloo on CPU: a C usleep holding the GIL stands in for the kernel (tests the driver)

Environment: ``SPIN`` (40 s), ``READ_AT`` (8 s), ``DEBUG_SERVER_PORT`` and
``MASTER_PORT`` (one more of each per case; unset: free ports).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

from gpucommon import REPO, env_port, get, wait_for_mark

SITE = Path("/tmp/site")
CUDA_FRAME = re.compile(r"libcuda|libcudart|libnvidia|^cu[A-Z]|^cuda", re.I)
CPU_FRAME = re.compile(r"^(usleep|nanosleep|clock_nanosleep)$")


# ---------------------------------------------------------------------------------------------
# One rank (run by torchrun)


def rank_main(case: str, marker: str, cpu: bool) -> int:
    import ctypes

    import torch

    from debug_server import start_debug_server
    from debug_server.recording.comms import new_comm
    from debug_server.recording.hooks import FlightRecorderHook

    rank = int(os.environ["RANK"])
    spin = float(os.environ.get("SPIN", "40"))
    if cpu:
        device, backend = torch.device("cpu"), "gloo"
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device, backend = torch.device("cuda", torch.cuda.current_device()), "nccl"

    def wait_gpu() -> None:
        if not cpu:
            torch.cuda.synchronize()

    start_debug_server(port=int(os.environ["DEBUG_SERVER_PORT"]), fetch_timeout=3.0,
                       dump_interval=3600.0)
    comm = new_comm(backend, device, "main_comm",
                    timeout=datetime.timedelta(seconds=spin + 60))
    FlightRecorderHook(max_entries=100).register_with_comm(comm)
    t = torch.ones(1024, device=device)
    for _ in range(3):
        comm.all_reduce(t)
    wait_gpu()
    if rank == 1:
        print(f"[rank 1] spinning {spin:.0f} s ({case})", flush=True)
        Path(marker).write_text(str(time.time()))
        if cpu:  # the stand-in: a C call that holds the GIL, before #3
            libc = ctypes.PyDLL(None)
            libc.usleep.argtypes = [ctypes.c_uint]
            libc.usleep(int(spin * 1e6))
            comm.all_reduce(t)
        else:
            # Cycles of the SM clock (~2 GHz on H100/H200); a slower clock only spins longer.
            torch.cuda._sleep(int(spin * 2e9))
            if case == "sync":
                torch.cuda.synchronize()  # the host waits for the kernel before #3
                comm.all_reduce(t)
            else:
                comm.all_reduce(t)  # #3 queued behind the kernel
                torch.cuda.synchronize()
    else:
        time.sleep(1.0)  # rank 1 starts its spin first
        comm.all_reduce(t)
        wait_gpu()
    print(f"[rank {rank}] #3 done", flush=True)
    # The driver ends the job after reading the pages; a rank whose launcher is gone (the
    # driver was killed) leaves by itself.
    parent, deadline = os.getppid(), time.monotonic() + spin + 120
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.5)
    return 0


# ---------------------------------------------------------------------------------------------
# py-spy from the wheel


def ensure_pyspy() -> str:
    """py-spy's path: found as the debug server finds it, else installed from ``.whl/``."""
    from debug_server.readers import pyspy

    try:
        return pyspy.locate()
    except pyspy.PySpyError as e:
        first = e.reason
    wheels = sorted(REPO.glob(".whl/py_spy-*.whl"))
    if not wheels:
        raise SystemExit(f"{first}; and no py_spy-*.whl in {REPO / '.whl'} to install")
    binary = SITE / "bin" / "py-spy"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(SITE),
                    str(wheels[-1])], check=False, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    if not binary.exists():  # no pip here: the wheel is a zip, its binary a data script
        with zipfile.ZipFile(wheels[-1]) as z:
            name = next(n for n in z.namelist() if n.endswith(".data/scripts/py-spy"))
            binary.parent.mkdir(parents=True, exist_ok=True)
            binary.write_bytes(z.read(name))
    binary.chmod(0o755)
    os.environ["PATH"] = f"{binary.parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return pyspy.locate()


# ---------------------------------------------------------------------------------------------
# The driver


def _section(text: str, rank: int) -> str:
    parts = text.split(f"=== Rank {rank} ===", 1)
    return parts[1].split("\n=== Rank ", 1)[0] if len(parts) == 2 else ""


def check_stacks(text: str, cpu: bool) -> list[str]:
    """What is wrong with the native stacks page (empty when it shows what it should)."""
    from debug_server.analysis import stackparse

    problems = []
    for rank in (0, 1):
        sec = _section(text, rank)
        if "(py-spy --native" not in sec:
            first = sec.strip().splitlines()[0] if sec.strip() else "(no section)"
            problems.append(f"rank {rank}: not read by py-spy --native: {first}")
            continue
        main = stackparse.main_thread(stackparse.parse_threads(sec))
        if main is None or not any(f.native for f in main.frames):
            problems.append(f"rank {rank}: no native frames in its main thread")
    main = stackparse.main_thread(stackparse.parse_threads(_section(text, 1)))
    if main is not None:
        want = CPU_FRAME if cpu else CUDA_FRAME
        first_py = next((i for i, f in enumerate(main.frames) if not f.native), len(main.frames))
        below = [f for f in main.frames[:first_py] if f.native]
        if not any(want.search(f.function) or want.search(f.filename) for f in below):
            problems.append("rank 1: no " + ("usleep" if cpu else "CUDA library") + " frame under "
                            "its Python line: " + ", ".join(f.function for f in below[:12]))
    return problems


def stop(job: subprocess.Popen[Any]) -> None:
    """End torchrun and its ranks: torchrun starts each rank in a session of its own, so a
    signal to its process group misses them; SIGTERM lets torchrun end them, SIGKILL is last."""
    if job.poll() is None:
        job.terminate()
        try:
            job.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(30)


def run_case(case: str, out: Path, cpu: bool, index: int) -> list[str]:
    work = out / case
    work.mkdir(parents=True, exist_ok=True)
    marker = work / "spinning"
    marker.unlink(missing_ok=True)
    port = env_port("DEBUG_SERVER_PORT", index)
    master = env_port("MASTER_PORT", index)
    read_at = float(os.environ.get("READ_AT", "8"))
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1",
               DEBUG_SERVER_PORT=str(port))
    env.pop("TORCHCOMM_FR_DUMP_TEMP_FILE", None)
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
            f"--master-port={master}", __file__, "--rank-main", case, str(marker)]
    log = open(work / "job.log", "w")  # noqa: SIM115 - closed in finally
    job = subprocess.Popen(args + (["--cpu"] if cpu else []), env=env, stdout=log,
                           stderr=subprocess.STDOUT, start_new_session=True)
    problems: list[str] = []
    try:
        t0 = wait_for_mark(job, marker, 180, read_at)
        if t0 is None:
            return [f"{case}: the job never started spinning (see {work / 'job.log'})"]
        base = f"http://127.0.0.1:{port}"
        s = time.monotonic()
        code, stacks = get(f"{base}/stacks?native=1&format=text")
        took = time.monotonic() - s
        (work / "stacks_native.txt").write_text(stacks)
        code2, raw = get(f"{base}/fr_trace?format=json")
        (work / "fr_trace.json").write_text(raw)
        into = time.time() - t0
        print(f"=== {case}: {into:.1f} s into the spin; /stacks?native=1 took {took:.2f} s ===")
        if code != 200:
            problems.append(f"{case}: /stacks?native=1 answered {code}: {stacks[:200]}")
        else:
            groups = stacks.split("\n=== Rank ", 1)[0]
            print(groups.rstrip())
            main_lines = [ln for ln in _section(stacks, 1).splitlines()
                          if ln.startswith(("(", "Thread", "  Native", "  File"))]
            # Rank 1's main thread (the one holding <module>) is the last thread py-spy lists.
            start = max((i for i, ln in enumerate(main_lines) if "MainThread" in ln), default=0)
            print("--- rank 1 main thread (py-spy --native) ---")
            print("\n".join(main_lines[start:start + 25]))
            problems += [f"{case}: {p}" for p in check_stacks(stacks, cpu)]
        if code2 != 200:
            problems.append(f"{case}: /fr_trace answered {code2}: {raw[:200]}")
        else:
            result: dict[str, Any] = json.loads(raw)
            print("--- verdict ---")
            print(f"category: {result.get('category')}")
            print(f"verdict: {result.get('verdict')}")
            print(f"next step: {result.get('next_step')}")
            for f in result.get("findings", []):
                print(f"  [{f.get('kind')}] {f.get('group')} #{f.get('seq')} {f.get('op')} "
                      f"ranks {f.get('ranks')}")
            allowed = {"cpu_divergence", "unknown"} if cpu else {"gpu_or_network", "cpu_divergence"}
            if result.get("category") not in allowed:
                problems.append(f"{case}: category {result.get('category')!r}, want one of "
                                f"{sorted(allowed)}")
    finally:
        stop(job)
        log.close()
    return problems


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="where pages and logs go (default a temp dir)")
    p.add_argument("--cases", default="sync,queued")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU; a C usleep for the kernel")
    p.add_argument("--rank-main", nargs=2, metavar=("CASE", "MARKER"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_main:
        return rank_main(args.rank_main[0], args.rank_main[1], args.cpu)
    out = Path(args.out or tempfile.mkdtemp(prefix="gpu_check_native_"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"py-spy: {ensure_pyspy()}", flush=True)
    problems: list[str] = []
    for i, case in enumerate(c for c in args.cases.split(",") if c):
        if case not in ("sync", "queued"):
            print(f"unknown case {case!r} (sync, queued)")
            return 2
        problems += run_case(case, out, args.cpu, i)
    for prob in problems:
        print(f"FAIL: {prob}")
    print("OK: native frames and verdict for every case" if not problems else
          f"{len(problems)} problem(s); pages and logs in {out}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
