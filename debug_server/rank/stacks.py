"""Python stacks of every thread of this process, as faulthandler prints them."""

from __future__ import annotations

import faulthandler
import tempfile


def capture_stacks() -> str:
    """faulthandler's text for all threads of this process.

    faulthandler writes to a file descriptor from C, without the GIL-holding machinery a pure
    Python walk would need, so it works even when the main thread is stuck inside a C call;
    it needs a real file, hence the temp file rather than a StringIO.
    """
    with tempfile.TemporaryFile(mode="w+b", prefix="debug_server_stacks_") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.flush()
        f.seek(0)
        return f.read().decode("utf-8", errors="replace")
