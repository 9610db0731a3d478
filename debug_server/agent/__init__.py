"""The per-host agent: its own process (``python -m debug_server.agent``), started by each host's
local rank 0 (``rank.agent_launch``), asking that host's rank workers on the frontend's behalf
and answering the frontend once per host. The routes it answers are ``protocol.agentwire``; the
frontend's side of it is ``fanout.agents``.

- ``app``: the routes (``agent_fr``, ``agent_stacks``, ``agent_fetch``, ``agent_info``) over
  one ``fanout.live.LiveCollector`` of this host's ranks;
- ``hostreply``: the reply body (shared lists and frames, mismatch signatures, the ``tag``);
- ``registry``: where this host's ranks are (the store, or fixed URLs);
- ``main``: the process (arguments, registration in the store, staying while a rank runs).
"""
