"""``first_line``: how every page, log line and CLI message quotes an exception."""

from __future__ import annotations

import json

import pytest

from debug_server.errors import first_line


def test_multi_line_message_gives_its_first_line() -> None:
    assert first_line(RuntimeError("\n  store down\nTraceback (most recent call last):\n")) == \
        "store down"


def test_message_is_cut_to_the_limit() -> None:
    assert first_line(ValueError("x" * 500), 200) == "x" * 200


def test_exception_without_text_gives_its_type_name() -> None:
    assert first_line(TimeoutError()) == "TimeoutError"


def test_exception_without_text_gives_the_caller_s_empty_text() -> None:
    assert first_line(OSError(""), empty="invalid pickle") == "invalid pickle"


def test_json_decode_error_is_one_line_with_its_position() -> None:
    with pytest.raises(ValueError) as info:
        json.loads('{"a": 1,\n"b": }')
    assert first_line(info.value) == "Expecting value: line 2 column 6 (char 14)"
