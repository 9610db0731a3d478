"""Loading per-rank dumps safely: restricted pickles, JSON, validation, file naming."""

from __future__ import annotations

import json
import os
import pickle
import re

import _scenarios as S
import pytest

from debug_server.dumpio import (
    DumpError,
    infer_prefix,
    load_dump,
    loads_dump,
    parse_ranks,
    rank_files,
    safe_loads,
    write_dump_atomic,
)


class _Evil:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_write_then_load_round_trips(tmp_path):
    dump = S.clean()[0]
    path = write_dump_atomic(str(tmp_path / "rank_0"), dump)
    assert load_dump(path) == dump
    assert os.listdir(tmp_path) == ["rank_0"]


def test_json_dump_loads_like_a_pickle(tmp_path):
    dump = S.clean()[0]
    p = tmp_path / "rank_0"
    p.write_text(json.dumps(dump))
    assert load_dump(str(p)) == dump


@pytest.mark.parametrize("name", ["rank_0", "rank_3.json"])
def test_hostile_pickle_is_refused_and_never_runs(tmp_path, name):
    target = tmp_path / "pwned"
    p = tmp_path / name
    p.write_bytes(pickle.dumps({"version": "2.10", "entries": [_Evil(str(target))]}))
    with pytest.raises(
        DumpError, match=rf"^{re.escape(name)}: refused global posix.system \(not a plain FR dump\)$"
    ):
        load_dump(str(p))
    assert not target.exists()


def test_safe_loads_allows_sets_only_as_globals():
    assert safe_loads(pickle.dumps({"a": {1, 2}, "b": (1,)})) == {"a": {1, 2}, "b": (1,)}


def test_truncated_pickle_is_one_line_error(tmp_path):
    p = tmp_path / "rank_1"
    p.write_bytes(pickle.dumps(S.clean()[0])[:500])
    with pytest.raises(DumpError, match=r"^rank_1: truncated pickle$"):
        load_dump(str(p))


@pytest.mark.parametrize(
    "data,msg",
    [
        (b"", "empty file"),
        (b"hello world", "not a pickle or JSON FR dump"),
        (b"{not json", "invalid JSON"),
        (b"[1, 2]", "not an FR dump (top level is list, not dict)"),
        (json.dumps({"version": "2.10"}).encode(), "missing entries"),
        (json.dumps({"version": "1.0", "entries": []}).encode(), "unsupported FR version '1.0'"),
        (json.dumps({"version": 2.1, "entries": []}).encode(), "unsupported FR version 2.1"),
        (json.dumps({"version": "2.10", "entries": {}}).encode(), "entries is dict, not a list"),
    ],
)
def test_unusable_dumps_are_refused_with_reason(data, msg):
    with pytest.raises(DumpError) as ei:
        loads_dump(data, "rank_0")
    assert msg in str(ei.value) and "\n" not in str(ei.value)


def test_hostile_ranks_string_in_json_is_refused(tmp_path):
    target = tmp_path / "X"
    dump = S.clean()[0]
    dump["pg_config"]["main_comm"]["ranks"] = f"__import__('os').system('touch {target}')"
    with pytest.raises(DumpError, match="refused pg_config ranks"):
        loads_dump(json.dumps(dump).encode(), "rank_0")
    assert not target.exists()


@pytest.mark.parametrize(
    "value,expected", [("[0, 1]", [0, 1]), ("[]", []), (" [3,4 ,5] ", [3, 4, 5]), ([2, 3], [2, 3])]
)
def test_parse_ranks_accepts_plain_lists(value, expected):
    assert parse_ranks(value) == expected


@pytest.mark.parametrize(
    "value", ["[0, 1.5]", "[[0]]", "range(4)", "[0, 1] + []", [True], [0.0], None, "[1,]"]
)
def test_parse_ranks_refuses_anything_else(value):
    with pytest.raises(DumpError):
        parse_ranks(value)


@pytest.mark.parametrize("sfx", ["", ".json"])
def test_rank_files_skips_names_without_rank(tmp_path, sfx):
    for n in (f"rank_0{sfx}", f"rank_1{sfx}", "README", ".tmp_fr_x.part"):
        (tmp_path / n).write_text("x")
    files, notes = rank_files(str(tmp_path), "rank_")
    assert files == {0: str(tmp_path / f"rank_0{sfx}"), 1: str(tmp_path / f"rank_1{sfx}")}
    assert notes == ["skipped README: not named rank_<rank>[.json]"]


def test_prefix_is_inferred_when_unique():
    assert infer_prefix(["rank_0", "rank_1", "notes.txt"]) == "rank_"
    assert infer_prefix(["a_0", "b_1"]) is None


def test_rank_files_without_any_ranked_name_returns_nothing(tmp_path):
    (tmp_path / "foo").write_text("x")
    files, notes = rank_files(str(tmp_path))
    assert files == {} and notes == ["skipped foo: no rank number in the name"]


def test_ambiguous_prefix_is_an_error(tmp_path):
    for n in ("a_0", "b_1"):
        (tmp_path / n).write_text("x")
    with pytest.raises(DumpError, match="cannot infer a common file prefix"):
        rank_files(str(tmp_path))


def test_prefix_is_inferred_from_json_suffixed_and_plain_names_alike():
    assert infer_prefix(["rank_0.json", "rank_1", "rank_2.json"]) == "rank_"
    assert infer_prefix(["torch_0.json", "rank_1"]) is None


def test_rank_with_both_forms_uses_the_plain_name_and_notes_the_other(tmp_path):
    for n in ("rank_0", "rank_0.json", "rank_1.json"):
        (tmp_path / n).write_text("{}")
    files, notes = rank_files(str(tmp_path))
    assert files == {0: str(tmp_path / "rank_0"), 1: str(tmp_path / "rank_1.json")}
    assert notes == ["skipped rank_0.json: rank 0 already has rank_0"]


def test_rank_numbers_are_ascii_digits_only(tmp_path):
    # "\u00b2" (superscript two) passes str.isdigit() but is no rank number.
    for n in ("rank_0", "rank_\u00b2", "rank_\u0661"):
        (tmp_path / n).write_text("{}")
    files, notes = rank_files(str(tmp_path), "rank_")
    assert files == {0: str(tmp_path / "rank_0")}
    assert len(notes) == 2 and all("not named rank_<rank>[.json]" in n for n in notes)


def test_absurd_rank_number_in_a_name_is_skipped(tmp_path):
    for n in ("rank_0", "rank_99999999999"):
        (tmp_path / n).write_text("{}")
    files, notes = rank_files(str(tmp_path), "rank_")
    assert files == {0: str(tmp_path / "rank_0")}
    assert notes == ["skipped rank_99999999999: rank 99999999999 is above 1048576"]


def test_json_named_file_holding_a_pickle_is_loaded_by_content(tmp_path):
    dump = S.clean()[0]
    p = tmp_path / "rank_0.json"
    p.write_bytes(pickle.dumps(dump, protocol=2))
    assert load_dump(str(p)) == dump


def test_pytorch_c10d_json_dump_loads_with_tuple_free_process_group(tmp_path):
    dump = S.load_fixture("c10d_gloo_hang.json")[1]
    p = tmp_path / "nccl_trace_rank_1.json"
    p.write_text(json.dumps(dump))
    loaded = load_dump(str(p))
    assert loaded["entries"][0]["process_group"] == ["0", "default_pg"]
    assert loaded["pg_config"][""]["ranks"] == "[0, 1]"


def test_stall_watchdogs_stacks_file_is_skipped_without_a_note(tmp_path):
    for n in ("rank_0", "rank_1", "stalled_stacks_r0.txt"):
        (tmp_path / n).write_bytes(b"x")
    (tmp_path / "notes.txt").write_bytes(b"x")
    files, notes = rank_files(str(tmp_path), "rank_")
    assert sorted(files) == [0, 1]
    assert notes == ["skipped notes.txt: not named rank_<rank>[.json]"]
