"""``python -m debug_server.agent``: the per-host agent process."""

from debug_server.agent.main import main
from debug_server.listen import exit_now

if __name__ == "__main__":
    exit_now(main())
