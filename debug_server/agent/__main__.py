"""``python -m debug_server.agent``: the per-host agent process."""

import sys

from debug_server.agent.main import main

if __name__ == "__main__":
    sys.exit(main())
