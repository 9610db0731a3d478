"""Blocking HTTP requests for tests against a live frontend or worker (real servers, real jobs)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any


def timed_get(url: str, accept: str = "*/*", timeout: float = 20) -> tuple[int, str, float]:
    """(status, body, seconds taken) of a GET; an HTTP error status is returned, not raised."""
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers={"Accept": accept}),
                                    timeout=timeout) as r:
            return r.status, r.read().decode(), time.monotonic() - t0
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read().decode(), time.monotonic() - t0


def get_json(url: str, method: str = "GET") -> Any:
    """The JSON body of a request asking for JSON; an HTTP error status raises."""
    req = urllib.request.Request(url, method=method, headers={"Accept": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read().decode())
