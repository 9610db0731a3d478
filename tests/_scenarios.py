"""Scenario corpus for the analyzer tests: synthetic dumps in the recorder's schema.

Each builder returns ``{rank: dump}``; tests assert the exact findings each one must produce.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import Any

from _jobsim import JobSim

from debug_server.stacks import with_source
from debug_server.tools.synthetic import hang_job, make_dump, make_entry

DATA = os.path.join(os.path.dirname(__file__), "data")

Dumps = dict[int, dict[str, Any]]


def load_fixture(name: str) -> Dumps:
    """A captured real dump set from tests/data (JSON: {"dumps": {rank: dump}})."""
    with open(os.path.join(DATA, name), encoding="utf-8") as f:
        return {int(r): d for r, d in json.load(f)["dumps"].items()}


C10D_CAPTURE = os.path.join(DATA, "c10d_merge_gloo.json")
"""What ``scripts/capture_c10d_fixture.py`` read of a real 2-rank gloo job, per rank."""


def c10d_capture() -> dict[int, dict[str, Any]]:
    """Per rank of ``C10D_CAPTURE``: our hooks' dump (``ours``), c10d's recorders, the groups
    and the communicators ours owns, as ``recording.c10d_fr`` reads them in a live rank."""
    with open(C10D_CAPTURE, encoding="utf-8") as f:
        return {int(r): v for r, v in json.load(f)["ranks"].items()}


def _seqs(
    n: int, *, comm: str = "main_comm", start_record: int = 0, hang_last: bool = False, **kw: Any
) -> list[dict[str, Any]]:
    return [
        make_entry(
            record_id=start_record + s,
            comm=comm,
            seq=s,
            state="started" if hang_last and s == n - 1 else "completed",
            **kw,
        )
        for s in range(n)
    ]


def clean(world: int = 2, n: int = 5) -> Dumps:
    return {r: make_dump(_seqs(n), {"main_comm": range(world)}) for r in range(world)}


def missing_rank() -> Dumps:
    """The reference demo: rank 1 never issues all_reduce #4."""
    return hang_job(2, 5, missing_rank=1)


def _with_odd_entry(world: int, seq: int, odd_rank: int, **odd: Any) -> Dumps:
    dumps = {}
    for r in range(world):
        ents = _seqs(5)
        if r == odd_rank:
            ents[seq] = make_entry(record_id=seq, seq=seq, **odd)
        dumps[r] = make_dump(ents, {"main_comm": range(world)})
    return dumps


def type_mismatch() -> Dumps:
    """Rank 2 of 4 broadcasts where the others all_reduce (#2)."""
    return _with_odd_entry(4, 2, 2, op="broadcast")


def size_mismatch() -> Dumps:
    """Rank 1 of 4 all_reduces 512 floats where the others use 1024 (#2)."""
    return _with_odd_entry(4, 2, 1, input_sizes=((512,),))


def dtype_mismatch() -> Dumps:
    """Rank 3 of 4 all_reduces Half where the others use Float (#3)."""
    return _with_odd_entry(4, 3, 3, dtype="Half")


def two_subcomms() -> Dumps:
    """4 ranks; sub_a = [0, 1] is fine; rank 3 never issues sub_b #2 that rank 2 waits in."""
    groups = {"main_comm": [0, 1, 2, 3], "sub_a": [0, 1], "sub_b": [2, 3]}
    dumps = {}
    for r in range(4):
        rid = 0
        ents = []
        for s in range(3):
            ents.append(make_entry(record_id=rid, comm="main_comm", seq=s))
            rid += 1
        sub = "sub_a" if r < 2 else "sub_b"
        n = 2 if r == 3 else 3
        for s in range(n):
            hang = sub == "sub_b" and s == 2
            ents.append(
                make_entry(record_id=rid, comm=sub, seq=s, state="started" if hang else "completed")
            )
            rid += 1
        dumps[r] = make_dump(ents, groups)
    return dumps


def wrapped_ring(hang: bool = False) -> Dumps:
    """Rank 0's ring no longer holds main_comm #0-#9 (evicted by other_comm entries).

    With ``hang``, rank 1 also never issues the last all_reduce (#29).
    """
    groups = {"main_comm": [0, 1], "other_comm": [0]}
    n = 30
    r0 = [
        make_entry(
            record_id=100 + s, seq=s, state="started" if hang and s == n - 1 else "completed"
        )
        for s in range(10, n)
    ]
    r1_last = n - 1 if hang else n
    r1 = [make_entry(record_id=s, seq=s) for s in range(r1_last)]
    return {0: make_dump(r0, groups), 1: make_dump(r1, groups)}


def p2p_deadlock() -> Dumps:
    """Both ranks post a recv from the other after 3 all_reduces: nobody sends."""
    groups = {"main_comm": [0, 1]}
    dumps = {}
    for r in range(2):
        ents = _seqs(3)
        peer = 1 - r
        ents.append(
            make_entry(
                record_id=3, seq=3, p2p_seq=1, op="recv", is_p2p=True,
                peer_desc=f"{r}<-{peer}", state="started",
            )
        )  # fmt: skip
        dumps[r] = make_dump(ents, groups)
    return dumps


def send_and_collective_share_number() -> Dumps:
    """A send/recv pair whose collective_seq_id equals the next all_reduce's (recorder schema)."""
    groups = {"main_comm": [0, 1]}
    dumps = {}
    for r in range(2):
        ents = _seqs(3)
        if r == 0:
            ents.append(
                make_entry(record_id=3, seq=3, p2p_seq=1, op="send", is_p2p=True, peer_desc="0->1")
            )
        else:
            ents.append(
                make_entry(record_id=3, seq=3, p2p_seq=1, op="recv", is_p2p=True, peer_desc="1<-0")
            )
        ents.append(make_entry(record_id=4, seq=3))
        ents.append(make_entry(record_id=5, seq=4))
        dumps[r] = make_dump(ents, groups)
    return dumps


def record_id_misaligned(ring: int | None = None) -> Dumps:
    """Rank 0 also drives a private group, so its record_ids run far ahead of rank 1's.

    With ``ring``, rank 0 keeps only its newest ``ring`` entries (PyTorch then drops every rank 1
    entry older than rank 0's oldest record_id and reports rank 1 missing).
    """
    groups = {"main_comm": [0, 1], "solo": [0]}
    r0 = []
    rid = 0
    for s in range(5):
        for k in range(20):
            r0.append(make_entry(record_id=rid, comm="solo", seq=s * 20 + k))
            rid += 1
        r0.append(make_entry(record_id=rid, seq=s))
        rid += 1
    if ring is not None:
        # A ring of 60 keeps main_comm #2-#4 on rank 0 (record_ids 62, 83, 104); rank 1 holds
        # #0-#4 with record_ids 0..4, all older than rank 0's oldest retained record_id.
        r0 = r0[-ring:]
    r1 = [make_entry(record_id=s, seq=s) for s in range(5)]
    return {0: make_dump(r0, groups), 1: make_dump(r1, groups)}


def state_difference() -> Dumps:
    """Rank 1 was dumped a moment earlier: its last all_reduce is still 'started'."""
    dumps = clean(2, 5)
    dumps[1]["entries"][-1] = make_entry(record_id=4, seq=4, state="started")
    return dumps


def stuck_everywhere() -> Dumps:
    """Both ranks issued all_reduce #4 and neither completed it."""
    return {r: make_dump(_seqs(5, hang_last=True), {"main_comm": [0, 1]}) for r in range(2)}


def all_gather_bad_output() -> Dumps:
    """Rank 1 of 4 all_gathers into an output sized for 2 ranks instead of 4."""
    world = 4
    dumps = {}
    for r in range(world):
        out = ((2048,),) if r == 1 else ((4096,),)
        ents = [
            make_entry(
                record_id=0, seq=0, op="all_gather", input_sizes=((1024,),), output_sizes=out
            )
        ]
        dumps[r] = make_dump(ents, {"main_comm": range(world)})
    return dumps


def faulthandler_text(frames: list[tuple[str, int, str]], *, server_thread: bool = True) -> str:
    """faulthandler-style text: the main thread (frames innermost first) and a server thread."""
    lines = ["Thread 0x00007f0000000001 (most recent call first):"]
    lines += [f'  File "{f}", line {ln} in {fn}' for f, ln, fn in frames]
    if server_thread:
        lines += [
            "",
            "Current thread 0x00007f0000000002 (most recent call first):",
            '  File "/site-packages/debug_server/rank/stacks.py", line 20 in dump_all',
            '  File "/usr/lib/python3.11/threading.py", line 975 in run',
            '  File "/usr/lib/python3.11/threading.py", line 1038 in _bootstrap_inner',
            '  File "/usr/lib/python3.11/threading.py", line 995 in _bootstrap',
        ]
    return "\n".join(lines) + "\n"


C10D = "/site-packages/torch/distributed/distributed_c10d.py"


def stack_in_all_reduce(user_file: str = "/job/train.py", line: int = 148) -> str:
    return faulthandler_text(
        [
            (C10D, 2806, "all_reduce"),
            ("/site-packages/torch/distributed/c10d_logger.py", 81, "wrapper"),
            (user_file, line, "train_step"),
            (user_file, 200, "<module>"),
        ]
    )


def stack_sleeping(user_file: str, line: int, func: str = "hang_phase") -> str:
    # As a rank ships it (debug_server.stacks): each frame with its source line where ``user_file``
    # exists when the text is made; the analysis itself reads no files.
    return with_source(faulthandler_text([(user_file, line, func), (user_file, 120, "<module>")]))


# ---------------------------------------------------------------------------------------------
# Real layouts (issue 33), built with the stream model of _jobsim: 2-D meshes, pipelines, FSDP,
# uneven and coalesced collectives, batched P2P, split groups with equal names.

MESH_GROUPS = {"world": ("default_pg", [0, 1, 2, 3]), "tp0": ("mesh_tp", [0, 1]),
               "tp1": ("mesh_tp", [2, 3]), "dp0": ("mesh_dp", [0, 2]), "dp1": ("mesh_dp", [1, 3])}


def mesh_tp_skip(*, hashed: bool = True, skip: int | None = 2, blocking: bool = False,
                 delay_ns: dict[int, int] | None = None) -> JobSim:
    """2x2 mesh (dp [0, 2], [1, 3]; tp [0, 1], [2, 3]), 6 steps of 4 tp all_reduces and one dp
    all_reduce; then tp #24 (line 55), which rank ``skip`` leaves out, dp #6, a final barrier.
    ``blocking``: every op blocks the CPU (gloo) instead of only the barrier (NCCL)."""
    sim = JobSim(4, MESH_GROUPS, hashed=hashed, delay_ns=delay_ns)
    for _ in range(6):
        for _ in range(4):
            sim.coll("tp0", line=50, blocking=blocking)
            sim.coll("tp1", line=50, blocking=blocking)
        sim.coll("dp0", line=60, blocking=blocking)
        sim.coll("dp1", line=60, blocking=blocking)
    sim.coll("tp0", line=55, blocking=blocking)
    sim.coll("tp1", line=55, skip=[skip] if skip is not None else [], blocking=blocking)
    sim.coll("dp0", line=60, blocking=blocking)
    sim.coll("dp1", line=60, blocking=blocking)
    sim.coll("world", "barrier", line=90, blocking=True)
    return sim


def pipeline_skip(*, skip_step: int | None = 3) -> JobSim:
    """4 stages (pp = all 4 ranks) sending activations forward (blocking recvs), dp groups
    [0, 1] and [2, 3]; at ``skip_step`` stage 2 never sends to stage 3 and goes on to its dp
    all_reduce, where rank 3 (still in the recv) is missing."""
    sim = JobSim(4, {"pp": ("pp", [0, 1, 2, 3]), "dp0": ("dp", [0, 1]), "dp1": ("dp", [2, 3])})
    for step in range(5):
        for s in range(3):
            skip = [2] if (step == skip_step and s == 2) else []
            sim.p2p("pp", [(s, s + 1)], skip=skip, blocking_recv=True, line=40 + s)
        sim.coll("dp0", line=70, blocking=True)
        sim.coll("dp1", line=70, blocking=True)
    return sim


def fsdp(*, layers: int = 4, steps: int = 3, stall: int | None = None, world: int = 4) -> JobSim:
    """FSDP: per layer an all_gather_into_tensor (``_all_gather_base``) forward, and per layer a
    reduce_scatter_tensor (``_reduce_scatter_base``) backward on the default group. With
    ``stall``, that rank stops in its data loader before the last step's first all_gather."""
    sim = JobSim(world, {"world": ("default_pg", list(range(world)))})
    shard = 4096
    for step in range(steps):
        for _ in range(layers):
            skip = [stall] if (stall is not None and step == steps - 1) else []
            sim.coll("world", "_all_gather_base", ins=((shard,),), outs=((shard * world,),),
                     skip=skip, line=30)
        for _ in range(layers):
            skip = [stall] if (stall is not None and step == steps - 1) else []
            sim.coll("world", "_reduce_scatter_base", ins=((shard * world,),), outs=((shard,),),
                     skip=skip, line=35, blocking=True)
    return sim


def uneven(kind: str, *, missing: int | None = None, world: int = 4,
           bad: int | None = None) -> JobSim:
    """c10d on NCCL: an uneven all_gather is a run of ``_broadcast_oop`` closed by
    ``ALLGATHER_coalesced``; an uneven reduce_scatter a run of ``_reduce_oop`` closed by
    ``REDUCE_SCATTER_coalesced`` (one seq for the run). Two all_reduces before, one after; rank
    ``missing`` stops before the run, rank ``bad`` gives its second tensor another size."""
    sim = JobSim(world, {"world": ("default_pg", list(range(world)))})
    inner, closer = (("_broadcast_oop", "ALLGATHER_coalesced") if kind == "all_gather"
                     else ("_reduce_oop", "REDUCE_SCATTER_coalesced"))
    sizes = [(5 + 3 * i, 2) for i in range(world)]  # 10, 16, 22, 28 elements: uneven
    for _ in range(2):
        sim.coll("world", line=20)
    run = [(inner, ((a, b),), ((a, b),)) for a, b in sizes] + [(closer, (), ())]
    odd = {bad: [*run[:1], (inner, ((7, 7),), ((7, 7),)), *run[2:]]} if bad is not None else {}
    sim.coll("world", parts=run, odd_parts=odd, line=25, blocking=True,
             skip=[missing] if missing is not None else [])
    sim.coll("world", line=28, blocking=True, skip=[missing] if missing is not None else [])
    return sim


def batched_p2p(*, skip: int | None = None, world: int = 4, steps: int = 3) -> JobSim:
    """A ring exchange by ``batch_isend_irecv`` (each rank sends to r+1, receives from r-1, as
    one batch closed by a P2P ``coalesced`` entry), then an all_reduce, per step; rank ``skip``
    posts no batch in the last step."""
    sim = JobSim(world, {"world": ("default_pg", list(range(world)))})
    ring = [(r, (r + 1) % world) for r in range(world)]
    for step in range(steps):
        sim.p2p("world", ring, batch=True, skip=[skip] if skip is not None and step == steps - 1
                else [], line=45)
        sim.coll("world", line=48, blocking=True)
    return sim


def split_equal_names(*, skip: int | None = 3) -> dict[int, dict[str, Any]]:
    """Our communicators split twice with one name: ``sub`` [0, 1] and ``sub`` [2, 3]; rank
    ``skip`` never issues sub #2 (ranks 2 and 3's), which its partner waits in."""
    groups = {"main_comm": [0, 1, 2, 3], "sub": [0, 1]}
    dumps = {}
    for r in range(4):
        mine = dict(groups) if r < 2 else {"main_comm": [0, 1, 2, 3], "sub": [2, 3]}
        ents = [make_entry(record_id=s, seq=s) for s in range(2)]
        n = 2 if r == skip else 3
        for s in range(n):
            hang = r >= 2 and s == 2
            ents.append(make_entry(record_id=2 + s, comm="sub", seq=s,
                                   state="started" if hang else "completed"))
        dumps[r] = make_dump(ents, mine)
    return dumps


# ---------------------------------------------------------------------------------------------
# Profiles: GPU traces in torch.profiler's Chrome format (no GPU here to capture one)

PROFILE_BASE_NS = 1_790_000_000_000_000_000


def kernel(name: str, ts: float, dur: float, stream: int = 7) -> dict[str, Any]:
    """One GPU kernel event of a torch.profiler trace (``ts``/``dur`` in microseconds)."""
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts,
            "dur": dur, "args": {"device": 0, "stream": stream}}


def gpu_trace(kernels: list[dict[str, Any]], *, window: tuple[float, float] = (0.0, 1000.0),
              base_ns: int = PROFILE_BASE_NS, host: str = "node-a") -> dict[str, Any]:
    """A trace shaped as torch.profiler writes it: the profiler span, process/thread names,
    a CPU launch with its flow arrow to the first kernel."""
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": 4242, "tid": 0, "args": {"name": "python"}},
        {"ph": "M", "name": "process_labels", "pid": 4242, "tid": 0, "args": {"labels": "CPU"}},
        {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "python"}},
        {"ph": "M", "name": "process_labels", "pid": 0, "tid": 0, "args": {"labels": "GPU 0"}},
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": 7, "args": {"name": "stream 7"}},
        {"ph": "M", "name": "thread_name", "pid": 4242, "tid": 4242,
         "args": {"name": "thread 4242 (python)"}},
        {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans",
         "tid": "PyTorch Profiler", "ts": window[0], "dur": window[1] - window[0]},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 4242, "tid": 4242,
         "ts": window[0] + 1, "dur": 2.0},
        {"ph": "s", "id": 17, "pid": 4242, "tid": 4242, "ts": window[0] + 1, "cat": "ac2g",
         "name": "ac2g"},
    ]
    if kernels:
        k = kernels[0]
        events.append({"ph": "f", "id": 17, "pid": 0, "tid": k["tid"], "ts": k["ts"],
                       "cat": "ac2g", "name": "ac2g", "bp": "e"})
    return {"schemaVersion": 1, "host_name": host, "baseTimeNanoseconds": base_ns,
            "traceEvents": events + kernels}


# ---------------------------------------------------------------------------------------------
# Stragglers: rings whose ranks issue each collective late by a given lag

MS = 1_000_000
"""A millisecond in nanoseconds."""
T0 = 1_700_000_000 * 10**9
"""When ``lagged_rings``' seq 0 was nominally issued."""


def lagged_rings(m: int, ops: int, lag: Callable[[int, int], float], *,
                 group: str = "main_comm", members: Sequence[int] | None = None,
                 start_lag: Callable[[int, int], float] | None = None,
                 skew_ns: dict[int, int] | None = None,
                 into: dict[int, dict[str, Any]] | None = None) -> dict[int, dict[str, Any]]:
    """Rings of ``m`` ranks issuing ``ops`` all_reduces 100 ms apart; rank r issues seq s at
    ``lag(r, s)`` ms after the op's nominal time (plus ``skew_ns[r]``: its clock's offset)."""
    ranks = list(members) if members is not None else list(range(m))
    out = into if into is not None else {}
    for r in ranks:
        d = out.setdefault(r, {"pg_config": {}, "entries": []})
        d["pg_config"][group] = {"name": group, "desc": "gloo", "ranks": str(ranks)}
        for s in range(ops):
            created = T0 + s * 100 * MS + int(lag(r, s) * MS) + (skew_ns or {}).get(r, 0)
            e = {"process_group": [group, "gloo"], "collective_seq_id": s,
                 "profiling_name": "nccl:all_reduce", "time_created_ns": created,
                 "state": "completed"}
            if start_lag is not None:
                e["time_discovered_started_ns"] = (T0 + s * 100 * MS + int(start_lag(r, s) * MS)
                                                   + (skew_ns or {}).get(r, 0))
            d["entries"].append(e)
    return out
