"""The agent's routes as the frontend asks them (``agent/app.py`` answers them).

An agent serves its host's ranks under the workers' own route shape (``POST /handler/<name>``);
these are the names and the one conditional parameter both sides spell.
"""

from __future__ import annotations

from debug_server.protocol.names import DUMP_FILE_HANDLER, HEALTH_HANDLER, PING_HANDLER

FR = "agent_fr"
STACKS = "agent_stacks"
FETCH = "agent_fetch"
INFO = "agent_info"
TAG = "tag"
"""``agent_fr``'s conditional ask: the ``tag`` of the asker's last reply for the same question;
when nothing but the ranks' read times changed since, the reply is ``"unchanged": true`` with
the rank records and each rank's ``dump_time_ns`` (``"snap"``) instead of the dumps."""
RANKS = "ranks"
"""Every agent route: the ranks asked, as ``0-3,5`` (``agent_launch.format_ranks``)."""
WHOLE = "whole"
"""``agent_fr``: whole rings (with ``onlyactive``: torch's FR parameter)."""
HANDLER = "handler"
"""``agent_fetch``: which worker handler to relay (one of :data:`FETCHABLE`)."""
EVERY = "every"
"""``agent_stacks``: py-spy for every rank, not only the stuck ones (with ``native``:
``names.NATIVE``, py-spy ``--native`` for every rank)."""
FETCHABLE = frozenset({PING_HANDLER, HEALTH_HANDLER, DUMP_FILE_HANDLER})
"""Worker handlers ``agent_fetch`` relays (no parameters; the frontend asks the rest directly)."""
