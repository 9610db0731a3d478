"""What /profile's merge costs at 64 ranks, against the least any single-file download costs.

    python benchmarks/bench_profile_merge.py                  # 64 ranks x ~6000 events
    python benchmarks/bench_profile_merge.py --ranks 256 --events 20000

Each rank's trace is a real ``torch.profiler`` capture of this process (a matmul loop on the main
thread, captured from a side thread as the worker does), its CPU events repeated to ``--events``,
plus GPU kernels on a compute and a communication stream with CPU->GPU flow arrows (this machine
has no GPU; their layout is torch.profiler's). Ranks differ in ``baseTimeNanoseconds`` and kernel
timings. The input is the ranks' reply bodies (JSON text), as the frontend receives them.

* **ours**: what ``pages_extra.build_capture`` does: parse every body, the per-rank GPU split,
  the merge into one trace (pid per rank, threads, clock shift, flow ids; in place, as
  build_capture does), compact JSON.
* **baseline**: parse every body and write their event lists concatenated as one JSON file,
  nothing else: the floor of any single-file download.

Medians of ``--repeats`` runs of each (interleaved) and the ratio ours / baseline; then the peak
Python heap of one run of each (tracemalloc) and that ratio.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
import tracemalloc
from typing import Any

from debug_server.analysis import profile_merge
from debug_server.rank.rank_capture import capture_profile


def real_cpu_trace(seconds: float) -> dict[str, Any]:
    import torch

    out: dict[str, bytes] = {}
    t = threading.Thread(target=lambda: out.setdefault("t", capture_profile(seconds)))
    t.start()
    a = torch.randn(64, 64)
    while t.is_alive():
        (a @ a).sum()
    t.join()
    return json.loads(out["t"])


def rank_body(template: dict[str, Any], rank: int, events: int, rng: random.Random) -> str:
    cpu = [e for e in template["traceEvents"] if e.get("ph") != "M"]
    meta = [e for e in template["traceEvents"] if e.get("ph") == "M"]
    span = next(e for e in cpu if e.get("cat") == "Trace")
    t0, width = span["ts"], span["dur"]
    body: list[dict[str, Any]] = list(meta)
    n_kernels = events // 3
    i = 0
    while len(body) < events - 2 * n_kernels:  # CPU events, repeated across the window
        e = dict(cpu[i % len(cpu)])
        e["ts"] = t0 + (e["ts"] - t0 + (i // len(cpu)) * 7.0) % width
        body.append(e)
        i += 1
    body += [{"ph": "M", "name": "process_labels", "pid": 0, "tid": 0, "args": {"labels": "GPU 0"}},
             {"ph": "M", "name": "thread_name", "pid": 0, "tid": 7, "args": {"name": "stream 7"}},
             {"ph": "M", "name": "thread_name", "pid": 0, "tid": 20, "args": {"name": "stream 20"}}]
    step = width / n_kernels
    for k in range(n_kernels):
        ts = t0 + k * step
        comm = k % 4 == 0
        dur = step * (3.0 if comm else 0.6) * rng.uniform(0.8, 1.2)
        name = ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
                if comm else "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64")
        tid = 20 if comm else 7
        body.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": tid, "ts": ts,
                     "dur": dur, "args": {"device": 0, "stream": tid, "correlation": k}})
        body.append({"ph": "f", "id": k, "pid": 0, "tid": tid, "ts": ts, "cat": "ac2g",
                     "name": "ac2g", "bp": "e"})
    trace = {k: v for k, v in template.items() if k != "traceEvents"}
    trace["baseTimeNanoseconds"] = int(template.get("baseTimeNanoseconds", 0)) + rank * 1_000_003
    trace["traceEvents"] = body
    return json.dumps(trace)


def ours(bodies: dict[int, str]) -> bytes:
    traces = {r: profile_merge.parse_trace(b) for r, b in bodies.items()}
    summaries = [profile_merge.summarize(r, t) for r, t in traces.items()]
    profile_merge.flag(summaries)
    return profile_merge.to_json(profile_merge.merge(traces, in_place=True))


def baseline(bodies: dict[int, str]) -> bytes:
    events: list[Any] = []
    for b in bodies.values():
        events += json.loads(b)["traceEvents"]
    return json.dumps({"traceEvents": events}, separators=(",", ":")).encode()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--events", type=int, default=6000, help="events per rank")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    rng = random.Random(0)
    template = real_cpu_trace(0.5)
    bodies = {r: rank_body(template, r, args.events, rng) for r in range(args.ranks)}
    total_mb = sum(len(b) for b in bodies.values()) / 1e6
    n_events = sum(len(json.loads(b)["traceEvents"]) for b in bodies.values())
    print(f"{args.ranks} ranks, {n_events} events, {total_mb:.1f} MB of rank replies "
          f"(real CPU capture: {len(template['traceEvents'])} events)")
    times: dict[str, list[float]] = {"ours": [], "baseline": []}
    sizes = {}
    for _ in range(args.repeats):
        for name, fn in (("baseline", baseline), ("ours", ours)):
            t = time.perf_counter()
            sizes[name] = len(fn(bodies))
            times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    for k in ("baseline", "ours"):
        print(f"{k:9s} median {med[k] * 1e3:8.1f} ms over {args.repeats} runs "
              f"(min {min(times[k]) * 1e3:.1f}, max {max(times[k]) * 1e3:.1f}); "
              f"output {sizes[k] / 1e6:.1f} MB")
    print(f"ratio ours / baseline (time): {med['ours'] / med['baseline']:.2f}")
    peaks = {}
    for name, fn in (("baseline", baseline), ("ours", ours)):
        tracemalloc.start()
        fn(bodies)
        peaks[name] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    print(f"peak heap: baseline {peaks['baseline'] / 1e6:.0f} MB, ours {peaks['ours'] / 1e6:.0f} MB;"
          f" ratio {peaks['ours'] / peaks['baseline']:.2f}")


if __name__ == "__main__":
    main()
