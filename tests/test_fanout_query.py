"""The query string of a fan-out's requests (``fanout.handler_url``): every rank of a fan-out is
sent the same parameters, so ``fan_out`` encodes them once and passes the text; what is sent is
what ``urlencode`` makes of the mapping."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode

from debug_server.fanout.transport import handler_url


def test_a_handlers_url_carries_its_parameters_encoded_as_urlencode_does() -> None:
    params = {"window": "4", "pgknown": "a1b2,c3d4 e&f=g"}
    for base in ("http://10.0.0.1:8000", "http://10.0.0.2:8001"):
        url = handler_url(base, "torchcomms_fr_trace_json", params)
        assert url == f"{base}/handler/torchcomms_fr_trace_json?{urlencode(params)}"
        assert dict(parse_qsl(url.partition("?")[2])) == params


def test_an_encoded_query_is_sent_as_it_is_and_a_mapping_as_urlencode_makes_it() -> None:
    params = {"since": "0:5,1:7", "pgknown": "a b"}
    assert handler_url("http://h:1", "x", urlencode(params)) == handler_url("http://h:1", "x", params)
    assert handler_url("http://h:1", "ping", {"a": 1}) == "http://h:1/handler/ping?a=1"  # type: ignore[dict-item]
    assert handler_url("http://h:1", "ping", {"a": True}) == "http://h:1/handler/ping?a=True"  # type: ignore[dict-item]
    assert handler_url("http://h:1", "ping", {"a": "1"}) == "http://h:1/handler/ping?a=1"


def test_no_parameters_is_a_url_without_a_query() -> None:
    assert handler_url("http://h:1", "dump_traceback", None) == "http://h:1/handler/dump_traceback"
    assert handler_url("http://h:1", "dump_traceback", {}) == "http://h:1/handler/dump_traceback"
