"""Plain-text rendering of analysis results."""

from __future__ import annotations

import re

import _scenarios as S

from debug_server.analysis import report, tables
from debug_server.analysis.core import analyze
from debug_server.analysis.ranks import format_rank_set
from debug_server.tools.synthetic import hang_job


def test_text_has_sections_in_order():
    text = report.fr_trace_text(analyze(S.missing_rank()))
    heads = [
        "=== Verdict ===",
        "--- Findings ---",
        "--- Groups ---",
        "--- Collectives ---",
        "--- NCCL Calls ---",
    ]
    assert [text.index(h) for h in heads] == sorted(text.index(h) for h in heads)


def test_missing_rank_row_has_seq_name_and_missing_set_on_one_line():
    text = report.fr_trace_text(analyze(S.missing_rank()))
    rows = [ln for ln in text.splitlines() if "nccl:all_reduce" in ln and "{1}" in ln]
    assert len(rows) == 1
    cols = rows[0].split()
    assert cols[:4] == ["4", "main_comm", "False", "4"] and "started" in cols


def test_collectives_table_column_order():
    table = tables.collectives_table(analyze(S.missing_rank()))
    headers, rows = table.headers, table.rows
    assert headers[:10] == ["id", "group_id", "pass_check", "collective_seq_id", "p2p_seq_id",
                            "collective_name", "collective_state", "missing_ranks", "expected_ranks",
                            "input_sizes"]  # fmt: skip
    assert rows[-1][:8] == [4, "main_comm", False, 4, "", "nccl:all_reduce", "started", "{1}"]
    assert rows[0][7] == ""  # empty missing set renders blank


def test_collectives_table_marks_the_failing_row_and_keeps_its_missing_ranks_for_links():
    table = tables.collectives_table(analyze(S.missing_rank()))
    assert table.marks[-1] == "fail" and set(table.marks[:-1]) == {""}
    assert table.rank_column == 7 and table.rank_sets[-1] == [1] and table.rank_sets[0] == []
    assert table.total == len(table.rows) == 5


def test_nccl_calls_table_columns():
    table = tables.nccl_calls_table(analyze(S.missing_rank()))
    headers, rows = table.headers, table.rows
    assert table.marks[-1] == "fail"
    assert headers == ["id", "collective_id", "group_id", "global_rank", "collective_type", "state"]
    assert rows[-1] == [8, 4, "main_comm", 0, "nccl:all_reduce", "started"]


def test_clean_findings_say_none():
    text = report.fr_trace_text(analyze(S.clean()))
    assert "--- Findings ---\nnone\n" in text


def test_findings_lines_are_one_per_finding():
    lines = tables.findings_lines(analyze(S.two_subcomms()))
    assert len(lines) == 1
    assert lines[0].startswith("[missing_ranks] sub_b #2 all_reduce ranks {3}: ")


def test_ranks_without_data_section():
    dumps = S.missing_rank()
    del dumps[1]
    text = report.fr_trace_text(analyze(dumps, world_size=2, unavailable={1: "not registered"}))
    assert "--- Ranks without data ---\nrank 1: not registered\n" in text


def test_large_rank_sets_collapse_to_ranges():
    assert format_rank_set(range(64)) == "{0-63}"
    assert format_rank_set([0, 1, 5]) == "{0, 1, 5}"
    assert format_rank_set([]) == ""


def test_text_stays_bounded_at_scale():
    result = analyze(hang_job(16, 2000, missing_rank=3))
    text = report.fr_trace_text(result)
    assert len(result["collectives"]) == 2000  # the JSON keeps everything
    assert "... 1949 fully passing collectives elided" in text
    coll = text.split("--- Collectives ---")[1].split("--- NCCL Calls ---")[0]
    assert len([ln for ln in coll.splitlines() if re.match(r"^\d+\s", ln)]) == 51
    assert len(text) < 100_000
