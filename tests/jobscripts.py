"""Rank scripts that more than one test module runs (through ``mpjob`` or ``rankprocs``).

``ABORT_JOB``: a 2-rank gloo job on our communicator with ``abort_process_on_timeout_or_error``;
rank 1 never joins rank 0's second all_reduce, which times out (2 s), dumps and aborts.

``GIL_HOLDING_RANK``: ``start_debug_server``, ``READY <pid> <frontend url>`` once registered,
then the rank ``HOLD_RANK`` (default 0) waits for a file ``go`` in its working directory and
holds the GIL in one C call (``usleep``, ``HOLD_S`` s; ``HOLDING`` before, ``SLEPT <s>`` after);
the other ranks sleep. ``FETCH_TIMEOUT`` and ``HOLD_S`` in its text are placeholders the caller
replaces with the values below.
"""

from __future__ import annotations

ABORT_JOB = r'''
import datetime, os, resource, time
import torch
from debug_server.recording.comms import new_comm
from debug_server.recording.hooks import FlightRecorderHook

resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file from the abort
comm = new_comm("gloo", torch.device("cpu"), "main_comm", timeout=datetime.timedelta(seconds=2),
                abort_process_on_timeout_or_error=True)
FlightRecorderHook(max_entries=100).register_with_comm(comm)
t = torch.ones(16)
comm.all_reduce(t)
if comm.get_rank() == 0:
    comm.all_reduce(t)  # rank 1 never joins: times out, dumps, aborts
    print("NOT_REACHED", flush=True)
else:
    time.sleep(4)
'''

FETCH_TIMEOUT = 2.0
"""The frontend's fetch timeout in ``GIL_HOLDING_RANK`` (its text says ``FETCH_TIMEOUT``)."""
HOLD_S = 8.0
"""How long the held rank holds the GIL in one C call (its text says ``HOLD_S``)."""

GIL_HOLDING_RANK = """
import ctypes, os, time
from debug_server import start_debug_server
h = start_debug_server(port=0, fetch_timeout=FETCH_TIMEOUT)
assert h.wait_registered(30)
print("READY", os.getpid(), h.frontend_url, flush=True)
if os.environ["RANK"] != os.environ.get("HOLD_RANK", "0"):
    time.sleep(120)
libc = ctypes.PyDLL(None)  # PyDLL: the GIL stays held for the whole C call
libc.usleep.argtypes = [ctypes.c_uint]
while not os.path.exists("go"):  # the test starts the hold once the frontend is warm
    time.sleep(0.02)
print("HOLDING", flush=True)
t0 = time.monotonic()
libc.usleep(int(HOLD_S * 1e6))  # HOLD_LINE
print("SLEPT", f"{time.monotonic() - t0:.4f}", flush=True)
time.sleep(120)
"""
