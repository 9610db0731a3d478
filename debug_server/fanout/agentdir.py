"""Where the agents are: each host's agent and the tree's aggregators, read from the job's
store on a private thread and cached briefly (``agents.AgentRoute`` plans with it)."""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING

from debug_server.fanout.agentreply import AgentAddr
from debug_server.protocol.addrs import (
    agent_key,
    parse_ranks,
    tree_group_key,
    tree_hosts_key,
    tree_size_key,
)
from debug_server.readers import storeview

if TYPE_CHECKING:
    import torch.distributed as dist

logger = logging.getLogger(__name__)

AGENT_RETRY_S = 30.0
"""How long a failed agent is skipped (its ranks asked directly) before it is tried again."""
AGENT_TTL_S = 5.0
"""How long an agent's registration read from the store is trusted before it is read again."""
MISSING_TTL_S = 1.0
STORE_RETRY_S = 15.0
"""After the store failed to answer, how long the agents found before are used without asking."""
AGENT_SLACK_S = 2.0
GROUP_ID_PREFIX = "agg-"
"""An aggregator's id (``agent.tree``): ``agg-<group>``."""


class AgentDirectory:
    """Agents registered in the job's store, read on a private thread and cached briefly."""

    def __init__(self, master_addr: str, master_port: int, restart: int,
                 timeout: float = 5.0, tree: bool = True) -> None:
        self._addr = (master_addr, master_port)
        self._restart = restart
        self._timeout = timeout
        self._store: dist.Store | None = None
        self._cache: dict[str, tuple[float, AgentAddr | None]] = {}
        self.tree = tree
        """Whether the tree's aggregators are looked for (an aggregator's own directory: no)."""
        self._groups: tuple[float, list[AgentAddr]] = (-1e9, [])
        self._retry_at = 0.0
        self._reached = False
        # A daemon thread, never joined at exit (storeview.StoreLane).
        self._lane = storeview.StoreLane("debug_server.agents")

    def _read(self, ids: list[str]) -> dict[str, AgentAddr | None] | None:
        try:
            if self._store is None:
                self._store = storeview.store_client(*self._addr, timeout=self._timeout)
            store = self._store
            self._reached = True
            keys = [agent_key(i) for i in ids]
            found = [i for i, here in zip(ids, storeview.present(store, keys), strict=True)
                     if here]
            raw = dict(zip(found, storeview.get_many(store, [agent_key(i) for i in found]),
                           strict=True))
        except Exception as e:  # no store: the agents found before, else every rank directly
            self._store = None
            # A store that answered before and went away is the job's end (or rank 0's):
            # nothing to warn about here (the frontend's watch says what matters).
            logger.log(logging.DEBUG if self._reached else logging.WARNING,
                       "debug_server: agents not readable from the store: %s",
                       (str(e).splitlines() or [type(e).__name__])[0][:200])
            return None
        return {i: _agent_addr(i, raw.get(i), self._restart) for i in ids}

    async def lookup(self, ids: set[str]) -> dict[str, AgentAddr]:
        now = time.monotonic()
        # A missing agent is looked for again after a second (it may be starting), a found
        # one is trusted for AGENT_TTL_S (a dead one is noticed by its requests, not here).
        stale = sorted(i for i in ids if i not in self._cache or now - self._cache[i][0] > (
            AGENT_TTL_S if self._cache[i][1] is not None else MISSING_TTL_S))
        if stale and now >= self._retry_at:
            got = await self._lane.call(lambda: self._read(stale))
            if got is None:
                # The store is gone (rank 0 hosted it and died): keep the agents found before
                # (a dead one is noticed by its requests). One that answered before is never
                # asked again (that port may hold the next job's store); one never reached is
                # tried again every STORE_RETRY_S, so pages do not wait on it.
                self._retry_at = float("inf") if self._reached else now + STORE_RETRY_S
                got = {i: self._cache.get(i, (0.0, None))[1] for i in stale}
            for i, a in got.items():
                self._cache[i] = (now, a)
        return {i: a for i in ids if (a := self._cache.get(i, (0.0, None))[1]) is not None}

    def _read_groups(self) -> list[AgentAddr] | None:
        """The tree's aggregators (``agent.tree``) where the job has more hosts than one group
        holds; [] where it has none or not that many hosts; None: the store did not answer."""
        try:
            if self._store is None:
                self._store = storeview.store_client(*self._addr, timeout=self._timeout)
            store = self._store
            self._reached = True
            size_key = tree_size_key(self._restart)
            if not store.check([size_key]):
                return []
            size = int(store.get(size_key))
            hosts = store.add(tree_hosts_key(self._restart), 0)
            if size <= 0 or hosts <= size:
                return []
            keys = [tree_group_key(self._restart, g) for g in range((hosts + size - 1) // size)]
            present = [g for g, here in enumerate(storeview.present(store, keys)) if here]
            raw = storeview.get_many(store, [keys[g] for g in present])
        except Exception as e:  # noqa: BLE001 - no store: the host agents as before
            self._store = None
            logger.debug("debug_server: the tree is not readable from the store: %s", e)
            return None
        out = []
        for g, value in zip(present, raw, strict=True):
            got = _agent_addr(f"{GROUP_ID_PREFIX}{g}", value, self._restart)
            if got is not None:
                out.append(got)
        return out

    async def groups(self) -> list[AgentAddr]:
        """The tree's aggregators, read again every ``AGENT_TTL_S``."""
        if not self.tree:
            return []
        now = time.monotonic()
        if now - self._groups[0] > AGENT_TTL_S and now >= self._retry_at:
            got = await self._lane.call(self._read_groups)
            self._groups = (now, got if got is not None else self._groups[1])
        return self._groups[1]

    def forget(self, agent_id: str) -> None:
        self._cache.pop(agent_id, None)
        if agent_id.startswith(GROUP_ID_PREFIX):
            self._groups = (-1e9, self._groups[1])

    def close(self) -> None:
        self._lane.close()
        self._store = None


def _agent_addr(agent_id: str, raw: bytes | None, restart: int) -> AgentAddr | None:
    if raw is None:
        return None
    try:
        obj = json.loads(raw)
        if obj["restart"] != restart or not isinstance(obj["url"], str):
            return None
        return AgentAddr(agent_id, obj["url"].rstrip("/"), frozenset(parse_ranks(obj["ranks"])))
    except (ValueError, KeyError, TypeError):
        return None



__all__ = ["AGENT_RETRY_S", "AGENT_SLACK_S", "AGENT_TTL_S", "GROUP_ID_PREFIX", "MISSING_TTL_S",
           "STORE_RETRY_S", "AgentDirectory"]
