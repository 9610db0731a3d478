from __future__ import annotations

import json
import time
from typing import Any

import pytest
from fakes import closed_port_url, make_job
from mpjob import free_port

from debug_server.config import ConfigError, JobEnv, Settings, default_bind_host, is_loopback
from debug_server.rank import discovery
from debug_server.rank.discovery import (
    Advertised,
    advertise,
    interface_addresses,
    register_worker,
    route_source,
)
from debug_server.readers.storeview import StoreRegistry, lookup_workers, store_client

ENV = {"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_job_env_reads_torchrun_variables() -> None:
    job = JobEnv.from_env({**ENV, "TORCHELASTIC_RESTART_COUNT": "2", "LOCAL_WORLD_SIZE": "2"})
    assert (job.rank, job.world_size, job.local_world_size, job.restart_count) == (1, 4, 2, 2)


@pytest.mark.parametrize(("env", "named"), [
    ({k: v for k, v in ENV.items() if k != "MASTER_PORT"}, "MASTER_PORT"),
    ({**ENV, "WORLD_SIZE": "four"}, "WORLD_SIZE='four'"),
    ({**ENV, "RANK": "7"}, "RANK=7"),
])
def test_job_env_error_names_the_bad_variable(env: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        JobEnv.from_env(env)


def test_single_host_job_binds_loopback_and_multi_host_binds_all() -> None:
    assert default_bind_host(JobEnv.from_env({**ENV, "LOCAL_WORLD_SIZE": "4"})) == "127.0.0.1"
    assert default_bind_host(JobEnv.from_env({**ENV, "MASTER_ADDR": "localhost"})) == "127.0.0.1"
    assert default_bind_host(JobEnv.from_env({**ENV, "LOCAL_WORLD_SIZE": "2"})) is None
    assert default_bind_host(JobEnv.from_env({**ENV, "MASTER_ADDR": "node17"})) is None


def test_registered_rank_is_found_and_missing_rank_is_reported_at_once(tcp_store: Any) -> None:
    store = store_client("127.0.0.1", tcp_store.port, timeout=5)
    register_worker(store, make_job(0, 3, tcp_store.port), "http://127.0.0.1:1234")
    t0 = time.monotonic()
    addrs = lookup_workers(store, 3, restart_count=0)
    assert time.monotonic() - t0 < 1.0
    assert [(a.rank, a.url, a.error) for a in addrs] == [
        (0, "http://127.0.0.1:1234", None), (1, None, "not registered"), (2, None, "not registered")]


def test_key_from_an_earlier_restart_is_not_trusted(tcp_store: Any) -> None:
    store = store_client("127.0.0.1", tcp_store.port, timeout=5)
    register_worker(store, make_job(0, 1, tcp_store.port, restart=0), "http://old:1")
    (addr,) = lookup_workers(store, 1, restart_count=1)
    assert addr.url is None
    assert addr.error == "not registered (stale key from restart 0, job is at restart 1)"
    register_worker(store, make_job(0, 1, tcp_store.port, restart=1), "http://new:2")
    assert lookup_workers(store, 1, restart_count=1)[0].url == "http://new:2"


def test_key_without_sidecar_is_trusted_like_torchs_own_worker(tcp_store: Any) -> None:
    store = store_client("127.0.0.1", tcp_store.port, timeout=5)
    store.set("rank0", "http://host:5/")
    assert lookup_workers(store, 1, restart_count=3)[0].url == "http://host:5"


def test_sidecar_records_restart_pid_and_run_id(tcp_store: Any) -> None:
    store = store_client("127.0.0.1", tcp_store.port, timeout=5)
    register_worker(store, make_job(0, 1, tcp_store.port, restart=2), "http://h:1")
    meta = json.loads(store.get("rank0_meta"))
    assert meta["restart"] == 2 and meta["run_id"] == "job" and meta["pid"] > 0


def test_torchs_own_store_client_reads_our_registration(tcp_store: Any, monkeypatch: Any) -> None:
    pytest.importorskip("torch.distributed.debug._store")
    from torch.distributed.debug._store import tcpstore_client

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(tcp_store.port))
    register_worker(store_client("127.0.0.1", tcp_store.port, 5), make_job(0, 1, tcp_store.port),
                    "http://127.0.0.1:4321")
    assert tcpstore_client().get("rank0") == b"http://127.0.0.1:4321"


async def test_store_registry_lookup_is_async_and_bounded(tcp_store: Any) -> None:
    registry = StoreRegistry("127.0.0.1", tcp_store.port, world_size=2, restart_count=0, timeout=2)
    try:
        store_client("127.0.0.1", tcp_store.port, 5).set("rank1", "http://127.0.0.1:9")
        addrs = await registry.lookup()
        assert [a.url for a in addrs] == [None, "http://127.0.0.1:9"]
    finally:
        registry.close()


def _three_ranks(port: int) -> tuple[Any, StoreRegistry]:
    """A store with 3 ranks registered (at http://h:<rank>) and a registry over it."""
    store = store_client("127.0.0.1", port, 5)
    for r in range(3):
        register_worker(store, make_job(r, 3, port), f"http://h:{r}")
    return store, StoreRegistry("127.0.0.1", port, world_size=3, restart_count=0, timeout=2)


async def test_a_registry_started_after_the_ranks_registered_reads_them_at_once(
        tcp_store: Any) -> None:
    """An attached or restarted frontend reads the registry as it starts, so its first page
    does not; one that starts before the ranks registered leaves the read to the first page."""
    early = StoreRegistry("127.0.0.1", tcp_store.port, world_size=3, restart_count=0, timeout=2)
    try:
        await early._lane.call(lambda: None)  # its start (connect, look) is done: in order
        assert early.answered and early.last is None
        store, late = _three_ranks(tcp_store.port)
        try:
            await late._lane.call(lambda: None)
            assert late.last is not None and [a.url for a in late.last] == [
                "http://h:0", "http://h:1", "http://h:2"]
            assert await late.lookup() is late.last  # the page finds it read
        finally:
            late.close()
    finally:
        early.close()


async def test_a_read_again_of_unchanged_keys_gives_the_same_objects(tcp_store: Any,
                                                                      monkeypatch: Any) -> None:
    """Every REREAD_S the registry reads every rank's keys again: what did not change comes
    back as the very objects of the last read (memos keyed by identity stay valid, and the
    last read is not kept alive beside the new one: at 131072 ranks a read was ~80 MB)."""
    from debug_server.readers import storeview

    monkeypatch.setattr(storeview, "REREAD_S", 0.0)  # every lookup reads every key again
    monkeypatch.setattr(storeview, "REREAD_RANKS_PER_S", 1e9)
    store, registry = _three_ranks(tcp_store.port)
    try:
        first = await registry.lookup()
        again = await registry.lookup()
        assert again is first
        register_worker(store, make_job(2, 3, tcp_store.port), "http://moved:2")
        moved = await registry.lookup()
        assert moved is not first and [a.url for a in moved] == [
            "http://h:0", "http://h:1", "http://moved:2"]
        assert moved[0] is first[0] and moved[1] is first[1] and moved[2] is not first[2]
    finally:
        registry.close()


async def test_a_big_job_reads_unchanged_keys_again_less_often(tcp_store: Any,
                                                               monkeypatch: Any) -> None:
    """Above ``REREAD_S x REREAD_RANKS_PER_S`` ranks the read again is rationed (a read of
    131072 ranks' keys costs the frontend 0.5 s of CPU): a rank that registered again over its
    own keys is found at the next read after ``reread_s``, not before."""
    from debug_server.readers import storeview

    assert storeview.reread_s(4096) == storeview.REREAD_S == 30.0
    assert storeview.reread_s(131072) == 128.0
    monkeypatch.setattr(storeview, "REREAD_S", 0.0)
    monkeypatch.setattr(storeview, "REREAD_RANKS_PER_S", 3 / 3600)  # 3 ranks: an hour
    store, registry = _three_ranks(tcp_store.port)
    try:
        first = await registry.lookup()
        register_worker(store, make_job(2, 3, tcp_store.port), "http://moved:2")
        assert await registry.lookup() is first  # same key count, within the hour
        monkeypatch.setattr(storeview, "REREAD_RANKS_PER_S", 1e9)  # now: REREAD_S (0 s)
        assert [a.url for a in await registry.lookup()][2] == "http://moved:2"
    finally:
        registry.close()


async def test_store_registry_with_store_down_reports_every_rank_not_registered() -> None:
    port = int(closed_port_url().rsplit(":", 1)[1]) or free_port()
    registry = StoreRegistry("127.0.0.1", port, world_size=2, restart_count=0, timeout=0.5)
    try:
        t0 = time.monotonic()
        addrs = await registry.lookup()
        assert time.monotonic() - t0 < 5
        assert all(a.url is None and "unavailable" in (a.error or "") for a in addrs)
    finally:
        registry.close()


# -- what a rank advertises to the other hosts (issue 19) ------------------------------------


def _own_non_loopback_address() -> str:
    addrs = [a for a in interface_addresses() if not is_loopback(a)]
    if not addrs:
        pytest.skip("this host has no non-loopback IPv4 interface")
    return addrs[-1]


def test_advertised_host_is_the_interface_toward_master_addr() -> None:
    own = _own_non_loopback_address()
    adv = advertise(None, own, 29500)
    assert adv == Advertised(own, f"the interface toward MASTER_ADDR {own}")
    assert route_source(own, 29500) == own


def test_host_setting_wins_over_the_route_and_host() -> None:
    own = _own_non_loopback_address()
    host = Settings.from_env({"DEBUG_SERVER_HOST": "node7.example"}).host
    assert advertise(None, own, 29500, override=host).host == "node7.example"
    assert advertise("10.1.2.3", own, 29500, override=host).host == "node7.example"


def test_explicit_bind_address_wins_over_the_route() -> None:
    own = _own_non_loopback_address()
    assert advertise("10.1.2.3", own, 29500) == Advertised(
        "10.1.2.3", "the bind address (host=)")


def test_loopback_bind_is_advertised_even_with_host_setting() -> None:
    adv = advertise("127.0.0.1", "127.0.0.1", 29500, override="node7.example")
    assert (adv.host, adv.reachable) == ("127.0.0.1", False)


def test_127_0_1_1_is_never_advertised_when_a_better_address_exists(monkeypatch: Any) -> None:
    # The Debian trap: /etc/hosts maps the host name to 127.0.1.1, and MASTER_ADDR is that
    # name on rank 0's host. The route toward it is loopback; an interface address wins.
    _own_non_loopback_address()
    monkeypatch.setattr(discovery, "hostname_addresses", lambda: ["127.0.1.1"])
    adv = advertise(None, "127.0.1.1", 29500)
    assert not is_loopback(adv.host) and adv.reachable
    assert adv.host == next(a for a in interface_addresses() if not is_loopback(a))


def test_host_name_address_is_used_when_master_addr_is_unroutable(monkeypatch: Any) -> None:
    monkeypatch.setattr(discovery, "route_source", lambda dest, port: None)
    monkeypatch.setattr(discovery, "hostname_addresses", lambda: ["127.0.1.1", "10.20.30.40"])
    assert advertise(None, "master.invalid", 29500).host == "10.20.30.40"


def test_loopback_is_the_last_resort_and_says_so(monkeypatch: Any) -> None:
    monkeypatch.setattr(discovery, "route_source", lambda dest, port: "127.0.0.1")
    monkeypatch.setattr(discovery, "hostname_addresses", lambda: ["127.0.1.1"])
    monkeypatch.setattr(discovery, "interface_addresses", lambda: ["127.0.0.1"])
    adv = advertise(None, "master", 29500)
    assert (adv.host, adv.reachable) == ("127.0.0.1", False)


def test_sidecars_read_as_one_array_or_each_on_its_own() -> None:
    from debug_server.protocol.addrs import meta_dict, meta_dicts

    raws = {0: b'{"restart": 0, "pid": 5}', 3: b'{"restart": 0, "pid": 6}', 7: b"[1]"}
    assert meta_dicts(raws) == {0: {"restart": 0, "pid": 5}, 3: {"restart": 0, "pid": 6}, 7: None}
    # One value that is not JSON, or that reads as two items: each value on its own.
    for bad in (b"{oops", b'{"a": 1}, {"b": 2}', b""):
        got = meta_dicts({**raws, 9: bad})
        assert got == {**meta_dicts(raws), 9: meta_dict(bad)} and got[9] is None
    assert meta_dicts({}) == {}
