"""Python stacks of every thread of this process, as faulthandler prints them, each frame with
its source line.

faulthandler prints ``File "...", line N in f`` only; the line's text is what says *what* a
thread waits on (``time.sleep(30)``, ``work.wait()``). It is read here, on the rank's own host
where the files are, and shipped under each frame as ``traceback`` prints it, so the analysis
never reads source files where it runs::

    Thread 0x00007f3c... (most recent call first):
      File "/x/train.py", line 88 in hang_phase
        time.sleep(30)

Readers that know only faulthandler's layout (torch's frontend shows the text as it is) still
read it; a frame without a readable line (a frozen module, a deleted file) has none.
"""

from __future__ import annotations

import faulthandler
import linecache
import re
import tempfile

_FRAME = re.compile(r'^  File "(?P<file>.*)", line (?P<line>\d+) in ')
SOURCE_INDENT = "    "
"""Indent of a frame's source line: deeper than the frame's own two spaces."""


def capture_stacks() -> str:
    """faulthandler's text for all threads of this process, with each frame's source line.

    faulthandler writes to a file descriptor from C, without the GIL-holding machinery a pure
    Python walk would need, so it works even when the main thread is stuck inside a C call;
    it needs a real file, hence the temp file rather than a StringIO.
    """
    with tempfile.TemporaryFile(mode="w+b", prefix="debug_server_stacks_") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.flush()
        f.seek(0)
        return with_source(f.read().decode("utf-8", errors="replace"))


def with_source(text: str) -> str:
    """``text`` (faulthandler's layout) with the source line under each Python frame, read
    from this host's files. Run it where the process runs (its worker, or py-spy and signal
    reads on the same host). Lines already followed by a source line are left alone."""
    lines = text.splitlines()
    out: list[str] = []
    for i, ln in enumerate(lines):
        out.append(ln)
        m = _FRAME.match(ln)
        if m is None or (i + 1 < len(lines) and lines[i + 1].startswith(SOURCE_INDENT)):
            continue
        try:
            src = linecache.getline(m.group("file"), int(m.group("line"))).strip()
        except (OSError, ValueError, UnicodeError):  # linecache swallows most itself
            src = ""
        if src:
            out.append(SOURCE_INDENT + src)
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")
