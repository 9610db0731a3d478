"""The hand-over of a ``FrontendConfig`` to a spawned frontend: JSON in an inherited unnamed file.

Nothing on the command line (``ps`` shows it to every user, and the config holds the access
token) and no copy of the options in an argument parser.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping

from debug_server.config.configs import FrontendConfig
from debug_server.config.settings import FRONTEND_CONFIG_FD_ENV, ConfigError


def write_inherited(config: FrontendConfig) -> int:
    """A new descriptor of an unnamed file holding ``config`` as JSON, positioned at its start.

    The spawner passes it to the child (``pass_fds``) and names it in
    ``FRONTEND_CONFIG_FD_ENV``, then closes its own copy. Unnamed (``memfd`` where the
    OS has it, else an unlinked temp file): no other user can open it, and unlike one environment
    string (128 KiB at most) it holds the worker URLs of any job size.
    """
    data = config.to_json().encode()
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("debug_server_frontend_config")
    else:
        with tempfile.TemporaryFile() as f:
            fd = os.dup(f.fileno())
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_inherited(env: Mapping[str, str] | None = None) -> FrontendConfig | None:
    """The ``FrontendConfig`` a spawner left in ``FRONTEND_CONFIG_FD_ENV`` (None when
    the variable is unset); the descriptor is read whole and closed. Raises ``ConfigError``."""
    env = os.environ if env is None else env
    raw = env.get(FRONTEND_CONFIG_FD_ENV)
    if not raw:
        return None
    try:
        with os.fdopen(int(raw), "rb") as f:
            text = f.read()
    except (ValueError, OSError) as e:
        raise ConfigError(f"{FRONTEND_CONFIG_FD_ENV}={raw!r}: cannot read the frontend config "
                          f"({e})") from None
    return FrontendConfig.from_json(text)

