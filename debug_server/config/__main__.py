"""``python -m debug_server.config --markdown``: print docs/settings.md."""

import sys

from debug_server.config.docs import main

sys.exit(main())
