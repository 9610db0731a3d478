"""debug_server: a hang debugger for distributed PyTorch.

What a training script imports::

    from debug_server import start_debug_server, new_comm, FlightRecorderHook

* ``start_debug_server`` / ``stop_debug_server``: the worker on every rank, the pages on rank 0
  (``rank/server.py``); ``DebugServer`` is the handle it returns.
* ``new_comm``, ``ReduceOp``: communicators with hooks (``recording/comms.py``).
* ``FlightRecorderHook``: the Flight Recorder ring of every op a communicator issues
  (``recording/hooks.py``).
* ``ConfigError``: a bad argument or environment variable, named in the message.

The names load on first use: ``import debug_server`` costs neither torch nor aiohttp, and a
process that only records never loads the server side. The deep paths
(``debug_server.recording.comms``, ``debug_server.recording.hooks``, ...) stay valid.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "ConfigError",
    "DebugServer",
    "FlightRecorderHook",
    "ReduceOp",
    "new_comm",
    "start_debug_server",
    "stop_debug_server",
]

# Where each public name lives; loaded by __getattr__ on first use.
_HOMES = {
    "ConfigError": "debug_server.config",
    "DebugServer": "debug_server.rank.server",
    "FlightRecorderHook": "debug_server.recording.hooks",
    "ReduceOp": "debug_server.recording.comms",
    "new_comm": "debug_server.recording.comms",
    "start_debug_server": "debug_server.rank.server",
    "stop_debug_server": "debug_server.rank.server",
}

if TYPE_CHECKING:
    from debug_server.config import ConfigError
    from debug_server.rank.server import DebugServer, start_debug_server, stop_debug_server
    from debug_server.recording.comms import ReduceOp, new_comm
    from debug_server.recording.hooks import FlightRecorderHook


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'debug_server' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
