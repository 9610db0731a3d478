"""The per-host agent: its own process (``python -m debug_server.agent``), started by each host's
local rank 0 (``rank.agent_launch``), asking that host's rank workers on the frontend's behalf
and answering the frontend once per host (``app``). The routes it answers are
``protocol.agentwire``; the frontend's side of it is ``fanout``'s agent route."""
