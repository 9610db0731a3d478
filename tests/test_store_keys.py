"""store_keys: what /tcpstore shows of a store value, and pages read from a real TCPStore."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from debug_server.frontend.store_keys import (
    REDACTED,
    VALUE_CHARS,
    StoreReader,
    StoreReadError,
    select,
    show_value,
)

TOKEN = "tok_0123456789abcdefghijklmnop"


@pytest.mark.parametrize("key", ["debug_server/auth_token_r0", "job/API_KEY", "x/password",
                                 "svc/db_passwd", "a/secret", "creds/credentials", "ssh-key",
                                 "tls/private_key", "s3/access-key", "web/cookie"])
def test_values_of_keys_named_like_secrets_are_redacted(key: str) -> None:
    row = show_value(key, b"hunter2")
    assert row["value"] == REDACTED and row["redacted"] and row["size"] == 7


def test_a_value_holding_the_access_token_is_redacted_whatever_its_key() -> None:
    row = show_value("job/config", f'{{"header": "{TOKEN}"}}'.encode(), [TOKEN])
    assert row["value"] == REDACTED


def test_a_pem_private_key_is_redacted_whatever_its_key() -> None:
    pem = b"-----BEGIN RSA PRIVATE KEY-----\nMIIE...\n-----END RSA PRIVATE KEY-----\n"
    assert show_value("job/blob", pem)["value"] == REDACTED


def test_ordinary_keys_show_their_text() -> None:
    row = show_value("debug_server/rank0", b"http://10.0.0.1:4242")
    assert (row["value"], row["redacted"], row["truncated"]) == ("http://10.0.0.1:4242", False, False)


def test_long_values_are_cut_and_marked() -> None:
    row = show_value("job/x", b"a" * 1000)
    assert row["value"] == "a" * VALUE_CHARS and row["truncated"] and row["size"] == 1000


def test_binary_values_show_as_bytes_repr() -> None:
    row = show_value("torchelastic/state", b"\x80\x04\x95\x00\x01")
    assert row["value"] == repr(b"\x80\x04\x95\x00\x01") and row["binary"]


def test_select_pages_the_sorted_keys_under_the_prefix() -> None:
    keys = ["b/2", "a/1", "b/1", "b/3", "c"]
    assert select(keys, "b/", 1, 1) == (["b/2"], 3)
    assert select(keys, "", 3, 10) == (["b/3", "c"], 5)


@pytest.fixture
def reader(tcp_store: Any) -> Any:
    tcp_store.set("debug_server/rank0", "http://127.0.0.1:1")
    tcp_store.set("debug_server/auth_token_r0", TOKEN)
    tcp_store.set("other/x", "y")
    r = StoreReader("127.0.0.1", tcp_store.port, timeout=2.0, world_size=1, restart_count=0)
    yield r
    r.close()


async def test_reader_lists_our_prefix_and_redacts_the_token(reader: StoreReader) -> None:
    page = (await reader.read("debug_server/", 0, 100, [TOKEN])).as_dict()
    assert [(k["key"], k["value"]) for k in page["keys"]] == [
        ("debug_server/auth_token_r0", REDACTED), ("debug_server/rank0", "http://127.0.0.1:1")]
    assert (page["total"], page["all_keys"], page["next_offset"]) == (2, 3, None)


async def test_reader_pages_through_every_key(reader: StoreReader) -> None:
    first = (await reader.read("", 0, 2)).as_dict()
    second = (await reader.read("", first["next_offset"], 2)).as_dict()
    assert [k["key"] for k in first["keys"] + second["keys"]] == [
        "debug_server/auth_token_r0", "debug_server/rank0", "other/x"]
    assert second["next_offset"] is None


async def test_reader_reports_a_dead_store_in_one_line() -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = StoreReader("127.0.0.1", port, timeout=1.0, world_size=1, restart_count=0)
    try:
        with pytest.raises(StoreReadError) as e:
            await asyncio.wait_for(r.read("", 0, 10), 30)
        assert f"127.0.0.1:{port}" in str(e.value) and "\n" not in str(e.value)
    finally:
        r.close()
