"""debug_server: a hang debugger for distributed PyTorch.

The public surface is two functions; everything else lives in its own module
(``debug_server.comms``, ``debug_server.hooks``, ``debug_server.analysis``...).
"""

from debug_server.server import start_debug_server, stop_debug_server

__all__ = ["start_debug_server", "stop_debug_server"]
