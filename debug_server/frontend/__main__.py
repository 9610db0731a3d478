"""``python -m debug_server.frontend``: the rank-0 frontend process (see ``app.main``)."""

from debug_server.frontend.app import main
from debug_server.listen import exit_now

if __name__ == "__main__":
    exit_now(main())
