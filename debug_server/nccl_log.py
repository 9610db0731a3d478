"""``python -m debug_server.nccl_log``, the documented command; the code is ``tools/nccl_log.py``."""

import sys

from debug_server.tools.nccl_log import main

if __name__ == "__main__":
    sys.exit(main())
