"""``from debug_server.hooks import ...`` as documented; the code is ``recording/hooks.py``."""

from debug_server.recording.hooks import *  # noqa: F403
from debug_server.recording.hooks import __all__  # noqa: F401
