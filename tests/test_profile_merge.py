"""profile_merge: interval arithmetic, the per-rank GPU split, flags, and the one-trace merge.

GPU kernels cannot be produced on this CPU-only machine, so GPU traces here are written by hand in
torch.profiler's Chrome format (``cat: kernel``, ``ts``/``dur`` in microseconds); the CPU trace
is a real capture of this process (``rank_capture.capture_profile``).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from _scenarios import PROFILE_BASE_NS as BASE_NS
from _scenarios import gpu_trace, kernel

from debug_server.analysis import profile_merge as pm
from debug_server.rank.rank_capture import capture_profile


def test_union_merges_overlapping_and_touching_intervals() -> None:
    assert pm.union([(5, 7), (0, 2), (1, 3), (3, 4), (9, 9)]) == [(0, 4), (5, 7)]


def test_overlap_length_counts_time_in_both_unions() -> None:
    a = pm.union([(0, 10), (20, 30)])
    b = pm.union([(5, 25)])
    assert pm.overlap_length(a, b) == 10.0


def test_comm_kernels_are_told_by_name() -> None:
    comm = ["ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
            "ncclKernel_AllGather_RING_LL_Sum_int8_t", "rccl_kernel", "cross_device_reduce_1stage",
            "two_shot_all_reduce_kernel"]
    compute = ["void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor>",
               "sm90_xmma_gemm_bf16bf16_bf16f32", "void at::native::reduce_kernel<512, 1>"]
    assert all(pm.COMM_KERNEL.search(n) for n in comm)
    assert not any(pm.COMM_KERNEL.search(n) for n in compute)


def test_gpu_split_from_kernel_intervals() -> None:
    # comm [0,100) and [150,250); compute [50,200): overlap 50+50, exposed 100; window 1000 us.
    trace = gpu_trace([kernel("ncclDevKernel_AllReduce", 0, 100, stream=20),
                       kernel("ncclDevKernel_AllReduce", 150, 100, stream=20),
                       kernel("sm90_gemm", 50, 150)])
    s = pm.summarize(3, trace).as_dict()
    assert (s["rank"], s["gpu"], s["kernels"], s["comm_kernels"]) == (3, True, 3, 2)
    assert (s["comm_frac"], s["compute_frac"], s["overlap_frac"], s["exposed_frac"]) == (
        0.2, 0.15, 0.1, 0.1)
    assert s["idle_frac"] == 0.75 and s["hidden_share"] == 0.5  # busy: [0, 250)


def test_kernels_outside_the_capture_window_are_clipped() -> None:
    trace = gpu_trace([kernel("sm90_gemm", 900, 500)], window=(0.0, 1000.0))
    assert pm.summarize(0, trace).as_dict()["compute_frac"] == 0.1


def test_rank_without_kernels_says_no_gpu_activity_and_no_numbers() -> None:
    s = pm.summarize(1, gpu_trace([])).as_dict()
    assert s["note"] == "no GPU activity" and "comm_frac" not in s and s["gpu"] is False


def test_real_cpu_capture_has_a_window_and_no_gpu_activity() -> None:
    trace = pm.parse_trace(capture_profile(0.2))
    s = pm.summarize(0, trace).as_dict()
    assert s["note"] == "no GPU activity"
    assert 150 < s["window_ms"] < 5000  # the profiler's own span of the 0.2 s capture


def _rank_with(exposed_us: float) -> dict[str, Any]:
    # compute [0,400); comm [300, 300 + 100 + exposed): 100 us hidden, the rest exposed
    return gpu_trace([kernel("sm90_gemm", 0, 400),
                      kernel("ncclDevKernel_AllReduce", 300, 100 + exposed_us, stream=20)])


def test_rank_with_much_more_exposed_communication_is_flagged() -> None:
    summaries = [pm.summarize(r, _rank_with(600 if r == 5 else 50)) for r in range(8)]
    flags = pm.flag(summaries)
    assert {(f["rank"], f["metric"], f["direction"]) for f in flags} >= {
        (5, "exposed_frac", "high")}
    assert {f["rank"] for f in flags} == {5}
    exposed = next(f for f in flags if f["metric"] == "exposed_frac")
    assert exposed["reason"] == ("exposed communication 60.0% of the window vs median 5.0% "
                                 "(higher than the others)")


def test_equal_ranks_and_cpu_only_ranks_are_not_flagged() -> None:
    summaries = [pm.summarize(r, _rank_with(50)) for r in range(4)]
    summaries += [pm.summarize(r, gpu_trace([])) for r in range(4, 8)]
    assert pm.flag(summaries) == []


def test_merge_makes_one_process_per_rank_named_by_rank() -> None:
    merged = pm.merge({0: gpu_trace([kernel("k", 10, 5)]), 1: gpu_trace([kernel("k", 10, 5)])})
    names = {e["pid"]: e["args"]["name"] for e in merged["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    assert {e["pid"] for e in merged["traceEvents"]} == {0, 1}


def test_merge_puts_ranks_on_one_clock() -> None:
    # rank 1's base is 2 ms later: its kernel at ts=10 happened at 2010 us on rank 0's clock.
    merged = pm.merge({0: gpu_trace([kernel("k", 10, 5)]),
                       1: gpu_trace([kernel("k", 10, 5)], base_ns=BASE_NS + 2_000_000)})
    ts = {e["pid"]: e["ts"] for e in merged["traceEvents"] if e.get("cat") == "kernel"}
    assert ts == {0: 10.0, 1: 2010.0}
    assert merged["baseTimeNanoseconds"] == BASE_NS


def test_merge_names_cpu_threads_and_gpu_streams_within_a_rank() -> None:
    merged = pm.merge({2: gpu_trace([kernel("k", 10, 5)])})
    threads = {e["args"]["name"] for e in merged["traceEvents"]
               if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"GPU 0: stream 7", "CPU: thread 4242 (python)"} <= threads


def test_merge_keeps_each_ranks_flow_arrows_apart() -> None:
    merged = pm.merge({0: gpu_trace([kernel("k", 10, 5)]), 1: gpu_trace([kernel("k", 10, 5)])})
    flows = [(e["pid"], e["ph"], e["id"]) for e in merged["traceEvents"] if e["ph"] in "sf"]
    ids = {pid: {i for p, _, i in flows if p == pid} for pid in (0, 1)}
    assert len(ids[0]) == len(ids[1]) == 1 and ids[0] != ids[1]  # s and f share one id per rank


def test_merge_does_not_change_the_input_traces() -> None:
    trace = gpu_trace([kernel("k", 10, 5)])
    before = json.dumps(trace, sort_keys=True)
    pm.merge({7: trace})
    assert json.dumps(trace, sort_keys=True) == before


def test_merge_drops_events_without_a_numeric_timestamp() -> None:
    trace = gpu_trace([kernel("k", 10, 5)])
    trace["traceEvents"] += [{"ph": "X", "name": "bad", "ts": "soon"}, "not an event", None]
    merged = pm.merge({0: trace})
    assert merged["otherData"]["dropped_events"] == 3
    assert "bad" not in {e.get("name") for e in merged["traceEvents"]}


@pytest.mark.parametrize(("body", "reason"), [
    ("<html>oops</html>", "reply is not JSON"),
    ('{"schemaVersion": 1}', "not a Chrome trace (no traceEvents list)"),
    ('"a string"', "not a Chrome trace (no traceEvents list)"),
])
def test_unusable_trace_is_refused_in_one_line(body: str, reason: str) -> None:
    with pytest.raises(pm.TraceError) as e:
        pm.parse_trace(body)
    assert str(e.value).startswith(reason) and "\n" not in str(e.value)


def test_merge_in_place_gives_the_same_trace_as_a_copying_merge() -> None:
    def traces() -> dict[int, Any]:
        return {0: gpu_trace([kernel("k", 10, 5)]),
                1: gpu_trace([kernel("k", 10, 5)], base_ns=BASE_NS + 5)}

    assert pm.merge(traces(), in_place=True) == pm.merge(traces())
