"""What the recorder's helpers (``abort``, ``work``, ``records``, ``watchdog``) read and write of a
communicator: a ``Protocol``, so they name no concrete class above them and ``comms.Comm``
(which satisfies it) imports them without a circle, annotations included."""

from __future__ import annotations

import collections
import datetime
import threading
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["CommState"]


class CommState(Protocol):
    """A communicator's state as its helpers see it (``comms.Comm`` has every attribute)."""

    _pg: Any
    _name: str
    _backend: str
    _ranks: list[int]
    _rank: int
    _timeout: datetime.timedelta
    _abort_process: bool
    _c10d_name: str | None
    _seq: int
    _p2p_seq: int
    _lock: threading.Lock
    _abort_hooks: list[Callable[[Any, BaseException], None]]
    _finalized: bool
    _is_cuda: bool
    _starts: list[Any]
    _ends: list[Any]
    _backed: bool
    _pend: list[tuple[int, str, int]]
    _pend_w: list[tuple[int, str, int, bool, Any]]
    _status_warned: bool
    _inflight: list[Any]
    _loose: list[Any]
    _async_recs: collections.deque[Any]
    _done_op_id: int
    _done_ns: int
    _broken: str | None

    @property
    def pg_id(self) -> int: ...

    def _current_stream(self) -> Any: ...
