"""``python -m debug_server.fr_trace``, the documented command; the code is ``tools/fr_trace.py``."""

import sys

from debug_server.tools.fr_trace import main

if __name__ == "__main__":
    sys.exit(main())
