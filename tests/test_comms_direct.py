"""The communicator's direct c10d calls (``recording/calls.py``) on real 3-rank gloo jobs.

Every op calls the C++ ProcessGroup method itself with cached options; these tests check the
results and the semantics the public wrappers add: ranks in the communicator (a split group,
where they differ from global ranks), the fallbacks (complex tensors, a peer that is this
rank), the coalescing manager, and that the direct path really skips ``torch.distributed``'s
functions. Each job runs under our recorder and under c10d's (the c10d-backed mode, forced).
"""

from __future__ import annotations

import json

import pytest
from mpjob import rank0_result, run_job

pytestmark = pytest.mark.job

# Each rank checks its own results; rank 0 prints its own.
OPS_JOB = r'''
import json, os
import torch
import torch.distributed as dist
from debug_server.recording.comms import new_comm, ReduceOp

comm = new_comm("gloo", torch.device("cpu"), "main_comm")
r = comm.get_rank()
out = {"direct": comm._calls.direct}
t = torch.full((4,), float(r + 1))
comm.all_reduce(t)
out["all_reduce"] = t.tolist()
t = torch.full((2,), float(r + 1))
comm.all_reduce(t, op=ReduceOp.MAX)
out["all_reduce_max"] = t.tolist()
t = torch.full((2,), float(r))
comm.broadcast(t, root=2)
out["broadcast"] = t.tolist()
t = torch.full((2,), float(r + 1))
comm.reduce(t, root=1)
ref = torch.full((2,), float(r + 1))
dist.reduce(ref, dst=1)  # bare torch on the default group, for comparison
out["reduce_on_1"] = [t.tolist(), ref.tolist()]
o = torch.zeros(3)
comm.all_gather_single(o, torch.tensor([float(r)]))
out["all_gather_single"] = o.tolist()
o = torch.zeros(3)
comm.all_to_all_single(o, torch.tensor([10.0 * r + i for i in range(3)]))
out["all_to_all_single"] = o.tolist()
c = torch.full((2,), complex(r, 1))
comm.all_reduce(c)  # complex: the public function views it as real
out["complex"] = [[x.real, x.imag] for x in c.tolist()]
w = comm.all_reduce(torch.ones(1), async_op=True)
out["async_wait"] = w.wait()
seq = comm.next_seq
try:
    comm.broadcast(torch.ones(1), root=3)
    out["bad_root"] = "returned"
except ValueError as e:
    out["bad_root"] = [str(e), comm.next_seq - seq]
# P2P in a ring: sync send, async recv.
nxt, prv = (r + 1) % 3, (r + 2) % 3
buf = torch.zeros(2)
rw = comm.recv(buf, src=prv, async_op=True)
comm.send(torch.full((2,), float(r)), dst=nxt)
rw.wait()
out["recv_from_prev"] = buf.tolist()
try:
    comm.send(torch.ones(1), dst=r)
    out["send_to_self"] = "returned"
except RuntimeError as e:
    out["send_to_self"] = str(e)
# A split communicator over global ranks 1 and 2: its root 1 is global rank 2.
if r in (1, 2):
    sub = comm.split([1, 2], "sub")
    t = torch.full((2,), float(r))
    sub.broadcast(t, root=1)
    out["split_broadcast_root_1"] = t.tolist()
    o = torch.zeros(2)
    sub.all_gather_single(o, torch.tensor([float(r)]))
    out["split_all_gather"] = o.tolist()
    sub.finalize()
else:
    out["split_broadcast_root_1"] = out["split_all_gather"] = None
if r == 0:
    print("RESULT", json.dumps(out), flush=True)
comm.barrier()
dist.destroy_process_group()
'''

RECORDERS = {"python": {}, "c10d": {"DEBUG_SERVER_RECORDER": "c10d", "TORCH_FR_BUFFER_SIZE": "2000"}}


@pytest.fixture(scope="module", params=sorted(RECORDERS))
def ops(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp(f"direct_{request.param}")
    return rank0_result(run_job(OPS_JOB, 3, work, timeout=90, extra_env=RECORDERS[request.param]))


@pytest.mark.timeout(120)
def test_ops_take_the_direct_call_on_a_plain_gloo_group(ops: dict) -> None:
    assert ops["direct"] is True


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("key", "expected"), [
    ("all_reduce", [6.0] * 4),
    ("all_reduce_max", [3.0] * 2),
    ("broadcast", [2.0, 2.0]),
    ("all_gather_single", [0.0, 1.0, 2.0]),
    ("all_to_all_single", [0.0, 10.0, 20.0]),
    ("complex", [[3.0, 3.0], [3.0, 3.0]]),
    ("async_wait", True),
    ("recv_from_prev", [2.0, 2.0]),
])
def test_direct_ops_give_rank_0_the_result_torch_gives(ops: dict, key: str, expected: object) -> None:
    assert ops[key] == expected


@pytest.mark.timeout(120)
def test_reduce_leaves_a_non_root_tensor_as_bare_torch_does(ops: dict) -> None:
    # Rank 0 is not the root (1): what gloo leaves there, compared with bare torch.
    ours, bare = ops["reduce_on_1"]
    assert ours == bare


@pytest.mark.timeout(120)
def test_send_to_this_rank_raises_torchs_error_naming_the_op(ops: dict) -> None:
    assert ops["send_to_self"].startswith("send p2p #2 on communicator 'main_comm' (gloo, rank 0 of 3) failed: "
                                          "Invalid destination rank")


@pytest.mark.timeout(120)
def test_root_outside_the_communicator_raises_before_using_a_sequence_number(ops: dict) -> None:
    assert ops["bad_root"] == ["root 3 is not a rank of this communicator (size 3)", 0]


# Rank 0 is not in the split; ranks 1 and 2 check their own results and print them.
SPLIT_JOB = OPS_JOB.replace("if r == 0:\n    print(", "if r == 1:\n    print(")
assert SPLIT_JOB != OPS_JOB


@pytest.mark.timeout(120)
def test_split_communicator_ranks_are_group_ranks_in_direct_calls(tmp_path) -> None:
    results = run_job(SPLIT_JOB, 3, tmp_path, timeout=90)
    assert all(r.returncode == 0 for r in results), [r.stderr[-2000:] for r in results]
    line = next(ln for ln in results[1].stdout.splitlines() if ln.startswith("RESULT "))
    out = json.loads(line[len("RESULT "):])
    # root 1 of the split is global rank 2, which broadcast 2.0; the gather is in group order.
    assert out["split_broadcast_root_1"] == [2.0, 2.0]
    assert out["split_all_gather"] == [1.0, 2.0]


# The direct path never enters torch.distributed's wrappers: with them replaced by functions
# that raise, plain ops still run, and a complex tensor (the fallback) reaches the wrapper.
NO_WRAPPER_JOB = r'''
import json
import torch
import torch.distributed as dist
from debug_server.recording.comms import new_comm

comm = new_comm("gloo", torch.device("cpu"), "main_comm")
def refuse(*a, **k):
    raise AssertionError("public wrapper called")
for name in ("all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "all_to_all_single",
             "send", "recv", "isend", "irecv"):
    setattr(dist, name, refuse)
t = torch.ones(2)
comm.all_reduce(t)
comm.broadcast(t, root=0)
comm.reduce(t, root=0)
comm.all_gather_single(torch.zeros(1), torch.ones(1))
comm.all_to_all_single(torch.zeros(1), torch.ones(1))
try:
    comm.all_reduce(torch.ones(1, dtype=torch.complex64))
    fallback = "no wrapper"
except Exception as e:
    fallback = str(e)
print("RESULT", json.dumps({"sum": t.tolist(), "fallback": fallback}), flush=True)
'''


@pytest.mark.timeout(90)
@pytest.mark.parametrize("recorder", sorted(RECORDERS))
def test_direct_path_skips_torch_distributed_wrappers_and_complex_falls_back(tmp_path, recorder: str) -> None:
    out = rank0_result(run_job(NO_WRAPPER_JOB, 1, tmp_path, timeout=60, extra_env=RECORDERS[recorder]))
    assert out["sum"] == [1.0, 1.0]
    assert "public wrapper called" in out["fallback"]


# Inside torch's _coalescing_manager on the communicator's group, ops are queued by the wrapper
# and issued together at the end (the fallback): the sums must be those of one coalesced call.
COALESCE_JOB = r'''
import json
import torch
import torch.distributed as dist
from debug_server.recording.comms import new_comm

comm = new_comm("gloo", torch.device("cpu"), "main_comm")
a, b = torch.full((2,), 1.0 + comm.get_rank()), torch.full((3,), 10.0)
with dist.distributed_c10d._coalescing_manager(group=comm.process_group):
    comm.all_reduce(a)
    comm.all_reduce(b)
    queued = len(dist.distributed_c10d._world.pg_coalesce_state.get(comm.process_group, []))
if comm.get_rank() == 0:
    print("RESULT", json.dumps({"queued": queued, "a": a.tolist(), "b": b.tolist()}), flush=True)
dist.destroy_process_group()
'''


@pytest.mark.timeout(90)
def test_ops_inside_torchs_coalescing_manager_are_queued_by_torch(tmp_path) -> None:
    out = rank0_result(run_job(COALESCE_JOB, 2, tmp_path, timeout=60))
    assert out == {"queued": 2, "a": [3.0, 3.0], "b": [20.0, 20.0, 20.0]}
