"""The agent's routes as the frontend asks them (``agent/app.py`` answers them).

An agent serves its host's ranks under the workers' own route shape (``POST /handler/<name>``);
these are the names and the one conditional parameter both sides spell.
"""

from __future__ import annotations

FR = "agent_fr"
STACKS = "agent_stacks"
FETCH = "agent_fetch"
INFO = "agent_info"
TAG = "tag"
"""``agent_fr``'s conditional ask: the ``tag`` of the asker's last reply for the same question;
when nothing but the ranks' read times changed since, the reply is ``"unchanged": true`` with
the rank records and each rank's ``dump_time_ns`` (``"snap"``) instead of the dumps."""
FETCHABLE = frozenset({"ping", "torchcomms_health_check", "torchcomms_fr_dump_file"})
"""Worker handlers ``agent_fetch`` relays (no parameters; the frontend asks the rest directly)."""
