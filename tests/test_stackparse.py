"""faulthandler text parsing, main-thread choice and position summaries."""

from __future__ import annotations

import _scenarios as S

from debug_server.analysis import stackparse


def test_parse_threads_reads_every_thread_and_frame():
    threads = stackparse.parse_threads(S.stack_in_all_reduce())
    assert [len(t.frames) for t in threads] == [4, 4]
    assert [t.current for t in threads] == [False, True]
    assert threads[0].frames[2] == stackparse.Frame("/job/train.py", 148, "train_step")


def test_main_thread_is_the_module_thread_not_the_current_one():
    threads = stackparse.parse_threads(S.stack_in_all_reduce())
    assert stackparse.main_thread(threads) is threads[0]


def test_main_thread_when_current_thread_is_the_only_module_thread():
    text = 'Current thread 0x1 (most recent call first):\n  File "/job/a.py", line 3 in <module>\n'
    t = stackparse.main_thread(stackparse.parse_threads(text))
    assert t is not None and t.frames[0].line == 3


def test_single_thread_stack_header_is_parsed():
    text = 'Stack (most recent call first):\n  File "/job/a.py", line 7 in f\n  File "/job/a.py", line 9 in <module>\n'
    pos = stackparse.summarize_text(text)
    assert pos is not None and pos.position == "a.py:7 f" and pos.in_collective is False


def test_summary_in_collective_names_the_op_and_the_user_line():
    pos = stackparse.summarize_text(S.stack_in_all_reduce())
    assert pos == stackparse.Position(
        "all_reduce at train.py:148", "train.py:148 train_step", True, "all_reduce"
    )


def test_summary_outside_collective_names_the_call_from_the_shipped_source_line():
    text = S.faulthandler_text([("/job/demo.py", 88, "hang_phase"), ("/job/demo.py", 120, "<module>")])
    text = text.replace("line 88 in hang_phase\n", "line 88 in hang_phase\n    time.sleep(30)\n")
    pos = stackparse.summarize_text(text)
    assert pos == stackparse.Position(
        "time.sleep at demo.py:88", "demo.py:88 hang_phase", False, "time.sleep"
    )


def test_summary_never_reads_the_source_file_where_the_analysis_runs(tmp_path):
    src = tmp_path / "demo.py"
    src.write_text("import time\n" * 87 + "    time.sleep(30)\n")
    text = S.faulthandler_text([(str(src), 88, "hang_phase"), (str(src), 120, "<module>")])
    pos = stackparse.summarize_text(text)  # the file is here, but the stack did not ship the line
    assert pos is not None and pos.summary == "hang_phase at demo.py:88" and pos.call is None


def test_source_line_that_looks_like_a_frame_stays_the_frames_source():
    text = ('Thread 0x1 (most recent call first):\n'
            '  File "/job/a.py", line 7 in f\n'
            '    log(\'  File "/x.py", line 1 in g\')\n'
            '  File "/job/a.py", line 9 in <module>\n')
    [thread] = stackparse.parse_threads(text)
    assert [(f.line, f.source) for f in thread.frames] == [
        (7, 'log(\'  File "/x.py", line 1 in g\')'), (9, None)]


def test_torch_worker_stack_without_source_lines_parses_as_before():
    [main, _] = stackparse.parse_threads(S.stack_in_all_reduce())
    assert [f.source for f in main.frames] == [None] * 4
    assert main.frames[2] == stackparse.Frame("/job/train.py", 148, "train_step")


def test_summary_without_source_uses_the_function_name():
    pos = stackparse.summarize_text(S.stack_sleeping("/nonexistent/demo.py", 88))
    assert pos is not None and pos.summary == "hang_phase at demo.py:88" and pos.call is None


def test_comms_wrapper_frame_counts_as_collective():
    text = S.faulthandler_text(
        [("/x/debug_server/recording/comms.py", 40, "_run"), ("/job/t.py", 9, "<module>")]
    )
    pos = stackparse.summarize_text(text)
    assert pos is not None and pos.in_collective and pos.summary == "_run at t.py:9"


def test_threading_wait_is_not_a_collective():
    text = S.faulthandler_text(
        [("/usr/lib/python3.11/threading.py", 320, "wait"), ("/job/t.py", 5, "<module>")]
    )
    pos = stackparse.summarize_text(text)
    assert pos is not None and pos.in_collective is False


def test_garbage_text_gives_none():
    assert stackparse.summarize_text("nothing useful here\n") is None


def test_split_stacks_file_with_and_without_addresses():
    text = "header\n=== Rank 0 ===\nA\nB\n=== Rank 12: http://h:1 ===\nC\n"
    assert stackparse.split_stacks_file(text) == {0: "A\nB\n", 12: "C\n"}
