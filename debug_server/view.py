"""``python -m debug_server.view``, the documented command; the code is ``tools/view.py``."""

import sys

from debug_server.tools.view import main

if __name__ == "__main__":
    sys.exit(main())
