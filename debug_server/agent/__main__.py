"""``python -m debug_server.agent``: the per-host agent process."""

import sys

from debug_server.agent.app import main

if __name__ == "__main__":
    sys.exit(main())
