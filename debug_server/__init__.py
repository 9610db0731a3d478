"""debug_server: a hang debugger for distributed PyTorch.

The public surface is two functions; everything else lives in its own module
(``debug_server.recording.comms``, ``debug_server.recording.hooks``, ``debug_server.analysis.core``...).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["start_debug_server", "stop_debug_server"]

if TYPE_CHECKING:
    from debug_server.rank.server import start_debug_server, stop_debug_server


def __getattr__(name: str) -> Any:
    # Lazy, so that `import debug_server.recording.comms` (the recording side, on the training hot path)
    # does not pull in aiohttp and the server machinery.
    if name in __all__:
        from debug_server.rank import server

        return getattr(server, name)
    raise AttributeError(f"module 'debug_server' has no attribute {name!r}")
