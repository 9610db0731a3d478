"""Every name the wire spells: the worker's handlers and every query parameter (the table is in
``protocol/__init__.py``). Plain strings and nothing else, so the recording side's readers and the
processes that do not serve HTTP import them without aiohttp."""

from __future__ import annotations

FR_HANDLER = "torchcomms_fr_trace_json"
"""Our FR handler (the window parameters below, ``pgknown``, ``stacks``)."""
C10D_FR_HANDLER = "fr_trace_json"
"""c10d's own FR handler (torch's C++ worker has only this one; ours answers it too)."""
STACKS_HANDLER = "dump_traceback"
PING_HANDLER = "ping"
HEALTH_HANDLER = "torchcomms_health_check"
DUMP_FILE_HANDLER = "torchcomms_fr_dump_file"

ONLY_ACTIVE = "onlyactive"
"""torch's FR parameter: only the entries not yet completed."""
INCLUDE_COLLECTIVES = "includecollectives"
INCLUDE_STACKTRACES = "includestacktraces"
"""torch's FR parameter (``false``: entries without their call-site frames)."""
SINCE = "since"
"""Our FR parameter: per group, the first collective seq wanted (``frwindow.format_since``)."""
WINDOW = "window"
"""Our FR parameter: each group from the rank's own frontier less this many ops."""

WITH_STACKS = "stacks"
"""Our FR handler's parameter (``stacks=true``): the reply carries this rank's thread stacks too,
after the FR JSON and ``wire.STACKS_SEP``, so one request per rank serves a page that shows both
(``/fr_trace`` and the overview: half the requests per rank and per host agent)."""
PYSPY_HANDLER = "pyspy_dump"
"""torch's name: py-spy of the rank (or, ``pid=``, of another rank of the job on its host)."""
PROCESS_HANDLER = "process_state"
"""Ours: the worker's host reads a rank's process (``pid=``: of a rank of the job on its host)
from ``/proc``: state, since, CPU use, wait channel (``readers.procstate``), as JSON."""
PROFILE_HANDLER = "torch_profile"
WAIT_COUNTERS_HANDLER = "wait_counter_values"

NATIVE = "native"
"""``pyspy_dump``: Python and native frames (pauses the rank for the read); ``agent_stacks``:
the same for every rank."""
NONBLOCKING = "nonblocking"
SUBPROCESSES = "subprocesses"
PID = "pid"
"""``pyspy_dump``: read this pid (a rank of this job on this host) instead of the worker's own."""
DURATION = "duration"
"""``torch_profile``: seconds to record."""

__all__ = ["C10D_FR_HANDLER", "DUMP_FILE_HANDLER", "DURATION", "FR_HANDLER", "HEALTH_HANDLER",
           "INCLUDE_COLLECTIVES", "INCLUDE_STACKTRACES", "NATIVE", "NONBLOCKING", "ONLY_ACTIVE",
           "PID", "PING_HANDLER", "PROCESS_HANDLER", "PROFILE_HANDLER", "PYSPY_HANDLER", "SINCE",
           "STACKS_HANDLER", "SUBPROCESSES", "WAIT_COUNTERS_HANDLER", "WINDOW", "WITH_STACKS"]
