"""The live window cut inside the recorders (``recording.lazy``, ``frwindow.cutter``): the same
dump as the whole snapshot cut afterwards, on random rings and on real gloo rings."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from mpjob import rank0_result, run_job

from debug_server.protocol import frwindow
from debug_server.rank.worker import cut_dump
from debug_server.recording.c10d_fr import GroupInfo, merge_c10d
from debug_server.recording.lazy import KEY_FIELDS, LazyDump, Source
from debug_server.tools.synthetic import make_dump, make_entry

GROUPS = {"main_comm": [0, 1], "sub_comm": [0, 1], "pp": [0, 1]}
CAPTURE = Path(__file__).parent / "data" / "c10d_merge_gloo.json"  # see test_c10d_fr.py


def captured() -> dict[int, dict[str, Any]]:
    return {int(r): v for r, v in json.loads(CAPTURE.read_text())["ranks"].items()}


def _random_ring(rng: random.Random) -> dict[str, Any]:
    """A ring of collectives on two groups and P2P ops on a third, wrapped at a random point,
    with a random tail of unfinished ops and, sometimes, an entry c10d would never write."""
    start, n = rng.randrange(0, 500), rng.randrange(0, 60)
    active_from = rng.randrange(0, n + 1)
    seqs = {"main_comm": start, "sub_comm": start // 2, "pp": 0}
    entries = []
    for i in range(n):
        comm = rng.choice(("main_comm", "main_comm", "sub_comm", "pp"))
        state = rng.choice(("scheduled", "started")) if i >= active_from else "completed"
        if comm == "pp":
            seqs["pp"] += 1
            entries.append(make_entry(record_id=start + i, comm="pp", p2p_seq=seqs["pp"],
                                      op=rng.choice(("send", "recv")), is_p2p=True,
                                      peer_desc="0->1", state=state))
        else:
            entries.append(make_entry(record_id=start + i, comm=comm, seq=seqs[comm],
                                      op=rng.choice(("all_reduce", "broadcast")), state=state))
            seqs[comm] += 1
    dump = make_dump(entries, GROUPS)
    if entries and rng.random() < 0.2:
        del entries[rng.randrange(len(entries))]["collective_seq_id"]
    return dump


# Keys with only KEY_FIELDS: the cut must decide from those alone.
_PROJECTED = Source(lambda e: {k: e[k] for k in KEY_FIELDS if k in e}, lambda e, key: e,
                    lambda e: e.get("time_created_ns"))


def _keyed(dump: dict[str, Any]) -> LazyDump:
    """``dump`` as a recorder hands it over: entries built only once picked."""
    lazy = LazyDump({k: v for k, v in dump.items() if k != "entries"})
    lazy.extend(dump["entries"], _PROJECTED)
    return lazy


@pytest.mark.parametrize("seed", range(40))
def test_cut_from_keys_alone_keeps_what_the_window_keeps(seed: int) -> None:
    rng = random.Random(seed)
    dump = _random_ring(rng)
    for _ in range(5):
        since = {g: rng.randrange(0, 600) for g in rng.sample(sorted(GROUPS), rng.randrange(1, 4))}
        assert _keyed(dump).finish(frwindow.cutter(since=since)) == frwindow.window(dump, since)


@pytest.mark.parametrize("seed", range(40))
def test_cut_at_the_own_frontier_from_keys_alone_keeps_what_local_window_keeps(seed: int) -> None:
    rng = random.Random(1000 + seed)
    dump = _random_ring(rng)
    for slack in (0, 1, frwindow.LOCAL_SLACK, 1000):
        assert _keyed(dump).finish(frwindow.cutter(slack=slack)) == frwindow.local_window(dump, slack)


def test_worker_cut_of_a_served_dump_records_the_whole_ring() -> None:
    ring = [make_entry(record_id=s, seq=s) for s in range(50)]
    cut = cut_dump(make_dump(ring, {"main_comm": [0, 1]}), frwindow.cutter(since={"main_comm": 47}))
    assert [e["collective_seq_id"] for e in cut["entries"]] == [47, 48, 49]
    assert cut["fr_window"] == {"since": {"main_comm": 47}, "ring_entries": 50,
                                "ring_oldest_ns": ring[0]["time_created_ns"]}


def test_renumbered_timeline_leaves_the_callers_entries_alone() -> None:
    entries = [make_entry(record_id=10 + i, seq=i) for i in range(3)]
    lazy = LazyDump.of(make_dump(entries, {"main_comm": [0, 1]}))
    lazy.renumber = True
    out = lazy.finish(frwindow.cutter(since={"main_comm": 1}))
    assert [(e["record_id"], e["collective_seq_id"]) for e in out["entries"]] == [(1, 1), (2, 2)]
    assert [e["record_id"] for e in entries] == [10, 11, 12]


@pytest.mark.parametrize("rename", ["", "0", "mixed"])
def test_c10d_merge_cut_equals_the_merged_dump_cut_after(rename: str) -> None:
    """On captured gloo rings: our entries, c10d's kept under their own names, c10d's renamed
    (a group named like a communicator; the gloo side of a mixed group)."""
    for c in captured().values():
        ours = json.loads(json.dumps(c["ours"]).replace("main_comm", rename)) if rename == "0" \
            else c["ours"]
        groups = {k: GroupInfo(g["name"], g["desc"], tuple(g["ranks"]),
                               "cpu:gloo,cuda:nccl" if rename == "mixed" else g["backend"])
                  for k, g in c["groups"].items()}
        kw: dict[str, Any] = {"owned": c["owned"], "groups": groups}
        recorders = [tuple(r) for r in c["recorders"]]
        whole = merge_c10d(ours, recorders, **kw)
        seqs = {e["process_group"][0]: e["collective_seq_id"] for e in whole["entries"]}
        cuts = [{g: s} for g, last in seqs.items() for s in (0, last, last + 1)]
        for since in cuts:
            assert merge_c10d(ours, recorders, cut=frwindow.cutter(since=since), **kw) == \
                frwindow.window(whole, since)
        for slack in (0, 1, 4):
            assert merge_c10d(ours, recorders, cut=frwindow.cutter(slack=slack), **kw) == \
                frwindow.local_window(whole, slack)
        assert len({len(frwindow.window(whole, s)["entries"]) for s in cuts}) > 1


def test_cutter_takes_exactly_one_of_since_and_slack() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        frwindow.cutter()
    with pytest.raises(ValueError, match="exactly one"):
        frwindow.cutter(since={}, slack=4)


# Each rank builds rings of several shapes; after each, every cut is taken both ways (the whole
# snapshot cut afterwards, and cut inside the recorders) through the three entry points that
# build dumps: the whole process's (hooks.snapshot, what the worker serves) and one hook's own.
JOB = r'''
import datetime, json, os, time
from pathlib import Path
import torch, torch.distributed as dist
from debug_server.protocol import frwindow
from debug_server.recording.c10d_fr import GroupInfo, merge_c10d
from debug_server.recording import c10d_fr, hooks
from debug_server.recording.comms import new_comm
from debug_server.rank.worker import HooksProvider
from debug_server.recording.hooks import FlightRecorderHook

rank = int(os.environ["RANK"])
comm = new_comm("gloo", "cpu", "main_comm", timeout=datetime.timedelta(seconds=60))
hook = FlightRecorderHook(max_entries=40).register_with_comm(comm)
t = torch.ones(4)
reads = []
_read = c10d_fr._read


def counting(c10d, pickle_fn, json_fn, include_collectives, stacks):
    out = _read(c10d, pickle_fn, json_fn, include_collectives, stacks)
    if out is not None:  # a recorder this build lacks (NCCL's on CPU) reads nothing
        reads.append(include_collectives)
    return out


c10d_fr._read = counting
PRODUCERS = {"worker": lambda cut=None: hooks.snapshot(cut=cut),
             "hook": lambda cut=None: hook.dump_json(cut=cut)}
rows = []


def snap(name, cut=None):
    d = PRODUCERS[name](cut)
    d.pop("dump_time_ns", None)
    return d


def settle():
    # c10d retires a gloo op from its own thread a moment after the op returns: wait until two
    # reads agree, so that the comparisons compare one state of the rings.
    deadline = time.monotonic() + 20
    prev = snap("worker")
    while time.monotonic() < deadline:
        time.sleep(0.05)
        cur = snap("worker")
        if cur == prev:
            return
        prev = cur


def check(shape):
    settle()
    del reads[:]
    whole = snap("worker")
    full_reads = reads.count(True)
    owned, backed = hooks.owned_groups(), c10d_fr.backed_of(hooks.recorded_comms())
    from_rings = c10d_fr.merge_c10d(hooks.lazy_snapshot(), c10d_fr.read_recorders(), owned=owned,
                                    groups=c10d_fr.process_groups(), backed=backed)
    from_rings.pop("dump_time_ns")
    rows.append({"shape": shape, "cut": "status only", "equal": whole == from_rings,
                 "full_reads": full_reads})
    status = whole["pg_status"]
    cuts = [{"slack": k} for k in (0, 2, 4, 1000)]
    for g, st in sorted(status.items()):
        last = int(st["last_enqueued_collective"])
        cuts += [{"since": {g: s}} for s in (0, max(last - 3, 0), last, last + 5)]
    cuts.append({"since": frwindow.frontier({rank: whole})})
    for c in cuts:
        for name in PRODUCERS:
            if "slack" in c:
                before = frwindow.local_window(snap(name), c["slack"])
                after = snap(name, frwindow.cutter(slack=c["slack"]))
            else:
                before = frwindow.window(snap(name), c["since"])
                after = snap(name, frwindow.cutter(since=c["since"]))
            rows.append({"shape": shape, "producer": name, "cut": c, "equal": before == after,
                         "kept": len(after["entries"]), "ring": after["fr_window"]["ring_entries"],
                         "groups": sorted({e["process_group"][0] for e in after["entries"]}),
                         "active": sum(e["state"] != "completed" and not e.get("retired")
                                       for e in after["entries"])})


for _ in range(5):
    comm.all_reduce(t)
check("short")
sub = comm.split([0, 1], "sub_comm")
for i in range(30):
    comm.all_reduce(t)
    comm.broadcast(t, root=i % 2)
    sub.all_reduce(t)
    if rank == 0:
        comm.send(torch.ones(2), dst=1)
    else:
        comm.recv(torch.zeros(2), src=0)
check("wrapped")
for i in range(30):
    comm.all_reduce(t)
    dist.all_reduce(t)
check("ours and c10d's")
if rank == 0:  # rank 1 joins only once rank 0 has checked its unfinished ops
    works = [comm.all_reduce(torch.ones(4), async_op=True),
             dist.all_reduce(torch.ones(4), async_op=True),
             comm.send(torch.ones(2), dst=1, async_op=True)]
    check("pending")
    time.sleep(0.3)
    health = {"hooks": hooks.health(), "worker": HooksProvider(0, stall_timeout=0.2).health(),
              "pending": [r.seq for r in hook.records() if r.state != "completed"]}
    Path("pending_checked").write_text("1")
    for w in works:
        w.wait()
else:
    deadline = time.monotonic() + 120
    while not Path("pending_checked").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    comm.all_reduce(torch.ones(4))
    dist.all_reduce(torch.ones(4))
    comm.recv(torch.zeros(2), src=0)
    health = None
os.environ["DEBUG_SERVER_RECORDER"] = "c10d"  # only c10d records this one's ops
backed = new_comm("gloo", "cpu", "backed_comm", timeout=datetime.timedelta(seconds=60))
hook = FlightRecorderHook(max_entries=40).register_with_comm(backed)
for _ in range(8):
    backed.all_reduce(t)
    comm.all_reduce(t)
check("c10d-backed")
print("RESULT " + json.dumps({"rows": rows, "backed": backed.c10d_backed, "health": health}),
      flush=True)
dist.barrier()
dist.destroy_process_group()
'''


@pytest.fixture(scope="module")
def real_rings(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out: dict[str, Any] = rank0_result(run_job(JOB, 2, tmp_path_factory.mktemp("cut"),
                                               timeout=180))
    return out


@pytest.mark.job
@pytest.mark.timeout(240)
def test_cut_inside_the_recorders_equals_the_whole_snapshot_cut_after(real_rings: dict[str, Any]
                                                                       ) -> None:
    rows = [r for r in real_rings["rows"] if "producer" in r]
    assert real_rings["backed"] is True
    assert {r["shape"] for r in rows} == {"short", "wrapped", "ours and c10d's", "pending",
                                          "c10d-backed"}
    assert [r for r in rows if not r["equal"]] == []
    # The comparisons covered cuts that keep part of a ring, on every kind of group.
    assert any(0 < r["kept"] < r["ring"] for r in rows if r["shape"] == "wrapped")
    assert {"main_comm", "sub_comm", "0", "backed_comm"} <= {g for r in rows for g in r["groups"]}


@pytest.mark.job
@pytest.mark.timeout(240)
def test_cut_keeps_every_unfinished_op_of_a_waiting_rank(real_rings: dict[str, Any]) -> None:
    pending = [r for r in real_rings["rows"]
               if r["shape"] == "pending" and r.get("producer") == "worker" and "slack" in r["cut"]]
    # Our all_reduce and send, and c10d's all_reduce on the default group, none finished.
    assert [r["active"] for r in pending] == [3, 3, 3, 3]


@pytest.mark.job
@pytest.mark.timeout(240)
def test_worker_stall_limit_reports_the_oldest_unfinished_op_of_its_hooks(
        real_rings: dict[str, Any]) -> None:
    health = real_rings["health"]
    all_reduce_seq, _send_seq = health["pending"]
    assert health["hooks"]["healthy"] is True  # the hooks have no limit of their own here
    assert health["hooks"]["in_flight"] == 2
    assert health["worker"]["healthy"] is False
    stalled = health["worker"]["stalled_op"]
    assert (stalled["group"], stalled["op"], stalled["seq"]) == ("main_comm", "all_reduce",
                                                                 all_reduce_seq)
    assert stalled["age_s"] > 0.2


@pytest.mark.job
@pytest.mark.timeout(240)
def test_ring_of_only_our_communicators_groups_is_read_from_c10d_status_alone(
        real_rings: dict[str, Any]) -> None:
    reads = {r["shape"]: (r["full_reads"], r["equal"]) for r in real_rings["rows"]
             if r["cut"] == "status only"}
    # c10d's ring then holds only ops of main_comm's and sub_comm's own groups, which the merge
    # drops; once the default group has ops of its own, the ring is read whole.
    assert reads == {"short": (0, True), "wrapped": (0, True), "ours and c10d's": (1, True),
                     "pending": (1, True), "c10d-backed": (1, True)}

