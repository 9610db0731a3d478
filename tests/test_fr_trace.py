"""The CLI: exit codes, outputs, and refusing unusable or hostile input in one line."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import _scenarios as S
import pytest

from debug_server.dumpio import write_dump_atomic
from debug_server.tools import fr_trace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write(dir_, dumps, prefix="rank_"):
    dir_.mkdir(exist_ok=True)
    for r, d in dumps.items():
        write_dump_atomic(str(dir_ / f"{prefix}{r}"), d)
    return str(dir_)


def run_sub(args, timeout=60):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env
    )


def test_clean_exits_0(tmp_path, capsys):
    assert fr_trace.main([write(tmp_path / "d", S.clean())]) == 0
    assert "No hang or mismatch found" in capsys.readouterr().out


def test_missing_rank_exits_2_with_row(tmp_path, capsys):
    assert fr_trace.main([write(tmp_path / "d", S.missing_rank()), "-p", "rank_"]) == 2
    out = capsys.readouterr().out
    assert any("nccl:all_reduce" in ln and "{1}" in ln and " 4 " in ln for ln in out.splitlines())


def test_json_output_has_contract_keys(tmp_path, capsys):
    assert fr_trace.main([write(tmp_path / "d", S.missing_rank()), "--json"]) == 2
    r = json.loads(capsys.readouterr().out)
    assert {"world_size", "ranks_with_data", "ranks_without_data", "groups", "collectives",
            "nccl_calls", "findings", "verdict", "stack_groups"} <= set(r)  # fmt: skip
    assert [(f["kind"], f["seq"], f["ranks"]) for f in r["findings"]] == [("missing_ranks", 4, [1])]


def test_output_file_gets_the_json(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert fr_trace.main([write(tmp_path / "d", S.missing_rank()), "-o", str(out)]) == 2
    assert json.loads(out.read_text())["findings"][0]["ranks"] == [1]
    assert "=== Verdict ===" in capsys.readouterr().out


def test_history_lost_alone_exits_0(tmp_path):
    assert fr_trace.main([write(tmp_path / "d", S.wrapped_ring())]) == 0


def test_just_print_entries_aligns_rows_by_group_and_seq(tmp_path, capsys):
    assert fr_trace.main([write(tmp_path / "d", S.two_subcomms()), "-j"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["group", "seq", "Rank", "0", "Rank", "1", "Rank", "2", "Rank", "3"]
    sub_b = [ln for ln in lines if ln.startswith("sub_b")]
    assert [ln.split()[1] for ln in sub_b] == ["0", "1", "2"]
    assert sub_b[2].count("all_reduce(") == 1 and "state=started" in sub_b[2]  # rank 3 blank
    sub_a = [ln for ln in lines if ln.startswith("sub_a")]
    assert all(ln.count("all_reduce(") == 2 for ln in sub_a)


def test_just_print_with_stack_trace_and_selected_ranks(tmp_path, capsys):
    args = [
        write(tmp_path / "d", S.missing_rank()),
        "-j",
        "--print_stack_trace",
        "--selected-ranks",
        "1",
    ]
    assert fr_trace.main(args) == 0
    out = capsys.readouterr().out
    assert "Rank 0" not in out and "Rank 1" in out and "stack_id=0" in out
    assert "train_step at train.py:148" in out


def test_stacks_file_is_joined_into_the_verdict(tmp_path, capsys):
    demo = tmp_path / "demo.py"
    demo.write_text("import time\n" * 87 + "    time.sleep(30)\n")
    stacks = tmp_path / "stacks_20250101_000000.txt"
    stacks.write_text(
        "=== Rank 0: http://127.0.0.1:4000 ===\n" + S.stack_in_all_reduce()
        + "=== Rank 1 ===\n" + S.stack_sleeping(str(demo), 88)
    )  # fmt: skip
    assert fr_trace.main([write(tmp_path / "d", S.missing_rank()), "--stacks", str(stacks)]) == 2
    out = capsys.readouterr().out
    assert (
        "Rank 1's main thread is at demo.py:88 in hang_phase (time.sleep), not in a collective."
        in out
    )


def test_pg_filters_limit_analysis(tmp_path, capsys):
    assert (
        fr_trace.main(
            [
                write(tmp_path / "d", S.two_subcomms()),
                "--pg-filters",
                "sub_a",
                "--mismatch-cap",
                "3",
            ]
        )
        == 0
    )


def err_lines(capsys):
    return capsys.readouterr().err.strip().splitlines()


def test_empty_dir_exits_1_with_one_line(tmp_path, capsys):
    (tmp_path / "d").mkdir()
    assert fr_trace.main([str(tmp_path / "d")]) == 1
    err = err_lines(capsys)
    assert err[0] == f"error: no dump files in {tmp_path / 'd'}" and err[1].startswith("hint: ")


def test_files_without_rank_are_skipped_then_error(tmp_path, capsys):
    d = tmp_path / "d"
    d.mkdir()
    (d / "notes.txt").write_text("x")
    assert fr_trace.main([str(d)]) == 1
    err = err_lines(capsys)
    assert err[0] == f"error: no dump files in {d}"


def test_hostile_pickle_refused_and_side_effect_absent(tmp_path, capsys):
    target = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {target}",))

    d = tmp_path / "d"
    write(d, S.clean())
    (d / "rank_0").write_bytes(pickle.dumps({"version": "2.10", "entries": [Evil()]}))
    assert fr_trace.main([str(d)]) == 1
    err = err_lines(capsys)
    assert err[0] == "error: rank_0: refused global posix.system (not a plain FR dump)"
    assert not target.exists()


@pytest.mark.parametrize(("spoil", "line"), [
    (lambda data: data[: len(data) // 2], "error: rank_1: truncated pickle"),
    (lambda data: b"\x00\x01garbage", "error: rank_1: not a pickle or JSON FR dump"),
], ids=["truncated", "garbage"])
def test_unreadable_file_exits_1_naming_the_file_and_why(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], spoil: Callable[[bytes], bytes],
        line: str) -> None:
    d = tmp_path / "d"
    write(d, S.clean())
    (d / "rank_1").write_bytes(spoil((d / "rank_1").read_bytes()))
    assert fr_trace.main([str(d)]) == 1
    assert err_lines(capsys)[0] == line


def test_bad_file_with_allow_incomplete_becomes_rank_without_data(tmp_path, capsys):
    d = tmp_path / "d"
    write(d, S.missing_rank())
    (d / "rank_1").write_bytes(b"junk")
    # Rank 0 waits in #4 and rank 1 gave no data: a problem, so exit 2 (issue 33), not 0.
    assert fr_trace.main([str(d), "--allow-incomplete-ranks", "--json"]) == 2
    cap = capsys.readouterr()
    r = json.loads(cap.out)
    assert r["ranks_without_data"] == [1]
    assert r["unavailable"] == [
        {"rank": 1, "reason": "unusable dump: not a pickle or JSON FR dump"}
    ]


def test_mixed_versions_exit_1(tmp_path, capsys):
    dumps = S.clean(3)
    dumps[1]["version"] = "2.2"
    assert fr_trace.main([write(tmp_path / "d", dumps)]) == 1
    assert err_lines(capsys)[0] == "error: rank_1 has version 2.2 but rank_0 has 2.10"


def test_wrong_version_exits_1(tmp_path, capsys):
    dumps = S.clean()
    dumps[0]["version"] = "9.9"
    dumps[1]["version"] = "9.9"
    assert fr_trace.main([write(tmp_path / "d", dumps)]) == 1
    assert err_lines(capsys)[0] == "error: rank_0: unsupported FR version '9.9' (need 2.x)"


def test_json_dump_with_hostile_ranks_refused(tmp_path, capsys):
    target = tmp_path / "X"
    d = tmp_path / "d"
    d.mkdir()
    for r, dump in S.clean().items():
        dump["pg_config"]["main_comm"]["ranks"] = f"__import__('os').system('touch {target}')"
        (d / f"rank_{r}").write_text(json.dumps(dump))
    assert fr_trace.main([str(d)]) == 1
    assert err_lines(capsys)[0].startswith(
        "error: rank_0: pg_config['main_comm']: refused pg_config ranks"
    )
    assert not target.exists()


def test_missing_dump_file_of_a_member_exits_1_unless_allowed(tmp_path, capsys):
    dumps = S.missing_rank()
    del dumps[1]
    d = write(tmp_path / "d", dumps)
    assert fr_trace.main([d]) == 1
    assert err_lines(capsys)[0].startswith("error: no dump file for rank {1}")
    # Rank 0 waits in #4 and rank 1's dump is absent: exit 2 (issue 33), not 0.
    assert fr_trace.main([d, "--allow-incomplete-ranks", "--json"]) == 2
    r = json.loads(capsys.readouterr().out)
    assert r["unavailable"] == [{"rank": 1, "reason": "no dump file"}]


def test_ambiguous_prefix_exits_1(tmp_path, capsys):
    d = tmp_path / "d"
    write(d, {0: S.clean()[0]}, prefix="a_")
    write(d, {1: S.clean()[1]}, prefix="b_")
    assert fr_trace.main([str(d)]) == 1
    err = err_lines(capsys)
    assert "cannot infer a common file prefix" in err[0] and err[1].startswith(
        "hint: pass -p PREFIX"
    )


@pytest.mark.job
def test_worker_pool_gives_the_same_result_as_one_process(tmp_path):
    from debug_server.tools.synthetic import hang_job

    d = write(tmp_path / "d", hang_job(8, 20, missing_rank=5))
    one = run_sub(["-m", "debug_server.tools.fr_trace", d, "--json", "--jobs", "1"])
    two = run_sub(["-m", "debug_server.tools.fr_trace", d, "--json", "--jobs", "2"])
    assert (one.returncode, two.returncode) == (2, 2)
    assert json.loads(one.stdout) == json.loads(two.stdout)


@pytest.mark.job
def test_worker_pool_keeps_each_ranks_own_read_time_when_ranks_share_a_digest(tmp_path):
    from debug_server.tools.synthetic import hang_job

    dumps = hang_job(8, 20, missing_rank=5)
    base = 1_700_000_000_000_000_000
    for r, dump in dumps.items():
        dump["dump_time_ns"] = base + r * 1_000_000_007  # a rank's own read time: not in the class key
    d = Path(write(tmp_path / "d", dumps))
    loaded = fr_trace._load_all({r: str(d / f"rank_{r}") for r in dumps}, jobs=2)
    assert {rank: digest.snap_ns for rank, _, digest, _ in loaded} == {
        r: base + r * 1_000_000_007 for r in dumps}


@pytest.mark.job
def test_module_entry_point_exit_code_and_no_traceback(tmp_path):
    (tmp_path / "d").mkdir()
    p = run_sub(["-m", "debug_server.tools.fr_trace", str(tmp_path / "d")])
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert p.stderr.startswith("error: no dump files in ")


@pytest.mark.job
def test_pytorch_fr_trace_reads_our_pickles(tmp_path):
    """Schema check against PyTorch's own analyzer on write_dump_atomic pickles."""
    pytest.importorskip("torch.distributed.flight_recorder.fr_trace")
    d = write(tmp_path / "d", S.missing_rank())
    p = run_sub(["-m", "torch.distributed.flight_recorder.fr_trace", d, "-p", "rank_"], timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-2000:]
    assert "missing ranks: {1}" in out
    assert "Not all ranks joining collective, sequence number: 4" in out


def write_json(dir_, dumps, prefix="rank_"):
    dir_.mkdir(exist_ok=True)
    for r, d in dumps.items():
        (dir_ / f"{prefix}{r}.json").write_text(json.dumps(d))
    return str(dir_)


def test_json_suffixed_dumps_are_found_with_the_given_prefix(tmp_path, capsys):
    d = write_json(tmp_path / "d", S.missing_rank())
    assert fr_trace.main([d, "-p", "rank_", "--json"]) == 2
    r = json.loads(capsys.readouterr().out)
    assert [(f["kind"], f["seq"], f["ranks"]) for f in r["findings"]] == [
        ("missing_ranks", 4, [1])
    ]


def test_json_suffixed_dumps_are_found_with_the_prefix_inferred(tmp_path, capsys):
    d = write_json(tmp_path / "d", S.missing_rank())
    assert fr_trace.main([d, "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["ranks_with_data"] == [0, 1]


def test_pickle_and_json_ranks_mix_in_one_dir(tmp_path, capsys):
    dumps = S.missing_rank()
    d = write(tmp_path / "d", {0: dumps[0]})
    write_json(tmp_path / "d", {1: dumps[1]})
    assert fr_trace.main([d, "--json"]) == 2
    r = json.loads(capsys.readouterr().out)
    assert r["findings"][0]["ranks"] == [1] and r["ranks_with_data"] == [0, 1]


def test_pytorch_c10d_json_dumps_report_the_missing_rank(tmp_path, capsys):
    d = write_json(tmp_path / "d", S.load_fixture("c10d_gloo_hang.json"), prefix="nccl_trace_rank_")
    assert fr_trace.main([d, "--json"]) == 2
    f = json.loads(capsys.readouterr().out)["findings"][0]
    assert (f["kind"], f["seq"], f["op"], f["ranks"]) == ("missing_ranks", 5, "all_reduce", [1])


def test_just_print_entries_reads_json_suffixed_dumps(tmp_path, capsys):
    d = write_json(tmp_path / "d", S.missing_rank())
    assert fr_trace.main([d, "-j"]) == 0
    out = capsys.readouterr().out
    row4 = next(line for line in out.splitlines() if line.split()[:2] == ["main_comm", "4"])
    assert "all_reduce" in row4 and row4.count("all_reduce") == 1


def test_hostile_pickle_under_json_name_is_refused_in_one_line(tmp_path, capsys):
    target = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {target}",))

    d = write_json(tmp_path / "d", S.clean())
    (tmp_path / "d" / "rank_1.json").write_bytes(pickle.dumps({"version": "2.10", "entries": [Evil()]}))
    assert fr_trace.main([d]) == 1
    assert err_lines(capsys)[0] == "error: rank_1.json: refused global posix.system (not a plain FR dump)"
    assert not target.exists()


_TORCH_DUMPS = """
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d", rank=0, world_size=1)
t = torch.ones(8)
for _ in range(3):
    dist.all_reduce(t)
dist.broadcast(t, 0)
c10d = torch._C._distributed_c10d
import json, time  # c10d retires a gloo op in its own thread, just after wait() returned
deadline = time.monotonic() + 30
while not all(e.get("retired") for e in json.loads(c10d._dump_fr_trace_json())["entries"]):
    assert time.monotonic() < deadline, "c10d never retired the ops"
    time.sleep(0.01)
open(os.path.join(sys.argv[1], "trace_0"), "wb").write(c10d._dump_fr_trace())
open(os.path.join(sys.argv[2], "trace_0.json"), "wb").write(c10d._dump_fr_trace_json())
dist.destroy_process_group()
"""


@pytest.mark.job
def test_pytorch_own_pickle_and_json_dumps_give_the_same_analysis(tmp_path):
    """Torch's C++ pickler and its JSON writer, from a real one-rank gloo job."""
    from mpjob import free_port

    pk, js = tmp_path / "pk", tmp_path / "js"
    pk.mkdir()
    js.mkdir()
    env = dict(os.environ, TORCH_FR_BUFFER_SIZE="100")
    p = subprocess.run([sys.executable, "-c", _TORCH_DUMPS % free_port(), str(pk), str(js)],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert (pk / "trace_0").read_bytes()[:1] == b"\x80"
    one = run_sub(["-m", "debug_server.tools.fr_trace", str(pk), "--json"])
    two = run_sub(["-m", "debug_server.tools.fr_trace", str(js), "--json"])
    assert (one.returncode, two.returncode) == (0, 0), one.stderr + two.stderr
    a, b = json.loads(one.stdout), json.loads(two.stdout)
    # Torch's JSON form carries no stack frames; the two dumps are taken one after the other
    # (c10d may retire the last op in between), so states and times are not compared.
    assert a["collectives"][3]["frames"][-1]["line"] == 7  # the broadcast line of the script
    assert all(c["frames"] == [] for c in b["collectives"])
    for r in (a, b):
        assert [(c["seq"], c["op"], c["pass_check"]) for c in r["collectives"]] == [
            (1, "all_reduce", True), (2, "all_reduce", True), (3, "all_reduce", True),
            (4, "broadcast", True)]
    assert a["findings"] == b["findings"] == [] and a["groups"] == b["groups"]


def test_cycling_bucket_sizes_keep_their_own_signatures(tmp_path, capsys):
    """A loop over 4 gradient buckets: one odd size on rank 1 is found at its own seq."""
    from debug_server.tools.synthetic import make_dump, make_entry

    sizes = [1024, 4096, 256, 65536]
    dumps = {}
    for r in range(2):
        ents = [make_entry(record_id=s, seq=s, input_sizes=((sizes[s % 4],),)) for s in range(40)]
        if r == 1:
            ents[21] = make_entry(record_id=21, seq=21, input_sizes=((sizes[2],),))
        dumps[r] = make_dump(ents, {"main_comm": [0, 1]})
    assert fr_trace.main([write(tmp_path / "d", dumps), "--json"]) == 2
    r = json.loads(capsys.readouterr().out)
    assert [(f["kind"], f["seq"]) for f in r["findings"]] == [("size_mismatch", 21)]


def test_selected_ranks_keep_the_class_rows_they_are_in_and_only_themselves(
        tmp_path, capsys, monkeypatch):
    """Above ``NCCL_CALLS_FULL_LIMIT`` pairs a row stands for a class of ranks (its lowest is
    ``global_rank``): ``--selected-ranks`` keeps every row of a class a selected rank is in,
    naming the selected ranks only, not the rows whose lowest rank was selected."""
    from debug_server.analysis import core

    dumps = S.hang_job(8, 5, missing_rank=6)
    args = [write(tmp_path / "d", dumps), "--json", "--allow-incomplete-ranks"]
    fr_trace.main(args + ["--selected-ranks", "5"])
    per_rank = json.loads(capsys.readouterr().out)["nccl_calls"]
    monkeypatch.setattr(core, "NCCL_CALLS_FULL_LIMIT", 4)
    fr_trace.main(args)
    classes = json.loads(capsys.readouterr().out)["nccl_calls"]
    # rows of classes rank 5 is in, named by a lower rank: the old filter dropped them
    assert any(c["global_rank"] < 5 and 5 in _ranks_of(c["global_ranks"]) for c in classes), \
        classes
    fr_trace.main(args + ["--selected-ranks", "5", "6"])
    selected = json.loads(capsys.readouterr().out)["nccl_calls"]
    assert {c["global_ranks"] for c in selected} <= {"5", "5-6", "6"}, selected
    fives = [(c["collective_id"], c["state"]) for c in selected if c["global_ranks"] != "6"]
    assert sorted(fives) == sorted((c["collective_id"], c["state"]) for c in per_rank)


def _ranks_of(text: str) -> set[int]:
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out
