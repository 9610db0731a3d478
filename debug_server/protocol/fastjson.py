"""JSON on the hot paths of the wire (replies parsed and made by the thousand per page, every
rank's registration sidecar read at once).

``orjson`` where it is installed (a dependency of the package; parsing a rank's FR window takes
a third of the time, making an agent's reply a tenth), else the standard library. Both give the
same values for the same text: what ``orjson`` refuses and ``json`` takes (``NaN``, integers
over 64 bits, lone surrogates) is read by ``json``, and what ``orjson`` cannot write (keys that
are not strings, integers over 64 bits) is written by ``json``. One difference is left: a float
``NaN`` or infinity is written as ``null`` by ``orjson`` (strict JSON), as ``NaN`` by ``json``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

try:
    import orjson
except ImportError:  # running from a source tree without it (e.g. a GPU image): json alone
    orjson = None  # type: ignore[assignment]

__all__ = ["FAST", "dumps", "dumps_bytes", "loads"]

FAST = orjson is not None
"""Whether ``orjson`` is in use."""


def loads(text: str | bytes) -> Any:
    """``json.loads``; raises ``ValueError`` on bad text, as it does."""
    if orjson is not None:
        try:
            return orjson.loads(text)
        except orjson.JSONDecodeError:
            pass  # json decides: it takes a few things orjson refuses, and words the error
    return json.loads(text)


def dumps(obj: Any, default: Callable[[Any], Any] | None = None) -> str:
    """Compact JSON text of ``obj`` (``json.dumps`` with ``separators=(",", ":")``);
    ``default`` as ``json.dumps``'s."""
    if orjson is not None:
        try:
            return orjson.dumps(obj, default=default).decode()
        except TypeError:  # orjson.JSONEncodeError: non-str keys, big ints; json writes them
            pass
    return json.dumps(obj, default=default, separators=(",", ":"))


def dumps_bytes(obj: Any, default: Callable[[Any], Any] | None = None) -> bytes:
    """:func:`dumps` as UTF-8 bytes: a big page's JSON (43 MB at 131072 ranks) goes out as
    ``orjson`` made it, not decoded to text and encoded again (two more copies at its peak)."""
    if orjson is not None:
        try:
            return orjson.dumps(obj, default=default)
        except TypeError:
            pass
    return json.dumps(obj, default=default, separators=(",", ":")).encode()
