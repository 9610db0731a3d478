"""The worker's FR window on a rank: built whole then cut (before) against cut inside the
recorders, only kept entries built (after), on the same rings.

    taskset -c 1 python benchmarks/bench_worker_fr.py            # 2000-entry rings, 21 reps
    python benchmarks/bench_worker_fr.py --entries 500 --reps 11 --baseline-rev none

Each shape runs in fresh one-rank gloo processes (their own c10d recorder), with real rings:

* ``hooks``: a ``FlightRecorderHook(max_entries=N)`` over ``main_comm``, ``N + 100`` all_reduce
  (c10d records the same ops on main_comm's own group; the worker drops those);
* ``hooks+c10d``: the same plus as many ``dist.all_reduce`` on the default group (what DDP adds),
  so c10d's ring holds N entries of which half are served;
* ``c10d``: no hook, ``N + 100`` ``dist.all_reduce`` (a job without our communicators).

Per shape, two requests as the frontend sends them: ``window=4`` (the first round: the rank's
own frontier less 4) and ``since`` (the second round, at the job's frontier). Three paths:

* ``base``: the worker's path before the window moved into the recorders,
  ``frwindow.local_window(snapshot())`` / ``frwindow.window(...)``, run from the tree of
  ``--baseline-rev`` (``git archive``; default the commit before the change) in its own processes;
* ``whole``: the same calls on this tree (whole dump built, then cut);
* ``cut``: this tree's worker path, ``hooks.snapshot(cut=frwindow.cutter(...))``.

``whole`` and ``cut`` alternate in one process, and every ``cut`` dump is checked equal to its
``whole`` one (less ``dump_time_ns``); ``base`` and this tree's processes alternate ``--rounds``
times. Medians in ms, and the ratios base/cut and whole/cut.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from torch.distributed.elastic.utils.distributed import get_free_port

REPO = Path(__file__).resolve().parent.parent
BASELINE_REV = "7ff4592"
"""The commit before the window moved into the recorders (the worker built whole dumps)."""

_CHILD = r"""
import datetime, json, os, statistics, sys, time
import torch, torch.distributed as dist
from debug_server.protocol import frwindow
from debug_server.recording import c10d_fr, hooks
from debug_server.recording.comms import new_comm
from debug_server.recording.hooks import FlightRecorderHook

# The whole process's dump: hooks.snapshot since the recording package has one such API,
# c10d_fr.snapshot in a baseline tree from before.
snapshot = getattr(c10d_fr, "snapshot", hooks.snapshot)

shape, n, reps, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
dist.init_process_group("gloo")
t = torch.ones(16)
if shape == "c10d":
    for _ in range(n + 100):
        dist.all_reduce(t)
else:
    comm = new_comm("gloo", "cpu", "main_comm", timeout=datetime.timedelta(seconds=60))
    hook = FlightRecorderHook(max_entries=n).register_with_comm(comm)
    for _ in range(n + 100):
        comm.all_reduce(t)
        if shape == "hooks+c10d":
            dist.all_reduce(t)

# c10d retires a gloo op from its own thread a moment after it returns: wait for one state.
deadline, whole = time.monotonic() + 30, None
while time.monotonic() < deadline:
    prev, whole = whole, snapshot()
    whole.pop("dump_time_ns")
    if whole == prev:
        break
    time.sleep(0.05)
since = frwindow.frontier({0: whole})  # one rank: the job's frontier is its own


def whole_then(cut_after):
    return lambda: cut_after(snapshot())


requests = {"window=4": lambda d: frwindow.local_window(d, 4), "since": lambda d: frwindow.window(d, since)}
rows = []
for name, cut_after in requests.items():
    paths = {"whole": whole_then(cut_after)}
    if mode == "new":
        cutter = (frwindow.cutter(slack=4) if name == "window=4" else frwindow.cutter(since=since))
        paths["cut"] = lambda cutter=cutter: snapshot(cut=cutter)
    outs = {k: fn() for k, fn in paths.items()}
    for d in outs.values():
        d.pop("dump_time_ns", None)
    times = {k: [] for k in paths}
    for _ in range(reps):
        for k, fn in paths.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    rows.append({"shape": shape, "request": name, "ring": len(whole["entries"]),
                 "kept": len(outs["whole"]["entries"]),
                 "equal": outs.get("cut", outs["whole"]) == outs["whole"], "times": times})
print("ROWS " + json.dumps(rows), flush=True)
dist.destroy_process_group()
"""


def run_child(shape: str, entries: int, reps: int, port: int, mode: str, src: Path
              ) -> list[dict[str, Any]]:
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), TORCH_FR_BUFFER_SIZE=str(entries), PYTHONPATH=str(src))
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(_CHILD)
    try:
        proc = subprocess.run([sys.executable, f.name, shape, str(entries), str(reps), mode],
                              env=env, capture_output=True, text=True, timeout=600)
    finally:
        os.unlink(f.name)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("ROWS ")), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"{shape} ({mode}): child exited {proc.returncode}\n{proc.stderr[-3000:]}")
    rows: list[dict[str, Any]] = json.loads(line[5:])
    return rows


def baseline_tree(rev: str, into: Path) -> Path:
    """``rev``'s ``debug_server`` package, unpacked under ``into``."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "debug_server"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--entries", type=int, default=2000, help="ring size (hook and c10d)")
    p.add_argument("--reps", type=int, default=21, help="timed repetitions per path and round")
    p.add_argument("--rounds", type=int, default=2, help="base and this tree alternate this often")
    p.add_argument("--shapes", nargs="+", default=["hooks", "hooks+c10d", "c10d"])
    p.add_argument("--baseline-rev", default=BASELINE_REV,
                   help="git revision of the 'base' path; 'none' leaves it out")
    p.add_argument("--port", type=int, default=0,
                   help="first MASTER_PORT of the children, the next one per child (0: a free one each)")
    args = p.parse_args()
    t0 = time.time()
    times: dict[tuple[str, str], dict[str, list[float]]] = {}
    facts: dict[tuple[str, str], dict[str, Any]] = {}
    port = args.port
    with tempfile.TemporaryDirectory(prefix="bench_worker_fr_") as tmp:
        base = None if args.baseline_rev == "none" else baseline_tree(args.baseline_rev, Path(tmp))
        for shape in args.shapes:
            for _ in range(args.rounds):
                runs = [("new", REPO)] + ([("base", base)] if base is not None else [])
                for mode, src in runs:
                    port = port + 1 if args.port else get_free_port()
                    for r in run_child(shape, args.entries, args.reps, port, mode, src):
                        key = (r["shape"], r["request"])
                        got = times.setdefault(key, {})
                        for path, ts in r["times"].items():
                            got.setdefault("base" if mode == "base" else path, []).extend(ts)
                        if mode == "new":
                            prev = facts.get(key)
                            facts[key] = {**r, "equal": r["equal"] and (prev is None or prev["equal"])}
    print(f"worker FR window, {args.entries}-entry rings, medians of {args.reps * args.rounds} "
          f"per path, base = {args.baseline_rev} ({time.time() - t0:.0f} s)")
    print(f"{'shape':<11} {'request':<9} {'ring':>5} {'kept':>5} {'base ms':>8} {'whole ms':>9} "
          f"{'cut ms':>7} {'base/cut':>9} {'whole/cut':>10}  equal")
    for key, f in facts.items():
        med = {k: statistics.median(v) * 1e3 for k, v in times[key].items()}
        base_ms, cut_ms, whole_ms = med.get("base"), med["cut"], med["whole"]
        b = f"{base_ms:.2f}" if base_ms is not None else "-"
        ratio = f"{base_ms / cut_ms:.2f}" if base_ms is not None else "-"
        print(f"{key[0]:<11} {key[1]:<9} {f['ring']:>5} {f['kept']:>5} {b:>8} {whole_ms:>9.2f} "
              f"{cut_ms:>7.2f} {ratio:>9} {whole_ms / cut_ms:>10.2f}  {f['equal']}")
    if not all(f["equal"] for f in facts.values()):
        raise SystemExit("a cut dump differs from the whole dump cut afterwards")


if __name__ == "__main__":
    main()
