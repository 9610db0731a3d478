"""A rank's side of stacks by signal: faulthandler registered for a free real-time signal.

Why and how the signal path reads a rank whose worker cannot answer is ``readers.sigstack``'s
docstring; this module is what runs inside the rank: ``install`` (at ``start_debug_server``,
where the rank opted in), whose ``SigStack.meta()`` goes into the registration sidecar under
``readers.sigstack.META_KEY``, and ``close``.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import tempfile
import threading
from dataclasses import dataclass
from typing import Any

from debug_server.config import SIGNAL_STACKS_ENV as OPT_IN_ENV  # noqa: F401 (old name)
from debug_server.readers.sigstack import FILE_PREFIX, candidate_signals

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SigStack:
    """A registered faulthandler signal of this process; ``close()`` undoes it."""

    signum: int
    path: str
    file: Any

    def meta(self) -> dict[str, Any]:
        return {"signal": self.signum, "file": self.path, "fd": self.file.fileno()}

    def close(self) -> None:
        with contextlib.suppress(Exception):
            faulthandler.unregister(self.signum)
        with contextlib.suppress(OSError):
            self.file.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def install(enabled: bool) -> SigStack | None:
    """Register faulthandler for a free real-time signal where the rank opted in (``enabled``:
    ``start_debug_server(signal_stacks=)``, else ``Settings.signal_stacks``); None when it did
    not or that is not possible."""
    if not enabled:
        return None
    if not hasattr(faulthandler, "register") or threading.current_thread() is not threading.main_thread():
        return None  # signal dispositions are only checked reliably from the main thread
    for signum in candidate_signals():
        try:
            # None: a handler installed outside Python (C code) owns it; only SIG_DFL is free.
            if signal.getsignal(signum) is not signal.SIG_DFL:
                continue
        except (ValueError, OSError):
            continue
        fd, path = tempfile.mkstemp(prefix=f"{FILE_PREFIX}{os.getpid()}_", suffix=".txt")
        os.close(fd)
        # Append mode: the frontend empties the file before each capture and the next write
        # lands at offset 0, not at a stale offset past a hole.
        f = open(path, "ab", buffering=0)  # noqa: SIM115 - kept open for faulthandler
        try:
            faulthandler.register(signum, file=f, all_threads=True, chain=False)
        except (RuntimeError, ValueError, OSError) as e:
            f.close()
            os.unlink(path)
            logger.debug("debug_server: faulthandler.register(%d) failed: %s", signum, e)
            continue
        return SigStack(signum, path, f)
    return None
