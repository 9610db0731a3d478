"""``protocol.fastjson``: the same values as ``json`` for what the fan-outs parse and write,
with ``orjson`` and without it (a source tree run where it is missing)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from debug_server.protocol import fastjson
from debug_server.tools import synthetic

_DUMP = synthetic.hang_job(4, n_entries=5, missing_rank=3)[0]


@pytest.fixture(params=["orjson", "json"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "orjson":
        pytest.importorskip("orjson")
    else:
        monkeypatch.setattr(fastjson, "orjson", None)
    return str(request.param)


@pytest.mark.parametrize("value", [
    _DUMP,
    {"a": [1, 2.5, None, True, "é\u2028\x00"], "b": {"c": -(2**63)}, "d": 2**64 - 1},
    [], "", 0,
])
def test_values_round_trip_as_json_s(mode: str, value: Any) -> None:
    text = fastjson.dumps(value)
    assert fastjson.loads(text) == json.loads(text) == value
    assert fastjson.loads(text.encode()) == value


def test_what_orjson_refuses_is_read_and_written_by_json(mode: str) -> None:
    big = 2**70
    assert fastjson.loads(f'{{"n": {big}}}') == {"n": big}
    assert math.isnan(fastjson.loads('{"x": NaN}')["x"])
    assert fastjson.loads('"\\ud800"') == "\ud800"
    assert json.loads(fastjson.dumps({1: big})) == {"1": big}  # int keys, a 70-bit int


def test_default_and_bad_text_behave_as_json_s(mode: str) -> None:
    assert json.loads(fastjson.dumps({"s": {1}}, default=str)) == {"s": "{1}"}
    with pytest.raises(TypeError):
        fastjson.dumps({"s": {1}})
    with pytest.raises(ValueError):
        fastjson.loads('{"a": ')
    with pytest.raises(ValueError):  # as json's: UnicodeDecodeError
        fastjson.loads(b"\xff")
