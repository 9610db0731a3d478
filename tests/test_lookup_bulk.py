"""Reading every rank's registration from a real TCPStore in a few round trips
(``discovery.lookup_workers``; the agent's ``HostRegistry`` reads its host's ranks the same way).

Every page starts with this read; one ``check`` per rank's sidecar took 1.1 s of each page at
16384 ranks, so the sidecars are checked in one call where all are there.
"""

from __future__ import annotations

import json
from typing import Any

from fakes import make_job

from debug_server.rank.discovery import register_worker
from debug_server.readers.storeview import lookup_workers, store_client


class CountingStore:
    """A real store client that counts its ``check`` calls."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.checks = 0

    def check(self, keys: list[str]) -> bool:
        self.checks += 1
        return bool(self.store.check(keys))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def test_a_world_of_ranks_with_sidecars_is_read_with_two_checks(tcp_store: Any) -> None:
    store = store_client("127.0.0.1", tcp_store.port, timeout=5)
    for r in range(6):
        register_worker(store, make_job(r, 6, tcp_store.port, restart=1), f"http://h{r}:{r + 1}")
    counting = CountingStore(store)
    addrs = lookup_workers(counting, 6, restart_count=1)  # type: ignore[arg-type]
    assert counting.checks == 2
    assert [(a.rank, a.url, a.error) for a in addrs] == [
        (r, f"http://h{r}:{r + 1}", None) for r in range(6)]
    assert [a.meta["restart"] if a.meta else None for a in addrs] == [1] * 6


def test_ranks_with_and_without_sidecars_each_get_their_own_verdict(tcp_store: Any) -> None:
    store = store_client("127.0.0.1", tcp_store.port, timeout=5)
    register_worker(store, make_job(0, 5, tcp_store.port, restart=1), "http://ours:1")
    store.set("rank1", "http://torchs:2/")  # torch's C++ worker: no sidecar, trusted
    register_worker(store, make_job(2, 5, tcp_store.port, restart=0), "http://old:3")
    store.set("rank3", "http://garbled:4")
    store.set("rank3_meta", "{not json")
    store.set("rank4_meta", json.dumps({"restart": 1}))  # a sidecar without its URL key
    addrs = lookup_workers(store, 5, restart_count=1)
    assert [(a.rank, a.url, a.error) for a in addrs] == [
        (0, "http://ours:1", None),
        (1, "http://torchs:2", None),
        (2, None, "not registered (stale key from restart 0, job is at restart 1)"),
        (3, None, "not registered (unreadable registration metadata)"),
        (4, None, "not registered")]
    assert addrs[0].meta is not None and addrs[0].meta["restart"] == 1
    assert addrs[1].meta is None


def test_a_sidecar_whose_restart_is_a_numeric_string_is_read_as_before(tcp_store: Any) -> None:
    store = store_client("127.0.0.1", tcp_store.port, timeout=5)
    store.set("rank0", "http://h:1")
    store.set("rank0_meta", json.dumps({"restart": "2", "pid": 7}))
    (addr,) = lookup_workers(store, 1, restart_count=2)
    assert (addr.url, addr.error, addr.meta) == ("http://h:1", None, {"restart": "2", "pid": 7})


def test_an_agent_reads_its_hosts_registrations_with_two_checks(tcp_store: Any) -> None:
    from debug_server.agent.registry import HostRegistry

    store = store_client("127.0.0.1", tcp_store.port, timeout=5)
    for r in range(4, 8):
        register_worker(store, make_job(r, 8, tcp_store.port), f"http://h:{r}",
                        extra={"agent": "hB" if r == 5 else "hA"})
    registry = HostRegistry("127.0.0.1", tcp_store.port, 8, 0, range(4, 8), "hA", timeout=5.0)
    counting = CountingStore(store)
    registry._store = counting  # type: ignore[assignment]
    try:
        addrs = registry._lookup_sync()
    finally:
        registry.close()
    assert counting.checks == 2
    # Rank 5 names another host's agent: that agent serves it, not this one.
    assert [(a.rank, a.url) for a in addrs] == [(4, "http://h:4"), (6, "http://h:6"),
                                                (7, "http://h:7")]


def test_an_agent_reads_ranks_without_sidecars_and_refuses_stale_ones(tcp_store: Any) -> None:
    from debug_server.agent.registry import HostRegistry

    store = store_client("127.0.0.1", tcp_store.port, timeout=5)
    register_worker(store, make_job(0, 3, tcp_store.port, restart=2), "http://ours:1",
                    extra={"agent": "hA"})
    store.set("rank1", "http://torchs:2")
    register_worker(store, make_job(2, 3, tcp_store.port, restart=1), "http://old:3",
                    extra={"agent": "hA"})
    registry = HostRegistry("127.0.0.1", tcp_store.port, 3, 2, range(3), "hA", timeout=5.0)
    try:
        addrs = registry._lookup_sync()
    finally:
        registry.close()
    assert [(a.rank, a.url, a.error) for a in addrs] == [
        (0, "http://ours:1", None), (1, "http://torchs:2", None),
        (2, None, "not registered (stale or unreadable sidecar)")]
