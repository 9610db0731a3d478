"""``python -m debug_server.frontend``: the rank-0 frontend process (see ``app.main``)."""

import sys

from debug_server.frontend.app import main

if __name__ == "__main__":
    sys.exit(main())
