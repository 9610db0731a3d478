"""``from debug_server.comms import ...`` as documented; the code is ``recording/comms.py``."""

from debug_server.recording.comms import *  # noqa: F403
from debug_server.recording.comms import __all__  # noqa: F401
