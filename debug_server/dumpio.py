"""Reading and writing per-rank Flight Recorder dumps (torch FR schema).

Shared by the recording side (writes) and the analyzer (reads). Pure: no torch, no server code.
Pickles are written atomically (temp name in the same directory, then rename) and read back
with a restricted unpickler that only builds plain containers and scalars, so a hostile file
cannot run code.
"""

from __future__ import annotations

import io
import os
import pickle
import tempfile
from typing import Any

FR_VERSION = "2.10"

# Only these globals may appear in a dump pickle. Protocol-level containers (dict, list, tuple,
# str, int, float, bool, None, bytes) need no global at all; sets and frozensets do.
_ALLOWED_GLOBALS = {
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class DumpError(ValueError):
    """A dump file that cannot be used; the message is one line naming the file and why."""


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused global {module}.{name}")


def safe_loads(data: bytes) -> Any:
    """Unpickle ``data`` allowing only plain containers and scalars (never runs code)."""
    return _RestrictedUnpickler(io.BytesIO(data)).load()


def write_dump_atomic(path: str, dump: dict[str, Any]) -> str:
    """Pickle ``dump`` to ``path`` atomically and return the path.

    The temp file is created in the target directory without the target's name prefix, so a
    reader globbing ``rank_*`` never sees a half-written file.
    """
    directory = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp_fr_", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            pickle.dump(dump, f, protocol=4)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path
