"""The tree's second level: every ``tree_hosts`` hosts' agents answer through one of them.

At 131072 ranks (16384 hosts of 8) one request per host is 16384 requests and replies for the
frontend to send and read on every page. So the agents form groups through the job's store, with
no service of their own: each agent, once registered, takes the next place in the tree
(``store.add`` on ``addrs.tree_hosts_key``) and writes its host id at that place; the agent at
the first place of every ``tree_hosts`` places (place 0, 128, 256...) is its group's
**aggregator**. It serves a second app, the agent app itself (``app.make_agent_app``) over the
group's ranks (:class:`GroupRegistry`) whose collector goes through the group's host agents
(``fanout.agents.AgentRoute``, hosts only), and registers it as ``addrs.tree_group_key``. What it
answers is an agent's reply for a thousand ranks, merged before it goes up: one dump per class
of ranks that read the same (``hostreply.share_same``), the records, the host agents' tags
folded into its own (``agent_fr`` "unchanged" when none of its hosts changed).

The frontend asks the aggregators once the job has more hosts than one group
(``fanout.agents.AgentDirectory.groups``). An aggregator that does not answer is bypassed: its
ranks go through their host agents, and a host agent that does not answer has its ranks asked
directly, in the same page (``fanout.agents``); each rank's record says which way it came
("via agent agg-0", "via agent host7"...).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import TYPE_CHECKING

from debug_server.agent.registry import HostRegistry
from debug_server.fanout.agents import GROUP_ID_PREFIX
from debug_server.protocol import addrs
from debug_server.protocol.addrs import format_ranks, parse_ranks
from debug_server.readers import storeview

if TYPE_CHECKING:
    import torch.distributed as dist

logger = logging.getLogger(__name__)

REFRESH_S = 2.0
"""How often an aggregator reads its group's places again while the group is not full."""


def group_id(group: int) -> str:
    return f"{GROUP_ID_PREFIX}{group}"


def join(store: dist.Store, host_id: str, restart: int, size: int) -> int:
    """This agent's place in the tree (from 0); the tree's group size is set by the first."""
    if size <= 0:
        return -1
    place = store.add(addrs.tree_hosts_key(restart), 1) - 1
    store.set(addrs.tree_place_key(restart, place), host_id)
    if place == 0:
        store.set(addrs.tree_size_key(restart), str(size))
    return place


def leads(place: int, size: int) -> int | None:
    """The group this place leads (its first place), else None."""
    if place < 0 or size <= 0 or place % size:
        return None
    return place // size


class GroupRegistry(HostRegistry):
    """The ranks of the hosts at places ``first..first + size - 1``, read from the store: the
    places' host ids, their agents' ranks, then the ranks' own keys (``HostRegistry``: any
    agent's ranks). Read again every ``REFRESH_S`` until the group is full."""

    def __init__(self, master_addr: str, master_port: int, world_size: int, restart: int,
                 first: int, size: int, timeout: float) -> None:
        super().__init__(master_addr, master_port, world_size, restart, [], None, timeout)
        self.first = first
        self.size = size
        self.hosts: list[str] = []
        self._read_at = 0.0

    def _members_sync(self) -> None:
        now = time.monotonic()
        if len(self.hosts) >= self.size or now - self._read_at < REFRESH_S:
            return
        self._read_at = now
        store = self.store()
        keys = [addrs.tree_place_key(self._restart, p)
                for p in range(self.first, self.first + self.size)]
        present = [k for k, here in zip(keys, storeview.present(store, keys), strict=True)
                   if here]
        hosts = [v.decode(errors="replace") for v in storeview.get_many(store, present)]
        agent_keys = [k for k, here in zip(
            (addrs.agent_key(h) for h in hosts), storeview.present(
                store, [addrs.agent_key(h) for h in hosts]), strict=True) if here]
        ranks: set[int] = set()
        for raw in storeview.get_many(store, agent_keys):
            try:
                obj = json.loads(raw)
                if obj.get("restart") == self._restart:
                    ranks.update(parse_ranks(str(obj["ranks"])))
            except (ValueError, KeyError, TypeError):
                continue
        self.hosts = hosts
        self.ranks = sorted(ranks)

    def _lookup_sync(self) -> list[addrs.WorkerAddr]:
        if self._gone is None:
            try:
                self._members_sync()
            except Exception:  # noqa: BLE001 - the lookup below says what the store did
                pass
        return super()._lookup_sync()

    def record(self, url: str) -> str:
        return json.dumps({"url": url, "ranks": format_ranks(self.ranks), "hosts": self.hosts,
                           "restart": self._restart, "pid": os.getpid()})


def register(store: dist.Store, restart: int, group: int, record: str) -> None:
    store.set(addrs.tree_group_key(restart, group), record)


__all__ = ["GROUP_ID_PREFIX", "GroupRegistry", "group_id", "join", "leads", "register"]
