"""``python -m debug_server.preflight``, the documented command; the code is ``tools/preflight.py``."""

import sys

from debug_server.tools.preflight import main

if __name__ == "__main__":
    sys.exit(main())
