"""python -m debug_server.nccl_log on NCCL_DEBUG=INFO logs written by the tests."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from debug_server.tools import nccl_log, nccl_log_parse

IB_WARN = (
    "NET/IB : Got completion from peer 10.0.0.12<52344> with status=12 opcode=0 len=0 "
    "vendor err 129 (Recv) localGid ::ffff:10.0.0.11 remoteGids::ffff:10.0.0.12 hca mlx5_0"
)


def _pfx(host: str, pid: int, dev: int) -> str:
    return f"{host}:{pid}:{pid + 40} [{dev}] NCCL INFO "


def rank_log(
    rank: int,
    nranks: int,
    last_op: int,
    *,
    host: str = "node01",
    pid: int | None = None,
    dev: int | None = None,
    new_format: bool = False,
    init: bool = True,
    warn: str | None = None,
) -> str:
    """One rank's NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,COLL log issuing opCounts 0..last_op."""
    pid = 31000 + rank if pid is None else pid
    dev = rank if dev is None else dev
    comm = f"0x55d5c0{rank:02x}a0b0"  # a different pointer in every process, as in real logs
    p = _pfx(host, pid, dev)
    lines = [
        f"{p}Bootstrap : Using eth0:10.0.0.{11 + rank}<0>",
        f"{p}NET/Plugin: No plugin found (libnccl-net.so)",
        f"{p}cudaDriverVersion 12040",
    ]
    if rank == 0:
        lines.append(f"{p}NCCL version 2.21.5+cuda12.4")
    if init:
        cid = " commId 0x7f3a9c2e1b4d5e6f" if new_format else ""
        nvml = f" nvmlDev {dev}" if new_format else ""
        if new_format:
            lines.append(f"{p}comm {comm} rank {rank} nranks {nranks} cudaDev {dev}{nvml} "
                         f"busId {dev + 1}8000{cid} - Init START")
        lines += [
            f"{p}comm {comm} rank {rank} nRanks {nranks} nNodes 1 localRanks {nranks} "
            f"localRank {rank} MNNVL 0",
            f"{p}Channel 00/02 :    " + "   ".join(str(i) for i in range(nranks)),
            f"{p}comm {comm} rank {rank} nranks {nranks} cudaDev {dev}{nvml} busId {dev + 1}8000"
            f"{cid} - Init COMPLETE",
        ]
    for op in range(last_op + 1):
        name = "Broadcast" if op % 10 == 3 else "AllReduce"
        tail = (f"comm {comm} commHash 8821873481232165231 stream 0x56002a10 task 0"
                if new_format else f"comm {comm} [nranks={nranks}] stream 0x56002a10")
        lines.append(
            f"{p}{name}: opCount {op:x} sendbuff 0x7f5a3c{op:06x} recvbuff 0x7f5a3c{op:06x} "
            f"count 1024 datatype 7 op 0 root 0 {tail}"
        )
        if warn and op == last_op // 2:
            lines.append(f"{host}:{pid}:{pid + 41} [{dev}] transport/net_ib.cc:1295 NCCL WARN {warn}")
    return "\n".join(lines) + "\n"


def write_job(tmp_path: Path, last_ops: list[int], **kw: object) -> list[str]:
    """One file per rank, named by host and pid only (ranks must come from the init lines)."""
    paths = []
    for r, last in enumerate(last_ops):
        path = tmp_path / f"nccl.node01.{31000 + r}.log"
        path.write_text(rank_log(r, len(last_ops), last, **kw))  # type: ignore[arg-type]
        paths.append(str(path))
    return paths


def test_rank_one_op_behind_is_reported_with_op_counts(tmp_path):
    paths = write_job(tmp_path, [0x1e, 0x1e, 0x1d, 0x1e])
    result = nccl_log.analyze_files(paths)
    assert [(b["rank"], b["last_op_count"], b["max_op_count"], b["ops_behind"])
            for b in result["behind"]] == [(2, "1d", "1e", 1)]
    assert [r["rank"] for r in result["ranks"]] == [0, 1, 2, 3]
    assert {r["rank_source"] for r in result["ranks"]} == {"init"}
    last = {r["rank"]: r["comms"][0]["last_op_count"] for r in result["ranks"]}
    assert last == {0: "1e", 1: "1e", 2: "1d", 3: "1e"}


def test_identical_warn_lines_are_grouped_with_their_ranks(tmp_path):
    paths = []
    for r in range(4):
        path = tmp_path / f"nccl.node01.{31000 + r}.log"
        path.write_text(rank_log(r, 4, 5, warn=IB_WARN if r in (1, 3) else None))
        paths.append(str(path))
    result = nccl_log.analyze_files(paths)
    assert result["behind"] == []
    [msg] = result["messages"]
    assert (msg["level"], msg["ranks"], msg["count"], msg["message"]) == ("WARN", [1, 3], 2, IB_WARN)
    assert msg["source"] == "transport/net_ib.cc:1295"
    text = nccl_log.render_text(result)
    assert text.count("Got completion from peer") == 1
    assert "[WARN] ranks 1, 3 (x2)" in text


def test_exit_code_0_when_clean_and_2_when_behind(tmp_path, capsys):
    (tmp_path / "a").mkdir()
    clean = write_job(tmp_path / "a", [7, 7])
    assert nccl_log.main(clean) == 0
    out = capsys.readouterr().out
    assert "Ranks behind: none" in out
    (tmp_path / "b").mkdir()
    hung = write_job(tmp_path / "b", [7, 6])
    assert nccl_log.main(hung) == 2
    out = capsys.readouterr().out
    assert (
        "rank 1 on nranks=2#0: issued 7 collectives (last AllReduce opCount 0x6), others issued 8 "
        "(max opCount 0x7)" in out
    )


def test_summary_has_one_line_per_rank(tmp_path, capsys):
    paths = write_job(tmp_path, [3, 3, 2])
    assert nccl_log.main(paths) == 2
    lines = capsys.readouterr().out.splitlines()
    rows = [ln for ln in lines if "node01:3100" in ln]
    assert len(rows) == 3
    assert "AllReduce opCount 0x2" in rows[2] and rows[2].split()[0] == "2"


def test_warn_alone_gives_exit_2(tmp_path):
    paths = []
    for r in range(2):
        path = tmp_path / f"rank{r}.log"
        path.write_text(rank_log(r, 2, 4, warn=IB_WARN if r == 0 else None))
        paths.append(str(path))
    assert nccl_log.main(paths) == 2


def test_json_shape(tmp_path, capsys):
    paths = write_job(tmp_path, [0x10, 0x0f])
    assert nccl_log.main([*paths, "--json"]) == 2
    result = json.loads(capsys.readouterr().out)
    assert set(result) >= {"files", "ranks", "communicators", "behind", "messages", "notes", "found"}
    assert result["found"] is True
    assert result["files"] == paths
    r1 = result["ranks"][1]
    assert (r1["rank"], r1["host"], r1["pid"]) == (1, "node01", 31001)
    assert r1["comms"] == [{"comm": "nranks=2#0", "nranks": 2, "comm_rank": 1,
                            "last_op_count": "f", "last_op": "AllReduce", "coll_lines": 16}]
    assert result["communicators"] == [
        {"comm": "nranks=2#0", "nranks": 2, "ranks": [0, 1], "max_op_count": "10", "max_issued": 17}
    ]
    assert result["behind"][0] == {"comm": "nranks=2#0", "rank": 1, "host": "node01",
                                   "pid": 31001, "last_op_count": "f", "last_op": "AllReduce",
                                   "max_op_count": "10", "issued": 16, "max_issued": 17,
                                   "ops_behind": 1}


def test_newer_nccl_lines_with_comm_hash_and_no_nranks(tmp_path):
    paths = write_job(tmp_path, [0x20, 0x20, 0x20, 0x1f], new_format=True)
    result = nccl_log.analyze_files(paths)
    assert [c["comm"] for c in result["communicators"]] == ["commId 0x7f3a9c2e1b4d5e6f"]
    assert [(b["rank"], b["last_op_count"]) for b in result["behind"]] == [(3, "1f")]


def test_ranks_from_file_names_when_no_init_lines(tmp_path):
    # Device field 0 everywhere (one GPU per host), no init lines: only the names say the rank.
    names = ["nccl_rank0.log", "nccl_rank1.log", "gpu-host-07.4242.2.log"]
    paths = []
    for r, name in enumerate(names):
        path = tmp_path / name
        path.write_text(rank_log(r, 3, 9 if r != 1 else 8, host=f"gpu-host-0{5 + r}",
                                 pid=4242 if r == 2 else None, dev=0, init=False))
        paths.append(str(path))
    result = nccl_log.analyze_files(paths)
    assert [(r["rank"], r["rank_source"]) for r in result["ranks"]] == [
        (0, "file name"), (1, "file name"), (2, "file name")]
    assert [(b["rank"], b["last_op_count"], b["max_op_count"]) for b in result["behind"]] == [
        (1, "8", "9")]


def test_ranks_from_device_field_as_last_resort(tmp_path):
    path = tmp_path / "all.log"
    text = "".join(rank_log(r, 2, 3 - r, init=False) for r in range(2))
    path.write_text(text)
    result = nccl_log.analyze_files([str(path)])
    assert [(r["rank"], r["rank_source"]) for r in result["ranks"]] == [(0, "device"), (1, "device")]
    assert [b["rank"] for b in result["behind"]] == [1]


def test_interleaved_processes_in_one_file_use_init_ranks(tmp_path):
    # torchrun's combined stdout: lines of all ranks interleaved, devices not equal to ranks.
    logs = [rank_log(r, 2, 5 if r == 0 else 4, dev=1 - r).splitlines() for r in range(2)]
    merged = [ln for pair in itertools.zip_longest(*logs) for ln in pair if ln is not None]
    path = tmp_path / "train.out"
    path.write_text("\n".join(merged) + "\nsome training output\n")
    result = nccl_log.analyze_files([str(path)])
    assert [(r["rank"], r["pid"]) for r in result["ranks"]] == [(0, 31000), (1, 31001)]
    assert [(b["rank"], b["last_op_count"]) for b in result["behind"]] == [(1, "4")]


def test_rank_behind_on_a_sub_communicator(tmp_path):
    paths = []
    for r in range(2):
        p = _pfx("node01", 31000 + r, r)
        world, sub = f"0x5500{r}000", f"0x5600{r}000"
        lines = [
            f"{p}comm {world} rank {r} nranks 2 cudaDev {r} busId 1000 - Init COMPLETE",
            f"{p}comm {sub} rank {r} nranks 2 cudaDev {r} busId 1000 - Init COMPLETE",
            f"{p}AllReduce: opCount 0 sendbuff 0x1 recvbuff 0x1 count 1 datatype 7 op 0 root 0 comm {world} [nranks=2] stream 0x2",
            f"{p}AllGather: opCount 0 sendbuff 0x1 recvbuff 0x1 count 8 datatype 7 op 0 root 0 comm {sub} [nranks=2] stream 0x2",
        ]
        if r == 0:
            lines.append(f"{p}AllGather: opCount 1 sendbuff 0x1 recvbuff 0x1 count 8 datatype 7 op 0 root 0 comm {sub} [nranks=2] stream 0x2")
        path = tmp_path / f"n.{31000 + r}.log"
        path.write_text("\n".join(lines) + "\n")
        paths.append(str(path))
    result = nccl_log.analyze_files(paths)
    assert [(b["comm"], b["rank"], b["last_op_count"]) for b in result["behind"]] == [
        ("nranks=2#1", 1, "0")]


def test_torch_watchdog_errors_grouped_across_ranks(tmp_path):
    paths = []
    for r in range(2):
        path = tmp_path / f"nccl.node01.{31000 + r}.log"
        path.write_text(
            rank_log(r, 2, 4)
            + f"[rank{r}]:[E1120 10:00:0{r}.123456789 ProcessGroupNCCL.cpp:632] [PG ID 0 PG GUID 0"
            f"(default_pg) Rank {r}] Watchdog caught collective operation timeout: "
            f"WorkNCCL(SeqNum=5, OpType=ALLREDUCE) ran for 600000 milliseconds before timing out.\n"
        )
        paths.append(str(path))
    result = nccl_log.analyze_files(paths)
    [msg] = result["messages"]
    assert msg["level"] == "ERROR" and msg["ranks"] == [0, 1] and msg["count"] == 2
    assert msg["message"].startswith("Watchdog caught collective operation timeout")


def test_init_start_without_complete_is_an_init_failure(tmp_path):
    paths = write_job(tmp_path, [2, 2], new_format=True)
    stuck = Path(paths[1])
    stuck.write_text("\n".join(ln for ln in stuck.read_text().splitlines()
                               if "Init COMPLETE" not in ln and "opCount" not in ln) + "\n"
                     + "node01:31001:31042 [1] bootstrap.cc:77 NCCL WARN Bootstrap : no socket interface found\n")
    result = nccl_log.analyze_files(paths)
    kinds = {(m["kind"], m["message"]): m["ranks"] for m in result["messages"]}
    assert kinds[("init", "Bootstrap : no socket interface found")] == [1]
    assert kinds[("init", "communicator commId 0x7f3a9c2e1b4d5e6f: Init START without Init COMPLETE")] == [1]
    assert [(b["rank"], b["last_op_count"]) for b in result["behind"]] == [(1, None)]


def test_missing_file_is_unusable_input(tmp_path, capsys):
    assert nccl_log.main([str(tmp_path / "nope.log")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("nccl_log: error: cannot read") and "nope.log" in err[0]


def test_file_without_nccl_lines_is_unusable_input(tmp_path, capsys):
    path = tmp_path / "train.log"
    path.write_text("epoch 1 loss 0.5\nepoch 2 loss 0.4\n")
    assert nccl_log.main([str(path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "NCCL_DEBUG=INFO" in err[0]


def test_no_coll_lines_is_clean_with_a_note(tmp_path):
    path = tmp_path / "rank0.log"
    path.write_text(rank_log(0, 1, -1))
    result = nccl_log.analyze_files([str(path)])
    assert result["found"] is False
    assert any("NCCL_DEBUG_SUBSYS=INIT,COLL" in n for n in result["notes"])


@pytest.mark.parametrize(("name", "pid", "rank"), [
    ("nccl_rank3.log", 1, 3), ("host.1234.3.log", 1234, 3), ("nccl.host.1234.log", 1234, None),
    ("node12.log", 99, None), ("RANK-5.txt", 1, 5)])
def test_rank_from_file_name(name, pid, rank):
    assert nccl_log_parse.rank_from_filename(name, pid) == rank


def test_real_nccl_2_28_logs_name_the_rank_one_op_behind(capsys):
    # Captured on an H200 host (NCCL 2.28.9) from the reference demo's hang: NCCL prints
    # "opCount 0" on every COLL line, so the count of collectives issued tells who is behind.
    logs = sorted(str(p) for p in (Path(__file__).parent / "data" / "nccl_logs").glob("nccl.*.log"))
    assert nccl_log.main(logs + ["--json"]) == 2
    result = json.loads(capsys.readouterr().out)
    assert [(b["rank"], b["issued"], b["max_issued"], b["last_op"]) for b in result["behind"]] == [
        (1, 4, 5, "Broadcast")
    ]
