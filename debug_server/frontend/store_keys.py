"""The job's TCPStore as the ``/tcpstore`` page shows it: bounded, paginated, secrets redacted.

What is shown: the keys under one prefix (``debug_server/``, where the workers register, unless
the page asks for another; ``""`` is every key), sorted, one page of at most
:data:`MAX_LIMIT`, each value cut to :data:`VALUE_CHARS` characters. Values are shown, never
unpickled (torch elastic keeps pickles there).

What is never shown: the value of a key named like a secret (:data:`SECRET_NAME`: token,
secret, password, credential, cookie, auth, api/private/ssh/access/signing key) and any value
that contains the job's access token or a PEM private key.

Store calls block (a store that stopped answering, a key deleted between listing and reading),
so they run on this reader's own thread, on its own connection (worker lookups never queue
behind it), and every read is bounded by the store timeout; a connection that timed out is
dropped, since a late reply would answer the next request.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from debug_server.errors import first_line
from debug_server.protocol.addrs import PREFIX, meta_key, url_key
from debug_server.readers.storeview import StoreLane

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = PREFIX + "/"
DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
MAX_OFFSET = 10_000_000
MAX_PREFIX = 256
VALUE_CHARS = 160
SECRET_NAME = re.compile(
    r"token|secret|passw|pwd|credential|cookie|auth|(api|private|ssh|access|signing)[_-]?key",
    re.IGNORECASE)
"""Key names whose values are never shown."""
REDACTED = "<redacted>"
_PEM_PRIVATE = b"PRIVATE KEY-----"


def is_secret_name(key: str) -> bool:
    return SECRET_NAME.search(key) is not None


def show_value(key: str, value: bytes, secrets: Sequence[str] = ()) -> dict[str, Any]:
    """One row of the page: the value as text (or ``repr`` of its bytes when it is not
    printable UTF-8), cut to ``VALUE_CHARS``; redacted by name, by content (a ``secrets``
    string, a PEM private key)."""
    row: dict[str, Any] = {"key": key, "size": len(value), "redacted": False, "truncated": False}
    if (is_secret_name(key) or _PEM_PRIVATE in value
            or any(s and s.encode() in value for s in secrets)):
        return row | {"value": REDACTED, "redacted": True}
    try:
        text = value.decode("utf-8")
        if not text.isprintable():
            raise ValueError("not printable")
    except ValueError:
        text = repr(value[:VALUE_CHARS])
        return row | {"value": text, "truncated": len(value) > VALUE_CHARS, "binary": True}
    if len(text) > VALUE_CHARS:
        return row | {"value": text[:VALUE_CHARS], "truncated": True}
    return row | {"value": text}


def select(keys: Sequence[str], prefix: str, offset: int, limit: int) -> tuple[list[str], int]:
    """The sorted keys starting with ``prefix``, page ``[offset, offset + limit)``, and how
    many match in all."""
    matching = sorted(k for k in keys if k.startswith(prefix))
    return matching[offset : offset + limit], len(matching)


@dataclass(slots=True)
class KeyPage:
    """One page of the store's keys."""

    prefix: str
    offset: int
    limit: int
    total: int
    """Keys matching the prefix."""
    all_keys: int | None
    """Keys in the whole store (None when the store cannot list them)."""
    rows: list[dict[str, Any]] = field(default_factory=list)
    note: str = ""

    @property
    def next_offset(self) -> int | None:
        end = self.offset + len(self.rows)
        return end if end < self.total else None

    def as_dict(self) -> dict[str, Any]:
        return {"available": True, "prefix": self.prefix, "offset": self.offset,
                "limit": self.limit, "total": self.total, "all_keys": self.all_keys,
                "next_offset": self.next_offset, "note": self.note, "keys": self.rows}


class StoreReadError(Exception):
    """The store could not be read; the message is one line."""


class StoreReader:
    """Reads pages of the store at ``addr:port`` on one private thread (see the module doc)."""

    def __init__(self, addr: str, port: int, *, timeout: float, world_size: int,
                 restart_count: int) -> None:
        self.addr, self.port, self.timeout = addr, port, timeout
        self.world_size, self.restart_count = world_size, restart_count
        self._store: Any = None
        # A daemon thread, never joined at exit (discovery.StoreLane).
        self._lane = StoreLane("debug_server.tcpstore")

    async def read(self, prefix: str, offset: int, limit: int,
                   secrets: Sequence[str] = ()) -> KeyPage:
        """One page; ``StoreReadError`` when the store does not answer in time."""
        fut = self._lane.call(lambda: self._read_sync(prefix, offset, limit, tuple(secrets)))
        try:
            # The store's own timeout ends a blocked call; this bounds the page even if it does
            # not (a connect that hangs), plus the wait behind an earlier read on the thread.
            return await asyncio.wait_for(fut, 2 * self.timeout + 1.0)
        except asyncio.TimeoutError:
            raise StoreReadError(f"store {self.addr}:{self.port} did not answer within "
                                 f"{2 * self.timeout + 1.0:.0f} s") from None

    def _client(self) -> Any:
        if self._store is None:
            import torch.distributed as dist

            self._store = dist.TCPStore(host_name=self.addr, port=self.port, is_master=False,
                                        timeout=timedelta(seconds=self.timeout))
        return self._store

    def _known_keys(self, store: Any) -> list[str]:
        # Without list_keys (older torch): the keys this project writes, where they exist.
        names = [f"{PREFIX}/{k(r)}" for r in range(self.world_size) for k in (url_key, meta_key)]
        names.append(f"{PREFIX}/auth_token_r{self.restart_count}")
        return [k for k in names if store.check([k])]

    def _read_sync(self, prefix: str, offset: int, limit: int,
                   secrets: tuple[str, ...]) -> KeyPage:
        try:
            store = self._client()
            note = ""
            all_keys: int | None
            try:
                keys = [str(k) for k in store.list_keys()]
                all_keys = len(keys)
            except (AttributeError, NotImplementedError, RuntimeError) as e:
                if not DEFAULT_PREFIX.startswith(prefix) and not prefix.startswith(DEFAULT_PREFIX):
                    raise StoreReadError(f"this store cannot list its keys ({first_line(e, 200)}); "
                                         f"only {DEFAULT_PREFIX} keys can be shown") from None
                keys, all_keys = self._known_keys(store), None
                note = (f"this store cannot list its keys ({first_line(e, 200)}); showing the keys "
                        f"debug_server writes")
            page, total = select(keys, prefix, offset, limit)
            values = self._values(store, page)
        except StoreReadError:
            raise
        except Exception as e:  # a timeout or a broken connection: drop it, say why in a line
            self._store = None
            raise StoreReadError(f"store {self.addr}:{self.port}: {type(e).__name__}: "
                                 f"{first_line(e, 200)}") from None
        rows = [show_value(k, v, secrets) if v is not None
                else {"key": k, "size": None, "value": "(deleted while reading)",
                      "redacted": False, "truncated": False} for k, v in zip(page, values, strict=True)]
        return KeyPage(prefix, offset, limit, total, all_keys, rows, note)

    @staticmethod
    def _values(store: Any, keys: list[str]) -> list[bytes | None]:
        if not keys:
            return []
        # multi_get waits for a missing key until the timeout: check first, read what is there.
        present = keys if store.check(keys) else [k for k in keys if store.check([k])]
        got = dict(zip(present, store.multi_get(present), strict=True)) if present else {}
        return [bytes(got[k]) if k in got else None for k in keys]

    def close(self) -> None:
        self._lane.close()
        self._store = None

